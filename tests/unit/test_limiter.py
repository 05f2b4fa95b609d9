"""FixedLimiter and AdaptiveLimiter: the cap holds; the adaptive limit moves on server signals only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from raypipe.call.limiter import HISTORY_POINTS, AdaptiveLimiter, FixedLimiter, Limiter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def fill(limiter: Limiter) -> None:
    """Acquire slots until the limiter is saturated."""
    while limiter.in_flight < limiter.limit:
        await limiter.acquire()


async def saturated_samples(
    limiter: Limiter, clock: FakeClock, n: int, *, latency_s: float, dropped: bool = False, **server: Any
) -> None:
    """`n` calls of `latency_s` each, with the limiter kept full the whole time."""
    for _ in range(n):
        await fill(limiter)
        clock.now += latency_s / max(limiter.limit, 1)  # calls overlap: one finishes per slice
        limiter.release(latency_s=latency_s, dropped=dropped, **server)


def adaptive(clock: FakeClock, **kwargs: Any) -> AdaptiveLimiter:
    return AdaptiveLimiter(clock=clock, **kwargs)


# --- FixedLimiter -------------------------------------------------------------------------


def test_fixed_rejects_a_limit_below_one() -> None:
    with pytest.raises(ValueError):
        FixedLimiter(0)


def test_fixed_cap_holds_under_50_concurrent_tasks() -> None:
    limiter = FixedLimiter(5)
    peak = 0

    async def call(i: int) -> None:
        nonlocal peak
        await limiter.acquire()
        try:
            peak = max(peak, limiter.in_flight)
            for _ in range(i % 4):
                await asyncio.sleep(0)
        finally:
            limiter.release(latency_s=0.01, dropped=False)

    async def main() -> None:
        await asyncio.gather(*(call(i) for i in range(50)))

    asyncio.run(main())
    assert peak == 5
    assert limiter.in_flight == 0
    stats = limiter.stats()
    assert (stats.initial, stats.min, stats.max, stats.final) == (5, 5, 5, 5)
    assert stats.samples == 50
    assert stats.decreases == 0


def test_waiters_get_slots_in_arrival_order() -> None:
    limiter = FixedLimiter(1)
    order: list[int] = []

    async def call(i: int) -> None:
        await limiter.acquire()
        order.append(i)
        await asyncio.sleep(0)
        limiter.release_ignored()

    async def main() -> None:
        await asyncio.gather(*(call(i) for i in range(10)))

    asyncio.run(main())
    assert order == list(range(10))


def test_release_ignored_frees_the_slot_without_a_sample() -> None:
    limiter = FixedLimiter(1)

    async def main() -> None:
        await limiter.acquire()
        waiter = asyncio.ensure_future(limiter.acquire())
        await settle()
        assert not waiter.done()
        limiter.release_ignored()
        await waiter

    asyncio.run(main())
    assert limiter.in_flight == 1
    assert limiter.stats().samples == 0


def test_release_without_acquire_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        FixedLimiter(2).release_ignored()


def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    limiter = FixedLimiter(1)

    async def main() -> None:
        await limiter.acquire()
        gone = asyncio.ensure_future(limiter.acquire())
        kept = asyncio.ensure_future(limiter.acquire())
        await settle()
        gone.cancel()
        await settle()
        limiter.release_ignored()
        await kept
        assert limiter.in_flight == 1

    asyncio.run(main())


def test_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    limiter = FixedLimiter(1)

    async def main() -> None:
        await limiter.acquire()
        unlucky = asyncio.ensure_future(limiter.acquire())
        next_in_line = asyncio.ensure_future(limiter.acquire())
        await settle()
        limiter.release_ignored()  # hands the slot to `unlucky`...
        unlucky.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await unlucky
        await next_in_line
        assert limiter.in_flight == 1

    asyncio.run(main())


# --- AdaptiveLimiter ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_limit": 0},
        {"initial": 300, "max_limit": 256},
        {"initial": 2, "min_limit": 4},
        {"backoff_ratio": 1.0},
        {"backoff_ratio": 0.0},
        {"queue_tolerance": -1},
        {"outside_slack_s": 0.0},
    ],
)
def test_adaptive_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AdaptiveLimiter(**kwargs)


def test_grows_about_one_per_round_trip_under_good_latency_when_saturated() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=4)

    asyncio.run(saturated_samples(limiter, clock, 4 + 5 + 6 + 7, latency_s=0.1))

    # 4 + 5 + 6 + 7 samples are four round trips at limits 4, 5, 6, 7: about +1 each.
    assert limiter.limit in (7, 8)
    stats = limiter.stats()
    assert stats.decreases == 0
    assert stats.min == 4
    assert stats.max == limiter.limit
    assert [limit for _, limit in stats.history] == list(range(4, limiter.limit + 1))


def test_does_not_grow_when_app_limited() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=8)

    async def main() -> None:
        for _ in range(500):  # one call at a time: the limiter is never the bottleneck
            await limiter.acquire()
            clock.now += 0.1
            limiter.release(latency_s=0.1, dropped=False)

    asyncio.run(main())
    assert limiter.limit == 8
    assert limiter.stats().samples == 500


def test_backs_off_on_drops_once_per_round_trip() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=20)

    async def main() -> None:
        await fill(limiter)  # 20 calls start at t=0
        clock.now = 1.0
        for _ in range(20):  # ...and all come back RESOURCE_EXHAUSTED
            limiter.release(latency_s=1.0, dropped=True)
        assert limiter.limit == 18
        assert limiter.stats().decreases == 1

        await fill(limiter)  # 18 calls start at t=1, after the decrease
        clock.now = 2.0
        limiter.release(latency_s=1.0, dropped=True)
        limiter.release(latency_s=1.0, dropped=True)
        assert limiter.limit == 16  # 18 * 0.9 = 16.2
        assert limiter.stats().decreases == 2

    asyncio.run(main())


def test_drops_from_the_same_window_do_not_grow_the_limit_either() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=10)

    async def main() -> None:
        await fill(limiter)
        clock.now = 1.0
        limiter.release(latency_s=1.0, dropped=True)
        after_drop = limiter.limit
        for _ in range(9):
            limiter.release(latency_s=1.0, dropped=True)
        assert limiter.limit == after_drop == 9

    asyncio.run(main())


def test_long_batching_waits_are_not_overload() -> None:
    """A busy replica holds each call for a batch or two: tens of seconds, and healthy."""
    clock = FakeClock()
    limiter = adaptive(clock, initial=10)

    async def main() -> None:
        await saturated_samples(limiter, clock, 20, latency_s=0.1, replica_s=0.09, batches_ahead=0)
        await saturated_samples(limiter, clock, 100, latency_s=25.0, replica_s=24.9, batches_ahead=0)

    asyncio.run(main())
    assert limiter.stats().decreases == 0
    assert limiter.limit > 10


def test_backs_off_when_calls_wait_behind_more_than_the_next_batch() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=10)

    async def main() -> None:
        await saturated_samples(limiter, clock, 30, latency_s=2.0, replica_s=2.0, batches_ahead=0)
        grown = limiter.limit
        await saturated_samples(limiter, clock, 30, latency_s=3.0, replica_s=3.0, batches_ahead=1)
        assert limiter.limit < grown

    asyncio.run(main())
    assert limiter.stats().decreases >= 1


def test_queue_tolerance_allows_more_whole_batches_ahead() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=10, queue_tolerance=1)

    async def main() -> None:
        await saturated_samples(limiter, clock, 30, latency_s=3.0, replica_s=3.0, batches_ahead=1)
        assert limiter.stats().decreases == 0
        await saturated_samples(limiter, clock, 30, latency_s=4.0, replica_s=4.0, batches_ahead=2)
        assert limiter.stats().decreases >= 1

    asyncio.run(main())


def test_backs_off_when_calls_queue_in_front_of_the_replica() -> None:
    """Serve's proxy queues calls beyond max_ongoing_requests, where the replica cannot see them."""
    clock = FakeClock()
    limiter = adaptive(clock, initial=10, outside_slack_s=0.25)

    async def main() -> None:
        await saturated_samples(limiter, clock, 30, latency_s=0.2, replica_s=0.1, batches_ahead=0)
        assert limiter.stats().decreases == 0
        await saturated_samples(limiter, clock, 30, latency_s=1.0, replica_s=0.1, batches_ahead=0)
        assert limiter.stats().decreases >= 1

    asyncio.run(main())


def test_without_server_reports_latency_alone_never_backs_off() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=10)

    async def main() -> None:
        await saturated_samples(limiter, clock, 30, latency_s=0.1)
        await saturated_samples(limiter, clock, 30, latency_s=5.0)

    asyncio.run(main())
    assert limiter.stats().decreases == 0


def test_stays_within_min_and_max() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=4, min_limit=2, max_limit=6)

    async def main() -> None:
        await saturated_samples(limiter, clock, 500, latency_s=0.1)
        assert limiter.limit == 6
        for _ in range(100):  # every round trip brings a drop
            await fill(limiter)
            clock.now += 1.0
            limiter.release(latency_s=1.0, dropped=True)
        assert limiter.limit == 2
        await saturated_samples(limiter, clock, 500, latency_s=0.1)

    asyncio.run(main())
    stats = limiter.stats()
    assert (stats.min, stats.max, stats.final) == (2, 6, 6)
    assert all(2 <= limit <= 6 for _, limit in stats.history)


def test_lowered_limit_blocks_new_acquires_until_enough_releases() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=10)

    async def main() -> None:
        await fill(limiter)
        clock.now = 1.0
        limiter.release(latency_s=1.0, dropped=True)  # limit 9, in flight 9
        waiter = asyncio.ensure_future(limiter.acquire())
        await settle()
        assert not waiter.done()
        limiter.release(latency_s=1.0, dropped=True)  # same window: no second decrease
        await settle()
        assert waiter.done()
        assert (limiter.limit, limiter.in_flight) == (9, 9)

    asyncio.run(main())


def test_growing_the_limit_wakes_as_many_waiters_as_fit() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=4)

    async def main() -> None:
        await fill(limiter)
        waiters = [asyncio.ensure_future(limiter.acquire()) for _ in range(10)]
        await settle()
        # 4 -> 4.25 -> 4.49 -> 4.71 -> 4.92 -> 5.12: the fifth release frees one slot and
        # adds one, so two waiters get in.
        for released in range(1, 6):
            clock.now += 0.025
            limiter.release(latency_s=0.1, dropped=False)
            await settle()
            assert sum(w.done() for w in waiters) == released + (released == 5)
        assert (limiter.limit, limiter.in_flight) == (5, 5)
        for w in waiters:
            w.cancel()

    asyncio.run(main())


def test_history_stays_bounded() -> None:
    clock = FakeClock()
    limiter = adaptive(clock, initial=20, min_limit=1, max_limit=40)

    async def main() -> None:
        for _ in range(300):  # a saw-tooth: grow for a while, then one drop
            await saturated_samples(limiter, clock, 30, latency_s=0.1)
            await fill(limiter)
            clock.now += 1.0
            limiter.release(latency_s=1.0, dropped=True)

    asyncio.run(main())
    stats = limiter.stats()
    assert stats.decreases == 300
    assert len(stats.history) <= HISTORY_POINTS + 1
    assert stats.history[0] == (0.0, 20)
    assert stats.history[-1][1] == stats.final
    times = [t for t, _ in stats.history]
    assert times == sorted(times)


class SimulatedReplica:
    """One replica as serve_app runs it: FIFO calls, batches of up to `batch_calls` calls run
    back to back, each call costing `call_s` of model time; reports what the real one does."""

    def __init__(self, clock: FakeClock, batch_calls: int, call_s: float) -> None:
        self.clock = clock
        self.batch_calls = batch_calls
        self.call_s = call_s
        self.queue: list[tuple[Limiter, float, int]] = []  # (client, arrival, batches started then)
        self.batches = 0
        self.busy_s = 0.0

    def send(self, client: Limiter) -> None:
        self.queue.append((client, self.clock.now, self.batches))

    def run_batch(self) -> None:
        batch, self.queue = self.queue[: self.batch_calls], self.queue[self.batch_calls :]
        self.batches += 1
        duration = len(batch) * self.call_s
        self.clock.now += duration
        self.busy_s += duration
        for client, arrived, batches_then in batch:
            waited = self.clock.now - arrived
            client.release(
                latency_s=waited + 0.004, dropped=False, replica_s=waited, batches_ahead=self.batches - batches_then - 1
            )


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_clients_keep_a_batching_replica_busy_without_piling_up_work(clients: int) -> None:
    """The issue's collapse, simulated: whatever the number of actors, the model never waits
    for work, and together they keep about two batches in flight, not a growing queue."""
    clock = FakeClock()
    replica = SimulatedReplica(clock, batch_calls=8, call_s=0.5)
    limiters = [adaptive(clock, initial=2, min_limit=2, max_limit=64) for _ in range(clients)]

    async def main() -> None:
        for _ in range(600):
            for limiter in limiters:
                while limiter.in_flight < limiter.limit:
                    await limiter.acquire()
                    replica.send(limiter)
            replica.run_batch()

    asyncio.run(main())
    assert replica.busy_s / clock.now == 1.0  # never idle
    in_flight = sum(limiter.limit for limiter in limiters)
    assert in_flight <= 3 * replica.batch_calls, [limiter.limit for limiter in limiters]
    # ...and the model runs full batches, not the 1-2 calls a latency rule collapsed to.
    late = [limiter.stats().history[-1][1] for limiter in limiters]
    assert sum(late) >= replica.batch_calls, late

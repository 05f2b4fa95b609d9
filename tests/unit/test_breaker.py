"""CircuitBreaker: the state machine, probe exclusivity, waiting and giving up, on virtual time."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from raypipe.call.breaker import BreakerState, CircuitBreaker, Permit
from raypipe.errors import CircuitOpenError

T = TypeVar("T")


class VirtualTime:
    """A fake clock and sleep: time only moves when every task is blocked.

    `sleep(d)` parks the caller until virtual time reaches now + d; `run` drives the loop
    and, whenever nothing else can run, jumps to the earliest pending wake-up. Nothing
    really sleeps, and if every task is blocked with no wake-up pending, `run` fails with
    "deadlock" instead of hanging.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + max(delay, 0.0), next(self._seq), wake))
        await wake

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(self._drive(main))

    async def _drive(self, main: Coroutine[Any, Any, T]) -> T:
        task = asyncio.ensure_future(main)
        while not task.done():
            for _ in range(100):  # let every runnable task settle
                await asyncio.sleep(0)
                if task.done():
                    return task.result()
            while self._timers and self._timers[0][2].done():
                heapq.heappop(self._timers)  # a cancelled sleeper
            if not self._timers:
                task.cancel()
                raise AssertionError("deadlock: every task is blocked and no timer is pending")
            self.now = max(self.now, self._timers[0][0])
            while self._timers and self._timers[0][0] <= self.now:
                wake = heapq.heappop(self._timers)[2]
                if not wake.done():
                    wake.set_result(None)
        return task.result()


def make(vt: VirtualTime, **kwargs: Any) -> CircuitBreaker:
    options: dict[str, Any] = {"failure_threshold": 3, "reset_timeout_s": 1.0}
    options.update(kwargs)
    return CircuitBreaker(clock=vt.clock, sleep=vt.sleep, **options)


async def trip(breaker: CircuitBreaker) -> None:
    """Fail consecutive calls until the breaker opens."""
    while breaker.state is BreakerState.CLOSED:
        breaker.record(await breaker.acquire(), success=False)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_threshold": 0},
        {"reset_timeout_s": 0.0},
        {"reset_timeout_s": 2.0, "max_reset_timeout_s": 1.0},
        {"max_wait_s": -1.0},
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)


def test_builds_outside_an_event_loop() -> None:
    breaker = CircuitBreaker()  # as in a Ray actor's constructor: no running loop
    permit = asyncio.run(breaker.acquire())
    assert not permit.is_probe
    assert breaker.state is BreakerState.CLOSED


def test_opens_after_threshold_consecutive_failures() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        for _ in range(2):
            breaker.record(await breaker.acquire(), success=False)
        assert breaker.state is BreakerState.CLOSED
        assert breaker.stats().consecutive_failures == 2
        breaker.record(await breaker.acquire(), success=False)
        assert breaker.stats().state is BreakerState.OPEN

    vt.run(main())
    assert breaker.stats().openings == 1


def test_success_resets_consecutive_failures() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        for _ in range(5):
            breaker.record(await breaker.acquire(), success=False)
            breaker.record(await breaker.acquire(), success=False)
            breaker.record(await breaker.acquire(), success=True)

    vt.run(main())
    assert breaker.state is BreakerState.CLOSED
    assert breaker.stats().consecutive_failures == 0
    assert breaker.stats().openings == 0


def test_recording_a_permit_twice_counts_once() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        permit = await breaker.acquire()
        breaker.record(permit, success=False)
        breaker.record(permit, success=False)  # e.g. once in an except, once in a finally
        breaker.record(permit, success=True)

    vt.run(main())
    assert breaker.stats().consecutive_failures == 1


def test_open_breaker_waits_then_lets_one_probe_through() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=2.0)

    async def main() -> Permit:
        await trip(breaker)
        return await breaker.acquire()

    probe = vt.run(main())
    assert probe.is_probe
    assert vt.now == 2.0  # woke exactly at the reset deadline
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.stats().probes == 1


def test_probe_is_exclusive_among_many_waiters_and_success_closes() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        await trip(breaker)
        waiters = [asyncio.ensure_future(breaker.acquire()) for _ in range(30)]
        await vt.sleep(1.5)  # past the reset deadline
        done = [w for w in waiters if w.done()]
        assert len(done) == 1
        probe = done[0].result()
        assert probe.is_probe
        assert breaker.state is BreakerState.HALF_OPEN

        await vt.sleep(10.0)  # however long the probe takes, nobody else goes out
        assert sum(w.done() for w in waiters) == 1

        breaker.record(probe, success=True)
        await settle()
        assert all(w.done() for w in waiters)
        others = [w.result() for w in waiters if w is not done[0]]
        assert not any(p.is_probe for p in others)

    vt.run(main())
    assert breaker.state is BreakerState.CLOSED
    assert breaker.stats().probes == 1


def test_failed_probes_double_the_reset_timeout_up_to_the_cap() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0, max_reset_timeout_s=5.0)

    async def main() -> list[float]:
        await trip(breaker)
        probe_times = []
        for _ in range(5):
            probe = await breaker.acquire()
            assert probe.is_probe
            probe_times.append(vt.now)
            breaker.record(probe, success=False)
        return probe_times

    times = vt.run(main())
    gaps = [b - a for a, b in itertools.pairwise([0.0, *times])]
    assert gaps == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert breaker.stats().openings == 1  # one outage, however many failed probes
    assert breaker.stats().probes == 5


def test_closing_resets_the_reset_timeout_to_base() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0)

    async def main() -> None:
        await trip(breaker)
        breaker.record(await breaker.acquire(), success=False)  # probe at 1, next in 2
        breaker.record(await breaker.acquire(), success=True)  # probe at 3 closes
        assert vt.now == 3.0
        await trip(breaker)
        await breaker.acquire()
        assert vt.now == 4.0  # base timeout again, not 4 s

    vt.run(main())


def test_late_outcomes_from_before_the_opening_are_ignored() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        early = [await breaker.acquire() for _ in range(5)]  # all in flight together
        for permit in early[:3]:
            breaker.record(permit, success=False)
        assert breaker.state is BreakerState.OPEN
        breaker.record(early[3], success=True)  # a late success must not close it
        assert breaker.state is BreakerState.OPEN
        breaker.record(early[4], success=False)  # a late failure must not count again
        assert breaker.stats().consecutive_failures == 0

        await vt.sleep(0.5)
        probe = await breaker.acquire()
        assert vt.now == 1.0  # the late failure did not push the probe back
        breaker.record(probe, success=True)

    vt.run(main())
    assert breaker.state is BreakerState.CLOSED
    assert breaker.stats().openings == 1


def test_late_failures_after_closing_do_not_count() -> None:
    vt = VirtualTime()
    breaker = make(vt, failure_threshold=2)

    async def main() -> None:
        stale = [await breaker.acquire() for _ in range(4)]
        breaker.record(stale[0], success=False)
        breaker.record(stale[1], success=False)
        breaker.record(await breaker.acquire(), success=True)  # the probe closes it
        breaker.record(stale[2], success=False)
        breaker.record(stale[3], success=False)

    vt.run(main())
    assert breaker.state is BreakerState.CLOSED
    assert breaker.stats().consecutive_failures == 0


def test_open_waiter_gives_up_after_max_wait() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=10.0, max_wait_s=2.5)

    async def main() -> None:
        await trip(breaker)
        await vt.sleep(1.0)
        with pytest.raises(CircuitOpenError) as caught:
            await breaker.acquire()
        assert vt.now == 2.5  # on time: max_wait_s counts from the opening, not from this call
        assert caught.value.waited_s == 2.5
        assert caught.value.retry_after_s == 7.5

    vt.run(main())
    assert breaker.stats().calls_rejected == 1


def test_waiter_gives_up_while_a_probe_is_in_flight() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0, max_wait_s=3.0)

    async def main() -> None:
        await trip(breaker)
        probe = await breaker.acquire()
        assert vt.now == 1.0
        with pytest.raises(CircuitOpenError) as caught:
            await breaker.acquire()
        assert vt.now == 3.0  # the outage's deadline, though this caller began waiting at 1.0
        assert caught.value.waited_s == 3.0
        assert caught.value.retry_after_s == 0.0
        breaker.record(probe, success=True)

    vt.run(main())
    assert breaker.stats().calls_rejected == 1


def test_zero_max_wait_fails_at_once_when_open() -> None:
    vt = VirtualTime()
    breaker = make(vt, max_wait_s=0.0)

    async def main() -> None:
        await trip(breaker)
        with pytest.raises(CircuitOpenError) as caught:
            await breaker.acquire()
        assert caught.value.waited_s == 0.0

    vt.run(main())


def test_cancelled_probe_recorded_as_failure_does_not_deadlock_waiters() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0)

    async def doomed_call() -> None:
        permit = await breaker.acquire()
        try:
            await asyncio.get_running_loop().create_future()  # a call that never returns
        finally:
            breaker.record(permit, success=False)

    async def good_call() -> bool:
        permit = await breaker.acquire()
        breaker.record(permit, success=True)
        return permit.is_probe

    async def main() -> list[bool]:
        await trip(breaker)
        await vt.sleep(1.0)
        holder = asyncio.ensure_future(doomed_call())
        await settle()
        assert breaker.state is BreakerState.HALF_OPEN
        waiters = [asyncio.ensure_future(good_call()) for _ in range(10)]
        await settle()
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder
        assert breaker.stats().state is BreakerState.OPEN
        return await asyncio.gather(*waiters)

    was_probe = vt.run(main())
    assert sorted(was_probe) == [False] * 9 + [True]
    assert vt.now == 3.0  # the next probe came after the doubled timeout
    assert breaker.state is BreakerState.CLOSED


def test_cancelled_waiter_leaves_the_others_unharmed() -> None:
    vt = VirtualTime()
    breaker = make(vt)

    async def main() -> None:
        await trip(breaker)
        first = asyncio.ensure_future(breaker.acquire())
        second = asyncio.ensure_future(breaker.acquire())
        await settle()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        probe = await second
        assert probe.is_probe
        breaker.record(probe, success=True)

    vt.run(main())
    assert breaker.stats().probes == 1


def test_time_open_counts_open_and_half_open_periods() -> None:
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0)

    async def main() -> None:
        await vt.sleep(5.0)
        await trip(breaker)  # opens at 5
        await vt.sleep(0.5)
        assert breaker.stats().time_open_s == 0.5  # an ongoing period counts up to now
        probe = await breaker.acquire()  # half-open at 6
        await vt.sleep(0.5)
        breaker.record(probe, success=True)  # closes at 6.5
        await vt.sleep(10.0)
        assert breaker.stats().time_open_s == 1.5
        await trip(breaker)  # opens at 16.5
        await vt.sleep(0.25)

    vt.run(main())
    stats = breaker.stats()
    assert stats.time_open_s == 1.75
    assert stats.openings == 2
    assert stats.probes == 1
    assert stats.state is BreakerState.OPEN
    assert stats.calls_rejected == 0


def test_max_wait_counts_the_outage_not_each_call() -> None:
    """A service failing every call: callers that keep becoming the probe, failing and asking
    again do not start new waits; every caller gives up within max_wait_s + one reset period
    of the opening."""
    vt = VirtualTime()
    breaker = make(vt, reset_timeout_s=1.0, max_reset_timeout_s=2.0, max_wait_s=10.0)
    gave_up: list[float] = []

    async def caller() -> None:
        for _ in range(200):  # bounded: on the per-call deadline this loop never stops
            permit = await breaker.acquire()
            await vt.sleep(0.5)  # the call goes out and fails
            breaker.record(permit, success=False)
        raise AssertionError("the breaker never gave up")

    async def guarded() -> None:
        try:
            await caller()
        except CircuitOpenError:
            gave_up.append(vt.now)

    async def main() -> float:
        await trip(breaker)
        opened = vt.now
        await asyncio.gather(*(guarded() for _ in range(3)))
        return opened

    opened = vt.run(main())
    assert len(gave_up) == 3
    assert max(gave_up) <= opened + 10.0 + 2.0
    assert breaker.stats().calls_rejected == 3

"""In-flight limiters: how many calls one actor may have outstanding at the model service.

They replace the reference build's hand-tuned `asyncio.Semaphore(50)`. A caller takes a slot
with `acquire()` before a call and gives it back with `release(latency_s=..., dropped=...,
...)` (or `release_ignored()` when the call never reached the service), always from a
`finally`.

- `FixedLimiter` is that semaphore, with stats: a fixed cap, for measurements and as the
  safe fallback.
- `AdaptiveLimiter` finds the cap by itself: AIMD (as TCP Reno) driven by what the server
  says about its load, never by raw latency (below).

Where it sits (`raypipe.call.actor.InferenceActor._call`): **limiter (an in-flight slot, taken
first and held for the whole call, its breaker wait, retries and backoff included)** →
breaker (one permit per call) → retry → client. So a call waiting on an open breaker holds
its slot, and an outage costs at most `limit` calls. It is also where backpressure reaches
Ray Data: an actor whose slots are full stops taking new work.

Why not latency: the server batches across callers, so on a busy, healthy replica most of a
call's latency is waiting for the batch ahead of it to finish. That wait is what keeps the
model fed; a latency rule reads it as overload and throttles until the model idles between
small batches (measured: down to 1 in flight and 36% of the ceiling). What does mean
overload is work the replica cannot use soon: a call that waited behind more than the next
batch (the server reports how many other batches still had passes waiting for a model thread
when the call's batch queued its own), time
spent queued in front of the replica (the call's latency minus the time the replica says it
held it: Serve's proxy queues calls beyond a replica's `max_ongoing_requests`), and calls
refused or timed out (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED).

What to release with: `release` only when the service answered (a success, `dropped=False`,
with the server's report if it sent one) or sent an overload signal (`dropped=True`). Other
outcomes (UNAVAILABLE, a permanent rejection, a cancelled caller) go through
`release_ignored()`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["AdaptiveLimiter", "FixedLimiter", "Limiter", "LimiterStats"]

Clock = Callable[[], float]

#: Change points kept in `LimiterStats.history`; older ones are thinned out beyond that.
HISTORY_POINTS = 200


@dataclass(frozen=True)
class LimiterStats:
    #: The limit at construction.
    initial: int
    #: Lowest limit reached.
    min: int
    #: Highest limit reached.
    max: int
    #: The limit now.
    final: int
    #: Releases that carried a latency sample.
    samples: int
    #: Multiplicative decreases (overload seen).
    decreases: int
    #: `(clock time, limit)` at each change of the integer limit, thinned to at most
    #: about `HISTORY_POINTS` points; the first point is the initial limit.
    history: tuple[tuple[float, int], ...]


class Limiter(Protocol):
    """Caps the calls in flight; `acquire` waits for a slot, a `release*` frees one."""

    async def acquire(self) -> None: ...

    def release(
        self,
        *,
        latency_s: float,
        dropped: bool,
        replica_s: float | None = None,
        batches_ahead: int | None = None,
    ) -> None:
        """Free a slot after a call that reached the service.

        `latency_s` is how long the call took, as the client saw it; `dropped` says it
        failed with an overload signal (RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED). From a
        server that reports them: `replica_s`, how long the replica held the call, and
        `batches_ahead`, how many other batches still had forward passes waiting for a
        model thread when the call's batch queued its own (0 when its passes were next).
        """
        ...

    def release_ignored(self) -> None:
        """Free a slot without a sample (the call never reached the service)."""
        ...

    @property
    def limit(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    def stats(self) -> LimiterStats: ...


class _History:
    """Change points of the limit, bounded by dropping every other point when full."""

    def __init__(self, t: float, limit: int) -> None:
        self._points: list[tuple[float, int]] = [(t, limit)]
        self.lowest = limit
        self.highest = limit

    def add(self, t: float, limit: int) -> None:
        if limit == self._points[-1][1]:
            return
        self.lowest = min(self.lowest, limit)
        self.highest = max(self.highest, limit)
        self._points.append((t, limit))
        if len(self._points) > HISTORY_POINTS:
            # Keep the first point and the latest one exact; halve the resolution between.
            self._points = [*self._points[:-1:2], self._points[-1]]

    def points(self) -> tuple[tuple[float, int], ...]:
        return tuple(self._points)


class _SlotLimiter(Limiter):
    """The slot bookkeeping shared by both limiters: a FIFO of waiters and a count.

    `release` is synchronous (it runs in `finally` blocks), so instead of an
    `asyncio.Condition`, whose `notify` needs its lock, waiters park on futures that a
    release resolves; the slot is handed over with the wake-up, so it cannot be stolen.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._in_flight = 0
        # Futures are created inside the running loop by `acquire`, never here: limiters
        # are built in a Ray actor's constructor, outside the loop that will use them.
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limit(self) -> int:
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def acquire(self) -> None:
        if not self._waiters and self._in_flight < self.limit:
            self._in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed to us just as we were cancelled: pass it on.
                self._in_flight -= 1
                self._wake()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release_ignored(self) -> None:
        self._free_slot()
        self._wake()

    def _free_slot(self) -> None:
        if self._in_flight <= 0:
            raise RuntimeError("limiter released more often than acquired")
        self._in_flight -= 1

    def _wake(self) -> None:
        """Hand free slots to waiters, oldest first (as many as the limit allows)."""
        while self._waiters and self._in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)


class FixedLimiter(_SlotLimiter):
    """At most `limit` calls in flight, always."""

    def __init__(self, limit: int, *, clock: Clock = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        super().__init__(clock)
        self._limit = limit
        self._samples = 0
        self._history = _History(clock(), limit)

    @property
    def limit(self) -> int:
        return self._limit

    def release(
        self,
        *,
        latency_s: float,
        dropped: bool,
        replica_s: float | None = None,
        batches_ahead: int | None = None,
    ) -> None:
        self._free_slot()
        self._samples += 1
        self._wake()

    def stats(self) -> LimiterStats:
        return LimiterStats(
            initial=self._limit,
            min=self._limit,
            max=self._limit,
            final=self._limit,
            samples=self._samples,
            decreases=0,
            history=self._history.points(),
        )


class AdaptiveLimiter(_SlotLimiter):
    """AIMD in-flight limit driven by the server's overload signals.

    The limit is a float. On an answer without an overload signal, and only while the
    limiter is actually the bottleneck (at least half the limit in flight; below that the
    client is app-limited and growing would mean nothing), it grows by 1/limit: about +1 per
    round trip, as TCP's congestion avoidance. On an overload signal it is multiplied by
    `backoff_ratio`, at most once per round trip: a call that started before the last
    decrease was sent under the old limit and says nothing new, so a burst of signals from
    one window counts once. The limit stays in [`min_limit`, `max_limit`].

    Overload signals: a dropped call; a call that waited behind more than `queue_tolerance`
    whole batches in the replica; a call that spent more than `outside_slack_s` queued in
    front of the replica (latency minus `replica_s`: the proxy's queue, the network).

    What it converges to: about one batch of work queued in the replica behind the running
    one, so the model never waits for work and a call never waits more than about two batch
    times; beyond that, more in flight adds only waiting. Why AIMD: additive increase with
    multiplicative decrease makes several independent clients (here, several actors sharing
    one service) converge to equal shares without talking to each other (Chiu and Jain,
    1989), and the sum of their limits to what the replicas can queue.
    """

    def __init__(
        self,
        *,
        initial: int = 8,
        min_limit: int = 2,
        max_limit: int = 64,
        backoff_ratio: float = 0.9,
        queue_tolerance: int = 0,
        outside_slack_s: float = 0.25,
        clock: Clock = time.monotonic,
    ) -> None:
        if not 1 <= min_limit <= initial <= max_limit:
            raise ValueError(f"need 1 <= min_limit <= initial <= max_limit, got {min_limit}, {initial}, {max_limit}")
        if not 0 < backoff_ratio < 1:
            raise ValueError(f"backoff_ratio must be in (0, 1), got {backoff_ratio}")
        if queue_tolerance < 0:
            raise ValueError(f"queue_tolerance must be >= 0, got {queue_tolerance}")
        if not outside_slack_s > 0:
            raise ValueError(f"outside_slack_s must be > 0, got {outside_slack_s}")
        super().__init__(clock)
        self._initial = initial
        self._min = min_limit
        self._max = max_limit
        self._backoff = backoff_ratio
        self._queue_tolerance = queue_tolerance
        self._outside_slack = outside_slack_s
        self._limit = float(initial)
        self._last_decrease_at = -math.inf
        self._samples = 0
        self._decreases = 0
        self._history = _History(clock(), initial)

    @property
    def limit(self) -> int:
        return max(self._min, math.floor(self._limit))

    def release(
        self,
        *,
        latency_s: float,
        dropped: bool,
        replica_s: float | None = None,
        batches_ahead: int | None = None,
    ) -> None:
        """Free the slot and adjust the limit from this sample. Negative latency counts as 0."""
        in_use = self._in_flight  # including this call: how busy the limiter was
        self._free_slot()
        self._samples += 1
        latency_s = max(latency_s, 0.0)
        now = self._clock()
        if dropped or self._overloaded(latency_s, replica_s, batches_ahead):
            if now - latency_s >= self._last_decrease_at:
                self._limit = max(self._min, self._limit * self._backoff)
                self._decreases += 1
                self._last_decrease_at = now
        elif in_use >= self._limit / 2:
            self._limit = min(self._max, self._limit + 1 / self._limit)
        self._history.add(now, self.limit)
        self._wake()

    def stats(self) -> LimiterStats:
        return LimiterStats(
            initial=self._initial,
            min=self._history.lowest,
            max=self._history.highest,
            final=self.limit,
            samples=self._samples,
            decreases=self._decreases,
            history=self._history.points(),
        )

    def _overloaded(self, latency_s: float, replica_s: float | None, batches_ahead: int | None) -> bool:
        if batches_ahead is not None and batches_ahead > self._queue_tolerance:
            return True
        return replica_s is not None and latency_s - replica_s > self._outside_slack

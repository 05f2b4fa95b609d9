"""In-flight limiters: how many calls one actor may have outstanding at the model service.

They replace the reference build's hand-tuned `asyncio.Semaphore(50)`. A caller takes a slot
with `acquire()` before a call and gives it back with `release(latency_s=..., dropped=...)`
(or `release_ignored()` when the call never reached the service), always from a `finally`.

- `FixedLimiter` is that semaphore, with stats: a fixed cap, for measurements and as the
  safe fallback.
- `AdaptiveLimiter` finds the cap by itself, AIMD with a latency guard, in the spirit of
  Netflix's concurrency-limits and TCP Reno (below).

Where it sits: **limiter (in-flight cap)** → retry → breaker → client. It is the first
thing a call meets, so it is also where backpressure reaches Ray Data: an actor whose
slots are full stops taking new work from its `__call__`s.

What to release with: a sample (`release`) only when the latency says something about the
service's queue, i.e. a success (`dropped=False`) or an overload signal (`dropped=True`),
with the duration of the RPC that ended the call, not of backoffs or breaker waits. Other
outcomes (UNAVAILABLE, a permanent rejection, `CircuitOpenError`, a cancelled caller) go
through `release_ignored()`: a connection refused in a millisecond would otherwise pass for
the no-load latency and make every normal call look slow.
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
    #: Multiplicative decreases (overload or latency growth seen).
    decreases: int
    #: `(clock time, limit)` at each change of the integer limit, thinned to at most
    #: about `HISTORY_POINTS` points; the first point is the initial limit.
    history: tuple[tuple[float, int], ...]


class Limiter(Protocol):
    """Caps the calls in flight; `acquire` waits for a slot, a `release*` frees one."""

    async def acquire(self) -> None: ...

    def release(self, *, latency_s: float, dropped: bool, cost: float = 1.0) -> None:
        """Free a slot after a call that reached the service.

        `latency_s` is how long the call took; `dropped` says it failed with an overload
        signal (RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED); `cost` is how much work the call
        asked for (any positive unit), so calls of different sizes compare by latency per
        unit of work rather than raw latency.
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
            else:
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

    def release(self, *, latency_s: float, dropped: bool, cost: float = 1.0) -> None:
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
    """AIMD in-flight limit with a latency guard.

    The limit is a float. On a good sample, and only while the limiter is actually the
    bottleneck (at least half the limit in flight; below that the client is app-limited and
    growing would mean nothing), it grows by 1/limit: about +1 per round trip, as TCP's
    congestion avoidance. On an overload signal (a dropped call) or when the smoothed latency
    exceeds `latency_tolerance` × the baseline, it is multiplied by `backoff_ratio`, at most
    once per round trip: a call that started before the last decrease was sent under the
    old limit and says nothing new, so a burst of drops from one window counts once. The
    limit stays in [`min_limit`, `max_limit`].

    The baseline is the lowest latency of the last `window` good samples: the no-load
    latency, able to follow a drift (longer texts, a slower replica) within `window` calls.

    What it converges to: the largest limit that keeps latency within tolerance of the
    no-load latency, i.e. about one service time of queueing at the server; beyond that,
    more in flight only adds waiting, not throughput. Why AIMD: additive increase with
    multiplicative decrease makes several independent clients (here, several actors
    sharing one service) converge to equal shares of the capacity without talking to each
    other (Chiu and Jain, 1989), which neither fixed caps nor multiplicative growth do.
    """

    def __init__(
        self,
        *,
        initial: int = 8,
        min_limit: int = 1,
        max_limit: int = 256,
        backoff_ratio: float = 0.9,
        latency_tolerance: float = 2.0,
        window: int = 100,
        clock: Clock = time.monotonic,
    ) -> None:
        if not 1 <= min_limit <= initial <= max_limit:
            raise ValueError(f"need 1 <= min_limit <= initial <= max_limit, got {min_limit}, {initial}, {max_limit}")
        if not 0 < backoff_ratio < 1:
            raise ValueError(f"backoff_ratio must be in (0, 1), got {backoff_ratio}")
        if not latency_tolerance >= 1:
            raise ValueError(f"latency_tolerance must be >= 1, got {latency_tolerance}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(clock)
        self._initial = initial
        self._min = min_limit
        self._max = max_limit
        self._backoff = backoff_ratio
        self._tolerance = latency_tolerance
        self._limit = float(initial)
        self._recent: deque[float] = deque(maxlen=window)  # good latencies, for the baseline
        self._smoothed: float | None = None  # EWMA of good latencies
        self._last_decrease_at = -math.inf
        self._samples = 0
        self._decreases = 0
        self._history = _History(clock(), initial)

    @property
    def limit(self) -> int:
        return max(self._min, math.floor(self._limit))

    def release(self, *, latency_s: float, dropped: bool, cost: float = 1.0) -> None:
        """Free the slot and adjust the limit from this sample. Negative latency counts as 0.

        The baseline and the smoothed latency are kept per unit of `cost`; the raw latency
        only dates the call, for the once-per-round-trip rule.
        """
        in_use = self._in_flight  # including this call: how busy the limiter was
        self._free_slot()
        self._samples += 1
        latency_s = max(latency_s, 0.0)
        now = self._clock()
        if not dropped:
            # Dropped calls stay out of the latency estimates: a quick RESOURCE_EXHAUSTED
            # would fake a low baseline, a DEADLINE_EXCEEDED only measures the deadline.
            per_cost = latency_s / max(cost, 1e-9)
            self._recent.append(per_cost)
            self._smoothed = per_cost if self._smoothed is None else 0.8 * self._smoothed + 0.2 * per_cost
        if dropped or self._too_slow():
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

    def _too_slow(self) -> bool:
        if self._smoothed is None or not self._recent:
            return False
        return self._smoothed > self._tolerance * min(self._recent)

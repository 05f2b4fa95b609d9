"""A circuit breaker that makes callers wait while the model service is down.

Every call to the model service (`raypipe.call.actor.InferenceActor._call`: after it holds its
in-flight slot, before its retries) asks the breaker for a `Permit`, and reports the call's
outcome once, after its retries, with `record`; each attempt checks `admits(permit)` right
before it goes out. After `failure_threshold` consecutive failed calls (a call fails when it
ends in an error after its retries, whatever its code, unless the caller found its rows at
fault: see `record`) the breaker opens: the service is presumed down (a replica restarting,
the proxy redeploying) and hammering it would only slow the restart. Unlike a classic
breaker, an open circuit does not fail calls at once: `acquire` *waits*, so the job pauses
while the service comes back. `max_wait_s` bounds the outage, not a call: once the breaker
has stayed open (failed probes included) for `max_wait_s` since it opened, every waiting and
every new caller gets `CircuitOpenError` and no probe goes out any more. A caller that became
the probe, failed and asks again does not start a wait of its own, so a service that fails
every call stops the run within `max_wait_s` + one reset period (plus the call in flight).

    failure_threshold consecutive                 reset timeout elapsed:
    failed calls                                  the next caller becomes the probe
      ┌────────┐  ─────────────────────►  ┌──────┐  ─────────────────────►  ┌───────────┐
      │ CLOSED │                          │ OPEN │                          │ HALF_OPEN │
      └────────┘  ◄──────────┐            └──────┘  ◄─────────────────────  └───────────┘
          ▲                  │                        probe failed: reset      │
          │                  │                        timeout doubled (capped) │
          │                  └──────────────────────────────────────────────────┘
          │                        probe succeeded: reset timeout back to base
          └ success resets the consecutive-failure count

Bound on the load an outage sees: while the breaker is open, the only calls that reach the
service are probes, at most one per reset period, and every other caller waits.

Generations: each opening and each closing starts a new generation, and a permit remembers
the one it was issued in. Outcomes of permits from an older generation are ignored, so a
call that started before the breaker opened and fails afterwards does not count twice, and
one that succeeds late does not close an open breaker: only the probe decides.

Callers must record every permit, from a `finally`, or a probe that never reports keeps the
others waiting (up to their `max_wait_s`)::

    permit = await breaker.acquire()
    success = False
    try:
        result = await call()
        success = True
    except ModelServiceError as exc:
        success = rows_at_fault(exc)     # the caller's choice: see `record`
        raise
    finally:
        breaker.record(permit, success=success)

Where it sits (`raypipe.call.actor.InferenceActor._call`, the one caller): limiter (an in-flight
slot, held for the whole call) → **breaker (one permit per call)** → retry (attempts with
backoff) → each attempt checks `admits(permit)` → client. It counts calls, not retry
attempts: a call records one outcome, after its retries. An attempt checks `admits(permit)`
right before it goes out, so one admitted while the breaker was closed does not go out after
it opened. The breaker knows nothing of gRPC: the caller decides what a failure is.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from raypipe.errors import CircuitOpenError

__all__ = ["BreakerState", "BreakerStats", "CircuitBreaker", "Permit"]

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Permit:
    """Leave to make one attempt; hand it back to `CircuitBreaker.record` exactly once.

    Opaque to callers. Recording the same permit twice is harmless: the second call is
    ignored, so a `finally` that records "just in case" is safe.
    """

    __slots__ = ("_generation", "_is_probe", "_recorded")

    def __init__(self, generation: int, *, is_probe: bool) -> None:
        self._generation = generation
        self._is_probe = is_probe
        self._recorded = False

    @property
    def is_probe(self) -> bool:
        return self._is_probe

    def __repr__(self) -> str:
        return f"Permit(generation={self._generation}, is_probe={self._is_probe})"


@dataclass(frozen=True)
class BreakerStats:
    #: Times the breaker opened from CLOSED (a failed probe re-opening it is not counted).
    openings: int
    #: Probe calls let through in HALF_OPEN.
    probes: int
    #: Seconds spent OPEN or HALF_OPEN, including an ongoing open period up to now.
    time_open_s: float
    state: BreakerState
    #: Transient failures since the last success, in the current generation.
    consecutive_failures: int
    #: Callers that gave up waiting and got `CircuitOpenError`.
    calls_rejected: int


class CircuitBreaker:
    """Consecutive-failure breaker with a single probe and an exponentially growing reset."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        reset_timeout_s: float = 1.0,
        max_reset_timeout_s: float = 30.0,
        max_wait_s: float = 600.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not reset_timeout_s > 0:
            raise ValueError(f"reset_timeout_s must be > 0, got {reset_timeout_s}")
        if not max_reset_timeout_s >= reset_timeout_s:
            raise ValueError(
                f"max_reset_timeout_s ({max_reset_timeout_s}) must be >= reset_timeout_s ({reset_timeout_s})"
            )
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self._failure_threshold = failure_threshold
        self._base_reset_s = reset_timeout_s
        self._max_reset_s = max_reset_timeout_s
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._sleep = sleep

        self._state = BreakerState.CLOSED
        self._generation = 0
        self._consecutive_failures = 0
        self._reset_s = reset_timeout_s
        self._probe_at = 0.0  # when OPEN: the earliest time a probe may start
        self._opened_at = 0.0  # start of the current open period (OPEN or HALF_OPEN)
        # Asyncio objects are created lazily inside the running loop: the breaker is built in
        # a Ray actor's constructor, before (and outside) the loop that will use it.
        self._changed: asyncio.Event | None = None

        self._openings = 0
        self._probes = 0
        self._closed_open_time_s = 0.0
        self._rejected = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    async def acquire(self) -> Permit:
        """Wait until a call may go out; raise `CircuitOpenError` once the outage has lasted
        `max_wait_s` (counted from the opening, whoever waits and however often they ask)."""
        start = self._clock()
        while True:
            now = self._clock()
            if self._state is BreakerState.CLOSED:
                return Permit(self._generation, is_probe=False)
            deadline = self._opened_at + self._max_wait_s
            if now >= deadline:
                self._rejected += 1
                raise CircuitOpenError(
                    f"model service circuit open for {now - self._opened_at:.1f}s "
                    f"(breaker.max_wait_s {self._max_wait_s:g}); this caller waited {now - start:.1f}s",
                    waited_s=now - self._opened_at,
                    retry_after_s=self._retry_after(now),
                )
            if self._state is BreakerState.OPEN and now >= self._probe_at:
                self._state = BreakerState.HALF_OPEN
                self._probes += 1
                self._notify()
                return Permit(self._generation, is_probe=True)
            wake_at = deadline
            if self._state is BreakerState.OPEN:
                wake_at = min(wake_at, self._probe_at)
            await self._wait_for_change(wake_at - now)

    def admits(self, permit: Permit) -> bool:
        """May an attempt under `permit` go out now? False once the breaker opened after it was issued."""
        if permit._generation != self._generation:
            return False
        return self._state is BreakerState.CLOSED or (permit._is_probe and self._state is BreakerState.HALF_OPEN)

    def record(self, permit: Permit, *, success: bool) -> None:
        """Report how the call made under `permit` went, after its retries.

        The caller decides what a failure is. The actor records `success=True` for an answer,
        and for a failed call only when a canary call under the same permit was answered (the
        rows were at fault, not the service); every other failed call, permanent codes
        included, is `success=False`.
        """
        if permit._recorded:
            return
        permit._recorded = True
        if permit._generation != self._generation:
            return  # issued before the last opening or closing: already accounted for
        if permit._is_probe:
            if success:
                self._close()
            else:
                self._reset_s = min(self._reset_s * 2, self._max_reset_s)
                self._open()
            return
        if success:
            self._consecutive_failures = 0
            return
        self._consecutive_failures += 1
        if self._consecutive_failures >= self._failure_threshold:
            self._openings += 1
            self._opened_at = self._clock()
            self._open()

    def stats(self) -> BreakerStats:
        time_open = self._closed_open_time_s
        if self._state is not BreakerState.CLOSED:
            time_open += self._clock() - self._opened_at
        return BreakerStats(
            openings=self._openings,
            probes=self._probes,
            time_open_s=time_open,
            state=self._state,
            consecutive_failures=self._consecutive_failures,
            calls_rejected=self._rejected,
        )

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._generation += 1
        self._consecutive_failures = 0
        self._probe_at = self._clock() + self._reset_s
        self._notify()

    def _close(self) -> None:
        self._closed_open_time_s += self._clock() - self._opened_at
        self._state = BreakerState.CLOSED
        self._generation += 1
        self._consecutive_failures = 0
        self._reset_s = self._base_reset_s
        self._notify()

    def _retry_after(self, now: float) -> float:
        if self._state is BreakerState.OPEN:
            return max(self._probe_at - now, 0.0)
        return 0.0  # HALF_OPEN: a probe is deciding right now

    def _notify(self) -> None:
        # One event per state: setting it wakes everyone waiting on this state, and the next
        # waiter creates a fresh one for the new state.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_for_change(self, timeout: float) -> None:
        """Return when the state changes or `timeout` seconds pass, whichever comes first."""
        if self._changed is None:
            self._changed = asyncio.Event()
        changed = asyncio.ensure_future(self._changed.wait())
        slept = asyncio.ensure_future(self._sleep(timeout))
        try:
            await asyncio.wait((changed, slept), return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            slept.cancel()
        if slept.done() and not slept.cancelled():
            slept.result()  # surface an error from the injected sleep rather than lose it

"""The one retry layer of a model-service call, built on tenacity.

A call is retried only when it failed with a *transient* `ModelServiceError` (unavailable,
deadline exceeded, overloaded, cancelled by the server): `ModelServiceError.transient` is
the only thing this layer reads. Permanent errors (`RequestRejected`) and every other
exception, including `CircuitOpenError` and `asyncio.CancelledError`, pass through at once.
Between attempts it sleeps with exponential backoff and full jitter (AWS's "Full Jitter":
attempt n waits uniformly in [0, min(max_backoff_s, initial_backoff_s × 2^(n-1))]), so
many actors retrying after the same outage do not come back in lockstep.

Where it sits (`raypipe.call.actor.InferenceActor._call`): limiter (one in-flight slot, held for
the whole call, retries and backoff included) → breaker (one permit per call) → **retry** →
each attempt checks that its permit is still admitted → client. The breaker sees the call's
outcome once, after its retries; gRPC's channel-level retry policy stays off, so that no
failure is retried by two layers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from raypipe.errors import ModelServiceError

__all__ = ["RetryPolicy", "call_with_retries"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed call is tried again."""

    max_attempts: int = 4
    """Calls made in total, the first one included (the reference build's 4); >= 1."""

    initial_backoff_s: float = 0.1
    """Upper bound of the first backoff; the bound doubles with each retry. > 0."""

    max_backoff_s: float = 5.0
    """Cap on the backoff bound, so a long outage is polled at least this often. >= initial."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.initial_backoff_s > 0:
            raise ValueError(f"initial_backoff_s must be > 0, got {self.initial_backoff_s}")
        if not self.max_backoff_s >= self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s}) must be >= initial_backoff_s ({self.initial_backoff_s})"
            )


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, ModelServiceError) and exc.transient


async def call_with_retries(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Await `call()` until it succeeds, fails permanently, or `policy` runs out of attempts.

    The final exception is re-raised as it is (not wrapped); a `ModelServiceError` gets its
    `attempts` set to the number of calls made. `on_retry(attempt_number, exc)` runs before
    each backoff sleep, with the number of the attempt that just failed.
    """
    attempts = 0

    async def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return await call()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            exc = state.outcome.exception()
            if exc is not None:
                on_retry(state.attempt_number, exc)

    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts),
        wait=tenacity.wait_random_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s),
        retry=tenacity.retry_if_exception(_is_transient),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        result: T = await retrying(attempt)
    except ModelServiceError as exc:
        exc.attempts = attempts
        raise
    return result

"""call_with_retries: what is retried, how long it waits, and what the caller finally sees."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from raypipe.call.retry import RetryPolicy, call_with_retries
from raypipe.errors import (
    CircuitOpenError,
    ModelServiceError,
    RequestRejected,
    ServiceCancelled,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)


class FakeSleep:
    """Records each delay and advances a fake clock; never really sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.now += delay
        await asyncio.sleep(0)


class Script:
    """A call that raises the scripted exceptions in turn, then returns "ok"."""

    def __init__(self, *outcomes: BaseException) -> None:
        self._outcomes = list(outcomes)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self._outcomes:
            raise self._outcomes.pop(0)
        return "ok"


def unavailable() -> ServiceUnavailable:
    return ServiceUnavailable("down", status_code="UNAVAILABLE")


def run(call: Callable[[], Awaitable[str]], policy: RetryPolicy | None = None, **kwargs: Any) -> str:
    return asyncio.run(call_with_retries(call, policy or RetryPolicy(), **kwargs))


@pytest.fixture
def upper_bound_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make full jitter always pick the top of its window, so delays are exact."""
    monkeypatch.setattr(random, "uniform", lambda low, high: high)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_backoff_s": 0.0},
        {"initial_backoff_s": 1.0, "max_backoff_s": 0.5},
    ],
)
def test_policy_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_policy_defaults() -> None:
    assert RetryPolicy() == RetryPolicy(max_attempts=4, initial_backoff_s=0.1, max_backoff_s=5.0)


def test_success_at_once_does_not_sleep() -> None:
    sleep = FakeSleep()
    call = Script()
    assert run(call, sleep=sleep) == "ok"
    assert call.calls == 1
    assert sleep.delays == []


@pytest.mark.parametrize(
    "error",
    [
        unavailable(),
        ServiceTimeout("slow", status_code="DEADLINE_EXCEEDED"),
        ServiceOverloaded("busy", status_code="RESOURCE_EXHAUSTED"),
        ServiceCancelled("cancelled", status_code="CANCELLED"),
    ],
)
def test_transient_errors_are_retried(error: ModelServiceError) -> None:
    sleep = FakeSleep()
    retried: list[tuple[int, BaseException]] = []
    call = Script(error, error)
    result = run(call, sleep=sleep, on_retry=lambda n, exc: retried.append((n, exc)))
    assert result == "ok"
    assert call.calls == 3
    assert len(sleep.delays) == 2
    assert retried == [(1, error), (2, error)]


def test_exhaustion_reraises_the_last_error_with_attempts() -> None:
    sleep = FakeSleep()
    errors = [unavailable() for _ in range(4)]
    call = Script(*errors)
    with pytest.raises(ServiceUnavailable) as caught:
        run(call, RetryPolicy(max_attempts=4), sleep=sleep)
    assert caught.value is errors[-1]  # the original exception, not a tenacity wrapper
    assert caught.value.attempts == 4
    assert call.calls == 4
    assert len(sleep.delays) == 3


def test_single_attempt_policy_never_retries() -> None:
    sleep = FakeSleep()
    call = Script(unavailable())
    with pytest.raises(ServiceUnavailable) as caught:
        run(call, RetryPolicy(max_attempts=1), sleep=sleep)
    assert caught.value.attempts == 1
    assert sleep.delays == []


@pytest.mark.usefixtures("upper_bound_jitter")
def test_backoff_doubles_up_to_the_cap() -> None:
    sleep = FakeSleep()
    call = Script(*(unavailable() for _ in range(7)))
    policy = RetryPolicy(max_attempts=7, initial_backoff_s=0.1, max_backoff_s=1.0)
    with pytest.raises(ServiceUnavailable):
        run(call, policy, sleep=sleep)
    assert sleep.delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_full_jitter_stays_within_the_window() -> None:
    random.seed(1234)
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=1.0)
    windows = [0.1, 0.2, 0.4, 0.8, 1.0]
    seen: list[list[float]] = [[] for _ in windows]
    for _ in range(200):
        sleep = FakeSleep()
        with pytest.raises(ServiceUnavailable):
            run(Script(*(unavailable() for _ in range(6))), policy, sleep=sleep)
        for i, delay in enumerate(sleep.delays):
            seen[i].append(delay)
    for window, delays in zip(windows, seen, strict=True):
        assert all(0.0 <= d <= window for d in delays)
        # Full jitter spreads over the whole window, not just near its top.
        assert min(delays) < 0.25 * window
        assert max(delays) > 0.75 * window


def test_permanent_error_is_not_retried() -> None:
    sleep = FakeSleep()
    retried: list[int] = []
    call = Script(RequestRejected("bad input", status_code="INVALID_ARGUMENT"))
    with pytest.raises(RequestRejected) as caught:
        run(call, sleep=sleep, on_retry=lambda n, exc: retried.append(n))
    assert call.calls == 1
    assert caught.value.attempts == 1
    assert sleep.delays == []
    assert retried == []


def test_permanent_error_after_retries_counts_every_attempt() -> None:
    call = Script(unavailable(), RequestRejected("bad input", status_code="INVALID_ARGUMENT"))
    with pytest.raises(RequestRejected) as caught:
        run(call, sleep=FakeSleep())
    assert caught.value.attempts == 2


def test_circuit_open_passes_through_untouched() -> None:
    sleep = FakeSleep()
    call = Script(unavailable(), CircuitOpenError("open", waited_s=600.0, retry_after_s=5.0))
    with pytest.raises(CircuitOpenError) as caught:
        run(call, sleep=sleep)
    assert call.calls == 2
    assert len(sleep.delays) == 1
    assert caught.value.attempts == 0  # left as the breaker set it


def test_other_exceptions_pass_through() -> None:
    call = Script(ValueError("a bug"))
    with pytest.raises(ValueError):
        run(call, sleep=FakeSleep())
    assert call.calls == 1


def test_cancellation_of_the_call_is_not_retried() -> None:
    call = Script(asyncio.CancelledError())
    sleep = FakeSleep()
    with pytest.raises(asyncio.CancelledError):
        run(call, sleep=sleep)
    assert call.calls == 1
    assert sleep.delays == []


def test_cancellation_during_backoff_stops_retrying() -> None:
    call = Script(unavailable(), unavailable())

    async def main() -> None:
        parked: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def sleep_forever(delay: float) -> None:
            await parked

        task = asyncio.ensure_future(call_with_retries(call, RetryPolicy(), sleep=sleep_forever))
        for _ in range(10):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert call.calls == 1


def test_attempts_are_counted_per_call() -> None:
    first = Script(unavailable(), unavailable(), unavailable(), unavailable())
    second = Script(unavailable(), RequestRejected("bad", status_code="INVALID_ARGUMENT"))

    async def main() -> tuple[BaseException | str, BaseException | str]:
        policy = RetryPolicy()
        return await asyncio.gather(
            call_with_retries(first, policy, sleep=FakeSleep()),
            call_with_retries(second, policy, sleep=FakeSleep()),
            return_exceptions=True,
        )

    one, two = asyncio.run(main())
    assert isinstance(one, ServiceUnavailable) and one.attempts == 4
    assert isinstance(two, RequestRejected) and two.attempts == 2

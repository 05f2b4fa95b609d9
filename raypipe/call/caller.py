"""One call to the model service as an inference actor makes it, and what a failed one means.

A call goes through, in this order (`raypipe.call.actor` tells the unit around it):

    limiter (one in-flight slot, held for the whole call, retries and backoff included)
      -> breaker (one permit per call; waits while the service is down)
        -> retry (`raypipe.call.retry`: transient codes, a few attempts with backoff)
          -> each attempt: does the breaker still admit the permit? -> gRPC client

A micro-batch that keeps failing is attributed by a canary call (a paragraph no model
rejects) and, when the rows are at fault, bisected until each failing row stands alone.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raypipe.call.breaker import CircuitBreaker, Permit
from raypipe.call.client import BatchResult, ModelClient
from raypipe.call.limiter import Limiter
from raypipe.call.retry import RetryPolicy, call_with_retries
from raypipe.config import RetryConfig
from raypipe.errors import ModelServiceError, ServiceWrongModel
from raypipe.report import UnitStats

__all__ = ["Outcome", "ServiceCaller"]

_OVERLOAD = frozenset({"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
# The canary: a paragraph no model rejects, so its failure can only be the service's.
_CANARY_ID = "raypipe-canary"
_CANARY_TEXT = "The weather is fine today."


# (latency, dropped, answer) of an attempt the limiter may learn from.
_Sample = tuple[float, bool, BatchResult | None]


@dataclass
class Outcome:
    """The fate of some rows of a unit: probabilities, or the error that ended them."""

    rows: np.ndarray  # indices into the unit's table
    result: BatchResult | None = None
    error: BaseException | None = None
    attempts: int = 0


class _StalePermit(Exception):
    """The breaker opened after this call's permit was issued: the attempt must not go out."""


class _RowsSuspect(Exception):
    """A call failed while a canary under its permit passed: its rows, not the service, are at fault."""

    def __init__(self, error: ModelServiceError) -> None:
        super().__init__(str(error))
        self.error = error


class ServiceCaller:
    """Classifies micro-batches through one actor's client, breaker and limiter."""

    def __init__(
        self,
        client: ModelClient,
        breaker: CircuitBreaker,
        limiter: Limiter,
        retry: RetryConfig,
        *,
        model_version: str = "",
        labels: tuple[str, ...] = (),
    ) -> None:
        """`model_version` and `labels`: the run's model; an answer as another one is the
        service's failure (`ServiceWrongModel`), never a result ("" and (): any)."""
        self._client = client
        self._breaker = breaker
        self._limiter = limiter
        self._retry = retry
        self._model_version = model_version
        self._labels = tuple(labels)
        self.last_failure: str | None = None
        """The last failed attempt's error, for the message of a run the breaker stops."""

    async def classify(
        self, batch: np.ndarray, ids: Sequence[str], texts: Sequence[str], stats: UnitStats
    ) -> list[Outcome]:
        """Classifies a micro-batch until it is answered, or its rows are proven at fault.

        `CircuitOpenError` (the service stayed down) propagates: the unit is not committed.
        """
        batch_ids = [ids[i] for i in batch]
        batch_texts = [texts[i] for i in batch]
        attempts = 0
        failed_calls = 0
        max_calls = self._retry.max_attempts
        while True:
            try:
                result = await self._call(batch_ids, batch_texts, stats)
                return [Outcome(batch, result=result)]
            except _RowsSuspect as suspect:
                error: ModelServiceError = suspect.error  # the canary passed: these rows are at fault
                attempts += error.attempts
            except ModelServiceError as e:
                attempts += e.attempts
                failed_calls += 1
                if not e.service_fault or failed_calls < max_calls:
                    stats.retries += 1  # the service is down, slow, or fails every call alike: send again
                    continue
                # Service codes on this batch, call after call: does the service answer others?
                if not await self._service_answers(stats):
                    continue
                error = e
            if len(batch) > 1:
                mid = len(batch) // 2
                left, right = await asyncio.gather(
                    self.classify(batch[:mid], ids, texts, stats),
                    self.classify(batch[mid:], ids, texts, stats),
                )
                return left + right
            return [Outcome(batch, error=error, attempts=attempts)]

    async def _service_answers(self, stats: UnitStats) -> bool:
        """A canary call of its own: does the service answer a call that cannot be at fault?"""
        stats.canaries += 1
        try:
            await self._call([_CANARY_ID], [_CANARY_TEXT], stats, canary=True)
        except (ModelServiceError, _RowsSuspect):
            return False
        return True

    async def _canary(self, stats: UnitStats, permit: Permit) -> bool:
        """The canary under a failed call's own permit (so a half-open probe can be attributed too)."""
        stats.canaries += 1
        try:
            await call_with_retries(
                functools.partial(self._attempt, [_CANARY_ID], [_CANARY_TEXT], stats, permit, []),
                self._retry_policy(),
            )
        except (ModelServiceError, _StalePermit):
            return False
        return True

    def _retry_policy(self) -> RetryPolicy:
        r = self._retry
        return RetryPolicy(
            max_attempts=r.max_attempts, initial_backoff_s=r.initial_backoff_s, max_backoff_s=r.max_backoff_s
        )

    async def _call(self, ids: list[str], texts: list[str], stats: UnitStats, *, canary: bool = False) -> BatchResult:
        """One call: an in-flight slot, a breaker permit, then attempts until it succeeds or fails for good.

        The limiter's slot is held for the whole call, retries and backoff included, so an
        outage costs at most `limit` calls' attempts before the breaker opens. The breaker
        records the call's outcome once. A failure on a code that may be the rows' fault is
        attributed first, by a canary under the same permit: if the canary passes, the service
        is fine (a success for the breaker) and `_RowsSuspect` tells the caller to isolate rows.
        """
        breaker, limiter = self._breaker, self._limiter
        last: list[_Sample] = []

        def on_retry(attempt_number: int, exc: BaseException) -> None:
            stats.retries += 1

        await limiter.acquire()
        try:
            while True:
                permit = await breaker.acquire()
                success = False
                try:
                    result = await call_with_retries(
                        functools.partial(self._attempt, ids, texts, stats, permit, last),
                        self._retry_policy(),
                        on_retry=on_retry,
                    )
                    success = True
                    return result
                except _StalePermit:
                    continue  # the breaker opened while this call waited: wait on it again
                except ModelServiceError as e:
                    if not e.service_fault and not canary and await self._canary(stats, permit):
                        success = True
                        raise _RowsSuspect(e) from e
                    raise
                finally:
                    breaker.record(permit, success=success)
        finally:
            self._release(limiter, last[-1] if last else None)

    async def _attempt(
        self, ids: list[str], texts: list[str], stats: UnitStats, permit: Permit, samples: list[_Sample]
    ) -> BatchResult:
        """One attempt: check the breaker still admits the call, call the service, note what it said.

        The breaker is checked right before the RPC, so an attempt admitted while it was
        closed cannot go out after it opened: only the attempts already in flight fail when the
        service goes away. The limiter learns only from answers (with the replica's report of
        its queue) and overload signals; other failures say nothing about load (`samples` gets
        an entry only for those).
        """
        client, breaker = self._client, self._breaker
        if not breaker.admits(permit):
            raise _StalePermit()
        started = time.monotonic()
        if stats.first_call_at is None:
            stats.first_call_at = time.time()
        try:
            result = await client.classify(ids, texts)
        except ModelServiceError as e:
            latency = time.monotonic() - started
            if e.status_code in _OVERLOAD:
                samples.append((latency, True, None))
            self._count_call(stats, e.status_code, latency)
            self.last_failure = str(e)
            raise
        latency = time.monotonic() - started
        wrong = self._wrong_model(result)
        if wrong is not None:
            self._count_call(stats, "WRONG_MODEL", latency)
            self.last_failure = wrong
            raise ServiceWrongModel(wrong, status_code="OK", address=getattr(client, "address", None))
        samples.append((latency, False, result))
        self._count_call(stats, "OK", latency)
        if result.server is not None:
            stats.model_cpu_s += result.server.model_cpu_s
        return result

    def _wrong_model(self, result: BatchResult) -> str | None:
        """What is wrong when `result` comes from another model than the run's; None if nothing."""
        if self._model_version and result.model_version != self._model_version:
            what = f"model version {result.model_version!r}, the run's is {self._model_version!r}"
        elif self._labels and result.labels != self._labels:
            what = f"labels {list(result.labels)}, the run's are {list(self._labels)}"
        else:
            return None
        return (
            f"the model service answered as {what}: is the run's application deployed? (Ray Serve "
            "sends a call naming an application it does not have to the only one it has)"
        )

    @staticmethod
    def _release(limiter: Limiter, sample: _Sample | None) -> None:
        """Frees the call's slot, teaching the limiter from the call's last answer or overload signal."""
        if sample is None:
            limiter.release_ignored()
            return
        latency, dropped, answer = sample
        server = answer.server if answer is not None else None
        limiter.release(
            latency_s=latency,
            dropped=dropped,
            replica_s=server.replica_s if server else None,
            batches_ahead=server.batches_ahead if server else None,
        )

    @staticmethod
    def _count_call(stats: UnitStats, status: str, latency_s: float) -> None:
        stats.calls += 1
        stats.status_counts[status] += 1
        stats.latency.add(latency_s)

"""The async inference actor: one work unit in, its results and dead letters committed.

Ray Data hands the actor whole blocks, one per work unit (`raypipe.sources`). For a unit the
actor splits the sendable rows into length-sorted micro-batches and sends them all at once.
Each micro-batch is one *call*, and a call goes through, in this order:

    breaker (one permit per call; waits while the service is down)
      -> retry (`raypipe.retry`: transient codes, a few attempts with backoff)
        -> limiter (one in-flight slot per attempt) -> gRPC client

The breaker sees one outcome per call, after its retries, never one per attempt. An attempt
whose permit went stale while it waited for a slot (the breaker opened meanwhile) does not
go out: it waits on the breaker again, so an outage costs the calls already in flight.

Who is at fault when a call fails after its retries:
- the service (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED): the rows go
  back to be sent again; the breaker decides when the service is down, and when it stays down
  past `breaker.max_wait_s` the run stops with `CircuitOpenError`, its rows still to do;
- maybe the rows (INTERNAL, UNKNOWN, INVALID_ARGUMENT, ...; or a service-fault code that keeps
  failing this batch for `retry.max_attempts` calls): a one-paragraph *canary* call decides.
  If the canary fails too, every call fails alike: it is the service, handled as above. If it
  succeeds, the batch is bisected, and a row that still fails when sent alone, while other
  calls succeed, becomes a dead letter (a poison paragraph).

Rows with no text are recorded with `status="empty_text"` and never sent. The unit is then
committed through `raypipe.sinks.UnitCommitter` (fenced by the run's lease generation), and
the actor returns the unit's summary, which the driver folds into the run report.

All of one actor's concurrent units share its breaker, limiter and channel, all created
lazily inside Ray Data's event loop for the actor.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypipe.breaker import CircuitBreaker, Permit
from raypipe.client import BatchResult, GrpcModelClient, ModelClient
from raypipe.config import ClientConfig, ServiceConfig
from raypipe.errors import ModelServiceError, SinkError
from raypipe.lease import Fence
from raypipe.limiter import AdaptiveLimiter, FixedLimiter, Limiter
from raypipe.metrics import ActorGauges, Metrics, MetricsInterceptor, MetricsSpec, NullMetrics
from raypipe.report import UnitStats
from raypipe.retry import RetryPolicy, call_with_retries
from raypipe.sinks import (
    DEAD_LETTER_SCHEMA,
    RESULT_STATUS_EMPTY,
    RESULT_STATUS_OK,
    UnitCommitter,
    label_column,
    now_utc,
    results_schema,
)
from raypipe.store import OutputStore

__all__ = ["SUMMARY_SCHEMA", "ActorSettings", "InferenceActor"]

_OVERLOAD = frozenset({"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
# The canary: a paragraph no model rejects, so its failure can only be the service's.
_CANARY_ID = "raypipe-canary"
_CANARY_TEXT = "The weather is fine today."


# (latency, dropped, answer) of an attempt the limiter may learn from.
_Sample = tuple[float, bool, BatchResult | None]


class _StalePermit(Exception):
    """The breaker opened after this call's permit was issued: the attempt must not go out."""


class _RowsSuspect(Exception):
    """A call failed while a canary under its permit passed: its rows, not the service, are at fault."""

    def __init__(self, error: ModelServiceError) -> None:
        super().__init__(str(error))
        self.error = error


SUMMARY_SCHEMA = pa.schema(
    [pa.field("unit", pa.string()), pa.field("error", pa.string()), pa.field("summary", pa.string())]
)


@dataclass(frozen=True)
class ActorSettings:
    """Everything an actor needs, picklable (it travels to Ray workers)."""

    output_uri: str
    run_id: str
    """The results partition written to (a replay writes into the run it replays)."""
    attempt: str
    """Identifies this start of the run (a resume is a new attempt of the same run)."""
    service: ServiceConfig
    client: ClientConfig
    labels: tuple[str, ...]
    state_run_id: str | None = None
    """Where commit markers go, if not under `run_id` (a replay keeps its own)."""
    fence: Fence | None = None
    """The attempt's lease fence: every commit checks it first."""
    replaces: dict[str, str] | None = None
    """Replays: unit key -> the dead-letter file (stem) whose rows the unit re-infers."""
    metrics: MetricsSpec | None = None
    """Where the actor's metrics go (calls by status, latency, breaker, in-flight limit)."""

    @property
    def marker_run_id(self) -> str:
        return self.state_run_id or self.run_id


@dataclass
class _Outcome:
    """The fate of some rows of a unit: probabilities, or the error that ended them."""

    rows: np.ndarray  # indices into the unit's table
    result: BatchResult | None = None
    error: BaseException | None = None
    attempts: int = 0


class InferenceActor:
    """A Ray Data callable class (`map_batches(InferenceActor, ...)`), async."""

    def __init__(self, settings: ActorSettings, client_factory: Callable[[], ModelClient] | None = None) -> None:
        self._settings = settings
        self._client_factory = client_factory
        self._committer = UnitCommitter(
            OutputStore(settings.output_uri),
            settings.run_id,
            fence=settings.fence,
            marker_run_id=settings.marker_run_id,
        )
        self._schema = results_schema(settings.labels)
        self._actor_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._client: ModelClient | None = None
        self._breaker: CircuitBreaker | None = None
        self._limiter: Limiter | None = None
        self._seq = 0
        self._metrics: Metrics = NullMetrics()
        self._gauges: ActorGauges | None = None

    def _components(self) -> tuple[ModelClient, CircuitBreaker, Limiter]:
        if self._client is None:
            c = self._settings.client
            s = self._settings.service
            spec = self._settings.metrics
            self._metrics = spec.build() if spec is not None and spec.enabled else NullMetrics()
            self._client = (
                self._client_factory()
                if self._client_factory
                else GrpcModelClient(
                    s.address,
                    application=s.application,
                    timeout_s=s.timeout_s,
                    max_timeout_s=s.max_timeout_s,
                    deadline_safety=s.deadline_safety,
                    interceptors=[MetricsInterceptor(self._metrics)] if spec is not None and spec.enabled else (),
                )
            )
            b = c.breaker
            self._breaker = CircuitBreaker(
                failure_threshold=b.failure_threshold,
                reset_timeout_s=b.reset_timeout_s,
                max_reset_timeout_s=b.max_reset_timeout_s,
                max_wait_s=b.max_wait_s,
            )
            lim = c.limiter
            self._limiter = (
                FixedLimiter(lim.initial)
                if lim.kind == "fixed"
                else AdaptiveLimiter(
                    initial=lim.initial,
                    min_limit=lim.min_limit,
                    max_limit=lim.max_limit,
                    backoff_ratio=lim.backoff_ratio,
                    queue_tolerance=lim.queue_tolerance,
                    outside_slack_s=lim.outside_slack_s,
                )
            )
            if spec is not None and spec.enabled:
                self._gauges = ActorGauges(
                    self._metrics, self._breaker, self._limiter, actor=self._actor_id, interval_s=spec.gauge_interval_s
                )
                self._gauges.start()
        assert self._breaker is not None and self._limiter is not None
        return self._client, self._breaker, self._limiter

    async def __call__(self, block: pa.Table) -> pa.Table:
        units, errors, summaries = [], [], []
        for unit in pc.unique(block.column("_unit")).to_pylist():
            rows = block.filter(pc.equal(block.column("_unit"), unit))
            error, stats = await self._process_unit(unit, rows)
            units.append(unit)
            errors.append(error)
            summaries.append(None if stats is None else json.dumps(stats.to_dict()))
        return pa.table({"unit": units, "error": errors, "summary": summaries}, schema=SUMMARY_SCHEMA)

    async def _process_unit(self, unit: str, rows: pa.Table) -> tuple[str | None, UnitStats | None]:
        error = rows.column("_unit_error")[0].as_py()
        if error is not None:
            return error, None  # an unreadable shard: reported by the driver, not committed
        expected = rows.column("_unit_rows")[0].as_py()
        marker_only = expected == 0
        if not marker_only and rows.num_rows != expected:
            raise SinkError(
                f"unit {unit} arrived split ({rows.num_rows} of {expected} rows); lower input.unit_rows "
                "so a unit fits in one Ray Data block"
            )
        stats = UnitStats(
            unit=unit, shard=rows.column("_source")[0].as_py(), attempt=self._settings.attempt, actor=self._actor_id
        )
        started = time.monotonic()
        if marker_only:
            rows = rows.slice(0, 0)
        await asyncio.to_thread(self._committer.mark_started, unit, self._settings.attempt)
        results, dead = await self._infer_unit(rows, stats)
        stats.seconds = round(time.monotonic() - started, 3)
        stats.actor_stats = self._actor_snapshot()
        replaces = (self._settings.replaces or {}).get(unit)
        await asyncio.to_thread(self._committer.commit, unit, results, dead, stats.to_dict(), replaces=replaces)
        return None, stats

    async def _infer_unit(self, rows: pa.Table, stats: UnitStats) -> tuple[pa.Table, pa.Table]:
        texts = rows.column("text").to_pylist()
        ids = rows.column("id").to_pylist()
        stats.rows = len(ids)
        sendable = np.array([i for i, t in enumerate(texts) if t is not None and t.strip()], dtype=np.int64)
        empty = np.setdiff1d(np.arange(len(ids)), sendable)
        # Length-sorted micro-batches: neighbours pad to the same bucket on the server.
        order = sendable[np.argsort([len(texts[i]) for i in sendable], kind="stable")]
        size = self._settings.client.micro_batch_size
        batches = [order[i : i + size] for i in range(0, len(order), size)]
        # A TaskGroup: when one batch raises (the service stayed down), the others are cancelled.
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._classify(b, ids, texts, stats)) for b in batches]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        outcomes = [o for t in tasks for o in t.result()]
        return self._tables(rows, outcomes, empty, stats)

    async def _classify(
        self, batch: np.ndarray, ids: Sequence[str], texts: Sequence[str], stats: UnitStats
    ) -> list[_Outcome]:
        """Classifies a micro-batch until it is answered, or its rows are proven at fault.

        `CircuitOpenError` (the service stayed down) propagates: the unit is not committed.
        """
        batch_ids = [ids[i] for i in batch]
        batch_texts = [texts[i] for i in batch]
        attempts = 0
        failed_calls = 0
        max_calls = self._settings.client.retry.max_attempts
        while True:
            try:
                result = await self._call(batch_ids, batch_texts, stats)
                return [_Outcome(batch, result=result)]
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
                    self._classify(batch[:mid], ids, texts, stats),
                    self._classify(batch[mid:], ids, texts, stats),
                )
                return left + right
            return [_Outcome(batch, error=error, attempts=attempts)]

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
        r = self._settings.client.retry
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
        _, breaker, limiter = self._components()
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
        client, breaker, _ = self._components()
        if not breaker.admits(permit):
            raise _StalePermit()
        started = time.monotonic()
        try:
            result = await client.classify(ids, texts)
        except ModelServiceError as e:
            latency = time.monotonic() - started
            if e.status_code in _OVERLOAD:
                samples.append((latency, True, None))
            self._count_call(stats, e.status_code, latency)
            raise
        latency = time.monotonic() - started
        samples.append((latency, False, result))
        self._count_call(stats, "OK", latency)
        return result

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

    def _actor_snapshot(self) -> dict[str, Any]:
        _, breaker, limiter = self._components()
        self._seq += 1
        b = breaker.stats()
        lim = limiter.stats()
        if self._gauges is not None:
            self._gauges.sample()
        self._metrics.flush()  # a unit's calls are all counted by now; the actor may go away after it
        return {
            "seq": self._seq,
            "breaker": {"openings": b.openings, "time_open_s": b.time_open_s, "probes": b.probes},
            "limiter": {"min": lim.min, "max": lim.max, "final": lim.final},
        }

    def _tables(
        self, rows: pa.Table, outcomes: list[_Outcome], empty: np.ndarray, stats: UnitStats
    ) -> tuple[pa.Table, pa.Table]:
        labels = self._settings.labels
        run_id = self._settings.run_id
        now = now_utc()
        n_labels = len(labels)
        result_rows: list[np.ndarray] = [empty]
        probs: list[np.ndarray] = [np.full((len(empty), n_labels), np.nan, dtype=np.float32)]
        truncated: list[np.ndarray] = [np.zeros(len(empty), dtype=bool)]
        versions: list[str] = [""] * len(empty)
        statuses: list[str] = [RESULT_STATUS_EMPTY] * len(empty)
        dead_rows: list[int] = []
        dead_info: list[tuple[str, str, int, str]] = []
        for o in outcomes:
            if o.result is not None:
                if o.result.labels != labels:
                    raise SinkError(f"the service answered labels {o.result.labels}, the run expects {labels}")
                result_rows.append(o.rows)
                probs.append(o.result.probabilities)
                truncated.append(o.result.truncated)
                versions += [o.result.model_version] * len(o.rows)
                statuses += [RESULT_STATUS_OK] * len(o.rows)
            else:
                e = o.error
                status = e.status_code if isinstance(e, ModelServiceError) else ""
                kind = getattr(e, "kind", type(e).__name__)
                dead_rows += o.rows.tolist()
                dead_info += [(kind, status, o.attempts, str(e))] * len(o.rows)
                stats.dead_letter_kinds[kind] += len(o.rows)
        index = np.concatenate(result_rows).astype(np.int64)
        p = np.concatenate(probs) if probs else np.zeros((0, n_labels), np.float32)
        stats.empty_text = len(empty)
        stats.ok = len(index) - len(empty)
        stats.dead_letters = len(dead_rows)
        taken = rows.take(pa.array(index, pa.int64()))
        answered = np.isfinite(p).all(axis=1)
        top = np.where(answered, np.nan_to_num(p, nan=-1.0).argmax(axis=1), -1)
        top_score = np.where(answered, p[np.arange(len(p)), np.maximum(top, 0)], np.nan)
        columns: dict[str, Any] = {"id": taken.column("id"), "status": pa.array(statuses, pa.string())}
        for j, label in enumerate(labels):
            columns[label_column(label)] = pa.array(p[:, j], pa.float32(), mask=~answered)
        columns["top_label"] = pa.array([labels[t] if t >= 0 else None for t in top.tolist()], pa.string())
        columns["top_score"] = pa.array(top_score, pa.float32(), mask=~answered)
        columns["truncated"] = pa.array(np.concatenate(truncated), pa.bool_())
        columns["model_version"] = pa.array([v or None for v in versions], pa.string())
        columns["run_id"] = pa.array([run_id] * len(index), pa.string())
        columns["inferred_at"] = pa.array([now] * len(index), pa.timestamp("us", tz="UTC"))
        columns["updated_at"] = (
            taken.column("updated_at")
            if "updated_at" in taken.column_names
            else pa.nulls(len(index), pa.timestamp("us", tz="UTC"))
        )
        columns["source"] = taken.column("_source")
        columns["row"] = taken.column("_row")
        results = pa.table(columns, schema=self._schema).sort_by([("source", "ascending"), ("row", "ascending")])

        dead_taken = rows.take(pa.array(dead_rows, pa.int64()))
        kinds, codes, attempts, messages = (
            (list(x) for x in zip(*dead_info, strict=True)) if dead_info else ([], [], [], [])
        )
        dead = pa.table(
            {
                "id": dead_taken.column("id"),
                "error_kind": pa.array(kinds, pa.string()),
                "grpc_status": pa.array(codes, pa.string()),
                "attempts": pa.array(attempts, pa.int32()),
                "message": pa.array([m[:2000] for m in messages], pa.string()),
                "failed_at": pa.array([now] * len(dead_rows), pa.timestamp("us", tz="UTC")),
                "run_id": pa.array([run_id] * len(dead_rows), pa.string()),
                "text": dead_taken.column("text"),
                "updated_at": dead_taken.column("updated_at")
                if "updated_at" in dead_taken.column_names
                else pa.nulls(len(dead_rows), pa.timestamp("us", tz="UTC")),
                "source": dead_taken.column("_source"),
                "row": dead_taken.column("_row"),
            },
            schema=DEAD_LETTER_SCHEMA,
        ).sort_by([("source", "ascending"), ("row", "ascending")])
        return results, dead

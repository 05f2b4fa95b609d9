"""The async inference actor: one work unit in, its results and dead letters committed.

Ray Data hands the actor whole blocks, one per work unit (`raypipe.run.read`). For a unit the
actor splits the sendable rows into length-sorted micro-batches and sends them all at once.
Each micro-batch is one *call* (`raypipe.call.caller`), and a call goes through, in this order:

    limiter (one in-flight slot, held for the whole call, retries and backoff included)
      -> breaker (one permit per call; waits while the service is down)
        -> retry (`raypipe.call.retry`: transient codes, a few attempts with backoff)
          -> each attempt: does the breaker still admit the permit? -> gRPC client

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

Rows with no text are recorded with `status="empty_text"` and never sent. The unit's rows
(`raypipe.commit.rows`) are then committed, results and dead letters together, in one Delta
commit fenced by the attempt's generation, by the committer the run's
`raypipe.commit.protocol.CommitProtocol` hands each actor; the actor returns the unit's summary,
which the driver folds into the run report. When the service stays down (`CircuitOpenError`) or a
newer attempt fenced this one off (`LeaseLostError`), the unit is not committed, and the
actor returns the summary with the failure instead of raising, so the report of a stopped
run keeps its calls, statuses and breaker figures; the driver then stops the run.

All of one actor's concurrent units share its breaker, limiter and channel, all created
lazily inside Ray Data's event loop for the actor. The actor also keeps a running tally of its
calls over its finished and in-flight units and writes it to the output on a timer
(`raypipe.tally`), so a run stopped with every unit in flight still reports its calls.

Over ~400 lines on purpose: one job (a unit through the actor), whose docstring above is the
call path's map; the stages it drives live in their own modules (`batches`, `caller`, `limiter`,
`breaker`, `retry`, `client`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypipe.call.batches import (
    CALL_TEXT_BYTES,
    bad_row,
    duplicates_by_first,
    micro_batches,
    share_answers,
    within_bytes,
)
from raypipe.call.breaker import CircuitBreaker
from raypipe.call.caller import Outcome, ServiceCaller
from raypipe.call.client import BatchResult, ChannelSecurity, GrpcModelClient, ModelClient
from raypipe.call.limiter import AdaptiveLimiter, FixedLimiter, Limiter
from raypipe.call.metrics import ActorGauges, Metrics, MetricsInterceptor, MetricsSpec, NullMetrics
from raypipe.call.reuse import TextIndex
from raypipe.commit.fence import UnitCommitter
from raypipe.commit.rows import Answers, DeadLetters, unit_rows
from raypipe.commit.schema import text_hashes
from raypipe.commit.table import now_utc
from raypipe.config import ClientConfig, ServiceConfig
from raypipe.errors import (
    CircuitOpenError,
    ConfigError,
    LeaseLostError,
    ModelServiceError,
    SinkError,
)
from raypipe.report import UnitStats
from raypipe.store import OutputStore
from raypipe.tally import WRITE_INTERVAL_S, CallTally, tally_path

__all__ = ["SUMMARY_SCHEMA", "ActorSettings", "InferenceActor"]

logger = logging.getLogger("raypipe")


SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("unit", pa.string()),
        pa.field("error", pa.string()),
        pa.field("summary", pa.string()),
        pa.field("fatal", pa.string()),
    ]
)
"""What an actor returns per unit: an unreadable shard's `error`, the unit's `summary`, and
`fatal` (JSON: `kind` circuit_open, lease_lost or config, `message`, …) when the run must stop."""


@dataclass(frozen=True)
class ActorSettings:
    """Everything an actor needs, picklable (it travels to Ray workers)."""

    committer: UnitCommitter
    """Commits the actor's units: the run's `raypipe.commit.protocol.CommitProtocol.unit_committer`,
    fenced at the attempt's generation (the table rejects a stale one)."""
    run_id: str
    """The `run_id` the rows carry (a replay writes into the run it replays)."""
    attempt: str
    """Identifies this start of the run (a resume is a new attempt of the same run)."""
    service: ServiceConfig
    client: ClientConfig
    labels: tuple[str, ...]
    model_version: str = ""
    """The run's model version: an answer as another version is the service's failure, never a
    result (`raypipe.errors.ServiceWrongModel`); "" takes any."""
    replay: bool = False
    """Units re-infer committed dead letters: their commit replaces those rows."""
    text_index: Any = None
    """Committed answers by text hash (`raypipe.call.reuse.TextIndex`, or a Ray object ref to one)."""
    metrics: MetricsSpec | None = None
    """Where the actor's metrics go (calls by status, latency, breaker, in-flight limit)."""


class InferenceActor:
    """A Ray Data callable class (`map_batches(InferenceActor, ...)`), async."""

    def __init__(self, settings: ActorSettings, client_factory: Callable[[], ModelClient] | None = None) -> None:
        self._settings = settings
        self._client_factory = client_factory
        self._committer = settings.committer
        self._actor_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._client: ModelClient | None = None
        self._breaker: CircuitBreaker | None = None
        self._limiter: Limiter | None = None
        self._caller: ServiceCaller | None = None
        self._seq = 0
        self._metrics: Metrics = NullMetrics()
        self._gauges: ActorGauges | None = None
        self._index: TextIndex | None = None
        self._done = CallTally()  # units finished (committed, found committed, or stopped)
        self._live: dict[int, UnitStats] = {}  # units in flight, their figures as far as they go
        self._tally_due = False  # a unit ended: write the tally at the writer's next look
        self._tally_writer: asyncio.Task[None] | None = None

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
                    security=ChannelSecurity.of(s),
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
            self._caller = ServiceCaller(
                self._client,
                self._breaker,
                self._limiter,
                c.retry,
                model_version=self._settings.model_version,
                labels=self._settings.labels,
            )
        assert self._breaker is not None and self._limiter is not None
        return self._client, self._breaker, self._limiter

    def _service_caller(self) -> ServiceCaller:
        """The actor's `ServiceCaller`, over its client, breaker and limiter (made on first use)."""
        self._components()
        assert self._caller is not None
        return self._caller

    async def __call__(self, block: pa.Table) -> pa.Table:
        loop = asyncio.get_running_loop()
        if self._tally_writer is None or self._tally_writer.get_loop() is not loop or self._tally_writer.done():
            self._tally_writer = loop.create_task(self._write_tallies())  # Ray Data keeps one loop per actor
        units, errors, summaries, fatals = [], [], [], []
        for unit in pc.unique(block.column("_unit")).to_pylist():
            rows = block.filter(pc.equal(block.column("_unit"), unit))
            stats = UnitStats(
                unit=unit, shard=rows.column("_source")[0].as_py(), attempt=self._settings.attempt, actor=self._actor_id
            )
            error = fatal = None
            self._live[id(stats)] = stats
            try:
                error = await self._process_unit(unit, rows, stats)
            except CircuitOpenError as e:
                last = self._caller.last_failure if self._caller is not None else None
                message = str(e) if last is None else f"{e}; the last failure: {last}"
                fatal = json.dumps(
                    {"kind": e.kind, "message": message, "waited_s": e.waited_s, "retry_after_s": e.retry_after_s}
                )
            except LeaseLostError as e:
                fatal = json.dumps({"kind": "lease_lost", "message": str(e)})
            except ConfigError as e:  # e.g. service.token_env unset on this node: no call can be made
                fatal = json.dumps({"kind": e.kind, "message": str(e)})
            finally:  # its calls were made, whatever became of the unit: from in flight to done, in one step
                self._done.add(self._live.pop(id(stats)))
                self._tally_due = True
            if fatal is not None:
                stats.committed = False
                if self._client is not None:  # else the client could not even be built (config)
                    stats.actor_stats = self._actor_snapshot()
            units.append(unit)
            errors.append(error)
            summaries.append(None if error is not None else json.dumps(stats.to_dict()))
            fatals.append(fatal)
            if fatal is not None:
                break  # the run stops: leave the block's other units uncommitted
        return pa.table({"unit": units, "error": errors, "summary": summaries, "fatal": fatals}, schema=SUMMARY_SCHEMA)

    async def _process_unit(self, unit: str, rows: pa.Table, stats: UnitStats) -> str | None:
        """Infers and commits one unit; returns an unreadable shard's error instead."""
        error = rows.column("_unit_error")[0].as_py()
        if error is not None:
            return str(error)  # an unreadable shard: reported by the driver, not committed
        expected = rows.column("_unit_rows")[0].as_py()
        marker_only = expected == 0
        if not marker_only and rows.num_rows != expected:
            raise SinkError(
                f"unit {unit} arrived split ({rows.num_rows} of {expected} rows); lower input.unit_rows "
                "so a unit fits in one Ray Data block"
            )
        started = time.monotonic()
        if marker_only:
            rows = rows.slice(0, 0)
        outcomes = await self._infer_unit(rows, stats)
        stats.seconds = round(time.monotonic() - started, 3)
        stats.actor_stats = self._actor_snapshot()
        t0 = time.monotonic()
        stats.committed = await asyncio.to_thread(
            self._committer.commit, unit, outcomes, replace_dead_letters=self._settings.replay
        )
        stats.commit_s = round(time.monotonic() - t0, 4)
        if stats.committed and (index := await self._text_index()) is not None:
            try:  # reused by this actor's next units (a watcher's, tick after tick)
                index.add_committed(outcomes)
            except Exception:  # reuse saves calls; the unit is committed whatever happens here
                logger.warning("unit %s: its answers are not added to the reuse index", unit, exc_info=True)
        if self._gauges is not None:
            self._gauges.committed()
        return None

    async def _infer_unit(self, rows: pa.Table, stats: UnitStats) -> pa.Table:
        texts = rows.column("text").to_pylist()
        ids = rows.column("id").to_pylist()
        stats.rows = len(ids)
        bad = rows.column("_bad").to_pylist()
        refused = [Outcome(np.array([i], np.int64), error=bad_row(bad[i], ids[i])) for i in range(len(ids))
                   if bad[i] is not None or not ids[i]]  # fmt: skip
        unsendable = {int(o.rows[0]) for o in refused}
        sendable = np.array(
            [i for i, t in enumerate(texts) if i not in unsendable and t is not None and t.strip()], dtype=np.int64
        )
        empty = np.setdiff1d(np.setdiff1d(np.arange(len(ids)), sendable), np.array(sorted(unsendable), np.int64))
        # One hash per text, for the answers reused and for the table's text_hash column.
        text_hash = text_hashes(texts)
        hashes = text_hash.fill_null(0).to_numpy(zero_copy_only=False)
        copied, sendable, duplicates = await self._reuse_answers(sendable, hashes, stats)
        # Length-sorted micro-batches: neighbours pad to the same bucket on the server.
        lengths = pc.binary_length(rows.column("text")).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        sendable, too_large = within_bytes(sendable, lengths, self._settings.client.max_text_bytes)
        order = sendable[np.argsort(lengths[sendable], kind="stable")]
        batches = micro_batches(order, lengths[order], self._settings.client.micro_batch_size, CALL_TEXT_BYTES)
        # A TaskGroup: when one batch raises (the service stayed down), the others are cancelled.
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._service_caller().classify(b, ids, texts, stats)) for b in batches]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        sent = [o for t in tasks for o in t.result()]
        for o in sent:
            if o.result is not None:
                stats.answered_by[o.result.setting or "unknown"] += len(o.rows)
        # A text too large is refused once; the rows that repeat it share its dead letter.
        outcomes = refused + copied + too_large + sent + share_answers(too_large + sent, duplicates)
        answers, dead_letters = self._fates(outcomes, stats)
        stats.empty_text = len(empty)
        return unit_rows(
            rows,
            unit=stats.unit,
            run_id=self._settings.run_id,
            labels=self._settings.labels,
            answers=answers,
            dead_letters=dead_letters,
            empty=empty,
            text_hash=text_hash,
            inferred_at=now_utc(),
        )

    def _fates(self, outcomes: list[Outcome], stats: UnitStats) -> tuple[list[Answers], list[DeadLetters]]:
        """The outcomes as the table's answers and dead letters, counted in the unit's stats."""
        answers, dead_letters = [], []
        for o in outcomes:
            if o.result is not None:  # as the run's model: the caller refuses any other
                answers.append(Answers(o.rows, o.result.probabilities, o.result.truncated, o.result.model_version))
                stats.ok += len(o.rows)
                continue
            e = o.error
            kind = getattr(e, "kind", type(e).__name__)
            status = e.status_code if isinstance(e, ModelServiceError) else ""
            dead_letters.append(DeadLetters(o.rows, kind, status, o.attempts, str(e)))
            stats.dead_letters += len(o.rows)
            stats.dead_letter_kinds[kind] += len(o.rows)
        return answers, dead_letters

    async def _reuse_answers(
        self, sendable: np.ndarray, hashes: np.ndarray, stats: UnitStats
    ) -> tuple[list[Outcome], np.ndarray, dict[int, np.ndarray]]:
        """Rows whose text already has a committed answer of this model (`raypipe.call.reuse`), and
        rows whose text another row of the unit sends: (answered rows, rows still to send,
        {row sent: the rows that share its text}). `hashes` are the unit's text hashes."""
        if not len(sendable):
            return [], sendable, {}
        hashes = hashes[sendable]
        copied: list[Outcome] = []
        index = await self._text_index()
        if index is not None:
            pos = index.lookup(hashes)
            hit = pos >= 0
            if hit.any():
                answer = BatchResult(
                    labels=index.labels,
                    model_version=index.model_version,
                    probabilities=index.probabilities[pos[hit]],
                    truncated=index.truncated[pos[hit]],
                )
                copied.append(Outcome(sendable[hit], result=answer))
                stats.copied += int(hit.sum())
                sendable, hashes = sendable[~hit], hashes[~hit]
        _, first, inverse = np.unique(hashes, return_index=True, return_inverse=True)
        duplicates = duplicates_by_first(sendable, first[inverse.ravel()])
        stats.copied += sum(len(d) for d in duplicates.values())
        return copied, np.sort(sendable[first]), duplicates

    async def _text_index(self) -> TextIndex | None:
        ref = self._settings.text_index
        if ref is None or isinstance(ref, TextIndex):
            return ref
        if self._index is None:
            import ray

            self._index = await asyncio.to_thread(ray.get, ref)
        return self._index

    def _actor_snapshot(self) -> dict[str, Any]:
        """The actor's breaker and limiter figures, and its call tally over every unit it worked
        on so far, finished or in flight (`raypipe.tally`); `seq` orders the snapshots."""
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
            "tally": CallTally.over(self._done, self._live.values()).to_dict(),
        }

    def _calls_so_far(self) -> int:
        return self._done.calls + sum(u.calls for u in self._live.values())

    async def _write_tallies(self) -> None:
        """Writes the actor's snapshot to the output (`raypipe.tally.tally_path`) within a
        second of a unit's end, and otherwise, while its calls change, once soon after the first
        ones and then at most every `WRITE_INTERVAL_S`; runs until the actor goes away. One
        writer, so a later snapshot is never overwritten by an earlier one."""
        fence = self._committer.fence
        store = OutputStore(fence.output_uri)
        path = tally_path(store, fence.run_id, self._settings.attempt, self._actor_id)
        written_calls, written_at = 0, None
        while True:
            await asyncio.sleep(1.0)
            stale = written_at is None or time.monotonic() - written_at >= WRITE_INTERVAL_S
            if not self._tally_due and (self._calls_so_far() == written_calls or not stale):
                continue
            self._tally_due = False
            if self._client is None:
                continue  # no call made yet, so nothing to tell
            record = {"actor": self._actor_id, "attempt": self._settings.attempt, **self._actor_snapshot()}
            try:
                await asyncio.to_thread(store.write_json, path, record)
            except Exception as e:  # the unit summaries still count the finished units' calls
                logger.warning("could not write the call tally of actor %s: %s", self._actor_id, e)
                continue
            written_calls, written_at = record["tally"]["calls"], time.monotonic()

"""Metrics: what a run tells Datadog (DogStatsD) and Ray's metrics (dashboard, Prometheus).

    Metrics, NullMetrics, DogStatsdMetrics, RayMetrics, FanoutMetrics, MetricsSpec
                             the emitters, shared with the server (`protos.telemetry`)
    CATALOG                  every metric below, declared once (`MetricDef`: name, kind, tags,
                             meaning); the code sends each through its `record`, and the Datadog
                             dashboard and monitors (`kuberay/datadog/`) are checked against it

Who emits what (names below carry the `metrics.namespace` prefix, `raypipe.` by default):
- `MetricsInterceptor`, on the actors' gRPC channel: per call attempt `client.calls`,
  `client.latency_ms` and `client.paragraphs`, tagged `method` and `status` (the gRPC code).
  These are the attempts the run report counts in `status_counts`.
- `ActorGauges`, sampled in each actor: `client.breaker.open`, `client.breaker.openings`,
  `client.inflight.limit`, `client.inflight.calls` and `run.since_commit_s` (the run's heartbeat
  while its actors live), tagged `actor`.
- the driver, per finished unit (`raypipe.run.progress.Progress`): `run.units`, `run.rows`
  (tagged `outcome`: ok, empty_text, dead_letter), `run.dead_letters` (tagged `kind`),
  `client.retries`, `client.canaries`, and the gauges `run.units_left` and `run.eta_s`; and per
  run (`RunMetrics`): `run.started`, `run.finished` (tagged `status`), `run.rows_per_s`, and Datadog events
  "started", "succeeded" and "failed" with the run's counts.
- a watcher's driver (`raypipe.run.watch`), per tick: `watch.ticks` and the gauges
  `watch.backlog_rows`, `watch.backlog_files`, `watch.oldest_waiting_s`; per report window the
  gauges `watch.freshness_p50_s` and `watch.freshness_p95_s` (arrival to commit). Its `mode`
  tag is `watch`, its `run_id` the watch id.
- the server: `serve_app.metrics`.

Every metric carries the run's tags: `run_id`, `mode`, `model_version`, `app`.

An absent agent never fails or slows a run: DogStatsD is UDP, the host is resolved once when
the sink is built (a name that does not resolve turns Datadog off for the process), sends go
through a non-blocking socket whose errors are dropped, and the first failure in a process is
logged once, as one warning. Sinks are built where they are used (the driver, each actor, each
replica), from a picklable `MetricsSpec`; nothing happens at import.

Over ~400 lines on purpose: one concept, what raypipe emits; the catalog and its emitters
stay together so each metric's declaration sits beside the code that sends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from protos.telemetry import (
    Catalog,
    DogStatsdMetrics,
    FanoutMetrics,
    MetricDef,
    Metrics,
    MetricsSpec,
    NullMetrics,
    RayMetrics,
)

if TYPE_CHECKING:
    from raypipe.call.breaker import CircuitBreaker
    from raypipe.call.limiter import Limiter
    from raypipe.config import MetricsConfig
    from raypipe.report import RunReport, UnitStats

__all__ = [
    "BREAKER_OPEN",
    "BREAKER_OPENINGS",
    "CATALOG",
    "CLIENT_CALLS",
    "CLIENT_CANARIES",
    "CLIENT_LATENCY_MS",
    "CLIENT_PARAGRAPHS",
    "CLIENT_RETRIES",
    "INFLIGHT_CALLS",
    "INFLIGHT_LIMIT",
    "RUN_DEAD_LETTERS",
    "RUN_ETA_S",
    "RUN_FINISHED",
    "RUN_ROWS",
    "RUN_ROWS_PER_S",
    "RUN_SINCE_COMMIT_S",
    "RUN_STARTED",
    "RUN_TAGS",
    "RUN_UNITS",
    "RUN_UNITS_LEFT",
    "WATCH_BACKLOG_FILES",
    "WATCH_BACKLOG_ROWS",
    "WATCH_FRESHNESS_P50_S",
    "WATCH_FRESHNESS_P95_S",
    "WATCH_OLDEST_WAITING_S",
    "WATCH_TICKS",
    "ActorGauges",
    "DogStatsdMetrics",
    "FanoutMetrics",
    "MetricDef",
    "Metrics",
    "MetricsInterceptor",
    "MetricsSpec",
    "NullMetrics",
    "RayMetrics",
    "RunMetrics",
    "emit_progress",
    "emit_unit",
    "emit_watch_freshness",
    "emit_watch_tick",
    "metrics_spec",
]

logger = logging.getLogger("raypipe.metrics")

_STATUSES = tuple(code.name for code in grpc.StatusCode)
_RPCS = ("Classify", "ModelInfo")
"""The EmotionClassifier's RPCs (protos/raypipe/v1/emotion.proto): the calls the interceptor sees."""
_PER_ATTEMPT = (("method", "status"), (("method", _RPCS), ("status", _STATUSES)))
"""The interceptor's per-attempt metrics: their tags, and each tag's values."""

CLIENT_CALLS = MetricDef(
    "client.calls",
    "count",
    "one per call attempt, as the run report's status table counts them",
    *_PER_ATTEMPT,
)
CLIENT_LATENCY_MS = MetricDef(
    "client.latency_ms",
    "distribution",
    "an attempt's time from the channel's view, ms",
    *_PER_ATTEMPT,
)
CLIENT_PARAGRAPHS = MetricDef(
    "client.paragraphs",
    "count",
    "paragraphs sent per attempt",
    *_PER_ATTEMPT,
)
CLIENT_RETRIES = MetricDef("client.retries", "count", "attempts retried (per committed unit)")
CLIENT_CANARIES = MetricDef(
    "client.canaries", "count", "canary calls made to tell a broken service from rows at fault (per committed unit)"
)
BREAKER_OPEN = MetricDef(
    "client.breaker.open", "gauge", "1 while an actor's breaker is open or half-open, else 0", ("actor",)
)
BREAKER_OPENINGS = MetricDef("client.breaker.openings", "count", "times an actor's breaker opened", ("actor",))
INFLIGHT_LIMIT = MetricDef("client.inflight.limit", "gauge", "an actor's in-flight call limit", ("actor",))
INFLIGHT_CALLS = MetricDef("client.inflight.calls", "gauge", "an actor's calls in flight", ("actor",))
RUN_UNITS = MetricDef("run.units", "count", "units committed")
RUN_ROWS = MetricDef(
    "run.rows",
    "count",
    "rows of committed units, by outcome",
    ("outcome",),
    (("outcome", ("ok", "empty_text", "dead_letter")),),
)
RUN_ROWS_PER_S = MetricDef("run.rows_per_s", "gauge", "the run's throughput, sent once when it ends")
RUN_DEAD_LETTERS = MetricDef(
    "run.dead_letters", "count", "dead letters of committed units, by kind (the report's dead-letter kinds)", ("kind",)
)
RUN_SINCE_COMMIT_S = MetricDef(
    "run.since_commit_s",
    "gauge",
    "seconds since an actor last committed a unit (or started); sampled while it lives, so it is the run's heartbeat",
    ("actor",),
)
RUN_UNITS_LEFT = MetricDef("run.units_left", "gauge", "units of this attempt not finished yet (driver, per unit)")
RUN_ETA_S = MetricDef("run.eta_s", "gauge", "seconds left at this attempt's rate so far (driver, per unit)")
RUN_STARTED = MetricDef("run.started", "count", "1 when a run starts (after the service check)")
RUN_FINISHED = MetricDef(
    "run.finished",
    "count",
    "1 when a run ends, with its status",
    ("status",),
    (("status", ("completed", "incomplete", "failed")),),
)
WATCH_FRESHNESS_P50_S = MetricDef(
    "watch.freshness_p50_s", "gauge", "a watcher's median arrival-to-commit time over its last report window, s"
)
WATCH_FRESHNESS_P95_S = MetricDef(
    "watch.freshness_p95_s",
    "gauge",
    "a watcher's 95th percentile arrival-to-commit time over its last report window, s",
)
WATCH_BACKLOG_ROWS = MetricDef("watch.backlog_rows", "gauge", "rows a watcher has seen arrive and not committed yet")
WATCH_BACKLOG_FILES = MetricDef("watch.backlog_files", "gauge", "files a watcher has seen arrive and not committed yet")
WATCH_OLDEST_WAITING_S = MetricDef(
    "watch.oldest_waiting_s", "gauge", "age of a watcher's oldest arrival not committed yet, s (0 with none)"
)
WATCH_TICKS = MetricDef("watch.ticks", "count", "a watcher's looks for new input (one per tick)")

RUN_TAGS = ("run_id", "mode", "model_version", "app")
"""The tags of every metric of a run: the driver's sink sets them and the actors' sinks inherit them."""

CATALOG = Catalog(
    "client",
    RUN_TAGS,
    (
        CLIENT_CALLS,
        CLIENT_LATENCY_MS,
        CLIENT_PARAGRAPHS,
        CLIENT_RETRIES,
        CLIENT_CANARIES,
        BREAKER_OPEN,
        BREAKER_OPENINGS,
        INFLIGHT_LIMIT,
        INFLIGHT_CALLS,
        RUN_UNITS,
        RUN_ROWS,
        RUN_ROWS_PER_S,
        RUN_DEAD_LETTERS,
        RUN_SINCE_COMMIT_S,
        RUN_UNITS_LEFT,
        RUN_ETA_S,
        RUN_STARTED,
        RUN_FINISHED,
        WATCH_FRESHNESS_P50_S,
        WATCH_FRESHNESS_P95_S,
        WATCH_BACKLOG_ROWS,
        WATCH_BACKLOG_FILES,
        WATCH_OLDEST_WAITING_S,
        WATCH_TICKS,
    ),
)
"""Every metric the driver and the actors emit; `kuberay/datadog/` is checked against it."""


def _method(name: str | bytes) -> str:
    text = name.decode() if isinstance(name, bytes) else name
    return text.rsplit("/", 1)[-1]


class MetricsInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts every unary call attempt on a grpc.aio channel: status code, latency, paragraphs.

    A call the caller cancels (its task was cancelled) is not counted, as the run report does
    not count it either; a status the server or the channel gives (CANCELLED included) is.
    """

    def __init__(self, metrics: Metrics, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        started = self._clock()
        try:
            call = await continuation(client_call_details, request)
        except grpc.aio.AioRpcError as e:
            self._record(client_call_details, request, e.code().name, started)
            raise
        try:
            await call
        except grpc.aio.AioRpcError as e:
            status = e.code().name
        else:
            status = "OK"
        self._record(client_call_details, request, status, started)
        return call  # the caller awaits it again: it answers at once, with the same outcome

    def _record(self, details: grpc.aio.ClientCallDetails, request: Any, status: str, started: float) -> None:
        tags = {"method": _method(details.method), "status": status}
        CLIENT_CALLS.record(self._metrics, 1, tags)
        CLIENT_LATENCY_MS.record(self._metrics, (self._clock() - started) * 1000, tags)
        # A Classify request's paragraphs, in either form (ids + texts, or Paragraph messages).
        paragraphs = len(getattr(request, "ids", ())) or len(getattr(request, "paragraphs", ()))
        if paragraphs:
            CLIENT_PARAGRAPHS.record(self._metrics, paragraphs, tags)


class ActorGauges:
    """Samples an actor's breaker, limiter and time since its last commit into gauges, every
    `interval_s` and on demand."""

    def __init__(
        self,
        metrics: Metrics,
        breaker: CircuitBreaker,
        limiter: Limiter,
        *,
        actor: str,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._breaker = breaker
        self._limiter = limiter
        self._tags = {"actor": actor}
        self._interval_s = interval_s
        self._clock = clock
        self._last_commit = clock()
        self._openings = 0
        self._task: asyncio.Task[None] | None = None

    def committed(self) -> None:
        """The actor finished a unit (committed it, or found it committed)."""
        self._last_commit = self._clock()

    def start(self) -> None:
        """Samples in the running loop until the actor goes away (call from inside the loop)."""
        if self._task is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (a synchronous caller): samples are taken on demand only
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self._interval_s)

    def sample(self) -> None:
        from raypipe.call.breaker import BreakerState

        b = self._breaker.stats()
        BREAKER_OPEN.record(self._metrics, 0 if b.state is BreakerState.CLOSED else 1, self._tags)
        if b.openings > self._openings:
            BREAKER_OPENINGS.record(self._metrics, b.openings - self._openings, self._tags)
            self._openings = b.openings
        INFLIGHT_LIMIT.record(self._metrics, self._limiter.limit, self._tags)
        INFLIGHT_CALLS.record(self._metrics, self._limiter.in_flight, self._tags)
        RUN_SINCE_COMMIT_S.record(self._metrics, self._clock() - self._last_commit, self._tags)


def emit_unit(metrics: Metrics, stats: UnitStats) -> None:
    """The driver's counts for one committed unit."""
    RUN_UNITS.record(metrics, 1)
    for outcome, rows in (("ok", stats.ok), ("empty_text", stats.empty_text), ("dead_letter", stats.dead_letters)):
        if rows:
            RUN_ROWS.record(metrics, rows, {"outcome": outcome})
    for kind, rows in sorted(stats.dead_letter_kinds.items()):
        if rows:
            RUN_DEAD_LETTERS.record(metrics, rows, {"kind": kind})
    if stats.retries:
        CLIENT_RETRIES.record(metrics, stats.retries)
    if stats.canaries:
        CLIENT_CANARIES.record(metrics, stats.canaries)


def emit_progress(metrics: Metrics, units_left: int, eta_s: float | None) -> None:
    """The driver's view of how much of the attempt is left (`raypipe.run.progress.Progress`)."""
    RUN_UNITS_LEFT.record(metrics, units_left)
    if eta_s is not None:
        RUN_ETA_S.record(metrics, eta_s)


def emit_watch_tick(metrics: Metrics, *, backlog_rows: int, backlog_files: int, oldest_waiting_s: float) -> None:
    """A watcher's tick: one `watch.ticks`, and its backlog as gauges."""
    WATCH_TICKS.record(metrics, 1)
    WATCH_BACKLOG_ROWS.record(metrics, backlog_rows)
    WATCH_BACKLOG_FILES.record(metrics, backlog_files)
    WATCH_OLDEST_WAITING_S.record(metrics, oldest_waiting_s)


def emit_watch_freshness(metrics: Metrics, p50_s: float, p95_s: float) -> None:
    """A watcher's freshness over its last report window (sent with each report)."""
    WATCH_FRESHNESS_P50_S.record(metrics, p50_s)
    WATCH_FRESHNESS_P95_S.record(metrics, p95_s)


def metrics_spec(config: MetricsConfig, tags: dict[str, str] | None = None) -> MetricsSpec:
    """The spec of a `MetricsConfig`, with `tags` over its own (the run's: run id, mode, ...)."""
    merged = {**config.tags, **(tags or {})}
    return MetricsSpec(
        config.dogstatsd_host,
        config.dogstatsd_port,
        config.ray_metrics,
        config.namespace,
        tuple(sorted(merged.items())),
        config.gauge_interval_s,
    )


class RunMetrics:
    """A run's metrics in the driver: its tags, its sink, and its start and end events."""

    def __init__(self, spec: MetricsSpec, report: RunReport) -> None:
        self.spec = spec
        self.metrics = spec.build()
        self._report = report

    @classmethod
    def start(cls, config: MetricsConfig, report: RunReport, *, app: str) -> RunMetrics:
        """Builds the driver's sink with the run's tags and sends the "started" event."""
        tags = {"run_id": report.run_id, "mode": report.mode, "model_version": report.model_version, "app": app}
        run = cls(metrics_spec(config, tags), report)
        RUN_STARTED.record(run.metrics)
        run.metrics.event(
            f"raypipe {report.mode} {report.run_id} started",
            f"output {report.output}, model {report.model_version}",
            alert_type="info",
        )
        return run

    def finish(self, report: RunReport) -> None:
        """Sends `run.finished` and the "succeeded" or "failed" event, then closes the sink."""
        ok = report.status == "completed"
        word = "succeeded" if ok else ("finished incomplete" if report.status == "incomplete" else "failed")
        text = (
            f"status {report.status}; rows in {report.rows_in:,}, results {report.rows_results:,}, "
            f"dead letters {report.rows_dead_letters:,}; calls {report.calls:,} "
            f"({', '.join(f'{k} {v:,}' for k, v in sorted(report.status_counts.items())) or 'none'}); "
            f"{report.throughput_rows_per_s:,.1f} rows/s over {report.wall_s:,.1f} s"
            + (f"; error: {report.error}" if report.error else "")
        )
        try:
            RUN_FINISHED.record(self.metrics, 1, {"status": report.status})
            RUN_ROWS_PER_S.record(self.metrics, report.throughput_rows_per_s)
            self.metrics.event(
                f"raypipe {report.mode} {report.run_id} {word}",
                text,
                alert_type="success" if ok else ("warning" if report.status == "incomplete" else "error"),
            )
        finally:
            self.metrics.close()

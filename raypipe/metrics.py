"""Metrics: what a run tells Datadog (DogStatsD) and Ray's metrics (dashboard, Prometheus).

    Metrics                  the protocol: count, gauge, distribution, event, flush, close
      NullMetrics            metrics off (the default when nothing is configured)
      DogStatsdMetrics       DogStatsD over UDP (the `datadog` package), constant tags
      RayMetrics             `ray.util.metrics`, so the Ray dashboard and Prometheus show them
      FanoutMetrics          several of the above at once

Who emits what (names below carry the `metrics.namespace` prefix, `raypipe.` by default):
- `MetricsInterceptor`, on the actors' gRPC channel: per call attempt `client.calls`,
  `client.latency_ms` and `client.paragraphs`, tagged `method` and `status` (the gRPC code).
  These are the attempts the run report counts in `status_counts`.
- `ActorGauges`, sampled in each actor: `client.breaker.open`, `client.breaker.openings`,
  `client.inflight.limit` and `client.inflight.calls`, tagged `actor`.
- the driver, per committed unit (`raypipe.progress.Progress`): `run.units`, `run.rows`
  (tagged `outcome`: ok, empty_text, dead_letter), `client.retries`, `client.canaries`; and per
  run (`RunMetrics`): `run.started`, `run.finished` (tagged `status`), and Datadog events
  "started", "succeeded" and "failed" with the run's counts.
- the server: `serve_app.metrics`.

Every metric carries the run's tags: `run_id`, `mode`, `model_version`, `app`.

An absent agent never fails or slows a run: DogStatsD is UDP, the host is resolved once when
the sink is built (a name that does not resolve turns Datadog off for the process), sends go
through a non-blocking socket whose errors are dropped, and the first failure in a process is
logged once, as one warning. Sinks are built where they are used (the driver, each actor, each
replica), from a picklable `MetricsSpec`; nothing happens at import.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

if TYPE_CHECKING:
    from raypipe.breaker import CircuitBreaker
    from raypipe.config import MetricsConfig
    from raypipe.limiter import Limiter
    from raypipe.report import RunReport, UnitStats

__all__ = [
    "BREAKER_OPEN",
    "BREAKER_OPENINGS",
    "CLIENT_CALLS",
    "CLIENT_CANARIES",
    "CLIENT_LATENCY_MS",
    "CLIENT_PARAGRAPHS",
    "CLIENT_RETRIES",
    "INFLIGHT_CALLS",
    "INFLIGHT_LIMIT",
    "RUN_FINISHED",
    "RUN_ROWS",
    "RUN_ROWS_PER_S",
    "RUN_STARTED",
    "RUN_UNITS",
    "ActorGauges",
    "DogStatsdMetrics",
    "FanoutMetrics",
    "Metrics",
    "MetricsInterceptor",
    "MetricsSpec",
    "NullMetrics",
    "RayMetrics",
    "RunMetrics",
    "emit_unit",
]

logger = logging.getLogger("raypipe.metrics")

Tags = Mapping[str, str]

CLIENT_CALLS = "client.calls"
"""Count: one per call attempt; tags `method`, `status`."""
CLIENT_LATENCY_MS = "client.latency_ms"
"""Distribution: an attempt's time from the channel's view, ms; tags `method`, `status`."""
CLIENT_PARAGRAPHS = "client.paragraphs"
"""Count: paragraphs sent per attempt; tags `method`, `status`."""
CLIENT_RETRIES = "client.retries"
"""Count: attempts retried (committed units)."""
CLIENT_CANARIES = "client.canaries"
"""Count: canary calls made to tell a broken service from rows at fault (committed units)."""
BREAKER_OPEN = "client.breaker.open"
"""Gauge: 1 while an actor's breaker is open or half-open, else 0; tag `actor`."""
BREAKER_OPENINGS = "client.breaker.openings"
"""Count: times an actor's breaker opened; tag `actor`."""
INFLIGHT_LIMIT = "client.inflight.limit"
"""Gauge: an actor's in-flight call limit; tag `actor`."""
INFLIGHT_CALLS = "client.inflight.calls"
"""Gauge: an actor's calls in flight; tag `actor`."""
RUN_UNITS = "run.units"
"""Count: units committed."""
RUN_ROWS = "run.rows"
"""Count: rows of committed units; tag `outcome` (ok, empty_text, dead_letter)."""
RUN_ROWS_PER_S = "run.rows_per_s"
"""Gauge: the run's throughput, sent when it ends."""
RUN_STARTED = "run.started"
"""Count: 1 when a run starts (after the service check)."""
RUN_FINISHED = "run.finished"
"""Count: 1 when a run ends; tag `status` (completed, incomplete, failed)."""


class Metrics(Protocol):
    """Where metrics go. Every method is cheap, never blocks on the network and never raises."""

    def count(self, name: str, value: float = 1, tags: Tags | None = None) -> None: ...

    def gauge(self, name: str, value: float, tags: Tags | None = None) -> None: ...

    def distribution(self, name: str, value: float, tags: Tags | None = None) -> None: ...

    def event(self, title: str, text: str, *, alert_type: str = "info", tags: Tags | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullMetrics:
    """Metrics off."""

    def count(self, name: str, value: float = 1, tags: Tags | None = None) -> None:
        pass

    def gauge(self, name: str, value: float, tags: Tags | None = None) -> None:
        pass

    def distribution(self, name: str, value: float, tags: Tags | None = None) -> None:
        pass

    def event(self, title: str, text: str, *, alert_type: str = "info", tags: Tags | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tag_list(tags: Tags | None) -> list[str] | None:
    return [f"{k}:{v}" for k, v in tags.items()] if tags else None


class _WarnOnce:
    """Logs the first problem of a sink as one warning; later ones only at debug level."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.warned = False

    def __call__(self, message: str, *args: object) -> None:
        with self._lock:
            first, self.warned = not self.warned, True
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)


class _QuietUdpSocket(socket.socket):
    """A connected, non-blocking UDP socket whose failed sends are counted and dropped.

    Connected, so a closed port is noticed (the kernel reports the ICMP refusal on a later
    send); non-blocking, so a full buffer drops a packet instead of stalling the caller. The
    DogStatsd client never sees an error, so it never logs one per packet or reconnects.
    """

    def __init__(self, family: int, address: tuple[Any, ...], on_error: Callable[[OSError], None]) -> None:
        super().__init__(family, socket.SOCK_DGRAM)
        self.setblocking(False)
        self.connect(address)
        self._on_error = on_error
        self.dropped = 0

    def send(self, data: Any, flags: int = 0) -> int:
        try:
            return super().send(data, flags)
        except OSError as e:
            self.dropped += 1
            self._on_error(e)
            return 0


class DogStatsdMetrics:
    """DogStatsD over UDP through the `datadog` package, buffered, with constant tags."""

    def __init__(
        self,
        host: str,
        port: int = 8125,
        *,
        namespace: str = "raypipe",
        tags: Tags | None = None,
        flush_interval_s: float = 0.3,
    ) -> None:
        from datadog.dogstatsd import DogStatsd

        self.host, self.port = host, port
        self._warn = _WarnOnce()
        self._socket: _QuietUdpSocket | None = None
        self._statsd: Any = None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as e:
            self._warn(
                "DogStatsD host %r does not resolve (%s): Datadog metrics are off in this process; "
                "check metrics.dogstatsd_host or DD_AGENT_HOST",
                host,
                e,
            )
            return
        family, _, _, _, address = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
        self._socket = _QuietUdpSocket(family, address, self._send_failed)
        self._statsd = DogStatsd(
            host=str(address[0]),
            port=port,
            namespace=namespace or None,
            constant_tags=_tag_list(tags) or [],
            disable_buffering=False,
            flush_interval=flush_interval_s,
            disable_telemetry=True,
        )
        self._statsd.socket = self._socket

    def _send_failed(self, error: OSError) -> None:
        self._warn(
            "DogStatsD at %s:%d is not accepting metrics (%s): they are dropped while it is away; the run goes on",
            self.host,
            self.port,
            error,
        )

    @property
    def enabled(self) -> bool:
        return self._statsd is not None

    @property
    def dropped(self) -> int:
        """Packets the socket failed to send."""
        return self._socket.dropped if self._socket is not None else 0

    def count(self, name: str, value: float = 1, tags: Tags | None = None) -> None:
        if self._statsd is not None:
            self._statsd.increment(name, value, tags=_tag_list(tags))

    def gauge(self, name: str, value: float, tags: Tags | None = None) -> None:
        if self._statsd is not None:
            self._statsd.gauge(name, value, tags=_tag_list(tags))

    def distribution(self, name: str, value: float, tags: Tags | None = None) -> None:
        if self._statsd is not None:
            self._statsd.distribution(name, value, tags=_tag_list(tags))

    def event(self, title: str, text: str, *, alert_type: str = "info", tags: Tags | None = None) -> None:
        if self._statsd is not None:
            self._statsd.event(title, text, alert_type=alert_type, tags=_tag_list(tags), source_type_name="raypipe")

    def flush(self) -> None:
        if self._statsd is not None:
            self._statsd.flush()

    def close(self) -> None:
        if self._statsd is not None:
            self._statsd.stop(timeout=1.0)
            self._statsd = None
        if self._socket is not None:
            if self._socket.dropped:
                logger.debug("DogStatsD at %s:%d: %d packets dropped", self.host, self.port, self._socket.dropped)
            self._socket.close()


# Bucket bounds of Ray histograms: milliseconds for `*_ms`, sizes (rows, calls, tokens) otherwise.
_MS_BOUNDS = [1.0, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 120_000]
_SIZE_BOUNDS = [float(2**i) for i in range(15)]


class RayMetrics:
    """`ray.util.metrics` counters, gauges and histograms (`raypipe_client_calls`, ...).

    Ray metrics exist only in a process connected to Ray; until it is, records are dropped.
    Each metric is created on first use with the tag keys of that use plus the constant ones.
    """

    def __init__(self, *, namespace: str = "raypipe", tags: Tags | None = None) -> None:
        self._prefix = f"{namespace}_" if namespace else ""
        self._tags = dict(tags or {})
        self._made: dict[str, Any] = {}
        self._ready = False

    def _metric(self, kind: str, name: str, tags: Tags | None) -> tuple[Any, dict[str, str]] | None:
        if not self._ready:
            import ray

            if not ray.is_initialized():
                return None
            self._ready = True
        final = {**self._tags, **(tags or {})}
        metric = self._made.get(name)
        if metric is None:
            from ray.util import metrics as rm

            full = (self._prefix + name).replace(".", "_")
            keys = tuple(sorted(final))
            if kind == "count":
                metric = rm.Counter(full, description=name, tag_keys=keys)
            elif kind == "gauge":
                metric = rm.Gauge(full, description=name, tag_keys=keys)
            else:
                bounds = _MS_BOUNDS if name.endswith("_ms") else _SIZE_BOUNDS
                metric = rm.Histogram(full, description=name, boundaries=bounds, tag_keys=keys)
            self._made[name] = metric
        for key in metric.info["tag_keys"]:
            final.setdefault(key, "")
        return metric, final

    def count(self, name: str, value: float = 1, tags: Tags | None = None) -> None:
        if value > 0 and (m := self._metric("count", name, tags)) is not None:
            m[0].inc(value, tags=m[1])

    def gauge(self, name: str, value: float, tags: Tags | None = None) -> None:
        if (m := self._metric("gauge", name, tags)) is not None:
            m[0].set(value, tags=m[1])

    def distribution(self, name: str, value: float, tags: Tags | None = None) -> None:
        if (m := self._metric("histogram", name, tags)) is not None:
            m[0].observe(value, tags=m[1])

    def event(self, title: str, text: str, *, alert_type: str = "info", tags: Tags | None = None) -> None:
        pass  # Ray has no events for applications; the counters carry the run's outcome

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class FanoutMetrics:
    """Sends every record to each of several sinks."""

    def __init__(self, sinks: Iterable[Metrics]) -> None:
        self.sinks = tuple(sinks)

    def count(self, name: str, value: float = 1, tags: Tags | None = None) -> None:
        for s in self.sinks:
            s.count(name, value, tags)

    def gauge(self, name: str, value: float, tags: Tags | None = None) -> None:
        for s in self.sinks:
            s.gauge(name, value, tags)

    def distribution(self, name: str, value: float, tags: Tags | None = None) -> None:
        for s in self.sinks:
            s.distribution(name, value, tags)

    def event(self, title: str, text: str, *, alert_type: str = "info", tags: Tags | None = None) -> None:
        for s in self.sinks:
            s.event(title, text, alert_type=alert_type, tags=tags)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()


@dataclass(frozen=True)
class MetricsSpec:
    """What a process needs to build its metrics sink (picklable: it travels to actors)."""

    dogstatsd_host: str | None = None
    dogstatsd_port: int = 8125
    ray_metrics: bool = False
    namespace: str = "raypipe"
    tags: tuple[tuple[str, str], ...] = ()
    gauge_interval_s: float = 5.0

    @classmethod
    def from_config(cls, config: MetricsConfig, tags: Tags | None = None) -> MetricsSpec:
        merged = {**config.tags, **(tags or {})}
        return cls(
            config.dogstatsd_host,
            config.dogstatsd_port,
            config.ray_metrics,
            config.namespace,
            tuple(sorted(merged.items())),
            config.gauge_interval_s,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.dogstatsd_host) or self.ray_metrics

    def build(self) -> Metrics:
        tags = dict(self.tags)
        sinks: list[Metrics] = []
        if self.dogstatsd_host:
            sinks.append(
                DogStatsdMetrics(self.dogstatsd_host, self.dogstatsd_port, namespace=self.namespace, tags=tags)
            )
        if self.ray_metrics:
            sinks.append(RayMetrics(namespace=self.namespace, tags=tags))
        if not sinks:
            return NullMetrics()
        return sinks[0] if len(sinks) == 1 else FanoutMetrics(sinks)


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
        self._metrics.count(CLIENT_CALLS, 1, tags)
        self._metrics.distribution(CLIENT_LATENCY_MS, (self._clock() - started) * 1000, tags)
        paragraphs = len(getattr(request, "paragraphs", ()))
        if paragraphs:
            self._metrics.count(CLIENT_PARAGRAPHS, paragraphs, tags)


class ActorGauges:
    """Samples an actor's breaker and limiter into gauges, every `interval_s` and on demand."""

    def __init__(
        self, metrics: Metrics, breaker: CircuitBreaker, limiter: Limiter, *, actor: str, interval_s: float = 5.0
    ) -> None:
        self._metrics = metrics
        self._breaker = breaker
        self._limiter = limiter
        self._tags = {"actor": actor}
        self._interval_s = interval_s
        self._openings = 0
        self._task: asyncio.Task[None] | None = None

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
        from raypipe.breaker import BreakerState

        b = self._breaker.stats()
        self._metrics.gauge(BREAKER_OPEN, 0 if b.state is BreakerState.CLOSED else 1, self._tags)
        if b.openings > self._openings:
            self._metrics.count(BREAKER_OPENINGS, b.openings - self._openings, self._tags)
            self._openings = b.openings
        self._metrics.gauge(INFLIGHT_LIMIT, self._limiter.limit, self._tags)
        self._metrics.gauge(INFLIGHT_CALLS, self._limiter.in_flight, self._tags)


def emit_unit(metrics: Metrics, stats: UnitStats) -> None:
    """The driver's counts for one committed unit."""
    metrics.count(RUN_UNITS, 1)
    for outcome, rows in (("ok", stats.ok), ("empty_text", stats.empty_text), ("dead_letter", stats.dead_letters)):
        if rows:
            metrics.count(RUN_ROWS, rows, {"outcome": outcome})
    if stats.retries:
        metrics.count(CLIENT_RETRIES, stats.retries)
    if stats.canaries:
        metrics.count(CLIENT_CANARIES, stats.canaries)


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
        run = cls(MetricsSpec.from_config(config, tags), report)
        run.metrics.count(RUN_STARTED)
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
            self.metrics.count(RUN_FINISHED, 1, {"status": report.status})
            self.metrics.gauge(RUN_ROWS_PER_S, report.throughput_rows_per_s)
            self.metrics.event(
                f"raypipe {report.mode} {report.run_id} {word}",
                text,
                alert_type="success" if ok else ("warning" if report.status == "incomplete" else "error"),
            )
        finally:
            self.metrics.close()

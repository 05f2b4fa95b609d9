"""The metric emitters both sides send through: raypipe's driver and actors, and serve_app's
replicas. Which metrics each side emits lives with that side (`raypipe.call.metrics`,
`serve_app.metrics`); this module only knows how to send them.

    Metrics                  the protocol: count, gauge, distribution, event, flush, close
      NullMetrics            metrics off (the default when nothing is configured)
      DogStatsdMetrics       DogStatsD over UDP (the `datadog` package), constant tags
      RayMetrics             `ray.util.metrics`, so the Ray dashboard and Prometheus show them
      FanoutMetrics          several of the above at once
    MetricsSpec              what a process needs to build its sink (picklable)
    MetricDef                one declared metric: name, kind, tags, meaning; `record` sends it
    Catalog                  every metric one side emits, and the tags its sink adds to all of them

An absent agent never fails or slows a caller: DogStatsD is UDP, the host is resolved once when
the sink is built (a name that does not resolve turns Datadog off for the process), sends go
through a non-blocking socket whose errors are dropped, and the first failure in a process is
logged once, as one warning. Nothing happens at import.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = [
    "Catalog",
    "DogStatsdMetrics",
    "FanoutMetrics",
    "MetricDef",
    "MetricKind",
    "Metrics",
    "MetricsSpec",
    "NullMetrics",
    "RayMetrics",
    "Tags",
]

logger = logging.getLogger("raypipe.metrics")

Tags = Mapping[str, str]


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


MetricKind = Literal["count", "gauge", "distribution"]


@dataclass(frozen=True)
class MetricDef:
    """One metric a side emits, declared once: the emitting code sends it through `record`, and
    the Datadog assets (`kuberay/datadog/`) are checked against it, so neither can drift.

    `name` is without the namespace (`client.calls` is `raypipe.client.calls` in Datadog and
    `raypipe_client_calls` in Ray). `tags` are the keys each record sets, beside the catalog's
    constant ones; `values` closes the set of values some of them take.
    """

    name: str
    kind: MetricKind
    doc: str
    """What it counts or measures, in one line."""
    tags: tuple[str, ...] = ()
    values: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(tag, the values the code gives it) for tags whose values form a closed set."""

    def record(self, sink: Metrics, value: float = 1, tags: Tags | None = None) -> None:
        """Sends one record of this metric to `sink` (cheap, never raises: see `Metrics`)."""
        if self.kind == "count":
            sink.count(self.name, value, tags)
        elif self.kind == "gauge":
            sink.gauge(self.name, value, tags)
        else:
            sink.distribution(self.name, value, tags)

    def allowed(self, tag: str) -> tuple[str, ...] | None:
        """The values `tag` takes, if they form a closed set."""
        return dict(self.values).get(tag)


@dataclass(frozen=True)
class Catalog:
    """Every metric one side emits (`raypipe.call.metrics.CATALOG`, `serve_app.metrics.CATALOG`)."""

    side: str
    constant_tags: tuple[str, ...]
    """Tags the side's sink puts on every record (`MetricsSpec.tags`), besides `metrics.tags`."""
    metrics: tuple[MetricDef, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.side}: a metric is declared twice in {names}")

    def tags_of(self, metric: MetricDef) -> frozenset[str]:
        """Every tag a record of `metric` carries."""
        return frozenset(self.constant_tags) | frozenset(metric.tags)

    def get(self, name: str) -> MetricDef | None:
        return next((m for m in self.metrics if m.name == name), None)

"""Server-side metrics of the EmotionClassifier replica: requests, batches, queue wait, model time, errors.

    raypipe.server.requests      count         per Classify call; tag `status` (gRPC code name)
    raypipe.server.paragraphs    count         paragraphs of those calls; tag `status`
    raypipe.server.errors        count         calls answered with an error; tag `status`
    raypipe.server.queue_ms      distribution  arrival in the replica -> its batch started
    raypipe.server.replica_ms    distribution  arrival in the replica -> answer
    raypipe.server.batch.calls   distribution  calls merged into one @serve.batch
    raypipe.server.batch.rows    distribution  paragraphs in that batch
    raypipe.server.batch.tokens  distribution  tokens in that batch
    raypipe.server.model_ms      distribution  the batch's forward passes

They are declared once, in `CATALOG`, and sent through it; the Datadog dashboard and monitors
(`kuberay/datadog/`) are checked against it. Every metric is tagged `app` (the Serve
application), `model_version` and `setting` (the runtime x precision that computes, e.g.
``openvino:bf16``: on a pool of mixed CPUs, `server.paragraphs` by `setting` says which setting
answered how many paragraphs). The sinks are raypipe's (`protos.telemetry`: DogStatsD with
an absent agent logged once, Ray metrics); this module knows nothing of the client's pipeline.
Settings come from `ServerSettings.metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from protos.telemetry import Catalog, MetricDef, Metrics, MetricsSpec, NullMetrics

__all__ = ["CATALOG", "SERVER_TAGS", "ServerMetrics", "ServerMetricsSettings"]

_STATUS = (("status", tuple(code.name for code in grpc.StatusCode)),)

REQUESTS = MetricDef("server.requests", "count", "Classify calls answered, by gRPC status", ("status",), _STATUS)
PARAGRAPHS = MetricDef("server.paragraphs", "count", "paragraphs of those calls", ("status",), _STATUS)
ERRORS = MetricDef("server.errors", "count", "calls answered with an error status", ("status",), _STATUS)
QUEUE_MS = MetricDef(
    "server.queue_ms", "distribution", "a call's wait from arrival in the replica to its batch's start, ms"
)
REPLICA_MS = MetricDef("server.replica_ms", "distribution", "a call's whole time in the replica, ms")
BATCH_CALLS = MetricDef("server.batch.calls", "distribution", "calls merged into one @serve.batch")
BATCH_ROWS = MetricDef("server.batch.rows", "distribution", "paragraphs in one batch")
BATCH_TOKENS = MetricDef("server.batch.tokens", "distribution", "tokens in one batch")
MODEL_MS = MetricDef("server.model_ms", "distribution", "one batch's forward passes, ms")

SERVER_TAGS = ("app", "model_version", "setting")
"""The tags every replica metric carries (`ServerMetrics.build`)."""

CATALOG = Catalog(
    "server",
    SERVER_TAGS,
    (REQUESTS, PARAGRAPHS, ERRORS, QUEUE_MS, REPLICA_MS, BATCH_CALLS, BATCH_ROWS, BATCH_TOKENS, MODEL_MS),
)
"""Every metric a replica emits."""


@dataclass(frozen=True)
class ServerMetricsSettings:
    """Where a replica sends its metrics. Datadog is off unless a host is known."""

    dogstatsd_host: str | None = None
    """DogStatsD agent host; None: the replica's `DD_AGENT_HOST`, if set; "" turns Datadog off."""
    dogstatsd_port: int | None = None
    """DogStatsD port; None: the replica's `DD_DOGSTATSD_PORT`, else 8125."""
    ray_metrics: bool = True
    """Also record them as Ray metrics (dashboard, Prometheus)."""
    namespace: str = "raypipe"
    """Prefix of every metric name."""

    def __post_init__(self) -> None:
        if self.dogstatsd_port is not None and not 0 < self.dogstatsd_port < 65536:
            raise ValueError(f"dogstatsd_port must be a port number, not {self.dogstatsd_port}")

    def spec(self, environ: Mapping[str, str], tags: Mapping[str, str]) -> MetricsSpec:
        """The sink to build, reading the Datadog agent's address from `environ` where unset."""
        host = self.dogstatsd_host if self.dogstatsd_host is not None else environ.get("DD_AGENT_HOST")
        port = self.dogstatsd_port or int(environ.get("DD_DOGSTATSD_PORT") or 8125)
        return MetricsSpec(
            dogstatsd_host=host or None,
            dogstatsd_port=port,
            ray_metrics=self.ray_metrics,
            namespace=self.namespace,
            tags=tuple(sorted(tags.items())),
        )


class ServerMetrics:
    """The replica's metric calls, one method per moment of a request's life."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._m = metrics or NullMetrics()

    @classmethod
    def build(
        cls,
        settings: ServerMetricsSettings,
        *,
        environ: Mapping[str, str],
        app: str,
        model_version: str,
        setting: str = "",
    ) -> ServerMetrics:
        return cls(settings.spec(environ, {"app": app, "model_version": model_version, "setting": setting}).build())

    def request(self, status: str, paragraphs: int) -> None:
        """A Classify call was answered with `status` (OK or an error code)."""
        tags = {"status": status}
        REQUESTS.record(self._m, 1, tags)
        PARAGRAPHS.record(self._m, paragraphs, tags)
        if status != "OK":
            ERRORS.record(self._m, 1, tags)

    def timing(self, *, queue_s: float, replica_s: float) -> None:
        """An answered call's wait for its batch and its whole time in the replica."""
        QUEUE_MS.record(self._m, queue_s * 1000)
        REPLICA_MS.record(self._m, replica_s * 1000)

    def batch(self, *, calls: int, rows: int, tokens: int, compute_s: float) -> None:
        """One @serve.batch ran its forward passes."""
        BATCH_CALLS.record(self._m, calls)
        BATCH_ROWS.record(self._m, rows)
        BATCH_TOKENS.record(self._m, tokens)
        MODEL_MS.record(self._m, compute_s * 1000)

    def close(self) -> None:
        self._m.close()

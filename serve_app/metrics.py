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

Every metric is tagged `app` (the Serve application) and `model_version`. The sinks are
raypipe's (`protos.telemetry`: DogStatsD with an absent agent logged once, Ray metrics); this
module knows nothing of the client's pipeline. Settings come from `ServerSettings.metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protos.telemetry import Metrics, MetricsSpec, NullMetrics

__all__ = ["ServerMetrics", "ServerMetricsSettings"]


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
        cls, settings: ServerMetricsSettings, *, environ: Mapping[str, str], app: str, model_version: str
    ) -> ServerMetrics:
        return cls(settings.spec(environ, {"app": app, "model_version": model_version}).build())

    def request(self, status: str, paragraphs: int) -> None:
        """A Classify call was answered with `status` (OK or an error code)."""
        tags = {"status": status}
        self._m.count("server.requests", 1, tags)
        self._m.count("server.paragraphs", paragraphs, tags)
        if status != "OK":
            self._m.count("server.errors", 1, tags)

    def timing(self, *, queue_s: float, replica_s: float) -> None:
        """An answered call's wait for its batch and its whole time in the replica."""
        self._m.distribution("server.queue_ms", queue_s * 1000)
        self._m.distribution("server.replica_ms", replica_s * 1000)

    def batch(self, *, calls: int, rows: int, tokens: int, compute_s: float) -> None:
        """One @serve.batch ran its forward passes."""
        self._m.distribution("server.batch.calls", calls)
        self._m.distribution("server.batch.rows", rows)
        self._m.distribution("server.batch.tokens", tokens)
        self._m.distribution("server.model_ms", compute_s * 1000)

    def close(self) -> None:
        self._m.close()

"""Server-side settings of the EmotionClassifier deployment, including fault injection.

These are chosen by whoever deploys the service (`raypipe serve`, a RayService's
serveConfigV2), never by a client: no field of a request can switch fault injection on.
Plain frozen dataclasses so they travel as deployment arguments and parse from YAML.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import grpc

from serve_app.metrics import ServerMetricsSettings

__all__ = ["PRECISION_SETTINGS", "RUNTIME_SETTINGS", "FaultInjection", "ServerSettings"]

#: Values of `ServerSettings.precision` (and `raypipe serve --precision`).
PRECISION_SETTINGS = (
    "fp32",
    "bf16",
    "bf16-dense",
    "bf16-ffn",
    "bf16-recheck",
    "bf16-dense-recheck",
    "int8",
    "auto",
)
#: Values of `ServerSettings.runtime` (and `raypipe serve --runtime`).
RUNTIME_SETTINGS = ("tensorflow", "openvino", "auto")


@dataclass(frozen=True)
class FaultInjection:
    """Fails a fraction of Classify calls and/or delays them. Off by default; for tests and drills."""

    fail_fraction: float = 0.0
    """Fraction of calls answered with `status` instead of a prediction (0 disables)."""
    status: str = "UNAVAILABLE"
    """gRPC status code name of the injected failures."""
    extra_latency_s: float = 0.0
    """Delay added to every call before it is answered."""
    poison_text: str | None = None
    """Every call holding a paragraph that contains this text fails with `status` (a poison
    paragraph that crashes the model), whatever `fail_fraction` says."""
    seed: int | None = None
    """Seeds the choice of failing calls, for repeatable drills."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_fraction <= 1.0:
            raise ValueError(f"fail_fraction must be in [0, 1], not {self.fail_fraction}")
        if self.extra_latency_s < 0:
            raise ValueError(f"extra_latency_s must be >= 0, not {self.extra_latency_s}")
        if self.status not in grpc.StatusCode.__members__ or self.status == "OK":
            raise ValueError(f"status must name a gRPC error code, not {self.status!r}")

    @property
    def enabled(self) -> bool:
        return self.fail_fraction > 0 or self.extra_latency_s > 0 or bool(self.poison_text)


@dataclass(frozen=True)
class ServerSettings:
    max_batch_size: int = 256
    """Most paragraphs accepted in one Classify call; more is INVALID_ARGUMENT."""
    max_sequence_length: int | None = None
    """Lowers the model's maximum token length; longer texts are truncated to it."""
    token_budget: int = 2048
    """Most (rows x padded length) in one forward pass. Measured on 2 cores (MiniLM and
    bert-base shapes): 2048 beat 4096 by 9-23% and 8192 by 20%; smaller chunks hold a narrower
    range of lengths, so less padding, and the matmuls are still large enough."""
    batch_max_tokens: int = 8192
    """Tokens merged across callers into one @serve.batch (cut into `token_budget` chunks).
    A busy replica runs batches back to back, so this sets the latency of one batch, not the
    throughput; a call larger than this runs alone."""
    batch_max_calls: int = 16
    """Most calls merged into one @serve.batch. A replica runs up to two batches per model
    thread at once (`serve_app.app.concurrent_batches`), so the deployment's
    max_ongoing_requests should be at least this x 2 x model_threads (Serve warns otherwise)."""
    batch_wait_timeout_s: float = 0.005
    """How long the first call of a batch waits for others to join it."""
    model_threads: int | None = None
    """Forward passes computed at once, each on its own model thread: a batch's passes (its
    length-sorted chunks) spread over them, and a next batch's passes queue behind. Default:
    the replica's CPUs, rounded up, at most the cores the process may run on. Measured on 2
    cores (MiniLM shape, length-sorted calls of 32): two
    single-threaded forward passes side by side ran 15% faster than one pass on two
    threads, and 22-30% faster while another process took 30% of a core (as Serve's proxy
    and the Ray Data actors do on a small node): a preempted thread stalls every barrier of
    a multi-threaded pass, while separate passes do not wait for each other."""
    intra_op_threads: int | None = None
    """Threads of one forward pass (TensorFlow intra-op); default: the replica's CPUs over
    `model_threads`, rounded up (1 with the defaults)."""
    inter_op_threads: int | None = None
    """TensorFlow inter-op threads; default: `model_threads` (each concurrent pass runs its
    ops on one)."""
    precision: str = "auto"
    """`auto` (default): the fastest setting this CPU's measured record passes through the
    agreement gate, or with no record for this CPU the fastest with the reference's answers
    (OpenVINO fp32); or one precision: `fp32`, `bf16` (needs AVX512_BF16 or AMX), the OpenVINO
    candidates between the two (`bf16-dense`, `bf16-ffn`, `bf16-recheck`, `bf16-dense-recheck`:
    `serve_app.compiled`),
    `int8` (OpenVINO only: the NNCF build of `raypipe model optimize DIR`). See `serve_app.runtimes`."""
    runtime: str = "auto"
    """`auto` (default: whichever runtime the choice of `precision` lands on), `tensorflow` (the
    SavedModel as exported: the reference), or `openvino` (the SavedModel compiled by OpenVINO
    for this CPU; converted once per model, OpenVINO version and machine, or ahead by
    `raypipe model export`/`optimize`)."""
    min_agreement: float = 0.99
    """The gate: a setting whose recorded top-label agreement with TensorFlow fp32
    (``DIR/runtimes.json``), the worse of in domain and out of domain, is under this is never
    served, unless `force_precision`."""
    force_precision: bool = False
    """Serve the asked precision even when its recorded agreement is under `min_agreement`."""
    measure_unrecorded: bool = True
    """With `precision: auto` and no record for this CPU, measure the settings with the
    reference's answers (fp32 on TensorFlow and OpenVINO) in the background after starting, write
    the record for the next start, and switch to a clearly faster one (the model version stays).
    See `serve_app.self_measure`."""
    fault: FaultInjection = field(default_factory=FaultInjection)
    metrics: ServerMetricsSettings = field(default_factory=ServerMetricsSettings)
    """Where the replica's metrics go (DogStatsD when a host is set or `DD_AGENT_HOST` is, Ray metrics)."""

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "token_budget",
            "batch_max_tokens",
            "batch_max_calls",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("model_threads", "intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or unset, not {value!r}")
        if self.batch_wait_timeout_s < 0:
            raise ValueError("batch_wait_timeout_s must be >= 0")
        if self.precision not in PRECISION_SETTINGS:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_SETTINGS)}, not {self.precision!r}")
        if self.runtime not in RUNTIME_SETTINGS:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIME_SETTINGS)}, not {self.runtime!r}")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"min_agreement must be in [0, 1], not {self.min_agreement}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ServerSettings:
        """Parses a plain mapping (YAML, deployment args), rejecting unknown keys."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown server settings: {', '.join(unknown)}")
        fault = data.pop("fault", None) or {}
        if isinstance(fault, dict):
            fault_known = {f.name for f in fields(FaultInjection)}
            if set(fault) - fault_known:
                raise ValueError(f"unknown fault settings: {', '.join(sorted(set(fault) - fault_known))}")
            fault = FaultInjection(**fault)
        metrics = data.pop("metrics", None) or {}
        if isinstance(metrics, dict):
            metrics_known = {f.name for f in fields(ServerMetricsSettings)}
            if set(metrics) - metrics_known:
                raise ValueError(f"unknown metrics settings: {', '.join(sorted(set(metrics) - metrics_known))}")
            metrics = ServerMetricsSettings(**metrics)
        return cls(fault=fault, metrics=metrics, **data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

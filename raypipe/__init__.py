"""raypipe: offline NLP inference at scale on Ray.

Ray Data streams paragraph shards (S3 or local, Parquet or JSON lines) into async actors that
call a Ray Serve BERT deployment over gRPC, behind an adaptive in-flight limit, a circuit
breaker and retries, and commit results and dead letters to a Delta Lake table, unit by unit.

    import raypipe
    report = raypipe.backfill("s3://corpus/paragraphs/", "s3://out/emotions/", service="10.0.0.5:9000")
    print(report.render())
    raypipe.latest("s3://out/emotions/")         # one row per id (pyarrow Table)
    raypipe.read_outcomes("s3://out/emotions/")  # every committed row, results and dead letters
    raypipe.read_report("s3://out/emotions/", report.run_id)  # the stored report, from any output URI
    raypipe.watch("s3://corpus/paragraphs/", "s3://out/emotions/", every_s=60)  # commit arrivals until stopped

`raypipe.connect()` joins the Ray cluster at `RAY_ADDRESS` (or one `ray start` left running),
else starts a local one; the run calls do it by themselves when they need Ray.

Names are imported on first use, so `import raypipe` stays cheap and starts nothing. The wire
contract with the model service (`protos`) lies below both raypipe and `serve_app`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "CircuitOpenError",
    "ConfigError",
    "InputError",
    "LeaseLostError",
    "ModelServiceError",
    "NoShardsError",
    "OutputLockedError",
    "OutputPermissionError",
    "PipelineConfig",
    "RaypipeError",
    "RunNotFoundError",
    "RunReport",
    "RunStopped",
    "SchemaError",
    "ServiceTlsError",
    "ServiceUnavailable",
    "SinkError",
    "UnsafeOutputError",
    "WatchReport",
    "backfill",
    "build_config",
    "check_model_dir",
    "connect",
    "daily",
    "export_hf_checkpoint",
    "export_saved_model",
    "latest",
    "load_config",
    "read_outcomes",
    "read_report",
    "replay",
    "watch",
]

_HOMES = {
    "CircuitOpenError": "raypipe.errors",
    "ConfigError": "raypipe.errors",
    "InputError": "raypipe.errors",
    "LeaseLostError": "raypipe.errors",
    "ModelServiceError": "raypipe.errors",
    "NoShardsError": "raypipe.errors",
    "OutputLockedError": "raypipe.errors",
    "OutputPermissionError": "raypipe.errors",
    "PipelineConfig": "raypipe.config",
    "RaypipeError": "raypipe.errors",
    "RunNotFoundError": "raypipe.errors",
    "RunReport": "raypipe.report",
    "RunStopped": "raypipe.errors",
    "SchemaError": "raypipe.errors",
    "ServiceTlsError": "raypipe.errors",
    "ServiceUnavailable": "raypipe.errors",
    "SinkError": "raypipe.errors",
    "UnsafeOutputError": "raypipe.errors",
    "WatchReport": "raypipe.run.watch.report",
    "backfill": "raypipe.api",
    "build_config": "raypipe.api",
    "check_model_dir": "serve_app.export",
    "connect": "raypipe.api",
    "daily": "raypipe.api",
    "export_hf_checkpoint": "serve_app.export",
    "export_saved_model": "serve_app.export",
    "latest": "raypipe.commit.outcomes",
    "load_config": "raypipe.config",
    "read_outcomes": "raypipe.commit.outcomes",
    "read_report": "raypipe.api",
    "replay": "raypipe.api",
    "watch": "raypipe.api",
}

if TYPE_CHECKING:
    from raypipe.api import backfill, build_config, connect, daily, read_report, replay, watch
    from raypipe.commit.outcomes import latest, read_outcomes
    from raypipe.config import PipelineConfig, load_config
    from raypipe.errors import (
        CircuitOpenError,
        ConfigError,
        InputError,
        LeaseLostError,
        ModelServiceError,
        NoShardsError,
        OutputLockedError,
        OutputPermissionError,
        RaypipeError,
        RunNotFoundError,
        RunStopped,
        SchemaError,
        ServiceTlsError,
        ServiceUnavailable,
        SinkError,
        UnsafeOutputError,
    )
    from raypipe.report import RunReport
    from raypipe.run.watch.report import WatchReport
    from serve_app.export import check_model_dir, export_hf_checkpoint, export_saved_model


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'raypipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

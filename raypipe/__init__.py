"""raypipe: offline NLP inference at scale on Ray.

Ray Data streams paragraph shards (S3 or local, Parquet or JSON lines) into async actors that
call a Ray Serve BERT deployment over gRPC, behind an adaptive in-flight limit, a circuit
breaker and retries, and commit results and dead letters to a Delta Lake table, unit by unit.

    import raypipe
    report = raypipe.backfill("s3://corpus/paragraphs/", "s3://out/emotions/", service="10.0.0.5:9000")
    print(report.render())
    raypipe.latest("s3://out/emotions/")         # one row per id (pyarrow Table)
    raypipe.read_outcomes("s3://out/emotions/")  # every committed row, results and dead letters

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
    "ModelServiceError",
    "OutputLockedError",
    "PipelineConfig",
    "RaypipeError",
    "RunReport",
    "SinkError",
    "backfill",
    "build_config",
    "check_model_dir",
    "daily",
    "export_hf_checkpoint",
    "export_saved_model",
    "latest",
    "load_config",
    "read_outcomes",
    "replay",
]

_HOMES = {
    "backfill": "raypipe.api",
    "daily": "raypipe.api",
    "replay": "raypipe.api",
    "read_outcomes": "raypipe.outcomes",
    "latest": "raypipe.outcomes",
    "export_hf_checkpoint": "serve_app.export",
    "export_saved_model": "serve_app.export",
    "check_model_dir": "serve_app.export",
    "build_config": "raypipe.api",
    "PipelineConfig": "raypipe.config",
    "load_config": "raypipe.config",
    "RunReport": "raypipe.report",
    "CircuitOpenError": "raypipe.errors",
    "ConfigError": "raypipe.errors",
    "InputError": "raypipe.errors",
    "ModelServiceError": "raypipe.errors",
    "OutputLockedError": "raypipe.errors",
    "RaypipeError": "raypipe.errors",
    "SinkError": "raypipe.errors",
}

if TYPE_CHECKING:
    from raypipe.api import backfill, build_config, daily, replay
    from raypipe.config import PipelineConfig, load_config
    from raypipe.errors import (
        CircuitOpenError,
        ConfigError,
        InputError,
        ModelServiceError,
        OutputLockedError,
        RaypipeError,
        SinkError,
    )
    from raypipe.outcomes import latest, read_outcomes
    from raypipe.report import RunReport
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

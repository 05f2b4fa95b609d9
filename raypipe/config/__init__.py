"""One typed, frozen configuration for a run, validated before any data is read.

Settings come from three layers, later ones winning: a config file (YAML or JSON), the
environment (``RAYPIPE_<SECTION>__<FIELD>``, e.g. ``RAYPIPE_SERVICE__ADDRESS``), and explicit
overrides (CLI flags, keyword arguments of the Python API). Unknown keys are errors, never
ignored: a typo in a 96-hour job's config must fail in the first second.

Nothing here reads the environment or a file at import time; `load_config` does, when asked.
"""

from raypipe.config.load import load_config, run_input
from raypipe.config.sections import (
    ActorPoolConfig,
    DedupConfig,
    InputConfig,
    MetricsConfig,
    OutputConfig,
    PipelineConfig,
    WatchConfig,
    check_run_id,
    default_max_actors,
    validate_uri,
)
from raypipe.config.service import BreakerConfig, ClientConfig, LimiterConfig, RetryConfig, ServiceConfig

__all__ = [
    "ActorPoolConfig",
    "BreakerConfig",
    "ClientConfig",
    "DedupConfig",
    "InputConfig",
    "LimiterConfig",
    "MetricsConfig",
    "OutputConfig",
    "PipelineConfig",
    "RetryConfig",
    "ServiceConfig",
    "WatchConfig",
    "check_run_id",
    "default_max_actors",
    "load_config",
    "run_input",
    "validate_uri",
]

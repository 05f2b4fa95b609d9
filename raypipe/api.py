"""The Python API: one call per run mode, for notebooks, jobs and scripts.

Each call builds the run's typed config from (lowest first) an optional config file, the
`RAYPIPE_*` environment and its keyword arguments, validates it, runs, and returns the
`RunReport` (also written to `OUTPUT/runs/<run_id>.json`). They connect to the Ray cluster
already initialised in the process, else to `RAY_ADDRESS`, else start a local one.

Before any of that, `raypipe.preflight.check_run` checks the input, the output and the
settings: a wrong one raises `ConfigError` or `InputError` before the model service is called,
Ray is started or anything is written. The values are the CLI's: `since` takes an ISO time
string (`"2026-11-20T00:00:00Z"`) as well as a timezone-aware `datetime`.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.config import PipelineConfig, load_config
from raypipe.preflight import check_run, parse_since

if TYPE_CHECKING:
    from raypipe.report import RunReport

__all__ = ["backfill", "build_config", "daily", "replay"]


def build_config(
    *,
    input: str | None = None,
    output: str | None = None,
    service: str | None = None,
    run_id: str | None = None,
    config_file: str | Path | None = None,
    settings: dict[str, Any] | None = None,
) -> PipelineConfig:
    """The run's config: file, then environment, then `settings` (nested), then the named arguments."""
    overrides: dict[str, Any] = dict(settings or {})
    if input is not None:
        overrides.setdefault("input", {})
        overrides["input"] = {**overrides["input"], "uri": input}
    if output is not None:
        overrides["output"] = {**overrides.get("output", {}), "uri": output}
    if service is not None:
        overrides["service"] = {**overrides.get("service", {}), "address": service}
    if run_id is not None:
        overrides["run_id"] = run_id
    return load_config(config_file, overrides, environ=os.environ)


def backfill(
    input: str | None = None,
    output: str | None = None,
    *,
    service: str | None = None,
    run_id: str | None = None,
    config_file: str | Path | None = None,
    settings: dict[str, Any] | None = None,
) -> RunReport:
    """Classifies every paragraph of `input` into `output`; the same `run_id` resumes it."""
    config = build_config(
        input=input, output=output, service=service, run_id=run_id, config_file=config_file, settings=settings
    )
    check_run(config, "backfill")
    from raypipe import modes  # after the checks: it brings Ray Data

    return modes.backfill(config)


def daily(
    input: str | None = None,
    output: str | None = None,
    *,
    service: str | None = None,
    run_id: str | None = None,
    since: str | datetime | None = None,
    config_file: str | Path | None = None,
    settings: dict[str, Any] | None = None,
) -> RunReport:
    """Classifies the paragraphs of input files no run has read whole (new or changed files),
    whatever their `updated_at`; `since` (an ISO time with a zone, or an aware `datetime`) also
    re-reads rows of earlier files updated after it."""
    after = parse_since(since)
    config = build_config(
        input=input, output=output, service=service, run_id=run_id, config_file=config_file, settings=settings
    )
    check_run(config, "daily")
    from raypipe import modes

    return modes.daily(config, since=after)


def replay(
    output: str | None = None,
    *,
    run_id: str,
    replay_id: str | None = None,
    service: str | None = None,
    config_file: str | Path | None = None,
    settings: dict[str, Any] | None = None,
) -> RunReport:
    """Re-infers the dead letters of run `run_id` and merges them into its results; `replay_id`
    names the replay (default: resume the latest unfinished `<run_id>.replay-<n>`, else a new one)."""
    config = build_config(output=output, service=service, run_id=replay_id, config_file=config_file, settings=settings)
    check_run(config, "replay", of_run=run_id)
    from raypipe import modes

    return modes.replay(config, of_run=run_id)

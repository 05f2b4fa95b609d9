"""The Python API: one call per run mode, for notebooks, jobs and scripts; `read_report` to read
a run's report back from its output, and `connect` to join (or start) the Ray cluster.

Each call builds the run's typed config from (lowest first) an optional config file, the
`RAYPIPE_*` environment and its keyword arguments, validates it, runs, and returns the
`RunReport` (also written to `OUTPUT/runs/<run_id>.json`). They connect to the Ray cluster
already initialised in the process, else to `RAY_ADDRESS`, else start a local one. The input
(`input=` over the config's `input` section: `raypipe.config.run_input`) is kept apart from
the rest of the config: only the checks and planning read it.

The output is kept apart the same way: the `output` argument and the config's `output`
section are turned into the output's one owner object once per call
(`raypipe.commit.output.Output.for_run`: its settings, files and table), and that object, not the
config, is what the checks and the run write through.

Before any of that, `raypipe.run.preflight.check_run` checks the input, the output and the
settings: a wrong one raises `ConfigError` or `InputError` before the model service is called,
Ray is started or anything is written. The values are the CLI's: `since` takes an ISO time
string (`"2026-11-20T00:00:00Z"`) as well as a timezone-aware `datetime`.
"""

from __future__ import annotations

import os
import threading
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.config import OutputConfig, PipelineConfig, check_run_id, load_config, run_input
from raypipe.errors import RunNotFoundError
from raypipe.run.preflight import check_input_run, check_replay, check_watch, parse_since

if TYPE_CHECKING:
    from raypipe.commit.output import Output
    from raypipe.report import RunReport
    from raypipe.run.watch.report import WatchReport

__all__ = ["backfill", "build_config", "connect", "daily", "read_report", "replay", "watch"]


def connect(address: str | None = None) -> None:
    """Joins a Ray cluster from this process, quietly.

    The cluster is `address` (`"10.0.0.5:6379"`, `"ray://head:10001"`) if given, else the one
    `RAY_ADDRESS` names, else one `ray start` left running on this host; with none of them, a
    local cluster is started for this process (it stops when the process ends). Does nothing
    when Ray is already initialised here. Ray's token-authentication notice and the INFO lines
    of Serve and Ray Data are turned down; their warnings and errors still show.

    The run calls (`backfill`, `daily`, `replay`) connect by themselves when they need Ray; call
    this first to deploy the model service from the same process or to choose the cluster.
    """
    import ray

    if ray.is_initialized():
        return
    from raypipe.run.driver import start_local_ray  # Ray Data comes with it: only when asked

    start_local_ray(**({} if address is None else {"address": address}))


def read_report(output_uri: str, run_id: str) -> RunReport:
    """The report of run `run_id`, read from `<output_uri>/runs/<run_id>.json` (a local path or
    `s3://`). Raises `RunNotFoundError` naming the nearest run id there when it has none."""
    from raypipe.report import RunReport

    return RunReport.from_dict(report_dict(output_uri, run_id))


def report_dict(output_uri: str, run_id: str) -> dict[str, Any]:
    """The stored report of `run_id` as written (`read_report`'s source; `raypipe report --json`).
    A run id that is not one (`..`, a path) is a `ConfigError`: nothing outside the output is read."""
    import difflib
    import posixpath

    from raypipe.store import OutputStore

    check_run_id(run_id, what="--run-id")

    store = OutputStore(output_uri)
    data = store.read_json_or_none(store.report_file(run_id))
    if data is not None:
        return dict(data)
    runs = [posixpath.basename(p).removesuffix(".json") for p in store.list_files(store.path("runs"), ".json")]
    near = difflib.get_close_matches(run_id, runs, n=1)
    hint = f": did you mean {near[0]}?" if near else f"; its runs: {', '.join(runs[-5:])}" if runs else ""
    raise RunNotFoundError(
        f"no report for run {run_id} at {output_uri}{hint}",
        run_id=run_id,
        output=output_uri,
        nearest=near[0] if near else None,
    )


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


def _output(settings: OutputConfig, uri: str | None) -> Output:
    """The run's output as its one owner object (`Output.for_run`), built here once; building it
    reads and writes nothing. Imported here: the table's module brings pyarrow."""
    from raypipe.commit.output import Output

    return Output.for_run(settings, uri=uri)


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
    config = build_config(service=service, run_id=run_id, config_file=config_file, settings=settings)
    source = run_input(config, input, "backfill")  # only the checks and planning read the input
    place = _output(config.output, output)  # the output's one owner, for the checks and the run
    check_input_run(source, "backfill", place)
    from raypipe.run import modes  # after the checks: it brings Ray Data

    return modes.backfill(config, source, place)


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
    config = build_config(service=service, run_id=run_id, config_file=config_file, settings=settings)
    source = run_input(config, input, "daily")
    place = _output(config.output, output)
    check_input_run(source, "daily", place)
    from raypipe.run import modes

    return modes.daily(config, source, place, since=after)


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
    config = build_config(service=service, run_id=replay_id, config_file=config_file, settings=settings)
    place = _output(config.output, output)
    check_replay(run_id, place)
    from raypipe.run import modes

    return modes.replay(config, place, of_run=run_id)


def watch(
    input: str | None = None,
    output: str | None = None,
    *,
    every_s: float | None = None,
    max_wait_s: float | None = None,
    events_queue: str | None = None,
    config: str | Path | PipelineConfig | None = None,
    stop: threading.Event | None = None,
    ticks: int | None = None,
    service: str | None = None,
    run_id: str | None = None,
    settings: dict[str, Any] | None = None,
) -> WatchReport:
    """Watches `input` and commits what arrives into `output`, unit by unit as a daily commits,
    minutes after each arrival, until `stop` is set, SIGTERM or SIGINT comes (in the main
    thread), or `ticks` looks were made; returns the watcher's `WatchReport`.

    `every_s` (default `watch.every_s`, 60) is how often it looks; `max_wait_s` (default 60)
    how long an arrival waits for others before it is committed; `events_queue` an SQS queue
    of the input's S3 notifications, read instead of a listing per look. `config` is a config
    file or a built `PipelineConfig`; `run_id` names the watcher (default: one per input, so a
    restart resumes it). `raypipe.run.watch` tells the rest."""
    watch_settings = {
        k: v
        for k, v in (("every_s", every_s), ("max_wait_s", max_wait_s), ("events_queue", events_queue))
        if v is not None
    }
    overrides = dict(settings or {})
    if watch_settings:
        overrides["watch"] = {**overrides.get("watch", {}), **watch_settings}
    if isinstance(config, PipelineConfig):
        base = config.model_dump(exclude_unset=True)
        for key, value in overrides.items():  # a section given here goes over the same section of `config`
            base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        merged = build_config(service=service, run_id=run_id, settings=base)
    else:
        merged = build_config(service=service, run_id=run_id, config_file=config, settings=overrides)
    source = run_input(merged, input, "watch")
    place = _output(merged.output, output)
    check_watch(merged, source, place)
    from raypipe.run.watch.mode import watch as run_watch  # after the checks: it brings Ray Data

    return run_watch(merged, source, place, stop=stop, ticks=ticks)

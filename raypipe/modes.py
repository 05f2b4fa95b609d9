"""Run modes: backfill, daily delta and replay, over one shared run protocol.

Every run, whatever its mode:
1. checks the model service (labels, version, limits) before reading any data;
2. takes the output lease (`raypipe.lease`);
3. plans its units once and stores the plan, so a restart with the same run id does the same
   units, and skips those already committed (`raypipe.sinks`);
4. streams the rest through the pipeline, logging progress;
5. merges every committed unit's summary into the report, writes `runs/<run_id>.json`, and,
   when every unit is committed, marks the run committed (a daily run then advances the
   watermark: never before, so a failed day is picked up by the next run).

A daily run selects rows with `watermark < updated_at <= until` (`until` defaults to the
time the run was planned). A replay re-infers a run's dead letters into that run's results
partition and removes each dead-letter file once its rows are re-committed.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from raypipe.actor import ActorSettings
from raypipe.client import check_service
from raypipe.config import ClientConfig, PipelineConfig
from raypipe.errors import ConfigError
from raypipe.lease import Lease
from raypipe.pipeline import Progress, run_units
from raypipe.report import RunReport, UnitStats
from raypipe.sinks import committed_units, started_units
from raypipe.sources import ColumnNames, DeltaWindow, WorkUnit, list_shards, plan_units
from raypipe.store import OutputStore

__all__ = ["backfill", "daily", "replay"]

logger = logging.getLogger("raypipe")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


@dataclass
class _Plan:
    mode: str
    input: str | None
    units: list[WorkUnit]
    bad_shards: list[dict[str, str]]
    window: DeltaWindow | None = None
    replay_of: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "input": self.input,
            "units": [u.to_dict() for u in self.units],
            "bad_shards": self.bad_shards,
            "window": None
            if self.window is None
            else {"after": _iso(self.window.after), "until": _iso(self.window.until)},
            "replay_of": self.replay_of,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Plan:
        w = d.get("window")
        window = None if w is None else DeltaWindow(_parse(w["after"]), _parse(w["until"]))  # type: ignore[arg-type]
        return cls(
            d["mode"],
            d["input"],
            [WorkUnit.from_dict(u) for u in d["units"]],
            d["bad_shards"],
            window,
            d.get("replay_of"),
        )


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING, log_to_driver=False)


def _columns(config: PipelineConfig) -> ColumnNames:
    assert config.input is not None
    return ColumnNames(config.input.id_column, config.input.text_column, config.input.updated_at_column)


def _run(
    config: PipelineConfig,
    mode: str,
    make_plan: Callable[[OutputStore, str], _Plan],
    results_run_id: Callable[[str, _Plan], str] = lambda run_id, plan: run_id,
    after_commit: Callable[[OutputStore, str, _Plan, list[UnitStats]], None] | None = None,
) -> RunReport:
    store = OutputStore(config.output.uri)
    run_id = config.run_id or f"{mode}-{_stamp()}"
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    report = RunReport(run_id=run_id, mode=mode, output=config.output.uri, started_at=started_at.isoformat())

    info = check_service(
        config.service.address, application=config.service.application, timeout_s=config.service.connect_timeout_s
    )
    labels, version, max_batch = info.labels, info.model_version, info.max_batch_size
    client_cfg = config.client
    if max_batch and client_cfg.micro_batch_size > max_batch:
        logger.warning(
            "micro_batch_size %d is over the server's maximum %d: using %d",
            client_cfg.micro_batch_size,
            max_batch,
            max_batch,
        )
        client_cfg = ClientConfig.model_validate({**client_cfg.model_dump(), "micro_batch_size": max_batch})
    report.labels, report.model_version = list(labels), version

    lease = Lease(store, run_id, duration_s=config.output.lease_s)
    lease.acquire()
    try:
        plan_path = store.run_state(run_id, "plan.json")
        stored = store.read_json_or_none(plan_path)
        if stored is not None:
            plan = _Plan.from_dict(stored)
            if plan.mode != mode or plan.input != (config.input.uri if config.input else plan.input):
                raise ConfigError(
                    f"run {run_id} was started as a {plan.mode} of {plan.input}; "
                    f"it cannot be resumed as a {mode} of {config.input.uri if config.input else None}"
                )
            logger.info("resuming run %s: %d planned units", run_id, len(plan.units))
            if stored.get("model_version") not in (None, version):
                logger.warning(
                    "run %s was started with model %s and resumes with %s: its rows will carry both versions",
                    run_id,
                    stored["model_version"],
                    version,
                )
            if plan.bad_shards and config.input is not None:
                plan = _retry_bad_shards(config, plan)
                store.write_json(plan_path, {**plan.to_dict(), "model_version": stored.get("model_version")})
        else:
            plan = make_plan(store, run_id)
            store.write_json(plan_path, {**plan.to_dict(), "model_version": version})
        report.input, report.bad_shards, report.replay_of = plan.input, plan.bad_shards, plan.replay_of
        if plan.window is not None:
            report.window = {"after": _iso(plan.window.after), "until": _iso(plan.window.until)}
        report.units_total = len(plan.units)

        before = committed_units(store, run_id)
        started = started_units(store, run_id)
        todo = [u for u in plan.units if u.key not in before]
        redone = {u.key for u in todo if u.key in started}
        report.units_skipped_committed = len(plan.units) - len(todo)
        report.rows_skipped_committed = sum(s.get("rows", 0) for s in before.values())
        logger.info(
            "run %s: %d units to do, %d already committed, %d to redo after an interruption",
            run_id,
            len(todo),
            report.units_skipped_committed,
            len(redone),
        )
        settings = ActorSettings(
            output_uri=config.output.uri,
            run_id=results_run_id(run_id, plan),
            state_run_id=run_id,
            attempt=uuid.uuid4().hex[:8],
            service=config.service,
            client=client_cfg,
            labels=tuple(labels),
        )
        if todo:
            _ensure_ray()
        progress = Progress(len(todo), sum(u.expected_rows or 0 for u in todo) or None, config.progress_interval_s)
        bad = list(plan.bad_shards)
        units_by_key = {u.key: u for u in todo}
        this_attempt: list[UnitStats] = []
        for outcome in run_units(
            todo,
            columns=_columns(config) if config.input else ColumnNames(),
            window=plan.window,
            on_bad_shard=config.input.on_bad_shard if config.input else "fail",
            settings=settings,
            actors=config.actors,
        ):
            progress.update(outcome.stats)
            if outcome.error is not None:
                unit = units_by_key[outcome.unit]
                bad.append({"shard": unit.shard, "format": unit.format, "error": outcome.error})
            if outcome.stats is not None:
                this_attempt.append(outcome.stats)
                if outcome.unit in redone:
                    report.units_redone += 1
                    report.rows_redone += outcome.stats.rows
        report.bad_shards = bad
        report.rows_this_attempt = sum(s.rows for s in this_attempt)

        committed = committed_units(store, run_id)
        all_stats = [UnitStats.from_dict(s) for s in committed.values()]
        report.merge_units(all_stats)
        complete = all(u.key in committed for u in plan.units)
        report.status = "completed" if complete and not bad else "incomplete"
        if complete:
            store.write_json(
                store.run_state(run_id, "COMMITTED.json"), {"run_id": run_id, "at": _iso(datetime.now(UTC))}
            )
            if after_commit is not None:
                after_commit(store, run_id, plan, all_stats)
    except BaseException as e:
        report.status = "failed"
        report.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        report.finished_at = datetime.now(UTC).isoformat()
        report.wall_s = round(time.monotonic() - t0, 3)
        report.throughput_rows_per_s = round(report.rows_this_attempt / report.wall_s, 2) if report.wall_s else 0.0
        try:
            store.write_json(store.report_file(run_id), report.to_dict())
        finally:
            lease.release()
    return report


def _input_plan(config: PipelineConfig, mode: str, window: DeltaWindow | None) -> _Plan:
    if config.input is None:
        raise ConfigError(f"a {mode} run needs input.uri")
    shards = list_shards(config.input.uri, format=config.input.format)
    units, bad = plan_units(
        shards,
        unit_rows=config.input.unit_rows,
        columns=_columns(config),
        need_updated_at=window is not None,
        on_bad_shard=config.input.on_bad_shard,
    )
    logger.info("planned %d units over %d shards (%d bad)", len(units), len(shards), len(bad))
    return _Plan(mode, config.input.uri, units, bad, window)


def _retry_bad_shards(config: PipelineConfig, plan: _Plan) -> _Plan:
    """Plans again the shards an earlier attempt recorded as bad: a fixed shard joins the run."""
    assert config.input is not None
    shards = [(b["shard"], b["format"]) for b in plan.bad_shards]
    units, bad = plan_units(
        shards,  # type: ignore[arg-type]
        unit_rows=config.input.unit_rows,
        columns=_columns(config),
        need_updated_at=plan.window is not None,
        on_bad_shard="record",
    )
    if units:
        logger.info("%d shard(s) recorded as bad are readable now: %d units added", len(shards) - len(bad), len(units))
    return _Plan(plan.mode, plan.input, plan.units + units, bad, plan.window, plan.replay_of)


def backfill(config: PipelineConfig) -> RunReport:
    """Infers every row of the input; resumable by run id."""
    return _run(config, "backfill", lambda store, run_id: _input_plan(config, "backfill", None))


WATERMARK = "watermark.json"


def daily(config: PipelineConfig, *, until: datetime | None = None) -> RunReport:
    """Infers rows new or changed since the last committed daily run, as a new partition."""

    def make_plan(store: OutputStore, run_id: str) -> _Plan:
        mark = store.read_json_or_none(store.state(WATERMARK))
        after = _parse(mark["updated_at"]) if mark else None
        end = until or datetime.now(UTC)
        if end.tzinfo is None:
            raise ConfigError("daily: `until` must be timezone-aware")
        if after is not None and end <= after:
            raise ConfigError(f"daily: until {end.isoformat()} is not after the watermark {after.isoformat()}")
        return _input_plan(config, "daily", DeltaWindow(after, end))

    def advance(store: OutputStore, run_id: str, plan: _Plan, stats: list[UnitStats]) -> None:
        assert plan.window is not None
        store.write_json(store.state(WATERMARK), {"updated_at": _iso(plan.window.until), "run_id": run_id})
        logger.info("watermark advanced to %s", plan.window.until.isoformat())

    return _run(config, "daily", make_plan, after_commit=advance)


def replay(config: PipelineConfig, *, of_run: str) -> RunReport:
    """Re-infers run `of_run`'s dead letters and merges the answers into its results."""
    if config.run_id is None:
        config = config.model_copy(update={"run_id": f"{of_run}.replay-{_stamp()}"})

    def make_plan(store: OutputStore, run_id: str) -> _Plan:
        _finish_replays(store, of_run)
        files = store.list_files(store.path("dead_letters", f"run={of_run}"), ".parquet")
        units = []
        for path in files:
            stem = path.rsplit("/", 1)[-1].removesuffix(".parquet")
            rows = store.read_parquet(path, columns=["id"]).num_rows
            # The name depends only on the file replayed, so a replay interrupted and run again
            # overwrites what it wrote instead of adding to it.
            units.append(WorkUnit(store.full_uri(path), "dead_letters", 0, rows, name=f"{stem}.r"))
        if not files and store.read_json_or_none(store.report_file(of_run)) is None:
            raise ConfigError(f"no run {of_run!r} at {store.uri}")
        return _Plan("replay", None, units, [], None, replay_of=of_run)

    def finish(store: OutputStore, run_id: str, plan: _Plan, stats: list[UnitStats]) -> None:
        _finish_replays(store, of_run)

    return _run(config, "replay", make_plan, results_run_id=lambda run_id, plan: of_run, after_commit=finish)


def _finish_replays(store: OutputStore, of_run: str) -> None:
    """Deletes dead-letter files whose rows a replay has re-committed (idempotent)."""
    state_root = store.path("_raypipe", "runs")
    try:
        run_dirs = store.fs.ls(state_root, detail=False)
    except FileNotFoundError:
        return
    prefix = f"{of_run}.replay-"
    for run_dir in run_dirs:
        if not run_dir.rsplit("/", 1)[-1].startswith(prefix):
            continue
        for marker in store.list_files(f"{run_dir}/units", ".json"):
            unit = marker.rsplit("/", 1)[-1].removesuffix(".json")
            source_stem = unit.removesuffix(".r")
            store.delete(store.dead_letter_file(of_run, source_stem))

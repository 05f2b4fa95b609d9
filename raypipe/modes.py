"""Run modes: backfill, daily delta and replay, over one shared run protocol.

Every run, whatever its mode:
1. returns at once if the run id is already committed (its report is read back);
2. checks the model service (labels, version, limits) before reading any data;
3. refuses an output whose store ignores conditional writes, then takes the output lease
   (`raypipe.lease`): a live lease of the same run id is waited out (or taken with `force`),
   and every later write of the run checks the lease's fence first;
4. plans its units once and stores the plan, so a restart with the same run id does the same
   units, and skips those already committed (`raypipe.sinks`);
5. streams the rest through the pipeline, logging progress; if the service stays down the
   run stops with `CircuitOpenError`, its rows still to do;
6. redoes any unit a fenced-off attempt committed after this one took the lease;
7. folds every committed unit's summary into the report (streamed, O(actors) memory), writes
   `runs/<run_id>.json`, and, when every unit is committed and no shard was bad, marks the run
   committed and moves the watermark forward (never backwards).

A daily run selects rows with `watermark < updated_at <= until` (`until` defaults to the time
the run was planned); row groups and Hive partitions outside the window are never read. A
backfill records what its input was read as of (the latest `updated_at` in the footers, else
its planning time), so the first daily after it infers only the delta. A replay re-infers a
snapshot of a run's dead-letter files into that run's results, rewriting each dead-letter file
to the rows that still fail in the same unit commit.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from raypipe.actor import ActorSettings
from raypipe.client import check_service
from raypipe.config import ClientConfig, PipelineConfig
from raypipe.errors import ConfigError, LeaseLostError, RaypipeError
from raypipe.lease import Lease
from raypipe.metrics import RunMetrics
from raypipe.pipeline import run_units
from raypipe.progress import Progress
from raypipe.report import RunReport, UnitStats
from raypipe.sinks import committed_keys, iter_committed, started_units
from raypipe.sources import (
    ColumnNames,
    DeltaWindow,
    PlanObservations,
    WorkUnit,
    list_shards,
    plan_units,
    prune_partitions,
)
from raypipe.store import STATE_DIR, OutputStore

__all__ = ["backfill", "daily", "gc", "replay", "replay_run_id"]

COMMITTED = "COMMITTED.json"

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
    observations: dict[str, Any] | None = None
    """What planning saw in the footers (`PlanObservations`), and a backfill's `read_as_of`."""

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
            "observations": self.observations,
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
            d.get("observations"),
        )


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING, log_to_driver=False)


def _columns(config: PipelineConfig) -> ColumnNames:
    assert config.input is not None
    return ColumnNames(config.input.id_column, config.input.text_column, config.input.updated_at_column)


def _raypipe_error(e: BaseException) -> BaseException:
    """The raypipe error behind a Ray task failure (Ray wraps what an actor raised), else `e`."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, RaypipeError):
            return cur
        todo += [cur.__cause__, cur.__context__, getattr(cur, "cause", None)]
    return e


def _tally_skipped(units: Iterator[UnitStats], before: set[str], report: RunReport) -> Iterator[UnitStats]:
    """Passes summaries through, counting the rows of units an earlier attempt committed: the
    markers are read once, for the report's totals and this figure alike."""
    for u in units:
        if u.unit in before:
            report.rows_skipped_committed += u.rows
        yield u


def _committed(store: OutputStore, run_id: str) -> RunReport | None:
    if store.read_json_or_none(store.run_state(run_id, COMMITTED)) is None:
        return None
    stored = store.read_json_or_none(store.report_file(run_id))
    report = RunReport.from_dict(stored) if stored else RunReport(run_id=run_id, mode="?", status="completed")
    logger.info("run %s is already committed: nothing to do (report %s)", run_id, store.report_file(run_id))
    return report


def _run(
    config: PipelineConfig,
    mode: str,
    make_plan: Callable[[OutputStore, str], _Plan],
    results_run_id: Callable[[str, _Plan], str] = lambda run_id, plan: run_id,
    after_commit: Callable[[OutputStore, str, _Plan, Lease], None] | None = None,
    replaces: Callable[[_Plan], dict[str, str] | None] = lambda plan: None,
) -> RunReport:
    store = OutputStore(config.output.uri)
    run_id = config.run_id or f"{mode}-{_stamp()}"
    done = _committed(store, run_id)
    if done is not None:
        return done
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
    if config.output.require_conditional_writes:
        lease.check_conditional_writes()
    lease.acquire(force=config.output.take_over_lease)
    run_metrics = RunMetrics.start(config.metrics, report, app=config.service.application)
    write_report = True
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
            logger.info(
                "resuming run %s (lease generation %d): %d planned units", run_id, lease.generation, len(plan.units)
            )
            if stored.get("model_version") not in (None, version):
                logger.warning(
                    "run %s was started with model %s and resumes with %s: its rows will carry both versions",
                    run_id,
                    stored["model_version"],
                    version,
                )
            if plan.bad_shards and config.input is not None:
                plan = _retry_bad_shards(config, plan)
                lease.check()
                store.write_json(plan_path, {**plan.to_dict(), "model_version": stored.get("model_version")})
        else:
            plan = make_plan(store, run_id)
            lease.check()
            store.write_json(plan_path, {**plan.to_dict(), "model_version": version})
        report.input, report.bad_shards, report.replay_of = plan.input, plan.bad_shards, plan.replay_of
        report.planning = plan.observations
        if plan.window is not None:
            report.window = {"after": _iso(plan.window.after), "until": _iso(plan.window.until)}
        report.units_total = len(plan.units)

        before = committed_keys(store, run_id)
        started = started_units(store, run_id)
        todo = [u for u in plan.units if u.key not in before]
        redone = {u.key for u in todo if u.key in started}
        report.units_skipped_committed = len(plan.units) - len(todo)
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
            fence=lease.fence,
            replaces=replaces(plan),
            metrics=run_metrics.spec,
        )
        bad = list(plan.bad_shards)
        ours: set[str] = set()
        rows_this_attempt = 0
        while todo:
            _ensure_ray()
            progress = Progress(
                len(todo),
                sum(u.expected_rows or 0 for u in todo) or None,
                config.progress_interval_s,
                metrics=run_metrics.metrics,
            )
            units_by_key = {u.key: u for u in todo}
            try:
                for outcome in run_units(
                    todo,
                    columns=_columns(config) if config.input else ColumnNames(),
                    window=plan.window,
                    on_bad_shard=config.input.on_bad_shard if config.input else "fail",
                    settings=settings,
                    actors=config.actors,
                ):
                    if lease.lost:
                        lease.check()  # raises: a newer attempt took over
                    progress.update(outcome.stats)
                    if outcome.error is not None:
                        unit = units_by_key[outcome.unit]
                        bad.append({"shard": unit.shard, "format": unit.format, "error": outcome.error})
                    if outcome.stats is not None:
                        ours.add(outcome.unit)
                        rows_this_attempt += outcome.stats.rows
                        if outcome.unit in redone:
                            report.units_redone += 1
                            report.rows_redone += outcome.stats.rows
            except Exception as e:
                cause = _raypipe_error(e)
                if cause is e:
                    raise
                raise cause from e
            # Markers this attempt did not write, that were not there when it started: a fenced-off
            # attempt wrote them after losing the lease. Its files may mix with ours: redo them.
            zombies = committed_keys(store, run_id) - before - ours
            todo = [u for u in plan.units if u.key in zombies]
            if todo:
                logger.warning("%d unit(s) were committed by a fenced-off attempt: redoing them", len(todo))
        report.bad_shards = bad
        report.rows_this_attempt = rows_this_attempt

        committed = committed_keys(store, run_id)
        report.merge_units(_tally_skipped(iter_committed(store, run_id, committed), before, report))
        complete = all(u.key in committed for u in plan.units)
        report.status = "completed" if complete and not bad else "incomplete"
        if complete and not bad:
            lease.check()
            if after_commit is not None:
                after_commit(store, run_id, plan, lease)
            store.write_json(store.run_state(run_id, COMMITTED), {"run_id": run_id, "at": _iso(datetime.now(UTC))})
    except LeaseLostError:
        write_report = False  # the attempt that fenced us off owns the report now
        raise
    except BaseException as e:
        report.status = "failed"
        report.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        report.finished_at = datetime.now(UTC).isoformat()
        report.wall_s = round(time.monotonic() - t0, 3)
        report.throughput_rows_per_s = round(report.rows_this_attempt / report.wall_s, 2) if report.wall_s else 0.0
        run_metrics.finish(report)
        try:
            if write_report and not lease.lost:
                store.write_json(store.report_file(run_id), report.to_dict())
        finally:
            lease.release()
    return report


def _input_plan(config: PipelineConfig, mode: str, window: DeltaWindow | None) -> _Plan:
    if config.input is None:
        raise ConfigError(f"a {mode} run needs input.uri")
    shards = list_shards(config.input.uri, format=config.input.format)
    seen = PlanObservations()
    if window is not None and config.input.updated_at_partition:
        shards = prune_partitions(shards, config.input.updated_at_partition, window, seen)
    units, bad = plan_units(
        shards,
        unit_rows=config.input.unit_rows,
        columns=_columns(config),
        need_updated_at=window is not None,
        on_bad_shard=config.input.on_bad_shard,
        window=window,
        observations=seen,
    )
    logger.info(
        "planned %d units over %d shards (%d bad; %d row groups and %d shards pruned by the window)",
        len(units),
        len(shards),
        len(bad),
        seen.row_groups_pruned,
        seen.shards_pruned,
    )
    observations = seen.to_dict()
    if mode == "backfill":
        # What a daily after this backfill may start from: the input as it was read.
        observations["read_as_of"] = observations["max_updated_at"] or _iso(datetime.now(UTC))
    return _Plan(mode, config.input.uri, units, bad, window, observations=observations)


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
        window=plan.window,
    )
    if units:
        logger.info("%d shard(s) recorded as bad are readable now: %d units added", len(shards) - len(bad), len(units))
    return _Plan(plan.mode, plan.input, plan.units + units, bad, plan.window, plan.replay_of, plan.observations)


WATERMARK = "watermark.json"


def _advance_watermark(store: OutputStore, lease: Lease, to: datetime, run_id: str) -> None:
    """Moves the daily watermark to `to`, never backwards (an older run finishing late keeps it)."""
    mark = store.read_json_or_none(store.state(WATERMARK))
    current = _parse(mark["updated_at"]) if mark else None
    if current is not None and to <= current:
        logger.info("watermark stays at %s (this run reached %s)", current.isoformat(), to.isoformat())
        return
    lease.check()
    store.write_json(store.state(WATERMARK), {"updated_at": _iso(to), "run_id": run_id})
    logger.info("watermark advanced to %s", to.isoformat())


def backfill(config: PipelineConfig) -> RunReport:
    """Infers every row of the input; resumable by run id.

    Once complete, it moves the daily watermark to the point its input was read as of.
    """

    def advance(store: OutputStore, run_id: str, plan: _Plan, lease: Lease) -> None:
        as_of = _parse((plan.observations or {}).get("read_as_of"))
        if as_of is not None:
            _advance_watermark(store, lease, as_of, run_id)

    return _run(config, "backfill", lambda store, run_id: _input_plan(config, "backfill", None), after_commit=advance)


def daily(config: PipelineConfig, *, until: datetime | None = None) -> RunReport:
    """Infers rows new or changed since the watermark, as a new partition.

    The watermark moves only when every unit is committed and every shard was read.
    """

    def make_plan(store: OutputStore, run_id: str) -> _Plan:
        mark = store.read_json_or_none(store.state(WATERMARK))
        after = _parse(mark["updated_at"]) if mark else None
        end = until or datetime.now(UTC)
        if end.tzinfo is None:
            raise ConfigError("daily: `until` must be timezone-aware")
        if after is not None and end <= after:
            raise ConfigError(f"daily: until {end.isoformat()} is not after the watermark {after.isoformat()}")
        return _input_plan(config, "daily", DeltaWindow(after, end))

    def advance(store: OutputStore, run_id: str, plan: _Plan, lease: Lease) -> None:
        assert plan.window is not None
        _advance_watermark(store, lease, plan.window.until, run_id)

    return _run(config, "daily", make_plan, after_commit=advance)


def replay_run_id(store: OutputStore, of_run: str) -> str:
    """The replay to run for `of_run`: the latest unfinished one (to resume it), else a new one."""
    runs = store.path(STATE_DIR, "runs")
    try:
        store.fs.invalidate_cache(runs)
        names = [p.rsplit("/", 1)[-1] for p in store.fs.ls(runs, detail=False)]
    except FileNotFoundError:
        names = []
    prefix = f"{of_run}.replay-"
    numbers = sorted(int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit())
    if numbers and store.read_json_or_none(store.run_state(f"{prefix}{numbers[-1]}", COMMITTED)) is None:
        return f"{prefix}{numbers[-1]}"
    return f"{prefix}{(numbers[-1] + 1) if numbers else 1}"


def replay(config: PipelineConfig, *, of_run: str) -> RunReport:
    """Re-infers run `of_run`'s dead letters and merges the answers into its results.

    Its run id defaults to `<of_run>.replay-<n>`: the latest unfinished replay of that run is
    resumed, else a new one starts. It snapshots the dead-letter files when planned, infers
    from the snapshots, and commits each unit as: the recovered rows into
    `results/run=<of_run>/<file>.r<n>.parquet`, then the dead-letter file rewritten to the rows
    that still fail, then the marker.
    """
    store = OutputStore(config.output.uri)
    if config.run_id is None:
        config = config.model_copy(update={"run_id": replay_run_id(store, of_run)})
    assert config.run_id is not None
    number = config.run_id.rsplit("-", 1)[-1]
    suffix = f".r{number}" if number.isdigit() else f".{config.run_id}"

    def make_plan(store: OutputStore, run_id: str) -> _Plan:
        files = store.list_files(store.path("dead_letters", f"run={of_run}"), ".parquet")
        if not files and store.read_json_or_none(store.report_file(of_run)) is None:
            raise ConfigError(f"no run {of_run!r} at {store.uri}")
        units = []
        for path in files:
            stem = path.rsplit("/", 1)[-1].removesuffix(".parquet")
            snapshot = store.run_state(run_id, "inputs", f"{stem}.parquet")
            store.write_bytes(snapshot, store.read_bytes(path))
            rows = store.read_parquet(snapshot, columns=["id"]).num_rows
            units.append(WorkUnit(store.full_uri(snapshot), "dead_letters", 0, rows, name=f"{stem}{suffix}"))
        return _Plan("replay", None, units, [], None, replay_of=of_run)

    def sources(plan: _Plan) -> dict[str, str]:
        return {u.key: u.key.removesuffix(suffix) for u in plan.units}

    return _run(config, "replay", make_plan, results_run_id=lambda run_id, plan: of_run, replaces=sources)


def gc(output: str, *, older_than_days: float = 7.0, now: datetime | None = None) -> dict[str, int]:
    """Removes the unit state (markers, snapshots, plans) of runs committed more than
    `older_than_days` ago; their reports (`runs/<id>.json`) and `COMMITTED.json` stay, so a
    rerun of such a run id still does nothing. Unfinished runs are never touched."""
    store = OutputStore(output)
    limit = (now or datetime.now(UTC)).timestamp() - older_than_days * 86400
    removed = {"runs": 0, "files": 0}
    try:
        store.fs.invalidate_cache(store.path(STATE_DIR, "runs"))
        run_dirs = store.fs.ls(store.path(STATE_DIR, "runs"), detail=False)
    except FileNotFoundError:
        return removed
    for run_dir in run_dirs:
        run_id = run_dir.rsplit("/", 1)[-1]
        mark = store.read_json_or_none(store.run_state(run_id, COMMITTED))
        at = _parse(mark.get("at")) if mark else None
        if at is None or at.timestamp() > limit:
            continue
        doomed = [p for sub in ("units", "started", "inputs") for p in store.list_files(store.run_state(run_id, sub))]
        doomed += [store.run_state(run_id, "plan.json")]
        for path in doomed:
            store.delete(path)
        removed["runs"] += 1
        removed["files"] += len(doomed)
    return removed

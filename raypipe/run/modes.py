"""Run modes: backfill, daily delta and replay, over one shared run protocol.

A run calls its state's owner (`raypipe.run.state.RunState`: lease, plan, report) and its
commit protocol (`raypipe.commit.protocol.CommitProtocol`: the table) once per step:
1. `committed_report`: a run id already committed (`CommitProtocol.is_committed`, the one
   truth) returns at once, with its stored report;
2. the model service is checked (labels, version, limits) before any data is read;
3. `begin`: the output lease (one run id at a time; a live attempt of the same run id is
   waited out, or taken over with `force`), then `CommitProtocol.setup_run`: the table made
   ready and the takeover commit that fences every earlier attempt of this run id off;
4. `plan`: the units, planned once and stored (fenced), so a restart does the same units;
   `pending`: those the protocol does not find committed;
5. the pipeline streams them through the actors, which commit each unit through the
   protocol's `UnitCommitter` (results and dead letters in one Delta commit); if the service
   stays down the run stops with `CircuitOpenError`, its rows still to do;
6. the files read recorded (fenced), `CommitProtocol.commit_run` when every unit is committed,
   the watermark moved forward (never backwards); on a failure, `CommitProtocol.abort`
   instead, so nothing of this attempt lands after its report;
7. the report: row counts from the table's committed rows, the calls of every attempt,
   written to `runs/<run_id>.json`.

A daily reads the input files no run has read whole yet (new files, and files whose size or
ETag changed), whole, whatever their rows' `updated_at`: it selects by the files seen
(`RunState.files_seen`), not by a watermark. A file rewritten in place is read for its rows
updated at or after the latest `updated_at` read of it before (rows at that instant are
re-read and answered from the table by reuse); `--since` also re-reads the files read
before, for their rows updated after it. A backfill records what its input was read as of
(the latest `updated_at` in the footers, else its planning time): the watermark, which is
informational and never moves backwards. A replay re-infers a run's committed dead letters
and replaces them, in the same commit, with what they became.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc

from raypipe.call.actor import ActorSettings
from raypipe.call.client import ChannelSecurity, check_service
from raypipe.call.dedup import build_index
from raypipe.call.metrics import RunMetrics
from raypipe.commit.outcomes import Ledger
from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.table import OutcomeTable
from raypipe.config import ClientConfig, InputConfig, PipelineConfig
from raypipe.errors import CircuitOpenError, ConfigError, LeaseLostError, RaypipeError, RunStopped
from raypipe.plan.inputs import columns_of, on_bad_shard, plan_input, replan, with_whole_file_maxima
from raypipe.plan.plan import Plan
from raypipe.plan.units import ColumnNames, WorkUnit
from raypipe.report import AttemptStats, RunReport
from raypipe.run.cost import CpuMeter
from raypipe.run.pipeline import run_units
from raypipe.run.progress import Progress
from raypipe.run.state import RunState
from raypipe.store import STATE_DIR, OutputStore
from raypipe.tally import fold_tallies, read_tallies

__all__ = ["backfill", "daily", "replay", "replay_run_id"]

logger = logging.getLogger("raypipe")


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init` as raypipe's drivers want it: quiet, and the raypipe logging set up.

    Without RAY_ADDRESS, `ray.init` starts a local cluster with token authentication on (Ray's
    default, which raypipe keeps) and logs a WARNING that it did; that one line is dropped,
    any other (token authentication *disabled*, say) still shows.
    """
    import ray

    auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth_logger.addFilter(_drop_token_auth_enabled)
    on_sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        ray.init(**{"logging_level": logging.WARNING, "log_to_driver": False, **init_kwargs})
    finally:
        auth_logger.removeFilter(_drop_token_auth_enabled)
        if isinstance(on_sigterm, _StopOnSigterm):
            signal.signal(signal.SIGTERM, on_sigterm)  # `ray.init` sets its own (`sys.exit`); a run's stays
    quiet_ray_loggers()


class _StopOnSigterm:
    """The SIGTERM handler while a run is on: raises `RunStopped` in the driver, once."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            logger.warning("SIGTERM again: the run is already stopping (writing its report)")
            return
        self.stopping = True
        raise RunStopped("stopped by SIGTERM")


@contextlib.contextmanager
def _sigterm_stops_the_run() -> Iterator[None]:
    """SIGTERM (a deleted pod, `ray job stop`, a scheduler's deadline) stops the run as Ctrl-C
    would: `RunStopped` is raised where the driver is, so the run is aborted, writes its failed
    report (with the calls its actors tallied) and releases the output lease. A second SIGTERM
    while it does so is ignored. Only where Python delivers signals (the main thread); the
    previous handler is back once the run returns."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _StopOnSigterm())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _drop_token_auth_enabled(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def quiet_ray_loggers() -> None:
    """Serve's and Ray Data's INFO lines (execution plans, controller namespaces, per-operator
    progress every few seconds when stderr is no terminal) narrate their internals; raypipe's
    own progress line shows rows, rate, ETA and dead letters. Their warnings and errors stay."""
    from ray.data import DataContext

    for name in ("ray.serve", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray Data warns once that its bars are off: not news here.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    DataContext.get_current().enable_progress_bars = False


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        start_local_ray()


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


def _fatal_error(fatal: str) -> RaypipeError:
    """The typed error an actor reported (`raypipe.call.actor.SUMMARY_SCHEMA`'s `fatal`)."""
    d = json.loads(fatal)
    if d["kind"] == "lease_lost":
        return LeaseLostError(d["message"], holder="?", expires_at="?")
    if d["kind"] == ConfigError.kind:
        return ConfigError(d["message"])
    return CircuitOpenError(d["message"], waited_s=d.get("waited_s", 0.0), retry_after_s=d.get("retry_after_s", 0.0))


def _quiet(run: Callable[..., RunReport]) -> Callable[..., RunReport]:
    """Runs `run` with the known native noise off fd 2 (`protos.quiet`): also for notebook and
    script users of the API, whose cells would otherwise show Ray Data's actor-args ERROR."""

    @functools.wraps(run)
    def quiet(*args: Any, **kwargs: Any) -> RunReport:
        from protos.quiet import filtered_stderr

        with filtered_stderr():
            return run(*args, **kwargs)

    return quiet


@_quiet
@_sigterm_stops_the_run()
def _run(
    config: PipelineConfig,
    mode: str,
    make_plan: Callable[[RunState], Plan],
    *,
    results_run_id: Callable[[str, Plan], str] = lambda run_id, plan: run_id,
    watermark_to: Callable[[Plan], datetime | None] = lambda plan: None,
) -> RunReport:
    # A default id names a new run: two runs started in the same second must not share one (the
    # second would find the first committed and do nothing).
    run_id = config.run_id or f"{mode}-{_stamp()}-{uuid.uuid4().hex[:6]}"
    state = RunState(config, mode, run_id)
    protocol = state.protocol
    done = state.committed_report()
    if done is not None:
        return done
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    report = RunReport(run_id=run_id, mode=mode, output=config.output.uri, started_at=started_at.isoformat())

    info = check_service(
        config.service.address,
        application=config.service.application,
        timeout_s=config.service.connect_timeout_s,
        security=ChannelSecurity.of(config.service),
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

    fence = state.begin(tuple(labels))
    plan: Plan | None = None
    run_metrics = RunMetrics.start(config.metrics, report, app=config.service.application)
    attempt = AttemptStats(attempt=state.attempt)
    meter: CpuMeter | None = None  # what the run costs, from its first unit on (`raypipe.run.cost`)
    write_report = True
    try:
        input_uri = config.input.uri if config.input else None
        plan, resumed = state.plan(lambda: make_plan(state), input_uri=input_uri, model_version=version)
        if resumed and config.input is not None and (plan.bad_shards or any(u.planned_whole for u in plan.units)):
            plan = replan(config.input, plan, state.pending(plan))
            state.save_plan(plan)
        report.input, report.bad_shards, report.replay_of = plan.input, plan.bad_shards, plan.replay_of
        report.planning = {
            k: v for k, v in (plan.observations or {}).items() if k not in ("skipped_files", "shard_max")
        }
        report.skipped_files = list((plan.observations or {}).get("skipped_files") or [])
        if plan.window is not None:
            report.window = {"after": _iso(plan.window.after), "until": _iso(plan.window.until)}
        report.units_total = len(plan.units)

        todo = state.pending(plan)
        report.units_skipped_committed = len(plan.units) - len(todo)
        logger.info(
            "run %s (generation %d): %d units to do, %d already committed",
            run_id,
            fence.generation,
            len(todo),
            report.units_skipped_committed,
        )
        text_index: Any = None
        if todo and config.dedup.enabled:
            # Ray first: the index is built by Ray tasks into the object store (shards by hash
            # range), so the driver holds references, not 33 bytes per committed text.
            _ensure_ray()
            index, index_stats = build_index(
                config.output.uri, version, tuple(labels), max_rows=config.dedup.max_index_rows
            )
            # Under planning until the report has a field of its own: a capped index is never silent.
            report.planning = {**(report.planning or {}), "reuse_index": index_stats.to_dict()}
            if index is not None:
                _ensure_ray()
                import ray

                text_index = ray.put(index)  # once: every actor maps it from the object store
        settings = ActorSettings(
            fence=fence,
            text_index=text_index,
            run_id=results_run_id(run_id, plan),
            attempt=state.attempt,
            service=config.service,
            client=client_cfg,
            labels=tuple(labels),
            replay=plan.mode == "replay",
            metrics=run_metrics.spec,
        )
        bad = list(plan.bad_shards)
        committed_now: set[str] = set()
        if todo:
            _ensure_ray()
            meter = CpuMeter.start()
            progress = Progress(
                len(todo),
                None if any(u.expected_rows is None for u in todo) else sum(u.expected_rows or 0 for u in todo),
                config.progress_interval_s,
                metrics=run_metrics.metrics,
            )
            units_by_key = {u.key: u for u in todo}
            answered = 0
            try:
                for outcome in run_units(
                    todo,
                    columns=columns_of(config.input) if config.input else ColumnNames(),
                    on_bad_shard=on_bad_shard(config.input, mode) if config.input else "fail",
                    settings=settings,
                    actors=config.actors,
                ):
                    if outcome.stats is not None:
                        attempt.add(outcome.stats)
                    if outcome.fatal is not None:
                        raise _fatal_error(outcome.fatal)
                    if state.lease.lost:
                        state.lease.check()  # raises: the lease could not be renewed in time
                    progress.update(outcome.stats)
                    if outcome.error is not None:
                        unit = units_by_key[outcome.unit]
                        bad.append({"shard": unit.shard, "format": unit.format, "error": outcome.error})
                    elif outcome.stats is not None:
                        committed_now.add(outcome.unit)
                        report.rows_this_attempt += outcome.stats.rows
                    answered += 1
                    if answered == len(todo) and meter is not None:
                        meter.stop()  # before Ray Data tears its actors down: their CPU is still there to read
            except RaypipeError:
                raise
            except Exception as e:
                cause = _raypipe_error(e)
                if cause is e:
                    raise
                raise cause from e
        report.bad_shards = bad
        done_units = {u.key for u in plan.units} - {u.key for u in todo} | committed_now
        report.units_committed = len(done_units)
        complete = len(done_units) == len(plan.units)
        report.status = "completed" if complete and not bad else "incomplete"
        if plan.mode != "replay" and config.input is not None:
            plan = with_whole_file_maxima(
                plan,
                done_units,
                config.input.max_future_skew_s,
                lambda: state.table.max_updated_at_by_unit(state.run_id),
            )
            state.record_files_seen(dataclasses.replace(plan, bad_shards=bad), done_units)
        if complete and not bad:
            protocol.commit_run()
            mark = watermark_to(plan)
            if mark is not None:
                state.advance_watermark(mark)
    except LeaseLostError:
        write_report = False  # the attempt that fenced us off owns the report now
        raise
    except BaseException as e:
        report.status = "failed"
        report.error = f"{type(e).__name__}: {e}"
        _abort(protocol)
        raise
    finally:
        report.finished_at = datetime.now(UTC).isoformat()
        report.wall_s = round(time.monotonic() - t0, 3)
        report.throughput_rows_per_s = round(report.rows_this_attempt / report.wall_s, 2) if report.wall_s else 0.0
        if meter is not None:
            cost = meter.finish(
                paragraphs=report.rows_this_attempt, model_cpu_s=attempt.model_cpu_s, core_hour_usd=config.core_hour_usd
            )
            report.cost = None if cost is None else cost.to_dict()
        try:
            if write_report:
                attempt = _fold_report(state, report, attempt, plan=plan)
            run_metrics.finish(report)
            if write_report and not state.lease.lost:
                state.save_attempt(attempt)
                state.write_report(report)
        finally:
            state.release()
    return report


def _abort(protocol: CommitProtocol) -> None:
    """Fences off this attempt's own writers, so the report the driver writes next is final."""
    try:
        if protocol.abort():
            logger.info("run %s: this attempt is fenced off; its actors commit nothing more", protocol.run_id)
    except Exception as e:  # the table unreachable: the next attempt's take-over fences us anyway
        logger.warning("run %s: could not fence this attempt off: %s", protocol.run_id, e)


def _fold_report(state: RunState, report: RunReport, attempt: AttemptStats, *, plan: Plan | None) -> AttemptStats:
    """The report's figures: rows from the table (committed only), calls from every attempt.

    An attempt's calls are its unit summaries', or its actors' own tallies where those count
    more (`raypipe.tally`: a run stopped with units in flight; an attempt whose driver died
    before saving its statistics has only those). Returns this attempt's statistics so folded.

    A replay's rows replace another run's dead letters: its rows are what the dead letters of
    its committed units became (`RunState.replay_ledger`, from the table, so an attempt killed
    after committing counts too); for a plan stored without its table version, what its
    attempts reported committing."""
    tallies = read_tallies(state.store, state.run_id)
    earlier = state.earlier_attempts()
    saved = {a.attempt for a in earlier} | {attempt.attempt}
    unsaved = [AttemptStats(attempt=a) for a in sorted(tallies) if a not in saved]
    attempts = [fold_tallies(a, tallies.get(a.attempt, ())) for a in [*earlier, *unsaved, attempt]]
    attempt = attempts[-1]
    report.fold_attempts(attempts)
    if state.mode == "replay":
        replayed = state.replay_ledger(plan) if plan is not None else None
        if replayed is None:
            counts: Counter[str] = Counter()
            for a in attempts:
                counts.update(a.ledger())
            replayed = Ledger(counts)
        report.apply_ledger(dict(replayed))
    else:
        report.apply_ledger(state.ledger())
    report.rows_skipped_committed = max(0, report.rows_in - report.rows_this_attempt)
    return attempt


def _input(config: PipelineConfig, mode: str) -> InputConfig:
    if config.input is None:
        raise ConfigError(f"a {mode} run needs input.uri")
    return config.input


def backfill(config: PipelineConfig) -> RunReport:
    """Infers every row of the input; resumable by run id.

    Once complete, the files it read are recorded as seen (a daily after it reads only new and
    changed files) and the watermark moves to the point its input was read as of.
    """
    return _run(
        config,
        "backfill",
        lambda state: plan_input(_input(config, "backfill"), "backfill", state),
        watermark_to=lambda plan: _parse((plan.observations or {}).get("read_as_of")),
    )


def daily(config: PipelineConfig, *, since: datetime | None = None) -> RunReport:
    """Infers every row of the input files no run has read whole yet (new files, and files
    whose size or ETag changed), whatever their `updated_at`: late files are not lost.

    `since` also re-reads the files already read, for their rows updated after it (a rerun
    over an earlier window). Files of bad shards are retried by every daily until they read
    or are quarantined; the healthy ones are recorded as read and not read again.
    """
    if since is not None and since.tzinfo is None:
        raise ConfigError("daily: `since` must be timezone-aware")
    return _run(
        config,
        "daily",
        lambda state: plan_input(_input(config, "daily"), "daily", state, since=since),
        watermark_to=lambda plan: _parse((plan.observations or {}).get("read_as_of")),
    )


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
    if numbers and not OutcomeTable(store.uri).is_committed(f"{prefix}{numbers[-1]}"):
        return f"{prefix}{numbers[-1]}"
    return f"{prefix}{(numbers[-1] + 1) if numbers else 1}"


def replay(config: PipelineConfig, *, of_run: str) -> RunReport:
    """Re-infers run `of_run`'s committed dead letters; each unit's commit replaces them with
    what they became (results, or dead letters again), so an id is never in both sets.

    Its run id defaults to `<of_run>.replay-<n>`: the latest unfinished replay of that run is
    resumed, else a new one starts. A resumed replay reads the dead letters still committed,
    so rows already replayed are not sent again.
    """
    store = OutputStore(config.output.uri)
    if config.run_id is None:
        config = config.model_copy(update={"run_id": replay_run_id(store, of_run)})
    assert config.run_id is not None

    def make_plan(state: RunState) -> Plan:
        table = OutcomeTable(config.output.uri)
        if not table.exists():
            raise ConfigError(f"no run {of_run!r} at {config.output.uri}")
        version = table.load().version()  # what the report's rows are counted against
        rows = (
            table.load_version(version)
            .to_pyarrow_dataset()
            .to_table(filter=pc.field("run_id") == of_run, columns=["unit", "outcome"])
        )
        if rows.num_rows == 0 and store.read_json_or_none(store.report_file(of_run)) is None:
            raise ConfigError(f"no run {of_run!r} at {config.output.uri}")
        dead = rows.filter(pc.equal(rows.column("outcome"), "dead_letter"))
        counts = Counter(dead.column("unit").to_pylist())
        units = [
            WorkUnit(config.output.uri, "dead_letters", 0, n, name=u, source_run=of_run)
            for u, n in sorted(counts.items())
        ]
        return Plan("replay", None, units, [], None, replay_of=of_run, observations={"table_version": version})

    return _run(config, "replay", make_plan, results_run_id=lambda run_id, plan: of_run)

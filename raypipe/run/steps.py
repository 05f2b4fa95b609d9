"""A run's steps, one object each, in the order `raypipe.run.modes` calls them:

    committed_report(protocol)          a run id committed already: its report (nothing to do)
    ModelService.ask(service, client)   the service's labels, version and limits (nothing written)
    PlanRun(...).plan                   the stored plan or a new one; the units still to do
    ExecuteRun(...).execute             the units through the actors, who commit each one
    CommitRun(...).commit / .abort      files seen, the run's commit, the watermark; or abort
    ReportRun(...).write                the report: rows from the table, calls of every attempt

Each takes the part of the config it needs (an `InputConfig`, a `ServiceConfig`, ...), never
the whole `PipelineConfig`, and the run's `CommitProtocol` for what it does on the output.
Setting up the commit (lease, table ready, take-over) is `CommitProtocol.setup_run`, between
the service check and the plan; the order of the protocol's calls is told in
`raypipe.commit.protocol`, the fence in `raypipe.commit.fence`. After planning, what a step
needs of the input (its columns, the bad-shard policy) comes with the `Plan`.

Over ~440 lines, kept whole on purpose: one job, a run's steps, which read here in the order a
run takes them; each step is a small class, and split apart they would be read out of order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from raypipe.call.actor import ActorSettings
from raypipe.call.client import ChannelSecurity, check_service
from raypipe.call.metrics import RunMetrics
from raypipe.call.reuse import build_index
from raypipe.commit.outcomes import Ledger
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import ActorPoolConfig, ClientConfig, DedupConfig, InputConfig, ServiceConfig
from raypipe.errors import CircuitOpenError, ConfigError, LeaseLostError, RaypipeError
from raypipe.plan.planning import Plan, resume
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats, RunReport, UnitStats
from raypipe.run.cost import CpuMeter
from raypipe.run.driver import ensure_ray
from raypipe.run.pipeline import UnitResult, run_units
from raypipe.run.progress import Progress
from raypipe.tally import fold_tallies, read_tallies

__all__ = [
    "CommitRun",
    "ExecuteRun",
    "ExecuteSettings",
    "Executed",
    "ModelService",
    "PlanRun",
    "ReportRun",
    "committed_report",
]

logger = logging.getLogger("raypipe")


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


# -- the model service ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelService:
    """What the model service serves: its labels and model version, and the client settings
    fitted to its limits (a micro-batch no larger than its maximum batch)."""

    labels: tuple[str, ...]
    version: str
    client: ClientConfig

    @classmethod
    def ask(cls, service: ServiceConfig, client: ClientConfig) -> ModelService:
        """Asks the service (before any data is read); raises `ServiceUnavailable` if it does not answer."""
        info = check_service(
            service.address,
            application=service.application,
            timeout_s=service.connect_timeout_s,
            security=ChannelSecurity.of(service),
        )
        max_batch = info.max_batch_size
        if max_batch and client.micro_batch_size > max_batch:
            logger.warning(
                "micro_batch_size %d is over the server's maximum %d: using %d",
                client.micro_batch_size,
                max_batch,
                max_batch,
            )
            client = ClientConfig.model_validate({**client.model_dump(), "micro_batch_size": max_batch})
        return cls(tuple(info.labels), info.model_version, client)


# -- 1. plan the run -------------------------------------------------------------------------------
class PlanRun:
    """The run's plan, stored at its first start and read back on every later one (a resumed
    run brings its bad shards and whole-file units up to date with the input); the units the
    table does not hold committed yet. Runs after the take-over, so "committed" is final."""

    def __init__(
        self, protocol: CommitProtocol, input: InputConfig | None, make_plan: Callable[[CommitProtocol], Plan]
    ) -> None:
        self.protocol = protocol
        self.input = input
        self.make_plan = make_plan

    def plan(self, model_version: str, report: RunReport) -> tuple[Plan, list[WorkUnit]]:
        protocol, input = self.protocol, self.input
        plan, resumed = protocol.plan(
            lambda: self.make_plan(protocol), input_uri=input.uri if input else None, model_version=model_version
        )
        done = protocol.committed_units(plan)  # read once: a resumed plan's new units are not among them
        if resumed and input is not None:
            plan, changed = resume(input, plan, done, quarantined=protocol.quarantined())
            if changed:
                protocol.save_plan(plan)
        report.input, report.bad_shards, report.replay_of = plan.input, plan.bad_shards, plan.replay_of
        observations = plan.observations or {}
        report.planning = {k: v for k, v in observations.items() if k not in ("skipped_files", "shard_max")}
        report.skipped_files = list(observations.get("skipped_files") or [])
        if plan.window is not None:
            report.window = {"after": _iso(plan.window.after), "until": _iso(plan.window.until)}
        report.units_total = len(plan.units)

        todo = [u for u in plan.units if u.key not in done]
        report.units_skipped_committed = len(plan.units) - len(todo)
        logger.info(
            "run %s (generation %d): %d units to do, %d already committed",
            protocol.run_id,
            protocol.fence.generation,
            len(todo),
            report.units_skipped_committed,
        )
        return plan, todo


# -- 2. execute the pipeline -----------------------------------------------------------------------
@dataclass(frozen=True)
class ExecuteSettings:
    """What executing a run takes from its config."""

    service: ServiceConfig
    actors: ActorPoolConfig
    dedup: DedupConfig
    progress_interval_s: float


@dataclass
class Executed:
    """What executing the units did: the units committed now, and every bad shard so far."""

    committed: set[str]
    bad_shards: list[dict[str, Any]]


@dataclass
class Startup:
    """The report's start-up figures (`RunReport.startup`), in seconds from the attempt's start."""

    started: float
    """Unix time of the attempt's start (the report's `started_at`)."""
    figures: dict[str, float]
    """The report's own `startup` dict, filled in as the run goes."""

    @classmethod
    def begin(cls, report: RunReport) -> Startup:
        """Ray is ready now: the first figure, in a dict the report holds from here on."""
        started = datetime.fromisoformat(report.started_at).timestamp() if report.started_at else time.time()
        report.startup = {"ray_s": round(time.time() - started, 3)}
        return cls(started, report.startup)

    def unit_done(self, stats: UnitStats) -> None:
        self.figures.setdefault("first_unit_s", round(time.time() - self.started, 3))
        if stats.first_call_at is not None:  # actors' clocks: the same host's, or NTP's across nodes
            first = round(max(0.0, stats.first_call_at - self.started), 3)
            self.figures["first_call_s"] = min(self.figures.get("first_call_s", first), first)


class ExecuteRun:
    """Streams the units still to do through the actor pool; the actors commit each unit
    (results and dead letters in one fenced commit). Keeps this attempt's call statistics
    (`attempt`) and what the run cost (`meter`) for the report, also when a unit fails: an
    actor's fatal error (the breaker open, the lease lost) stops the run, raised as the typed
    error it was."""

    def __init__(self, protocol: CommitProtocol, settings: ExecuteSettings, metrics: RunMetrics) -> None:
        self.protocol = protocol
        self.settings = settings
        self.metrics = metrics
        self.attempt = AttemptStats(attempt=protocol.attempt)
        self.meter: CpuMeter | None = None

    runner: Callable[..., Iterator[UnitResult]] = staticmethod(run_units)
    """How the units run: Ray Data's actor pool; `raypipe.run.pipeline.run_units_in_process`
    (chosen by tests of the whole run path) runs them in this process, without Ray."""

    def execute(self, plan: Plan, todo: list[WorkUnit], model: ModelService, *, report: RunReport) -> Executed:
        bad = list(plan.bad_shards)
        committed: set[str] = set()
        if not todo:
            return Executed(committed, bad)
        in_ray = self.runner is run_units
        if in_ray:
            ensure_ray()  # joined or started here: the start-up line counts from the attempt's start
        startup = Startup.begin(report)
        actor_settings = ActorSettings(
            committer=self.protocol.unit_committer(),
            text_index=self._text_index(model, report),
            run_id=plan.rows_run_id(self.protocol.run_id),
            attempt=self.protocol.attempt,
            service=self.settings.service,
            client=model.client,
            labels=model.labels,
            model_version=model.version,
            replay=plan.mode == "replay",
            metrics=self.metrics.spec,
        )
        self.meter = meter = CpuMeter.start() if in_ray else None
        progress = Progress(
            len(todo),
            None if any(u.expected_rows is None for u in todo) else sum(u.expected_rows or 0 for u in todo),
            self.settings.progress_interval_s,
            metrics=self.metrics.metrics,
        )
        units_by_key = {u.key: u for u in todo}
        answered = 0
        try:
            for outcome in self.runner(
                todo,
                columns=plan.columns,
                on_bad_shard=plan.on_bad_shard,
                settings=actor_settings,
                actors=self.settings.actors,
            ):
                if outcome.stats is not None:
                    self.attempt.add(outcome.stats)
                    startup.unit_done(outcome.stats)
                if outcome.fatal is not None:
                    raise _fatal_error(outcome.fatal)
                if self.protocol.lease_lost:
                    self.protocol.check_lease()  # raises: the lease could not be renewed in time
                progress.update(outcome.stats)
                if outcome.error is not None:
                    unit = units_by_key[outcome.unit]
                    bad.append({"shard": unit.shard, "format": unit.format, "error": outcome.error})
                elif outcome.stats is not None:
                    committed.add(outcome.unit)
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
        return Executed(committed, bad)

    def _text_index(self, model: ModelService, report: RunReport) -> Any:
        """The committed answers by text hash, put once into Ray's object store (every actor
        maps it from there); None when reuse is off or the index would pass its cap."""
        if not self.settings.dedup.enabled:
            return None
        # Built by Ray tasks into the object store (shards by hash range; `execute` has joined
        # Ray), so the driver holds references, not 33 bytes per committed text.
        index, index_stats = build_index(
            self.protocol.table, model.version, model.labels, max_rows=self.settings.dedup.max_index_rows
        )
        # Under planning until the report has a field of its own: a capped index is never silent.
        report.planning = {**(report.planning or {}), "reuse_index": index_stats.to_dict()}
        if index is None or self.runner is not run_units:
            return index  # built in this process (Ray is not initialized): handed to the actor as is
        import ray

        return ray.put(index)


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


# -- 3. commit the run, or abort it -------------------------------------------------------------------
class CommitRun:
    """The run's end on its output. `commit`: the files every unit of which is committed are
    recorded as seen (also in an incomplete run: its healthy files are not read again), and a
    complete run is committed (`CommitProtocol.commit_run`) and moves the watermark to what its
    input was read as of (`Plan.read_as_of`; never backwards, never for a replay). `abort`:
    this attempt is fenced off, so nothing of it lands after its report."""

    def __init__(self, protocol: CommitProtocol) -> None:
        self.protocol = protocol

    def commit(self, plan: Plan, todo: list[WorkUnit], executed: Executed, report: RunReport) -> None:
        protocol, bad = self.protocol, executed.bad_shards
        report.bad_shards = bad
        done_units = {u.key for u in plan.units} - {u.key for u in todo} | executed.committed
        report.units_committed = len(done_units)
        complete = len(done_units) == len(plan.units)
        report.status = "completed" if complete and not bad else "incomplete"
        if plan.mode != "replay":
            protocol.record_files_seen(dataclasses.replace(plan, bad_shards=bad), done_units)
        if complete and not bad:
            protocol.commit_run(plan)
            mark = plan.read_as_of
            if mark is not None:
                protocol.advance_watermark(mark)

    def abort(self) -> None:
        """Fences off this attempt's own writers, so the report the driver writes next is final."""
        protocol = self.protocol
        try:
            if protocol.abort():
                logger.info("run %s: this attempt is fenced off; its actors commit nothing more", protocol.run_id)
        except Exception as e:  # the table unreachable: the next attempt's take-over fences us anyway
            logger.warning("run %s: could not fence this attempt off: %s", protocol.run_id, e)


# -- 4. report ---------------------------------------------------------------------------------------
class ReportRun:
    """The run's report, however the run ended: times, throughput and cost; rows from the
    table (committed only) and calls from every attempt; the "finished" metrics; written to
    `runs/<run_id>.json` unless another attempt fenced this one off (that one owns it now).
    The output lease is released last, whatever happened before."""

    def __init__(self, protocol: CommitProtocol, core_hour_usd: float, metrics: RunMetrics, *, t0: float) -> None:
        self.protocol = protocol
        self.core_hour_usd = core_hour_usd
        self.metrics = metrics
        self.t0 = t0

    def write(self, report: RunReport, executed: ExecuteRun, plan: Plan | None, *, write: bool) -> None:
        protocol, attempt, meter = self.protocol, executed.attempt, executed.meter
        report.finished_at = datetime.now(UTC).isoformat()
        report.wall_s = round(time.monotonic() - self.t0, 3)
        report.throughput_rows_per_s = round(report.rows_this_attempt / report.wall_s, 2) if report.wall_s else 0.0
        if meter is not None:
            cost = meter.finish(
                paragraphs=report.rows_this_attempt, model_cpu_s=attempt.model_cpu_s, core_hour_usd=self.core_hour_usd
            )
            report.cost = None if cost is None else cost.to_dict()
        try:
            if write:
                attempt = fold_report(protocol, report, attempt, plan=plan)
            self.metrics.finish(report)
            if write and not protocol.lease_lost:
                protocol.save_attempt(attempt)
                protocol.write_report(report)
                if report.status == "completed":
                    protocol.drop_state()
        finally:
            protocol.release()


def fold_report(
    protocol: CommitProtocol, report: RunReport, attempt: AttemptStats, *, plan: Plan | None
) -> AttemptStats:
    """The report's figures: rows from the table (committed only), calls from every attempt.

    An attempt's calls are its unit summaries', or its actors' own tallies where those count
    more (`raypipe.tally`: a run stopped with units in flight; an attempt whose driver died
    before saving its statistics has only those). Returns this attempt's statistics so folded.

    A replay's rows replace another run's dead letters: its rows are what the dead letters of
    its committed units became (`CommitProtocol.replay_ledger`, from the table, so an attempt killed
    after committing counts too); for a plan stored without its table version, what its
    attempts reported committing."""
    tallies = read_tallies(protocol.store, protocol.run_id)
    earlier = protocol.earlier_attempts()
    saved = {a.attempt for a in earlier} | {attempt.attempt}
    unsaved = [AttemptStats(attempt=a) for a in sorted(tallies) if a not in saved]
    attempts = [fold_tallies(a, tallies.get(a.attempt, ())) for a in [*earlier, *unsaved, attempt]]
    attempt = attempts[-1]
    report.fold_attempts(attempts)
    if protocol.mode == "replay":
        replayed = protocol.replay_ledger(plan) if plan is not None else None
        if replayed is None:
            counts: Counter[str] = Counter()
            for a in attempts:
                counts.update(a.ledger())
            replayed = Ledger(counts)
        report.apply_ledger(dict(replayed))
    else:
        committed, report.model_versions = protocol.ledger()
        report.apply_ledger(committed)
    report.rows_skipped_committed = max(0, report.rows_in - report.rows_this_attempt)
    return attempt


def committed_report(protocol: CommitProtocol) -> RunReport | None:
    """The report of a run id the table holds committed (then there is nothing to do), else None.

    A driver killed between the run's commit and its report leaves none, or an earlier
    attempt's (failed, incomplete): the report is then rebuilt from the table (rows by
    outcome, the plan's units, every attempt's calls), written, and returned, never a bare
    "completed" with zero counts."""
    if not protocol.is_committed():
        return None
    report = protocol.stored_report()
    path = protocol.store.report_file(protocol.run_id)
    if report is None or report.status != "completed":
        plan = protocol.stored_plan()
        report = RunReport(run_id=protocol.run_id, mode=protocol.mode, output=protocol.place.uri)
        if plan is not None:
            report.input, report.replay_of, report.model_version = plan.input, plan.replay_of, plan.model_version or ""
            report.units_total = report.units_committed = len(plan.units)
        fold_report(protocol, report, AttemptStats(attempt=protocol.attempt), plan=plan)
        report.status = "completed"
        report.finished_at = datetime.now(UTC).isoformat()
        protocol.write_report(report)
        logger.warning(
            "run %s is committed but its report was missing or unfinished: rebuilt from the table", protocol.run_id
        )
    logger.info("run %s is already committed: nothing to do (report %s)", protocol.run_id, path)
    return report

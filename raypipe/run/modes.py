"""Run modes: backfill, daily delta and replay, over one shared run protocol.

`_run` is the whole story of a run, a step at a time (`raypipe.run.steps`), each step given
the part of the config it needs, over one `CommitProtocol` that owns the run's output (built
over the run's one `Output`, which the caller built once from the URI and passes in). The
order of the protocol's calls is told in `raypipe.commit.protocol`; the fence that keeps every
older holder of the output from landing anything, in `raypipe.commit.fence`. The steps:
1. a run id already committed returns at once, with its report (`committed_report`: rebuilt
   from the table if a killed driver left none);
2. `ModelService.ask`: the model service is checked (labels, version, limits) before any data is read;
3. `CommitProtocol.setup_run`: the lease and the take-over (a failing metrics sink after it
   gives the lease back at once);
4. `PlanRun`: the units, planned once (`raypipe.plan.planning`; each mode says how) and
   stored, so a restart does the same units; those not committed are still to do;
5. `ExecuteRun`: the pipeline streams them through the actors, which commit each unit; if the
   service stays down the run stops with `CircuitOpenError`, its rows still to do;
6. `CommitRun.commit`: the files read, the run's commit when every unit is, the watermark;
   on a failure `CommitRun.abort` instead;
7. `ReportRun`: the report (rows from the table, the calls of every attempt), then the lease
   released, however the run ended.

A daily reads the input files no run has read whole yet (new files, and files whose size or
ETag changed), whole, whatever their rows' `updated_at`: it selects by the files seen
(`CommitProtocol.files_seen`), not by a watermark. A file rewritten in place is read whole
(its unchanged texts are answered from the table by reuse, without a call); `--since` only
adds reads: the unchanged files too, for their rows updated at or after it. A backfill
records what its input was read as of (the latest `updated_at` in the footers, else its
planning time): the watermark, which is informational and never moves backwards. A replay
re-infers a run's committed dead letters and replaces them, in the same commit, with what
they became.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

from raypipe.call.metrics import RunMetrics
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol, committed_runs, run_known
from raypipe.config import InputConfig, PipelineConfig, check_run_id
from raypipe.errors import ConfigError, LeaseLostError
from raypipe.plan.planning import Plan, plan_input, plan_replay
from raypipe.report import RunReport
from raypipe.run.driver import quiet, sigterm_stops_the_run
from raypipe.run.steps import (
    CommitRun,
    ExecuteRun,
    ExecuteSettings,
    ModelService,
    PlanRun,
    ReportRun,
    committed_report,
)

__all__ = ["backfill", "daily", "replay", "replay_run_id"]


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


@quiet
@sigterm_stops_the_run()
def _run(
    config: PipelineConfig,
    mode: str,
    make_plan: Callable[[CommitProtocol], Plan],
    place: Output,
    *,
    input: InputConfig | None = None,
) -> RunReport:
    # A default id names a new run: two runs started in the same second must not share one (the
    # second would find the first committed and do nothing).
    run_id = config.run_id or f"{mode}-{_stamp()}-{uuid.uuid4().hex[:6]}"
    protocol = CommitProtocol(place, mode, run_id)
    done = committed_report(protocol)
    if done is not None:
        return done
    started_at = datetime.now(UTC)
    t0 = time.monotonic()
    report = RunReport(run_id=run_id, mode=mode, output=place.uri, started_at=started_at.isoformat())

    model = ModelService.ask(config.service, config.client)
    report.labels, report.model_version = list(model.labels), model.version
    protocol.setup_run(model.labels)
    try:
        metrics = RunMetrics.start(config.metrics, report, app=config.service.application)
    except BaseException:
        protocol.release()  # nothing ran: the lease goes back now, as a failed set-up gives it back
        raise
    execute = ExecuteRun(
        protocol, ExecuteSettings(config.service, config.actors, config.dedup, config.progress_interval_s), metrics
    )
    commit = CommitRun(protocol)
    plan: Plan | None = None
    write_report = True
    try:
        plan, todo = PlanRun(protocol, input, make_plan).plan(model.version, report)
        executed = execute.execute(plan, todo, model, report=report)
        commit.commit(plan, todo, executed, report)
    except LeaseLostError:
        write_report = False  # the attempt that fenced us off owns the report now
        raise
    except BaseException as e:
        report.status = "failed"
        report.error = f"{type(e).__name__}: {e}"
        commit.abort()
        raise
    finally:
        ReportRun(protocol, config.core_hour_usd, metrics, t0=t0).write(report, execute, plan, write=write_report)
    return report


def backfill(config: PipelineConfig, input: InputConfig, place: Output) -> RunReport:
    """Infers every row of the input into `place`, the run's output; resumable by run id.

    Once complete, the files it read are recorded as seen (a daily after it reads only new and
    changed files) and the watermark moves to the point its input was read as of.
    """
    return _run(config, "backfill", lambda protocol: plan_input(input, "backfill", protocol), place, input=input)


def daily(config: PipelineConfig, input: InputConfig, place: Output, *, since: datetime | None = None) -> RunReport:
    """Infers into `place` every row of the input files no run has read whole yet (new files, and files
    whose size or ETag changed), whatever their `updated_at`: late files are not lost.

    `since` also re-reads the files already read, for their rows updated after it (a rerun
    over an earlier window). Files of bad shards are retried by every daily until they read
    or are quarantined; the healthy ones are recorded as read and not read again.
    """
    if since is not None and since.tzinfo is None:
        raise ConfigError("daily: `since` must be timezone-aware")
    return _run(config, "daily", lambda protocol: plan_input(input, "daily", protocol, since=since), place, input=input)


def replay_run_id(place: Output, of_run: str) -> str:
    """The replay to run for `of_run`: `<of_run>.replay-<n>`, one past the last the table
    records as committed, so the latest unfinished one is resumed, else a new one starts.

    From the table (past its transaction retention, the runs' completed reports:
    `committed_runs`), never from state folders: `vacuum` drops a finished replay's state, and a
    number taken from the folders left would name a committed replay again (which then does
    nothing). Replays of a run are numbered one after another, a new one only once the last
    is committed, so the committed ones are looked up in batches until one comes up short."""
    prefix, last, batch = f"{of_run}.replay-", 0, 64
    while True:
        names = {f"{prefix}{n}": n for n in range(last + 1, last + batch + 1)}
        done = [names[r] for r in committed_runs(place, set(names))]
        last = max(done, default=last)
        if last < max(names.values()):
            return f"{prefix}{last + 1}"


def replay(config: PipelineConfig, place: Output, *, of_run: str) -> RunReport:
    """Re-infers run `of_run`'s committed dead letters in `place`; each unit's commit replaces them with
    what they became (results, or dead letters again), so an id is never in both sets.

    Its run id defaults to `<of_run>.replay-<n>`: the latest unfinished replay of that run is
    resumed, else a new one starts. A resumed replay reads the dead letters still committed,
    so rows already replayed are not sent again.
    """
    check_run_id(of_run, what="replayed run id")  # it names the replay's state folder too
    if config.run_id is None:
        # model_copy skips the field's validator: the id is checked here, as the field would.
        replay_id = check_run_id(replay_run_id(place, of_run), what="replay id")
        config = config.model_copy(update={"run_id": replay_id})
    assert config.run_id is not None

    def make_plan(protocol: CommitProtocol) -> Plan:
        found = protocol.dead_letters_of(of_run)
        if found is None and not run_known(place, of_run):
            raise ConfigError(f"no run {of_run!r} at {place.uri}")
        version, dead_letters = found or (protocol.table.load().version(), Counter[str]())
        return plan_replay(place.uri, of_run, dead_letters, table_version=version)

    return _run(config, "replay", make_plan, place)

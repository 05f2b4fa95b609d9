"""A run's steps (`raypipe.run.steps`), each against a fake commit protocol: no Ray, no table, no service."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from raypipe.config import ActorPoolConfig, ClientConfig, DedupConfig, InputConfig, ServiceConfig
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats, RunReport, UnitStats
from raypipe.run import steps
from raypipe.run.steps import (
    CommitRun,
    Executed,
    ExecuteRun,
    ExecuteSettings,
    ModelService,
    PlanRun,
    ReportRun,
)

T = datetime(2026, 1, 2, tzinfo=UTC)


def _unit(shard: str, start: int = 0) -> WorkUnit:
    return WorkUnit(shard, "parquet", start, start + 10, fingerprint=f"etag-{shard}")


class FakeLease:
    lost = False

    def __init__(self) -> None:
        self.released = 0

    def check(self) -> None:
        pass

    def release(self) -> None:
        self.released += 1


class FakeProtocol:
    """What the steps ask of `CommitProtocol`, recorded."""

    def __init__(
        self, *, mode: str = "backfill", stored: Plan | None = None, done: set[str] = frozenset(), abort: Any = True
    ) -> None:
        self.mode, self.run_id, self.attempt = mode, "r1", "a1"
        self.output = SimpleNamespace(uri="/nowhere")
        self.fence = SimpleNamespace(generation=3)
        self.lease = FakeLease()
        self.table = SimpleNamespace(max_updated_at_by_unit=lambda run_id: {})
        self.committed_runs = 0
        self.committed_reads = 0
        self._abort = abort
        self.stored, self.done = stored, set(done)
        self.saved: list[Plan] = []
        self.files_seen: list[tuple[Plan, set[str]]] = []
        self.watermarks: list[datetime] = []
        self.reports: list[RunReport] = []

    def plan(self, make_plan: Any, *, input_uri: str | None, model_version: str) -> tuple[Plan, bool]:
        if self.stored is not None:
            return self.stored, True
        plan = make_plan()
        plan.model_version = model_version
        self.saved.append(plan)
        return plan, False

    def save_plan(self, plan: Plan) -> None:
        self.saved.append(plan)

    def quarantined(self) -> frozenset[str]:
        return frozenset()

    def committed_units(self, plan: Plan) -> set[str]:
        self.committed_reads += 1
        return set(self.done)

    def record_files_seen(self, plan: Plan, committed: set[str]) -> int:
        self.files_seen.append((plan, committed))
        return len(committed)

    def advance_watermark(self, to: datetime) -> None:
        self.watermarks.append(to)

    def save_attempt(self, stats: AttemptStats) -> None:
        pass

    def write_report(self, report: RunReport) -> None:
        self.reports.append(report)

    @property
    def lease_lost(self) -> bool:
        return self.lease.lost

    def check_lease(self) -> None:
        self.lease.check()

    def release(self) -> None:
        self.lease.release()

    def commit_run(self, plan: Plan) -> None:
        self.committed_runs += 1

    def abort(self) -> bool:
        if isinstance(self._abort, BaseException):
            raise self._abort
        return bool(self._abort)


def _plan(*units: WorkUnit, mode: str = "backfill", bad: list[dict[str, str]] | None = None) -> Plan:
    return Plan(mode, "/in", list(units), list(bad or []), observations={"read_as_of": T.isoformat(), "n": 2})


# -- ModelService -----------------------------------------------------------------------------------
def test_the_service_caps_the_micro_batch_at_its_maximum(monkeypatch, caplog):
    info = SimpleNamespace(labels=["joy", "anger"], model_version="m1", max_batch_size=8)
    monkeypatch.setattr(steps, "check_service", lambda address, **kw: info)
    model = ModelService.ask(ServiceConfig(), ClientConfig(micro_batch_size=32))
    assert (model.labels, model.version, model.client.micro_batch_size) == (("joy", "anger"), "m1", 8)
    assert "micro_batch_size 32 is over the server's maximum 8: using 8" in caplog.text


def test_the_service_keeps_a_micro_batch_within_its_maximum(monkeypatch):
    info = SimpleNamespace(labels=["joy"], model_version="m1", max_batch_size=0)
    monkeypatch.setattr(steps, "check_service", lambda address, **kw: info)
    client = ClientConfig(micro_batch_size=32)
    assert ModelService.ask(ServiceConfig(), client).client is client


# -- PlanRun ----------------------------------------------------------------------------------------
def test_planning_a_new_run_stores_its_plan_and_reports_it():
    a, b = _unit("/in/a"), _unit("/in/b")
    protocol = FakeProtocol(done={a.key})
    report = RunReport(run_id="r1", mode="backfill")
    plan, todo = PlanRun(protocol, InputConfig(uri="/in"), lambda s: _plan(a, b)).plan("m1", report)  # type: ignore[arg-type]
    assert protocol.saved == [plan] and plan.model_version == "m1"
    assert todo == [b]
    assert (report.units_total, report.units_skipped_committed, report.input) == (2, 1, "/in")
    assert report.planning == {"read_as_of": T.isoformat(), "n": 2}


def test_a_resumed_run_takes_its_stored_plan():
    stored = _plan(_unit("/in/a"))
    protocol = FakeProtocol(stored=stored)
    plan, todo = PlanRun(protocol, None, lambda s: pytest.fail("planned anew")).plan("m1", RunReport("r1", "backfill"))  # type: ignore[arg-type]
    assert plan is stored and todo == stored.units and protocol.saved == []


def test_a_resumed_run_brought_up_to_date_reads_the_committed_units_once(tmp_path):
    """A resumed plan with whole-file units is brought up to date with its input: the committed
    units are read once, and a whole-file unit not committed is read as its file is now."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("a", "b"):
        pq.write_table(pa.table({"id": [name], "text": ["t"]}), tmp_path / f"{name}.parquet")
    a = WorkUnit(str(tmp_path / "a.parquet"), "parquet", 0, None, fingerprint="old")
    b = WorkUnit(str(tmp_path / "b.parquet"), "parquet", 0, None, fingerprint="old")
    protocol = FakeProtocol(stored=_plan(a, b), done={a.key})
    plan, todo = PlanRun(protocol, InputConfig(uri=str(tmp_path)), lambda s: pytest.fail("planned anew")).plan(  # type: ignore[arg-type]
        "m1", RunReport("r1", "backfill")
    )
    assert protocol.committed_reads == 1
    assert [u.shard for u in todo] == [b.shard] and protocol.saved == [plan]
    fingerprints = {u.shard: u.fingerprint for u in plan.units}
    assert fingerprints[a.shard] == "old" and fingerprints[b.shard] != "old"  # the committed unit keeps its own


# -- ExecuteRun -------------------------------------------------------------------------------------
def test_nothing_to_do_executes_nothing_and_keeps_the_plans_bad_shards():
    bad = [{"shard": "/in/x", "format": "parquet", "error": "boom"}]
    settings = ExecuteSettings(ServiceConfig(), ActorPoolConfig(), DedupConfig(), 10.0)
    metrics = SimpleNamespace(spec=None, metrics=None)
    execute = ExecuteRun(FakeProtocol(), settings, metrics)  # type: ignore[arg-type]
    model = ModelService(("joy",), "m1", ClientConfig())
    done = execute.execute(_plan(bad=bad), [], model, report=RunReport("r1", "backfill"))
    assert done == Executed(set(), bad) and execute.meter is None
    assert execute.attempt.attempt == "a1"


def test_the_start_up_figures_count_from_the_attempts_start_and_keep_the_earliest_first_call(monkeypatch):
    started = datetime(2026, 1, 1, tzinfo=UTC)
    now = [started.timestamp() + 1.25]
    monkeypatch.setattr(steps.time, "time", lambda: now[0])
    report = RunReport("r1", "backfill", started_at=started.isoformat())
    startup = steps.Startup.begin(report)
    assert report.startup == {"ray_s": 1.25}

    def unit(first_call_after: float | None) -> UnitStats:
        at = None if first_call_after is None else started.timestamp() + first_call_after
        return UnitStats("u", "/in/a", "a1", "actor", first_call_at=at)

    now[0] = started.timestamp() + 6.0
    startup.unit_done(unit(2.5))
    now[0] = started.timestamp() + 7.0
    startup.unit_done(unit(2.25))  # another actor's unit went out earlier, and ended later
    startup.unit_done(unit(None))  # every row answered without a call
    assert report.startup == {"ray_s": 1.25, "first_unit_s": 6.0, "first_call_s": 2.25}
    assert "start-up      Ray ready 1.2 s | first call 2.2 s | first unit done 6.0 s" in report.render()


def test_a_report_without_start_up_figures_has_no_start_up_line():
    assert "start-up" not in RunReport("r1", "backfill").render()  # nothing was run (all committed)
    assert RunReport.from_dict({"run_id": "r", "mode": "daily"}).startup is None  # an earlier release's


def test_an_actors_fatal_error_comes_back_typed():
    from raypipe.errors import CircuitOpenError

    err = steps._fatal_error('{"kind": "circuit_open", "message": "down", "waited_s": 3.0}')
    assert isinstance(err, CircuitOpenError) and err.waited_s == 3.0


# -- CommitRun --------------------------------------------------------------------------------------
def test_a_complete_run_records_its_files_commits_and_moves_the_watermark():
    a, b = _unit("/in/a"), _unit("/in/b")
    protocol = FakeProtocol(done={a.key})
    report = RunReport("r1", "backfill")
    commit = CommitRun(protocol)  # type: ignore[arg-type]
    commit.commit(_plan(a, b), [b], Executed({b.key}, []), report)
    assert (report.status, report.units_committed) == ("completed", 2)
    assert [c for _, c in protocol.files_seen] == [{a.key, b.key}]
    assert protocol.committed_runs == 1 and protocol.watermarks == [T]  # what the plan's input was read as of


def test_a_run_with_a_bad_shard_records_its_healthy_files_but_is_not_committed():
    a, b = _unit("/in/a"), _unit("/in/b")
    bad = [{"shard": b.shard, "format": "parquet", "error": "boom"}]
    protocol = FakeProtocol()
    report = RunReport("r1", "backfill")
    CommitRun(protocol).commit(_plan(a, b), [a, b], Executed({a.key}, bad), report)  # type: ignore[arg-type]
    assert (report.status, report.bad_shards) == ("incomplete", bad)
    assert [p.bad_shards for p, _ in protocol.files_seen] == [bad]
    assert protocol.committed_runs == 0 and protocol.watermarks == []


def test_a_replay_records_no_files_seen():
    u = WorkUnit("/out", "dead_letters", 0, 3, name="u1", source_run="r0")
    protocol = FakeProtocol(mode="replay")
    plan = Plan("replay", None, [u], [], replay_of="r0", observations={"table_version": 4})
    CommitRun(protocol).commit(plan, [u], Executed({u.key}, []), RunReport("r1", "replay"))  # type: ignore[arg-type]
    assert protocol.files_seen == [] and protocol.committed_runs == 1
    assert protocol.watermarks == []  # a replay reads no input: the watermark stays


def test_abort_never_raises(caplog):
    protocol = FakeProtocol(abort=OSError("table unreachable"))
    CommitRun(protocol).abort()  # type: ignore[arg-type]
    assert "could not fence this attempt off: table unreachable" in caplog.text


# -- ReportRun --------------------------------------------------------------------------------------
class FakeMetrics:
    def __init__(self, fail: bool = False) -> None:
        self.finished: list[str] = []
        self.fail = fail

    def finish(self, report: RunReport) -> None:
        self.finished.append(report.status)
        if self.fail:
            raise RuntimeError("sink down")


def test_a_fenced_off_attempt_writes_no_report_and_releases_its_lease():
    protocol, metrics = FakeProtocol(), FakeMetrics()
    execute = SimpleNamespace(attempt=AttemptStats(attempt="a1"), meter=None)
    report = RunReport("r1", "backfill", status="failed", rows_this_attempt=50)
    ReportRun(protocol, 0.04, metrics, t0=0.0).write(report, execute, None, write=False)  # type: ignore[arg-type]
    assert protocol.reports == [] and protocol.lease.released == 1 and metrics.finished == ["failed"]
    assert report.wall_s > 0 and report.finished_at


def test_the_lease_is_released_even_when_the_metrics_fail():
    protocol = FakeProtocol()
    execute = SimpleNamespace(attempt=AttemptStats(attempt="a1"), meter=None)
    with pytest.raises(RuntimeError, match="sink down"):
        reporting = ReportRun(protocol, 0.04, FakeMetrics(fail=True), t0=0.0)  # type: ignore[arg-type]
        reporting.write(RunReport("r1", "backfill"), execute, None, write=False)  # type: ignore[arg-type]
    assert protocol.lease.released == 1


# -- a run committed already ---------------------------------------------------------------------
@pytest.mark.parametrize("left", [None, "failed"], ids=["no-report", "an-earlier-attempts-report"])
def test_a_driver_killed_after_the_run_commit_leaves_a_report_rebuilt_from_the_table(tmp_path, left):
    """Killed between `commit_run` and its report: the rerun finds the run committed and
    answers with its rows counted from the table, never a bare "completed" with zero counts."""
    from raypipe.commit.output import Output
    from raypipe.commit.protocol import CommitProtocol
    from raypipe.config import OutputConfig
    from tests.fakes import LABELS
    from tests.unit.test_table import UNIT, rows

    output = OutputConfig(uri=str(tmp_path / "out"), require_conditional_writes=False)
    killed = CommitProtocol(Output.at(output), "backfill", "r1", attempt="a1")
    killed.setup_run(LABELS)
    plan = Plan("backfill", "/in", [WorkUnit("/in/a.parquet", "parquet", 0, None, name=UNIT)], [])
    killed.plan(lambda: plan, input_uri="/in", model_version="m")
    assert killed.commit_unit(UNIT, rows({"A": "result", "B": "result", "C": "dead_letter"}, version="m"))
    if left is not None:  # an earlier attempt's report, from before this one committed
        killed.write_report(RunReport(run_id="r1", mode="backfill", status=left))
    killed.commit_run(plan)
    killed.release()  # SIGKILL here: no report of this attempt

    report = steps.committed_report(CommitProtocol(Output.at(output), "backfill", "r1", attempt="a2"))
    assert report is not None and report.status == "completed"
    assert (report.rows_ok, report.rows_dead_letters, report.units_total) == (2, 1, 1)
    stored = CommitProtocol(Output.at(output), "backfill", "r1").stored_report()
    assert stored is not None and (stored.status, stored.rows_ok, stored.rows_dead_letters) == ("completed", 2, 1)

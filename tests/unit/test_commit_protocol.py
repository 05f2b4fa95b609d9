"""The commit protocol object (`raypipe.commit.protocol`) on a real local Delta table: set up a
run, commit units, commit the run, abort; the plan and the files seen fenced like unit commits,
"committed" one truth (the table), an injected clock. No Ray. The table's own mechanics:
`test_table`.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import deltalake
import pyarrow as pa
import pytest

from raypipe.commit.lease import Lease
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.upkeep import compact, finished_runs, vacuum
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError, LeaseLostError, OutputLockedError, SinkError
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from raypipe.report import RunReport
from tests.fakes import LABELS
from tests.unit.test_table import UNIT, rows, visible

# -- the commit protocol object: set up a run, commit units, commit the run, abort ---------------


IN = "/data/in"


@pytest.fixture
def attempts():
    """The protocols a test sets up, released at its end (each holds the output lease)."""
    made: list[CommitProtocol] = []
    yield made
    for p in made:
        p.release()


def protocol(tmp_path, attempts, attempt: str, **kwargs) -> CommitProtocol:
    """An attempt of run r1; a later one takes the lease over at once (`--force`)."""
    output = OutputConfig(uri=str(tmp_path / "out"), take_over_lease=True, require_conditional_writes=False)
    p = CommitProtocol(Output.at(output), "backfill", "r1", attempt=attempt, **kwargs)
    attempts.append(p)
    return p


def plan(*shards: str) -> Plan:
    return Plan("backfill", IN, [WorkUnit(f"{IN}/{s}", "parquet", 0, None, fingerprint=f"fp-{s}") for s in shards], [])


def zombie(p: CommitProtocol) -> CommitProtocol:
    """An attempt whose lease check passed just before it stalled: its writes come later."""
    p.check_lease = lambda: None  # type: ignore[method-assign]
    return p


def test_protocol_steps_set_up_commit_units_commit_the_run(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    assert not p.table.is_committed("r1") and p.stored_report() is None
    fence = p.setup_run(LABELS)
    assert fence.generation == 1
    assert p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))
    assert not p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))  # once
    assert p.committed_units(plan("a.parquet")) == {UNIT}
    p.commit_run(Plan("backfill", IN, [WorkUnit(f"{IN}/a.parquet", "parquet", 0, None, name=UNIT)], []), {"why": "all"})
    assert protocol(tmp_path, attempts, "a2").table.is_committed("r1")
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "dead_letter", "m"): 1})


def test_protocol_setup_fences_the_earlier_attempt_off_at_every_step(tmp_path, attempts):
    old, new = protocol(tmp_path, attempts, "a1"), protocol(tmp_path, attempts, "a2")
    old.setup_run(LABELS)
    new.setup_run(LABELS)
    zombie(old)
    with pytest.raises(LeaseLostError):
        old.commit_unit(UNIT, rows({"A": "result"}, version="old"))
    with pytest.raises(LeaseLostError):
        old.save_plan(plan("zombie.parquet"))
    stale = plan("a.parquet")
    with pytest.raises(LeaseLostError):
        old.record_files_seen(stale, {u.key for u in stale.units})
    with pytest.raises(LeaseLostError):
        old.commit_run(plan())
    assert not new.table.is_committed("r1") and new.stored_plan() is None and new.files_seen() == {}
    assert new.commit_unit(UNIT, rows({"A": "result"}, version="new"))
    assert visible(tmp_path / "out") == Counter({("A", "result", "new"): 1})


def test_protocol_abort_fences_its_own_writers_but_never_a_newer_attempt(tmp_path, attempts):
    first = protocol(tmp_path, attempts, "a1")
    first.setup_run(LABELS)
    assert first.commit_unit(UNIT, rows({"A": "result"}, version="m"))
    stalled = first.unit_committer()  # an actor still working when the driver gives up
    assert first.abort()
    with pytest.raises(LeaseLostError):
        stalled.commit("shard-1-def", rows({"B": "result"}, version="m"))
    second = protocol(tmp_path, attempts, "a2")
    assert second.setup_run(LABELS).generation == 3
    assert second.committed_units(plan("a.parquet")) == {UNIT}  # what committed before stays
    third = protocol(tmp_path, attempts, "a3")
    third.setup_run(LABELS)
    assert not second.abort()  # the run is the third's now: left alone
    assert third.commit_unit("shard-1-def", rows({"B": "result"}, version="m"))


def test_protocol_plan_and_files_seen_read_back_through_the_table(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    first, _ = p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    p.save_plan(plan("a.parquet", "b.parquet"))  # a resumed run's refreshed plan
    assert p.record_files_seen(first, {u.key for u in first.units}) == 1
    assert p.record_files_seen(first, {u.key for u in first.units}) == 0
    reader = protocol(tmp_path, attempts, "reader")
    assert [u.shard for u in reader.stored_plan().units] == [f"{IN}/a.parquet", f"{IN}/b.parquet"]
    assert reader.files_seen() == {f"{IN}/a.parquet": ("fp-a.parquet", None)}


def test_protocol_unit_transactions_use_the_injected_clock(tmp_path, attempts):
    long_ago = (datetime.now(UTC) - timedelta(days=100)).timestamp()
    p = protocol(tmp_path, attempts, "a1", clock=lambda: long_ago)
    p.setup_run(LABELS)
    assert p.commit_unit(UNIT, rows({"A": "result"}, version="m"))
    assert p.table.load().transaction_version(f"raypipe/r1/unit/{UNIT}") is None  # past the retention
    assert p.committed_units(plan("a.parquet")) == {UNIT}  # still found committed by its file


def test_a_runs_own_transactions_expire_and_its_report_then_stands_for_its_commit(tmp_path, attempts):
    """The log's transactions do not grow with the history: a run's plan pointer, units and run
    commit are pruned after the table's retention (90 days); the output's fence and pointers
    stay. Past the retention the run is still committed: its completed report says so."""
    long_ago = (datetime.now(UTC) - timedelta(days=100)).timestamp()
    p = protocol(tmp_path, attempts, "a1", clock=lambda: long_ago)
    p.setup_run(LABELS)
    done, _ = p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    p.commit_unit(
        done.units[0].key, rows({"A": "result"}, version="m").set_column(2, "unit", pa.array([done.units[0].key]))
    )
    p.commit_run(done)
    assert p.record_files_seen(done, {done.units[0].key}) == 1
    dt = deltalake.DeltaTable(p.table.uri)
    for app in ("raypipe/r1/plan", "raypipe/r1/committed", f"raypipe/r1/unit/{done.units[0].key}"):
        assert dt.transaction_version(app) is None, app  # expired: pruned from the log
    assert dt.transaction_version("raypipe/files-seen") is not None  # the output's: kept
    assert dt.transaction_version("raypipe-output/slot-0") == p.fence.generation
    assert not p.table.is_committed("r1")
    assert not p.is_committed()  # no report: nothing says it was committed
    p.write_report(RunReport(run_id="r1", mode="backfill", output=p.place.uri, status="completed"))
    again = protocol(tmp_path, attempts, "a2")
    assert again.is_committed() and "r1" in finished_runs(again.place)


def test_a_fenced_off_attempt_cannot_replace_the_plan(tmp_path, attempts):
    old = protocol(tmp_path, attempts, "a1")
    old.setup_run(LABELS)
    old.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    protocol(tmp_path, attempts, "a2").setup_run(LABELS)
    zombie(old)
    with pytest.raises(LeaseLostError):
        old.save_plan(plan("zombie.parquet"))
    reader = protocol(tmp_path, attempts, "a3")
    stored, resumed = reader.plan(lambda: plan("never.parquet"), input_uri=IN, model_version="m")
    assert resumed and [u.shard for u in stored.units] == [f"{IN}/a.parquet"]


def test_a_fenced_off_attempt_cannot_rewrite_the_files_seen(tmp_path, attempts):
    old = protocol(tmp_path, attempts, "a1")
    old.setup_run(LABELS)
    new = protocol(tmp_path, attempts, "a2")
    new.setup_run(LABELS)
    done = plan("a.parquet")
    new.record_files_seen(done, {u.key for u in done.units})
    zombie(old)
    stale = plan("b.parquet")
    with pytest.raises(LeaseLostError):
        old.record_files_seen(stale, {u.key for u in stale.units})
    assert set(protocol(tmp_path, attempts, "a3").files_seen()) == {f"{IN}/a.parquet"}


def test_a_run_id_resumes_only_as_the_mode_and_input_it_started_as(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    with pytest.raises(ConfigError, match="cannot be resumed as a backfill of /data/other"):
        p.plan(lambda: plan("a.parquet"), input_uri="/data/other", model_version="m")


def test_committed_has_one_truth_the_table(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    p.plan(lambda: plan(), input_uri=IN, model_version="m")
    p.commit_run(plan())
    p.release()
    assert not list((tmp_path / "out").rglob("COMMITTED.json"))
    assert finished_runs(str(tmp_path / "out")) == ["r1"]
    assert protocol(tmp_path, attempts, "a2").table.is_committed("r1")


def test_a_run_resumes_under_another_model_version_only_when_asked(tmp_path, attempts):
    """Its rows would carry two models' answers: refused (a config error: exit 2) with the fix
    named, unless `output.allow_model_change`."""
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="bert-aaa")
    with pytest.raises(
        ConfigError, match=r"started with model bert-aaa .* now answers with bert-bbb: serve bert-aaa"
    ) as e:
        p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="bert-bbb")
    assert "output.allow_model_change=true" in str(e.value) and "\n" not in str(e.value)
    assert p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="bert-aaa")[1]  # the same model resumes
    output = OutputConfig(
        uri=str(tmp_path / "out"), take_over_lease=True, require_conditional_writes=False, allow_model_change=True
    )
    allowed = CommitProtocol(Output.at(output), "backfill", "r1", attempt="a2")
    attempts.append(allowed)
    allowed.setup_run(LABELS)
    resumed_plan, resumed = allowed.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="bert-bbb")
    assert resumed and resumed_plan.model_version == "bert-aaa"


# -- one fence for the output: a take-over by any run id fences every older holder ----------------


def other_run(tmp_path, attempts, run_id: str) -> CommitProtocol:
    """A daily of its own run id on the same output; it waits for no lease it does not hold."""
    output = OutputConfig(uri=str(tmp_path / "out"), require_conditional_writes=False)
    p = CommitProtocol(Output.at(output), "daily", run_id, attempt=run_id)
    attempts.append(p)
    return p


def rows_of(run_id: str, unit: str, ids: list[str], *, version: str):
    t = rows(dict.fromkeys(ids, "result"), version=version)
    t = t.set_column(t.schema.get_field_index("run_id"), "run_id", pa.array([run_id] * t.num_rows))
    return t.set_column(t.schema.get_field_index("unit"), "unit", pa.array([unit] * t.num_rows))


def test_a_take_over_by_another_run_id_fences_the_older_holder_at_commit(tmp_path, attempts, monkeypatch):
    """Run A takes the output and stalls inside a unit's commit (its checks passed); the
    operator expires the lease; run B, another run id, takes over, commits the same ids and
    the run. A's commit is refused by the table, and every id is there once, as B answered."""
    a = zombie(other_run(tmp_path, attempts, "daily-a"))
    a.setup_run(LABELS)
    a_actor = a.unit_committer()
    real = deltalake.write_deltalake
    entered, go_on = threading.Event(), threading.Event()

    def stalled(*args, **kwargs):
        if threading.current_thread().name == "run-a-actor":
            entered.set()
            assert go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(deltalake, "write_deltalake", stalled)
    outcome: list[BaseException | bool] = []

    def commit_a() -> None:
        try:
            outcome.append(a_actor.commit("shard-a", rows_of("daily-a", "shard-a", ["A", "B"], version="old")))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=commit_a, name="run-a-actor")
    thread.start()
    assert entered.wait(30), "run A never reached its write"
    Lease(a.store, "raypipe-cli").expire()  # `raypipe lease expire`: the operator declares A dead
    b = other_run(tmp_path, attempts, "daily-b")
    b.setup_run(LABELS)
    assert b.commit_unit("shard-b", rows_of("daily-b", "shard-b", ["A", "B"], version="new"))
    go_on.set()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLostError), outcome
    for late in (
        lambda: a.commit_unit("shard-a2", rows_of("daily-a", "shard-a2", ["C"], version="old")),
        lambda: a.save_plan(plan("a.parquet")),
        lambda: a.record_files_seen(plan("a.parquet"), {u.key for u in plan("a.parquet").units}),
        lambda: a.commit_run(plan()),
    ):
        with pytest.raises(LeaseLostError):
            late()
    b.commit_run(Plan("daily", IN, [WorkUnit(f"{IN}/b.parquet", "parquet", 0, None, name="shard-b")], []))
    seen = read_outcomes(str(tmp_path / "out"))
    assert sorted(zip(seen.column("id").to_pylist(), seen.column("run_id").to_pylist(), strict=True)) == [
        ("A", "daily-b"),
        ("B", "daily-b"),
    ]
    assert b.table.is_committed("daily-b") and not a.table.is_committed("daily-a") and a.files_seen() == {}


def test_the_run_commit_checks_every_planned_unit_in_the_table(tmp_path, attempts):
    """The driver's own tally is not asked: a unit the table does not hold keeps the run uncommitted."""
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    assert p.commit_unit(UNIT, rows({"A": "result"}, version="m"))
    assert p.unit_committer().commit("empty-unit", rows({}, version="m"))  # no rows: its transaction says so
    units = [WorkUnit(f"{IN}/{n}.parquet", "parquet", 0, None, name=n) for n in (UNIT, "empty-unit", "never")]
    with pytest.raises(SinkError, match="holds 2 of its 3 units committed"):
        p.commit_run(Plan("backfill", IN, units, []))
    assert not p.table.is_committed("r1")
    p.commit_run(Plan("backfill", IN, units[:2], []))
    assert p.table.is_committed("r1")


def test_maintenance_holds_the_output_and_fences_a_stalled_holder_off(tmp_path, attempts):
    """`vacuum --force` and `compact` take the output as a run does: refused while a run is
    live; after `lease expire`, a stalled run of any id can commit nothing afterwards."""
    out = str(tmp_path / "out")
    a = zombie(other_run(tmp_path, attempts, "daily-a"))
    a.setup_run(LABELS)
    stalled = a.unit_committer()
    with pytest.raises(OutputLockedError):
        vacuum(out, retention_hours=0, force=True)
    Lease(a.store, "raypipe-cli").expire()
    vacuum(out, retention_hours=0, force=True)
    with pytest.raises(LeaseLostError):
        stalled.commit("shard-a", rows_of("daily-a", "shard-a", ["A"], version="old"))
    assert read_outcomes(out).num_rows == 0
    assert Lease(a.store, "raypipe-cli").current() is None  # vacuum gave the output back
    assert compact(out) == {"runs": 0}


def test_the_watermark_and_the_quarantine_are_fenced_commits(tmp_path, attempts):
    """A holder fenced off cannot move the watermark or change the quarantine; the watermark
    never goes back, and an earlier release's `watermark.json` is where it starts."""
    a = zombie(other_run(tmp_path, attempts, "daily-a"))
    a.store.write_json(a.store.state("watermark.json"), {"updated_at": "2026-01-01T00:00:00+00:00"})
    a.setup_run(LABELS)
    assert a.watermark() == datetime(2026, 1, 1, tzinfo=UTC)
    a.advance_watermark(datetime(2026, 2, 1, 12, 30, 0, 123456, tzinfo=UTC))
    a.advance_watermark(datetime(2026, 1, 15, tzinfo=UTC))  # an older run finishing late: kept
    assert a.watermark() == datetime(2026, 2, 1, 12, 30, 0, 123456, tzinfo=UTC)
    assert a.set_quarantine(["s3://b/in/x.parquet"], reason="broken") == ["s3://b/in/x.parquet"]
    Lease(a.store, "raypipe-cli").expire()
    b = other_run(tmp_path, attempts, "daily-b")
    b.setup_run(LABELS)
    with pytest.raises(LeaseLostError):
        a.advance_watermark(datetime(2027, 1, 1, tzinfo=UTC))
    with pytest.raises(LeaseLostError):
        a.set_quarantine(["s3://b/in/y.parquet"], reason="late")
    assert b.watermark() == datetime(2026, 2, 1, 12, 30, 0, 123456, tzinfo=UTC)
    assert b.quarantined() == frozenset({"s3://b/in/x.parquet"})

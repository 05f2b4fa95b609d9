"""The commit protocol object (`raypipe.commit.protocol`) on a real local Delta table: set up a
run, commit units, commit the run, abort; the plan and the files seen fenced like unit commits,
"committed" one truth (the table), an injected clock. No Ray. The table's own mechanics:
`test_table`.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.upkeep import finished_runs
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError, LeaseLostError
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
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
    p = CommitProtocol(output, "backfill", "r1", attempt=attempt, **kwargs)
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
    assert not p.is_committed() and p.committed_report() is None
    fence = p.setup_run(LABELS)
    assert fence.generation == 1
    assert p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))
    assert not p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))  # once
    assert p.committed_units(plan("a.parquet")) == {UNIT}
    p.commit_run({"why": "every unit"})
    assert protocol(tmp_path, attempts, "a2").is_committed()
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
        old.commit_run()
    assert not new.is_committed() and new.stored_plan() is None and new.files_seen() == {}
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
    p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    p.commit_run()
    p.release()
    assert not list((tmp_path / "out").rglob("COMMITTED.json"))
    assert finished_runs(str(tmp_path / "out")) == ["r1"]
    assert protocol(tmp_path, attempts, "a2").committed_report() is not None


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
    allowed = CommitProtocol(output, "backfill", "r1", attempt="a2")
    attempts.append(allowed)
    allowed.setup_run(LABELS)
    resumed_plan, resumed = allowed.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="bert-bbb")
    assert resumed and resumed_plan.model_version == "bert-aaa"

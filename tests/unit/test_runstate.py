"""A run's state on its output, on a real (local) Delta table: the plan and the files seen are
fenced like unit commits, and "committed" has one truth, the table (no Ray)."""

from __future__ import annotations

import pytest

from raypipe.api import build_config
from raypipe.commit.upkeep import finished_runs
from raypipe.errors import LeaseLostError
from raypipe.plan.plan import Plan
from raypipe.plan.units import WorkUnit
from raypipe.run.state import RunState
from tests.fakes import LABELS

IN = "/data/in"


def state(tmp_path, run_id="r1", *, force=False) -> RunState:
    cfg = build_config(
        input=IN,
        output=str(tmp_path / "out"),
        service="127.0.0.1:1",
        run_id=run_id,
        settings={"output": {"take_over_lease": force, "require_conditional_writes": False}},
    )
    return RunState(cfg.output, "backfill", run_id)


def plan(*shards: str) -> Plan:
    return Plan("backfill", IN, [WorkUnit(f"{IN}/{s}", "parquet", 0, None, fingerprint=f"fp-{s}") for s in shards], [])


def zombie(s: RunState) -> RunState:
    """An attempt whose lease check passed just before it stalled: its writes come later."""
    s.lease.check = lambda: None  # type: ignore[method-assign]
    return s


def test_a_fenced_off_attempt_cannot_replace_the_plan(tmp_path):
    old = state(tmp_path)
    old.begin(LABELS)
    old.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    new = state(tmp_path, force=True)
    new.begin(LABELS)
    zombie(old)
    with pytest.raises(LeaseLostError):
        old.save_plan(plan("zombie.parquet"))
    stored, resumed = state(tmp_path).plan(lambda: plan("never.parquet"), input_uri=IN, model_version="m")
    assert resumed and [u.shard for u in stored.units] == [f"{IN}/a.parquet"]


def test_a_fenced_off_attempt_cannot_rewrite_the_files_seen(tmp_path):
    old = state(tmp_path)
    old.begin(LABELS)
    new = state(tmp_path, force=True)
    new.begin(LABELS)
    done = plan("a.parquet")
    new.record_files_seen(done, {u.key for u in done.units})
    zombie(old)
    stale = plan("b.parquet")
    with pytest.raises(LeaseLostError):
        old.record_files_seen(stale, {u.key for u in stale.units})
    assert set(state(tmp_path).files_seen()) == {f"{IN}/a.parquet"}


def test_committed_has_one_truth_the_table(tmp_path):
    s = state(tmp_path)
    s.begin(LABELS)
    s.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    s.protocol.commit_run()
    s.release()
    assert not list((tmp_path / "out").rglob("COMMITTED.json"))
    assert finished_runs(str(tmp_path / "out")) == ["r1"]
    assert state(tmp_path).committed_report() is not None

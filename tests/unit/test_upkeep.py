"""Upkeep of an output (`raypipe.commit.upkeep`) on a real local Delta table: `migrate` from the
earlier layout, `vacuum` (its floor, and the state of old finished runs). No Ray."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raypipe
from raypipe.commit.fence import mark_committed, take_over
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.table import OutcomeTable
from raypipe.commit.upkeep import drop_finished_state, finished_runs, migrate, quarantine, quarantined, vacuum
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError, OutputLockedError
from raypipe.store import OutputStore
from tests.fakes import LABELS
from tests.unit.test_outcomes import T0, commit


def test_migrate_copies_committed_units_of_the_earlier_layout_once(tmp_path):
    store = OutputStore(str(tmp_path))
    base = {"status": ["ok"], "prob_joy": [0.9], "top_label": ["joy"], "model_version": ["m"], "run_id": ["old"]}
    for unit, committed in (("u1", True), ("u2", False)):  # u2: an attempt died before its marker
        path = tmp_path / "results" / "run=old" / f"{unit}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [f"id-{unit}"], **base}), path)
        if committed:
            store.write_json(store.run_state("old", "units", f"{unit}.json"), {"rows": 1})
    dead = tmp_path / "dead_letters" / "run=old" / "u1.parquet"
    dead.parent.mkdir(parents=True)
    failed_at = pa.array([T0], pa.timestamp("us", tz="UTC"))
    pq.write_table(
        pa.table({"id": ["id-dead"], "error_kind": ["internal"], "text": ["x"], "failed_at": failed_at}), dead
    )
    assert migrate(str(tmp_path)) == {"runs": 1, "rows": 2}
    assert migrate(str(tmp_path)) == {"runs": 0, "rows": 0}  # rerunnable
    rows = {r["id"]: r for r in raypipe.read_outcomes(str(tmp_path), "old").to_pylist()}
    assert set(rows) == {"id-u1", "id-dead"}
    assert rows["id-dead"]["outcome"] == "dead_letter" and rows["id-dead"]["inferred_at"] == T0


def test_migrate_marks_committed_only_the_legacy_runs_that_were(tmp_path):
    """A legacy run is committed only with its COMMITTED.json: a half-done legacy backfill,
    migrated, resumes its other units instead of saying "already committed"."""
    store = OutputStore(str(tmp_path))
    for run_id in ("done", "half"):
        path = tmp_path / "results" / f"run={run_id}" / "u1.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [f"{run_id}-1"], "status": ["ok"], "run_id": [run_id]}), path)
        store.write_json(store.run_state(run_id, "units", "u1.json"), {"rows": 1})
    store.write_json(store.run_state("done", "COMMITTED.json"), {"run_id": "done", "at": T0.isoformat()})
    assert migrate(str(tmp_path)) == {"runs": 2, "rows": 2}
    table = OutcomeTable(str(tmp_path))
    assert table.is_committed("done")
    assert not table.is_committed("half")
    assert table.committed_units("half") == {"u1"}  # its migrated unit is not redone on resume


def legacy_run(tmp_path, run_id: str, units: list[str], *, committed: bool) -> None:
    """A run of the earlier layout: a result file and a unit marker per unit."""
    store = OutputStore(str(tmp_path))
    for unit in units:
        path = tmp_path / "results" / f"run={run_id}" / f"{unit}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"id": [f"{run_id}-{unit}"], "status": ["ok"], "prob_joy": [0.5]}), path)
        store.write_json(store.run_state(run_id, "units", f"{unit}.json"), {"rows": 1})
    if committed:
        store.write_json(store.run_state(run_id, "COMMITTED.json"), {"run_id": run_id, "at": T0.isoformat()})


def test_a_migrated_half_done_run_of_several_units_can_resume(tmp_path):
    """Each legacy unit is its own file in the table, so a resume reads which are committed."""
    legacy_run(tmp_path, "half", ["u1", "u2", "u3"], committed=False)
    assert migrate(str(tmp_path)) == {"runs": 1, "rows": 3}
    assert OutcomeTable(str(tmp_path)).committed_units("half") == {"u1", "u2", "u3"}


def test_a_migrate_killed_between_its_copy_and_its_mark_is_finished_by_a_rerun(tmp_path, monkeypatch):
    legacy_run(tmp_path, "done", ["u1", "u2"], committed=True)
    from raypipe.commit import upkeep

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies after its units were copied

    monkeypatch.setattr(upkeep, "mark_committed", killed)
    with pytest.raises(KeyboardInterrupt):
        migrate(str(tmp_path))
    monkeypatch.undo()
    table = OutcomeTable(str(tmp_path))
    assert not table.is_committed("done")
    migrate(str(tmp_path))
    table.refresh()  # past the rerun's commits
    assert table.is_committed("done")
    assert sorted(raypipe.read_outcomes(str(tmp_path), "done").column("id").to_pylist()) == ["done-u1", "done-u2"]
    assert migrate(str(tmp_path)) == {"runs": 0, "rows": 0}


def test_vacuum_refuses_a_retention_under_the_floor_and_never_truncates(tmp_path):
    """A file a live attempt has written but not yet committed is younger than any unit: a
    retention under the floor is refused unless forced, and 0.9 h never becomes 0 h."""
    commit(tmp_path, "r1", "u1", ["a"], version="A", updated=T0)
    pending = tmp_path / "outcomes" / "run_id=r2" / "part-live.parquet"
    pending.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": ["b"]}), pending)
    with pytest.raises(ConfigError, match="--force"):
        vacuum(str(tmp_path), retention_hours=0.9)
    assert pending.exists()
    vacuum(str(tmp_path), retention_hours=0.9, force=True)
    assert pending.exists(), "written a moment ago: inside 0.9 h"
    two_hours_ago = time.time() - 2 * 3600
    os.utime(pending, (two_hours_ago, two_hours_ago))
    assert vacuum(str(tmp_path), retention_hours=0.9, force=True)["files"] == 1
    assert not pending.exists()
    assert raypipe.read_outcomes(str(tmp_path)).column("id").to_pylist() == ["a"]


def test_vacuum_drops_old_finished_runs_state_and_keeps_reports(tmp_path):
    """Finished means committed in the table; when, from the report (or an earlier release's
    COMMITTED.json)."""
    store = OutputStore(str(tmp_path))
    table = OutcomeTable(str(tmp_path))
    table.ensure(LABELS)
    now = datetime.now(UTC)
    for run_id, committed_at in (
        ("old", now - timedelta(days=30)),
        ("legacy", now - timedelta(days=30)),
        ("recent", now - timedelta(hours=1)),
        ("open", None),
    ):
        store.write_json(store.run_state(run_id, "plan.json"), {"units": []})
        store.write_json(store.run_state(run_id, "attempts", "a1.json"), {"calls": 1})
        # A run writes "completed" only after its run commit landed (an open run: "incomplete").
        report = {"run_id": run_id, "mode": "backfill", "status": "completed" if committed_at else "incomplete"}
        if committed_at is not None:
            mark_committed(table, take_over(table, run_id), run_id, {})
            if run_id == "legacy":
                store.write_json(store.run_state(run_id, "COMMITTED.json"), {"at": committed_at.isoformat()})
            else:
                report["finished_at"] = committed_at.isoformat()
        store.write_json(store.report_file(run_id), report)
    store.write_json(store.run_state("stale", "COMMITTED.json"), {"at": now.isoformat()})  # no run commit
    assert finished_runs(str(tmp_path)) == ["legacy", "old", "recent"]
    assert drop_finished_state(Output.at(str(tmp_path)), before=now - timedelta(days=7)) == 2
    assert not store.exists(store.run_state("old", "plan.json"))
    assert not store.exists(store.run_state("legacy", "plan.json"))
    assert store.exists(store.report_file("old"))
    assert store.exists(store.run_state("recent", "plan.json")) and store.exists(store.run_state("open", "plan.json"))


def test_the_quarantine_holds_what_an_operator_set_aside_until_released(tmp_path):
    out = str(tmp_path)
    store = OutputStore(out)
    store.write_json(store.state("quarantine.json"), {"shards": {"s3://b/in/old.parquet": {"reason": "r", "at": "t"}}})
    assert quarantined(Output.at(out)) == frozenset({"s3://b/in/old.parquet"})  # an earlier release's file
    assert quarantine(out, ["s3://b/in/x.parquet", "s3://b/in/y.parquet"], reason="vendor broke them") == [
        "s3://b/in/old.parquet",
        "s3://b/in/x.parquet",
        "s3://b/in/y.parquet",
    ]
    assert quarantine(out, ["s3://b/in/x.parquet", "s3://b/in/old.parquet"], reason="", release=True) == [
        "s3://b/in/y.parquet"
    ]
    assert quarantined(Output.at(out)) == frozenset({"s3://b/in/y.parquet"})
    assert len(store.list_files(store.state("quarantine"), ".json")) == 2  # immutable files, the table names one


def test_the_quarantine_is_changed_holding_the_output(tmp_path):
    """Not a read-modify-write beside a live run: refused while a run holds the output."""
    out = str(tmp_path)
    run = CommitProtocol(Output.at(OutputConfig(uri=out, require_conditional_writes=False)), "daily", "live")
    run.setup_run(LABELS)
    try:
        with pytest.raises(OutputLockedError):
            quarantine(out, ["s3://b/in/x.parquet"], reason="broken")
    finally:
        run.release()
    assert quarantined(Output.at(out)) == frozenset()
    assert quarantine(out, ["s3://b/in/x.parquet"], reason="broken") == ["s3://b/in/x.parquet"]

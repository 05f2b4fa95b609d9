"""The readers users script against (`raypipe.read_outcomes`, `raypipe.latest`) and `migrate`,
on a real local Delta table."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raypipe
from raypipe.commit.table import OutcomeTable, UnitCommitter
from raypipe.commit.upkeep import migrate, vacuum
from raypipe.errors import ConfigError
from raypipe.store import OutputStore
from tests.fakes import LABELS

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def commit(
    out,
    run_id: str,
    unit: str,
    ids: list[str],
    *,
    version: str,
    updated: datetime | None,
    outcome="result",
    inferred: datetime | None = None,
    source: str = "in.parquet",
):
    table = OutcomeTable(str(out))
    table.ensure(LABELS)
    n = len(ids)
    rows = pa.table(
        {
            "id": ids,
            "outcome": [outcome] * n,
            "unit": [unit] * n,
            "run_id": [run_id] * n,
            "status": ["ok" if outcome == "result" else None] * n,
            "model_version": [version] * n,
            "updated_at": pa.array([updated] * n, pa.timestamp("us", tz="UTC")),
            "inferred_at": pa.array([inferred or datetime.now(UTC)] * n, pa.timestamp("us", tz="UTC")),
            "source": [source] * n,
            "row": list(range(n)),
        }
    )
    assert UnitCommitter(table.take_over(run_id)).commit(unit, rows)


def test_latest_after_a_rebackfill_with_a_new_model_shows_the_new_model_for_every_id(tmp_path):
    """Backfill with model A, a daily that touched 10 rows, a backfill of the same input with
    model B: every id's latest row is model B's (the bug: backfill rows had no updated_at, and
    nulls sorted last put the daily's model-A rows first)."""
    ids = [f"p{i}" for i in range(30)]
    touched = ids[:10]
    commit(tmp_path, "backfill-a", "u1", ids, version="A", updated=T0)
    commit(tmp_path, "daily-1", "u1", touched, version="A", updated=T0 + timedelta(days=1))
    for chunk, unit in ((touched, "u1"), (ids[10:], "u2")):  # the input now has the daily's timestamps
        when = T0 + timedelta(days=1) if chunk is touched else T0
        commit(tmp_path, "backfill-b", unit, chunk, version="B", updated=when)
    latest = raypipe.latest(str(tmp_path))
    assert sorted(latest.column("id").to_pylist()) == sorted(ids)
    assert set(latest.column("model_version").to_pylist()) == {"B"}
    assert raypipe.read_outcomes(str(tmp_path)).num_rows == 30 + 10 + 30
    assert raypipe.read_outcomes(str(tmp_path), "daily-1").num_rows == 10


def test_a_dead_letter_wins_only_over_results_of_an_older_source_version(tmp_path):
    """A newer dead letter does not hide a valid result of the same source version; it does
    hide one of an older version (the row changed and its new text failed)."""
    commit(tmp_path, "r1", "u1", ["a", "b", "c"], version="A", updated=T0)
    commit(tmp_path, "r2", "u1", ["b"], version="B", updated=T0, outcome="dead_letter")
    commit(tmp_path, "r3", "u1", ["c"], version="A", updated=T0 + timedelta(days=1), outcome="dead_letter")
    commit(tmp_path, "r4", "u1", ["d"], version="A", updated=None, outcome="dead_letter")
    latest = {r["id"]: (r["outcome"], r["run_id"]) for r in raypipe.latest(str(tmp_path)).to_pylist()}
    assert latest == {
        "a": ("result", "r1"),
        "b": ("result", "r1"),
        "c": ("dead_letter", "r3"),
        "d": ("dead_letter", "r4"),
    }


def test_latest_breaks_ties_on_run_id_then_source_then_row(tmp_path):
    """Same source version, same inference instant: the greatest run id, then source, then row
    wins, every time, whatever order the files are scanned in."""
    at = T0 + timedelta(hours=1)
    commit(tmp_path, "r-c", "u2", ["x"], version="r-c/z", updated=T0, inferred=at, source="z.parquet")
    for run_id in ("r-b", "r-c", "r-a"):
        commit(tmp_path, run_id, "u1", ["x"], version=run_id, updated=T0, inferred=at)
    for _ in range(5):
        rows = raypipe.latest(str(tmp_path)).to_pylist()
        assert [(r["run_id"], r["source"]) for r in rows] == [("r-c", "z.parquet")]


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

"""The readers users script against (`raypipe.read_outcomes`, `raypipe.latest`) on a real local
Delta table; `migrate` and `vacuum` are `test_upkeep`'s."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa

import raypipe
from raypipe.commit.table import OutcomeTable, UnitCommitter
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

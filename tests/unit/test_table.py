"""The outcomes table (`raypipe.commit.table`) on a real local Delta table: fencing by the
table's own concurrency control, one commit per unit, crashes, a unit's latest `updated_at`
from the log, retention of unit transactions (no Ray).

The interleavings below are the ones that broke the earlier check-then-write protocol: an
attempt passes its check, stalls, and writes after a newer attempt took over.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import deltalake
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable
from raypipe.commit.upkeep import vacuum
from raypipe.errors import LeaseLostError
from tests.fakes import LABELS

UNIT = "shard-0-abc"


def rows(outcomes: dict[str, str], *, version: str) -> pa.Table:
    """A unit's rows: id -> "result" or "dead_letter", answered by model `version`."""
    ids = sorted(outcomes)
    return pa.table(
        {
            "id": ids,
            "outcome": [outcomes[i] for i in ids],
            "unit": [UNIT] * len(ids),
            "run_id": ["r1"] * len(ids),
            "status": ["ok" if outcomes[i] == "result" else None for i in ids],
            "error_kind": [None if outcomes[i] == "result" else "internal" for i in ids],
            "model_version": [version] * len(ids),
            "source": ["in.parquet"] * len(ids),
            "row": list(range(len(ids))),
        }
    )


def visible(out) -> Counter[tuple[str, str, str]]:
    t = read_outcomes(str(out), "r1")
    return Counter(
        zip(
            t.column("id").to_pylist(),
            t.column("outcome").to_pylist(),
            t.column("model_version").to_pylist(),
            strict=True,
        )
    )


def table_for(tmp_path) -> OutcomeTable:
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    return table


@pytest.mark.parametrize(
    "old, new",
    [
        ({"A": "result", "B": "dead_letter"}, {"A": "result", "B": "result"}),  # B would be lost
        ({"A": "result", "B": "result"}, {"A": "result", "B": "dead_letter"}),  # B would be twice
    ],
    ids=["old-dead-lettered", "new-dead-lettered"],
)
def test_a_stalled_commit_of_a_fenced_off_attempt_never_becomes_visible(tmp_path, monkeypatch, old, new):
    """Attempt 1 passes every check, stalls right before its write, attempt 2 takes over and
    commits the unit, then attempt 1's write goes on: the table rejects it, and every id is
    there once, as attempt 2 answered it."""
    table = table_for(tmp_path)
    first = UnitCommitter(take_over(table, "r1"))
    real = deltalake.write_deltalake
    entered, release = threading.Event(), threading.Event()

    def stalled(*args, **kwargs):
        if threading.current_thread().name == "attempt-1":
            entered.set()
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(deltalake, "write_deltalake", stalled)
    outcome: list[BaseException | bool] = []

    def attempt_1() -> None:
        try:
            outcome.append(first.commit(UNIT, rows(old, version="model-A")))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=attempt_1, name="attempt-1")
    thread.start()
    assert entered.wait(30), "attempt 1 never reached its write"
    second = UnitCommitter(take_over(table, "r1"))  # --force, or the lease expired
    assert second.fence.generation == first.fence.generation + 1
    assert second.commit(UNIT, rows(new, version="model-B")) is True
    release.set()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLostError), outcome
    assert visible(tmp_path / "out") == Counter({(i, o, "model-B"): 1 for i, o in new.items()})
    table.refresh()  # its snapshot, past the committers' commits
    assert table.committed_units("r1") == {UNIT}


def test_results_and_dead_letters_become_visible_in_the_same_commit(tmp_path):
    table = table_for(tmp_path)
    committer = UnitCommitter(take_over(table, "r1"))
    before = table.load().version()
    committer.commit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))
    dt = table.refresh()
    assert dt.version() == before + 1
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "dead_letter", "m"): 1})
    dt.load_as_version(before)
    assert dt.to_pyarrow_table().num_rows == 0


def test_a_commit_retried_in_the_same_generation_writes_nothing_twice(tmp_path):
    table = table_for(tmp_path)
    fence = take_over(table, "r1")
    assert UnitCommitter(fence).commit(UNIT, rows({"A": "result"}, version="m")) is True
    assert UnitCommitter(fence).commit(UNIT, rows({"A": "result"}, version="m")) is False
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1})


def test_files_a_crashed_writer_left_are_invisible_and_vacuumed(tmp_path):
    """A writer that died after writing its data file but before its commit: no reader sees the
    file, a redo commits the unit once, and `vacuum` deletes the orphan."""
    table = table_for(tmp_path)
    orphan = tmp_path / "out" / "outcomes" / "run_id=r1" / "part-crashed.parquet"
    orphan.parent.mkdir(parents=True)
    pq.write_table(rows({"A": "result", "B": "result"}, version="crashed").drop(["run_id"]), orphan)
    assert read_outcomes(str(tmp_path / "out")).num_rows == 0
    UnitCommitter(take_over(table, "r1")).commit(UNIT, rows({"A": "result", "B": "result"}, version="m"))
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "result", "m"): 1})
    done = vacuum(str(tmp_path / "out"), retention_hours=0, force=True)
    assert done["files"] >= 1 and not orphan.exists()
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "result", "m"): 1})


def _take_over(out: str, barrier, results) -> None:
    table = OutcomeTable(out)
    barrier.wait(110)  # spawn children import the table library first: seconds apart on loaded cores
    try:
        results.put(("won", take_over(table, "r1").generation))
    except LeaseLostError:
        results.put(("lost", 0))


def test_two_processes_taking_over_at_once_never_share_a_generation(tmp_path):
    table = table_for(tmp_path)
    take_over(table, "r1")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_take_over, args=(table.output_uri, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    got = [results.get(timeout=5) for _ in procs]
    generations = [g for kind, g in got if kind == "won"]
    assert generations and len(set(generations)) == len(generations), got
    table.refresh()  # past the other processes' take-overs
    assert table.generation() == max(generations)


def test_each_units_latest_updated_at_comes_from_the_logs_statistics_never_rounded_up(tmp_path):
    """What a shard planned whole from its size was read up to (`raypipe.plan.planning.with_whole_file_maxima`):
    Delta keeps timestamps to the millisecond, truncated, so a later rewrite is re-read from
    at most that millisecond and no row is skipped."""
    table = table_for(tmp_path)
    committer = UnitCommitter(take_over(table, "r1"))
    stamps = {
        "u-a": [datetime(2026, 1, 1, 0, 0, 0, 999_999, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC)],
        "u-b": [datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC), None],
        "u-c": [None, None],
    }
    for unit, ts in stamps.items():
        t = rows({"A": "result", "B": "dead_letter"}, version="m")
        t = t.set_column(t.schema.get_field_index("unit"), "unit", pa.array([unit, unit]))
        committer.commit(unit, t.append_column("updated_at", pa.array(ts, pa.timestamp("us", tz="UTC"))))
    table.refresh()  # past the committer's commits
    latest = table.max_updated_at_by_unit("r1")
    assert latest == {
        "u-a": datetime(2026, 1, 1, 0, 0, 0, 999_000, tzinfo=UTC),
        "u-b": datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC),
    }
    assert table.max_updated_at_by_unit("other-run") == {}


def test_unit_transactions_carry_last_updated_so_the_table_retention_prunes_them(tmp_path):
    """A unit's own transaction is kept for the table's transaction retention (90 days), not
    forever; the run's fencing slots carry no time and stay."""
    table = table_for(tmp_path)
    fence = take_over(table, "r1")
    long_ago = (datetime.now(UTC) - timedelta(days=100)).timestamp()
    assert UnitCommitter(fence, clock=lambda: long_ago).commit(UNIT, rows({"A": "result"}, version="m"))
    recent = "shard-1-def"
    assert UnitCommitter(fence).commit(
        recent, rows({"B": "result"}, version="m").set_column(2, "unit", pa.array([recent]))
    )
    dt = table.refresh()
    assert dt.transaction_version(f"raypipe/r1/unit/{UNIT}") is None  # expired: pruned
    assert dt.transaction_version(f"raypipe/r1/unit/{recent}") == fence.generation
    assert table.generation() == fence.generation


def test_scan_where_reads_files_a_merge_rewrote_and_prunes_by_statistics(tmp_path):
    """delta-rs's MERGE writes strings as string_view; a plain comparison with a string literal
    has no kernel for them (a run after a replay failed building its reuse index), and a cast
    alone would read every file of the run."""
    from deltalake import DeltaTable, write_deltalake

    from raypipe.commit.table import scan_where

    path = str(tmp_path / "t")
    for unit in ("u1", "u2", "u3"):
        rows = {"run_id": ["r"], "unit": [unit], "outcome": ["dead_letter"], "id": [f"a{unit}"]}
        write_deltalake(path, pa.table(rows), partition_by=["run_id"], mode="append")
    source = pa.table({"run_id": ["r"], "unit": ["u1"], "outcome": ["result"], "id": ["au1"]})
    predicate = "t.run_id = 'r' AND t.unit = 'u1' AND t.id = s.id"
    DeltaTable(path).merge(
        source, predicate=predicate, source_alias="s", target_alias="t"
    ).when_matched_update_all().execute()
    ds = DeltaTable(path).to_pyarrow_dataset()
    assert any(pa.types.is_string_view(f.physical_schema.field("unit").type) for f in ds.get_fragments())

    got = scan_where(ds, {"run_id": "r", "unit": "u1", "outcome": "result"}, ["id"])
    assert got.column("id").to_pylist() == ["au1"]
    got = scan_where(ds, {"unit": ["u2", "u3"], "outcome": "dead_letter"}, ["id"])
    assert sorted(got.column("id").to_pylist()) == ["au2", "au3"]
    assert scan_where(ds, {"unit": "none"}, ["id"]).num_rows == 0


def test_a_snapshot_moved_incrementally_is_opened_anew_past_reopen_after(tmp_path, monkeypatch):
    """A delta-rs snapshot moved by `update_incremental` makes every later write through it cost
    more; a run commits all its units through one, so its backfill's commits slowed with each
    unit committed (`bench/snapshot.py`). `refresh` opens it anew once it has moved
    `REOPEN_AFTER` versions, and the snapshot it hands out is then the new one."""
    from raypipe.commit import table as table_module

    monkeypatch.setattr(table_module, "REOPEN_AFTER", 3)
    table = table_for(tmp_path)
    first = table.refresh()
    opened = first.version()
    writer = OutcomeTable(str(tmp_path / "out"))  # another holder moves the table
    take_over(writer, "r1")
    take_over(writer, "r2")
    assert table.refresh() is first and first.version() == opened + 2  # moved, not reopened
    take_over(writer, "r3")
    again = table.refresh()
    assert again is not first and again.version() == opened + 3
    assert table.load() is again
    take_over(writer, "r4")
    assert table.refresh() is again  # counted from its own opening

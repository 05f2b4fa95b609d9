"""The readers users script against (`raypipe.read_outcomes`, `raypipe.latest`) on a real local
Delta table; `migrate` and `vacuum` are `test_upkeep`'s."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

import raypipe
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import latest_of
from raypipe.commit.schema import text_hashes
from raypipe.commit.table import OutcomeTable
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
    text: str | None = None,
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
            "text_hash": text_hashes([text] * n),
            "source": [source] * n,
            "row": list(range(n)),
        }
    )
    assert UnitCommitter(take_over(table, run_id)).commit(unit, rows)


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


def _latest(out) -> dict[str, tuple[str, str]]:
    return {r["id"]: (r["outcome"], r["run_id"]) for r in raypipe.latest(str(out)).to_pylist()}


def test_a_new_text_with_the_same_updated_at_is_a_new_version(tmp_path):
    """A producer rewrote the row's text without moving `updated_at`, and the new text failed:
    the old text's answer must not hide the new text's dead letter. The same text failing
    later does not hide its own result."""
    commit(tmp_path, "r1", "u1", ["a", "b"], version="A", updated=T0, text="old text")
    commit(tmp_path, "r2", "u1", ["a"], version="A", updated=T0, text="new text", outcome="dead_letter")
    commit(tmp_path, "r3", "u1", ["b"], version="A", updated=T0, text="old text", outcome="dead_letter")
    assert _latest(tmp_path) == {"a": ("dead_letter", "r2"), "b": ("result", "r1")}


def test_a_version_without_updated_at_is_placed_at_its_commit(tmp_path):
    """A producer that dropped the column: its later texts win over versions committed before,
    and lose to versions stamped after they were committed."""
    commit(tmp_path, "r1", "u1", ["a", "b"], version="A", updated=T0, text="stamped")
    commit(tmp_path, "r2", "u1", ["a", "b"], version="A", updated=None, text="unstamped")
    commit(
        tmp_path, "r3", "u1", ["b"], version="A", updated=datetime.now(UTC) + timedelta(days=1), text="stamped again"
    )
    assert _latest(tmp_path) == {"a": ("result", "r2"), "b": ("result", "r3")}


def test_an_id_twice_in_one_run_gives_the_same_answer_whichever_unit_commits_first(tmp_path):
    """Two texts of one id with one `updated_at` in one run: the winner is a rule of the texts
    (the greater `text_hash`), not of which unit the scheduler committed last."""
    winners = []
    for order in (("x", "y"), ("y", "x")):
        out = tmp_path / "-".join(order)
        for i, text in enumerate(order):
            at = T0 + timedelta(hours=1, seconds=i)
            commit(
                out, "r1", f"u{i}", ["a"], version=text, updated=T0, text=text, inferred=at, source=f"{text}.parquet"
            )
        winners.append(raypipe.latest(str(out)).column("model_version").to_pylist())
    assert winners[0] == winners[1]
    assert winners[0] == ["x" if text_hashes(["x"])[0].as_py() > text_hashes(["y"])[0].as_py() else "y"]


def test_a_replay_does_not_move_the_run_it_replays_after_later_runs(tmp_path):
    """A producer without `updated_at`: r1 saw the old text, r2 the new one; a replay of r1's
    dead letters afterwards writes rows of r1, and must not bring r1's old text back."""
    commit(tmp_path, "r1", "u1", ["a"], version="A", updated=None, text="old text")
    commit(tmp_path, "r1", "u2", ["b"], version="A", updated=None, text="failed once", outcome="dead_letter")
    commit(tmp_path, "r2", "u1", ["a"], version="A", updated=None, text="new text")
    commit(tmp_path, "r1", "u3", ["b"], version="A", updated=None, text="failed once")  # the replay's result
    assert _latest(tmp_path) == {"a": ("result", "r2"), "b": ("result", "r1")}


# --- `latest` against a plain model of the rule, over random committed histories -------------


@dataclass(frozen=True)
class Row:
    id: str
    run_id: str
    inferred_at: datetime
    updated_at: datetime | None
    text: str | None
    outcome: str
    source: str
    row: int

    @property
    def text_hash(self) -> int | None:
        return text_hashes([self.text])[0].as_py()


def _reference_latest(rows: list[Row]) -> dict[str, Row]:
    """The rule of docs/output-and-sql.md, written plainly."""
    place: dict[str, datetime] = {}  # a run's first commit
    for r in rows:
        place[r.run_id] = min(place.get(r.run_id, r.inferred_at), r.inferred_at)

    def low_null(value: object) -> tuple[bool, object]:  # a missing value sorts below every other
        return (value is not None, value if value is not None else 0)

    chosen = {}
    for id_ in {r.id for r in rows}:
        versions: dict[tuple[datetime | None, int | None], list[Row]] = {}
        for r in rows:
            if r.id == id_:
                versions.setdefault((r.updated_at, r.text_hash), []).append(r)

        def newness(item: tuple[tuple[datetime | None, int | None], list[Row]]) -> tuple[object, ...]:
            (updated_at, text_hash), version_rows = item
            seen = max(place[r.run_id] for r in version_rows)
            return (updated_at or seen, seen, low_null(text_hash), low_null(updated_at))

        _, newest = max(versions.items(), key=newness)
        chosen[id_] = max(
            newest,
            key=lambda r: (r.outcome == "result", place[r.run_id], r.inferred_at, r.run_id, r.source, r.row),
        )
    return chosen


_STAMPS = [None, T0, T0 + timedelta(days=1), T0 + timedelta(days=30)]


@st.composite
def _histories(draw: st.DrawFn) -> list[Row]:
    """Runs one after another (one writer at a time), each a few units committed at their own
    instants, rows of a few ids with stamps before, between and after the runs, or none. A run id
    may come back later (a replay writes into the run it replays; a resume after another run)."""
    run_ids = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1, max_size=6))
    rows: list[Row] = []
    clock = T0 + timedelta(days=draw(st.integers(-1, 2)))
    for run_id in run_ids:
        for unit in range(draw(st.integers(1, 3))):
            clock += timedelta(hours=draw(st.integers(0, 2)))  # units of a run may share an instant
            for _ in range(draw(st.integers(1, 4))):
                rows.append(
                    Row(
                        id=draw(st.sampled_from(["p", "q", "r"])),
                        run_id=run_id,
                        inferred_at=clock,
                        updated_at=draw(st.sampled_from(_STAMPS)),
                        text=draw(st.sampled_from([None, "", "calm", "furious"])),
                        outcome=draw(st.sampled_from(["result", "dead_letter"])),
                        source=f"s{unit}",
                        row=len(rows),
                    )
                )
        clock += timedelta(days=draw(st.integers(0, 20)))
    return rows


@settings(max_examples=300, deadline=None)
@given(_histories())
def test_latest_is_the_documented_rule(rows: list[Row]) -> None:
    ts = pa.timestamp("us", tz="UTC")
    table = pa.table(
        {
            "id": [r.id for r in rows],
            "outcome": [r.outcome for r in rows],
            "run_id": [r.run_id for r in rows],
            "updated_at": pa.array([r.updated_at for r in rows], ts),
            "inferred_at": pa.array([r.inferred_at for r in rows], ts),
            "text_hash": text_hashes([r.text for r in rows]),
            "source": [r.source for r in rows],
            "row": pa.array([r.row for r in rows], pa.int64()),
        }
    )
    got = {r["id"]: r["row"] for r in latest_of(table).to_pylist()}
    assert got == {id_: r.row for id_, r in _reference_latest(rows).items()}


def test_the_report_names_every_model_version_that_answered_rows(tmp_path):
    """A resume allowed to change model: the run's rows carry both versions, and its report
    names each with the rows it answered, not only the last one."""
    from raypipe.commit.outcomes import answered_versions
    from raypipe.report import RunReport

    commit(tmp_path, "r1", "u1", ["a", "b", "c"], version="bert-aaa", updated=T0)
    commit(tmp_path, "r1", "u2", ["d"], version="bert-bbb", updated=T0)
    commit(tmp_path, "r2", "u1", ["e"], version="bert-ccc", updated=T0)
    assert answered_versions(str(tmp_path), "r1") == {"bert-aaa": 3, "bert-bbb": 1}
    report = RunReport(run_id="r1", mode="backfill", model_version="bert-bbb")
    report.model_versions = answered_versions(str(tmp_path), "r1")
    assert "model         bert-bbb (rows answered by bert-aaa 3, bert-bbb 1)" in report.render()


def test_a_table_written_before_first_inferred_at_is_read_and_gains_it_at_its_next_run(tmp_path):
    """`latest` places runs by `coalesce(first_inferred_at, inferred_at)`: a table an earlier
    release wrote has no such column, and is read as if it were null until `ensure` (every
    run's start) adds it."""
    from deltalake import write_deltalake

    from raypipe.commit.schema import outcome_schema

    old = pa.schema([f for f in outcome_schema(LABELS) if f.name != "first_inferred_at"])
    row = {"id": "a", "outcome": "result", "unit": "u1", "run_id": "r1", "model_version": "A"}
    write_deltalake(str(tmp_path / "outcomes"), pa.Table.from_pylist([row], schema=old), partition_by=["run_id"])
    assert raypipe.latest(str(tmp_path)).column("id").to_pylist() == ["a"]
    OutcomeTable(str(tmp_path)).ensure(LABELS)
    assert "first_inferred_at" in OutcomeTable(str(tmp_path)).arrow_schema().names
    assert raypipe.latest(str(tmp_path)).column("first_inferred_at").to_pylist() == [None]

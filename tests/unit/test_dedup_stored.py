"""The stored reuse index (`raypipe.call.reuse.StoredIndex`) on a real (local) Delta table: a run
reads what was committed since the index, and brought up to date it holds what a full read of
the table holds, whatever the table went through (no Ray)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raypipe.call.reuse import INDEX_DIR, TextIndex, build_index, hash_texts
from raypipe.commit.fence import UnitCommitter, mark_committed, take_over
from raypipe.commit.schema import label_column, text_hashes
from raypipe.commit.table import OutcomeTable
from raypipe.commit.upkeep import compact, vacuum
from raypipe.store import STATE_DIR
from tests.fakes import LABELS, fake_probs

TEXTS = [f"text {k}" for k in range(6)]
VERSIONS = ("m1", "m2")


def answer(version: str, text: str) -> list[float]:
    """The answer a version gives a text: another version answers otherwise, so a mix shows."""
    return fake_probs(f"{version}:{text}")


def unit_rows(run_id: str, unit: str, texts: list[str], version: str, dead: list[bool]) -> pa.Table:
    """One unit's rows: a result per text, or a dead letter (no answer) where `dead` says so."""
    n = len(texts)
    probs = np.array([answer(version, t) for t in texts], dtype=np.float32)
    return pa.table(
        {
            "id": [f"{unit}-{i}" for i in range(n)],
            "outcome": ["dead_letter" if d else "result" for d in dead],
            "unit": [unit] * n,
            "run_id": [run_id] * n,
            "status": [None if d else "ok" for d in dead],
            "error_kind": ["internal" if d else None for d in dead],
            "model_version": [version] * n,
            "text": texts,
            "text_hash": text_hashes(texts),
            "truncated": [False] * n,
            **{
                label_column(x): pa.array(
                    [None if d else float(p[k]) for d, p in zip(dead, probs, strict=True)], pa.float32()
                )
                for k, x in enumerate(LABELS)
            },
            "source": ["in.parquet"] * n,
            "row": list(range(n)),
        }
    )


def commit_run(out: Path, run_id: str, units: dict[str, pa.Table]) -> None:
    table = OutcomeTable(str(out))
    table.ensure(LABELS)
    fence = take_over(table, run_id)
    committer = UnitCommitter(fence)
    for unit, rows in units.items():
        assert committer.commit(unit, rows)
    mark_committed(table, fence, run_id, {})


def answers(index: TextIndex | None) -> dict[int, tuple[tuple[float, ...], bool]]:
    """hash -> (answer, truncated): what an index serves."""
    if index is None:
        return {}
    hashes = np.concatenate([s.hashes[:n] for s, n in zip(index.load()._loaded or (), index.limits, strict=True)])
    at = index.lookup(hashes)
    return {
        int(h): (tuple(index.probabilities[p].tolist()), bool(index.truncated[p]))
        for h, p in zip(hashes, at, strict=True)
    }


def stored_dirs(out: Path) -> list[Path]:
    return sorted((out / STATE_DIR / INDEX_DIR).glob("*"))


def test_a_daily_reads_only_what_was_committed_since_the_stored_index(tmp_path):
    """The first build reads the table whole and stores the index; the next reads the stored
    index and the one file committed since (by the log entries after the version it covers),
    not the table's other files, and serves the same answers as a full read."""
    commit_run(
        tmp_path,
        "backfill",
        {f"u{k}": unit_rows("backfill", f"u{k}", TEXTS[k : k + 2], "m1", [False, False]) for k in range(4)},
    )
    _, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    assert not stats.from_stored and stats.table_files_read == 4 and stats.stored_rows_written == 5
    assert len(stored_dirs(tmp_path)) == 1

    commit_run(tmp_path, "daily-1", {"d1": unit_rows("daily-1", "d1", ["new text", TEXTS[0]], "m1", [False, False])})
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    assert stats.from_stored
    assert stats.table_files_read == 1  # the daily's file, not the backfill's four
    assert stats.log_entries_read == 3  # the daily's take-over, unit and run commits
    assert stats.rows_read == 5 + 2  # the stored index's distinct texts and the new file's rows
    assert stats.stored_rows_written == 1  # "new text": text 0 was held already
    assert answers(index) == answers(build_index(str(tmp_path), "m1", LABELS, max_rows=100, stored=False)[0])
    found = index.lookup(hash_texts(["new text", TEXTS[4], "never seen"]))
    assert found[0] >= 0 and found[1] >= 0 and found[2] == -1
    np.testing.assert_allclose(index.probabilities[found[0]], answer("m1", "new text"))

    again, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    assert stats.from_stored and stats.table_files_read == 0 and stats.log_entries_read == 0
    assert stats.stored_rows_written == 0
    assert answers(again) == answers(index)


def test_a_lost_or_corrupt_stored_index_is_rebuilt_by_the_full_read(tmp_path):
    """A stored index deleted, a file of it or its log overwritten with garbage: the run reads
    the table whole (same answers) and stores it again; the run after that reads from it again."""
    commit_run(tmp_path, "r1", {"u1": unit_rows("r1", "u1", TEXTS[:3], "m1", [False] * 3)})
    full = answers(build_index(str(tmp_path), "m1", LABELS, max_rows=100, stored=False)[0])
    build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    for damage in ("lost", "corrupt", "corrupt log"):
        (where,) = stored_dirs(tmp_path)
        if damage == "lost":
            shutil.rmtree(where)
        elif damage == "corrupt":
            for part in where.glob("*.parquet"):
                part.write_bytes(b"not parquet at all")
        else:
            for entry in (where / "_delta_log").iterdir():
                entry.write_bytes(b"{not json")
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
        assert not stats.from_stored and stats.table_files_read == 1, damage
        assert answers(index) == full, damage
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
        assert stats.from_stored and stats.table_files_read == 0 and answers(index) == full, damage


def test_an_answer_deleted_from_the_table_leaves_the_stored_index(tmp_path):
    """Another tool deletes rows (a commit that removes answers raypipe's commits never remove):
    the run reads the table whole, and the deleted answer is not served."""
    from deltalake import DeltaTable

    commit_run(tmp_path, "r1", {"u1": unit_rows("r1", "u1", TEXTS[:3], "m1", [False] * 3)})
    build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    gone = int(hash_texts([TEXTS[0]])[0])
    DeltaTable(str(tmp_path / "outcomes")).delete(f"text_hash = {gone}")
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=100)
    assert not stats.from_stored
    assert gone not in answers(index) and len(answers(index)) == 2


# One step of a table's life: a run's commits, a replay, compact, vacuum, the log's retention, a
# delete by another tool, the stored index lost or corrupt; then a build from the stored index.
_commit = st.tuples(
    st.just("commit"),
    st.sampled_from(VERSIONS),
    st.lists(st.tuples(st.sampled_from(TEXTS), st.booleans()), min_size=1, max_size=4),
)
_step = st.one_of(
    _commit,
    st.tuples(st.just("replay"), st.integers(0, 10)),
    st.tuples(st.just("delete"), st.sampled_from(TEXTS)),
    st.sampled_from([("compact",), ("vacuum",), ("log-expired",), ("lost",), ("corrupt",)]),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, min_size=1, max_size=7))
@example(steps=[("delete", TEXTS[0])])
@example(
    steps=[
        ("commit", "m1", [(TEXTS[1], True), (TEXTS[2], False), (TEXTS[3], False)]),
        ("replay", 1),
        ("compact",),
        ("commit", "m2", [(TEXTS[1], False), (TEXTS[4], True)]),
        ("vacuum",),
        ("log-expired",),
        ("commit", "m1", [(TEXTS[5], False)]),
        ("corrupt",),
        ("lost",),
    ]
)
def test_brought_up_to_date_it_equals_a_full_read(steps):
    """After any sequence of commits (results and dead letters, two model versions), replays,
    compactions, vacuums, the log's retention passing, deletes by another tool, and the stored
    index lost or corrupt, the index built from the stored one serves exactly what a full read
    of the table serves, for each version: no answer missing, none stale, none of another version."""
    from deltalake import DeltaTable

    with tempfile.TemporaryDirectory(prefix="raypipe-stored-") as tmp:
        out = Path(tmp)
        runs: list[tuple[str, dict[str, pa.Table]]] = []
        serial = itertools.count()
        for step in [("commit", "m1", [(TEXTS[0], False)]), *steps]:
            kind = step[0]
            if kind == "commit":
                _, version, rows = step
                run_id = f"run-{next(serial)}"
                texts = [t for t, _ in rows]
                dead = [d for _, d in rows]
                half = max(1, len(texts) // 2)  # two units, two files: something for compact
                units = {
                    f"{run_id}-a": unit_rows(run_id, f"{run_id}-a", texts[:half], version, dead[:half]),
                    f"{run_id}-b": unit_rows(
                        run_id,
                        f"{run_id}-b",
                        texts[half:] or texts[:1],
                        version,
                        dead[:1] if len(texts) == 1 else dead[half:],
                    ),
                }
                commit_run(out, run_id, units)
                runs.append((run_id, units))
            elif kind == "replay":
                run_id, units = runs[step[1] % len(runs)]
                unit, rows = sorted(units.items())[0]
                version = rows.column("model_version")[0].as_py()
                texts = rows.column("text").to_pylist()
                replayed = unit_rows(run_id, unit, texts, version, [False] * len(texts))
                replayed = replayed.filter(pa.compute.equal(rows.column("outcome"), "dead_letter"))
                if replayed.num_rows:
                    table = OutcomeTable(str(out))
                    fence = take_over(table, f"{run_id}.replay-{next(serial)}")
                    UnitCommitter(fence).commit(unit, replayed, replace_dead_letters=True)
            elif kind == "compact":
                compact(str(out))
            elif kind == "vacuum":
                vacuum(str(out), retention_hours=0, force=True)
            elif kind == "log-expired":
                dt = DeltaTable(str(out / "outcomes"))
                dt.create_checkpoint()
                for entry in (out / "outcomes" / "_delta_log").glob("*.json"):
                    if int(entry.stem) < dt.version():
                        entry.unlink()
            elif kind == "delete":
                text = step[1]
                DeltaTable(str(out / "outcomes")).delete(f"text_hash = {int(hash_texts([text])[0])}")
            elif kind == "lost":
                for where in stored_dirs(out):
                    shutil.rmtree(where)
            elif kind == "corrupt":
                for part in itertools.islice((p for d in stored_dirs(out) for p in d.glob("*.parquet")), 1):
                    part.write_bytes(b"garbage")
            for version in VERSIONS:
                built, _ = build_index(str(out), version, LABELS, max_rows=100)
                full, _ = build_index(str(out), version, LABELS, max_rows=100, stored=False)
                assert answers(built) == answers(full), (step, version)
                again, stats = build_index(str(out), version, LABELS, max_rows=100)
                assert stats.from_stored and stats.table_files_read == 0, (step, version)  # stored again
                assert answers(again) == answers(full), (step, version)
                for h, (probs, _) in answers(built).items():
                    (text,) = [t for t in TEXTS if int(hash_texts([t])[0]) == h]
                    np.testing.assert_allclose(probs, answer(version, text), rtol=1e-6)


def test_with_ray_the_stored_index_is_brought_up_to_date_as_in_this_process(tmp_path, monkeypatch):
    """The shuffle as Ray tasks (a fake Ray that runs them at once) over the stored index and
    the files committed since: the same answers as a full read, the new rows stored from the
    object store's shards."""
    import sys

    from tests.unit.test_dedup import _FakeRay

    texts = [f"paragraph {i}" for i in range(60)]
    commit_run(tmp_path, "r1", {"u1": unit_rows("r1", "u1", texts[:40], "m1", [False] * 40)})
    monkeypatch.setitem(sys.modules, "ray", _FakeRay())
    _, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, shard_rows=16)
    assert stats.built_with_ray and not stats.from_stored and stats.stored_rows_written == 40
    commit_run(tmp_path, "r2", {"u2": unit_rows("r2", "u2", texts[30:], "m1", [False] * 30)})
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, shard_rows=16)
    assert stats.built_with_ray and stats.from_stored and stats.table_files_read == 1
    assert stats.stored_rows_written == 20
    assert index is not None
    index.load()
    assert answers(index) == answers(build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, stored=False)[0])

"""The reuse index on a real (local) Delta table: distinct texts, the cap, and its memory."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from raypipe.dedup import build_index, hash_texts
from raypipe.sinks import OutcomeTable, UnitCommitter, label_column, text_hashes
from tests.fakes import LABELS, fake_probs


def commit_results(out, run_id: str, unit: str, texts: list[str], *, version: str = "m1") -> None:
    table = OutcomeTable(str(out))
    table.ensure(LABELS)
    n = len(texts)
    probs = np.array([fake_probs(t) for t in texts], dtype=np.float32)
    rows = pa.table(
        {
            "id": [f"{unit}-{i}" for i in range(n)],
            "outcome": ["result"] * n,
            "unit": [unit] * n,
            "run_id": [run_id] * n,
            "status": ["ok"] * n,
            "model_version": [version] * n,
            "text_hash": text_hashes(texts),
            "truncated": [False] * n,
            **{label_column(x): probs[:, k] for k, x in enumerate(LABELS)},
            "source": ["in.parquet"] * n,
            "row": list(range(n)),
        }
    )
    assert UnitCommitter(table.take_over(run_id)).commit(unit, rows)


def test_the_cap_counts_distinct_texts_not_copies(tmp_path):
    """Two texts committed five times over (reruns, copies): within a cap of 2 distinct texts."""
    for run in ("r1", "r2"):
        commit_results(tmp_path, run, "u1", ["a", "b", "a"])
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=2)
    assert index is not None and len(index) == 2
    assert (stats.distinct_texts, stats.capped) == (2, False)
    found = index.lookup(hash_texts(["a", "b", "c"]))
    assert found[2] == -1 and (found[:2] >= 0).all()
    np.testing.assert_allclose(index.probabilities[found[0]], fake_probs("a"))


def test_a_capped_index_keeps_reusing_and_says_so(tmp_path, caplog):
    """More distinct texts than the cap: reuse goes on for `cap` of them (not off), the log and
    the stats say so."""
    commit_results(tmp_path, "r1", "u1", [f"text {i}" for i in range(10)])
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=4)
    assert index is not None and len(index) == 4
    assert stats.capped and stats.cap == 4 and stats.distinct_texts == 4 and stats.rows_read == 10
    assert "max_index_rows" in caplog.text
    assert stats.to_dict()["capped"] is True


def test_memory_per_distinct_text_at_a_million(tmp_path):
    """1M distinct texts committed (six labels): the index holds 33 bytes a text (8 hash + 6
    float32 + 1 flag), and building it peaks at a small multiple of that, not at every row."""
    import tracemalloc

    n, units = 1_000_000, 4
    table = OutcomeTable(str(tmp_path))
    table.ensure(LABELS)
    rng = np.random.default_rng(7)
    hashes = rng.choice(np.iinfo(np.int64).max, size=n, replace=False).astype(np.int64)
    committer = UnitCommitter(table.take_over("big"))
    for k, chunk in enumerate(np.array_split(hashes, units)):
        m = len(chunk)
        committer.commit(
            f"u{k}",
            pa.table(
                {
                    "id": pa.array(np.arange(m).astype(str)),
                    "outcome": pa.array(["result"] * m),
                    "unit": pa.array([f"u{k}"] * m),
                    "run_id": pa.array(["big"] * m),
                    "status": pa.array(["ok"] * m),
                    "model_version": pa.array(["m1"] * m),
                    "text_hash": pa.array(chunk),
                    **{label_column(x): pa.array(rng.random(m, dtype=np.float32)) for x in LABELS},
                }
            ),
        )
    pool = pa.default_memory_pool()
    tracemalloc.start()
    try:
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=20_000_000)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index is not None and stats.distinct_texts == n and not stats.capped
    held = index.hashes.nbytes + index.probabilities.nbytes + index.truncated.nbytes
    print(
        f"reuse index: {held / n:.1f} bytes/text held, numpy peak {numpy_peak / n:.1f} bytes/text while "
        f"building, Arrow pool peak {pool.max_memory() / 2**20:.0f} MiB"
    )
    assert held / n == 8 + 4 * len(LABELS) + 1
    assert numpy_peak / n < 6 * held / n

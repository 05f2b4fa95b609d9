"""The reuse index on a real (local) Delta table: distinct texts, the cap, and its memory."""

from __future__ import annotations

import logging
import pickle
import sys
import types

import numpy as np
import pyarrow as pa

from raypipe.call.reuse import IndexShard, TextIndex, build_index, hash_texts, shard_bounds
from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.schema import label_column, text_hashes
from raypipe.commit.table import OutcomeTable
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
    assert UnitCommitter(take_over(table, run_id)).commit(unit, rows)


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
    assert stats.committed_texts == 10
    assert "max_index_rows" in caplog.text
    assert stats.to_dict()["capped"] is True


def test_memory_per_distinct_text_at_a_million(tmp_path):
    """1M distinct texts committed (six labels), built in this process in 8 shards: the index
    holds 33 bytes a text (8 hash + 6 float32 + 1 flag), and building it peaks at a small
    multiple of that (every slice and shard here: with Ray, the object store holds them)."""
    import tracemalloc

    n, units = 1_000_000, 4
    table = OutcomeTable(str(tmp_path))
    table.ensure(LABELS)
    rng = np.random.default_rng(7)
    hashes = rng.choice(np.iinfo(np.int64).max, size=n, replace=False).astype(np.int64)
    hashes[::2] *= -1  # both halves of the int64 space, as BLAKE2b gives
    committer = UnitCommitter(take_over(table, "big"))
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
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=20_000_000, shard_rows=n // 8, use_ray=False)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index is not None and stats.distinct_texts == n and not stats.capped and stats.shards == 8
    held = index.nbytes
    print(
        f"reuse index: {held / n:.1f} bytes/text held, numpy peak {numpy_peak / n:.1f} bytes/text while "
        f"building, Arrow pool peak {pool.max_memory() / 2**20:.0f} MiB"
    )
    assert held / n == 8 + 4 * len(LABELS) + 1 == stats.index_bytes / n
    assert numpy_peak / n < 6 * held / n
    # Each shard holds about an eighth: routing by hash range, not a copy of the whole.
    assert max(len(s.hashes) for s in index.shards) < n / 8 * 1.1
    sample = rng.choice(hashes, 10_000)
    found = index.lookup(sample)
    assert (found >= 0).all()
    np.testing.assert_array_equal(index.lookup(-sample[sample > 0] - 1) >= 0, np.isin(-sample[sample > 0] - 1, hashes))


def test_sharded_lookups_route_every_hash_to_its_range(tmp_path):
    """Shards of a few rows each: every committed text is found with its own answer, in
    whichever shard its hash falls, and texts never committed are not."""
    texts = [f"paragraph {i}" for i in range(200)]
    for unit, part in enumerate(np.array_split(np.array(texts), 5)):
        commit_results(tmp_path, "r1", f"u{unit}", list(part))
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, shard_rows=16, use_ray=False)
    assert index is not None and stats.shards == 13 and len(index.shards) == 13
    assert stats.distinct_texts == stats.committed_texts == 200 and not stats.capped
    assert min(len(s.hashes) for s in index.shards) > 0  # hashes spread over every range
    probe = texts + [f"never committed {i}" for i in range(100)]
    found = index.lookup(hash_texts(probe))
    assert (found[:200] >= 0).all() and (found[200:] == -1).all()
    assert len(set(found[:200].tolist())) == 200
    np.testing.assert_allclose(index.probabilities[found[:200]], [fake_probs(t) for t in texts], rtol=1e-6)
    assert not index.truncated[found[:200]].any()
    assert index.nbytes == 200 * (8 + 4 * len(LABELS) + 1)


def test_hashes_at_the_edges_of_the_ranges():
    """Hashes equal to a shard's lowest, one below it, and the int64 extremes: each found in
    its own shard, and its neighbours that were never committed are not."""
    bounds = shard_bounds(4)
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    held = np.sort(np.array([lo, *bounds, *(bounds - 1), hi], dtype=np.int64))
    which = np.searchsorted(bounds, held, side="right")
    shards = [
        IndexShard(held[which == k], np.tile(held[which == k, None].astype(np.float32), 2), which[which == k] % 2 == 0)
        for k in range(4)
    ]
    assert [len(s.hashes) for s in shards] == [2, 2, 2, 2]
    index = TextIndex.of_shards("m1", ("a", "b"), bounds, shards, [2, 2, 2, 2])
    found = index.lookup(held)
    assert found.tolist() == list(range(8))
    np.testing.assert_array_equal(index.probabilities[found][:, 0], held.astype(np.float32))
    assert index.truncated[found].tolist() == (which % 2 == 0).tolist()
    misses = np.array([lo + 1, hi - 1, *(bounds + 1), *(bounds - 2)], dtype=np.int64)
    assert (index.lookup(misses) == -1).all()
    # A copy (what Ray ships to each actor) answers alike.
    assert pickle.loads(pickle.dumps(index)).lookup(held).tolist() == list(range(8))


def test_a_cap_across_shards_keeps_the_smallest_hashes(tmp_path, caplog):
    """The cap falls inside a shard: exactly `cap` texts answer, the smallest hashes, over
    every shard before it; the others are misses, and the log and stats say so."""
    texts = [f"text {i}" for i in range(100)]
    commit_results(tmp_path, "r1", "u1", texts)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=37, shard_rows=10, use_ray=False)
    assert index is not None and len(index) == 37 and stats.shards == 10
    assert (stats.capped, stats.distinct_texts, stats.committed_texts, stats.cap) == (True, 37, 100, 37)
    assert "max_index_rows" in caplog.text and "100 distinct texts" in caplog.text
    hashes = hash_texts(texts)
    found = index.lookup(hashes)
    smallest = np.argsort(hashes)[:37]
    assert set(np.flatnonzero(found >= 0).tolist()) == set(smallest.tolist())
    np.testing.assert_allclose(
        index.probabilities[found[smallest]], [fake_probs(texts[i]) for i in smallest], rtol=1e-6
    )


def test_an_answer_of_another_version_is_never_served(tmp_path):
    """Same texts committed by another model version: nothing to reuse (no index)."""
    commit_results(tmp_path, "r1", "u1", ["a", "b"], version="m0")
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=10, use_ray=False)
    assert index is None and stats.distinct_texts == 0 and not stats.capped


class _Ref:
    def __init__(self, value) -> None:
        self.value = value


class _FakeRay(types.ModuleType):
    """Just what `build_index` uses of Ray: tasks run at once, in this process, and every
    task's options are recorded."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.options: list[dict] = []

    def remote(self, fn):
        fake = self

        class Task:
            def options(self, **kw):
                fake.options.append(kw)
                returns = kw.get("num_returns", 1)

                class Bound:
                    @staticmethod
                    def remote(*args):
                        args = [a.value if isinstance(a, _Ref) else a for a in args]
                        out = fn(*args)
                        return [_Ref(v) for v in out] if returns > 1 else _Ref(out)

                return Bound()

        return Task()

    def get(self, refs):
        return [r.value for r in refs]

    def is_initialized(self) -> bool:
        return True


def test_the_index_tasks_fit_beside_the_default_replica(tmp_path, monkeypatch):
    """Built by Ray tasks (here a fake Ray that runs them at once), every task asks for no more
    CPU than a default replica leaves on a node (a task asking for more is never scheduled, and
    the run waits for it forever), and the index answers as the one built in this process."""
    from serve_app.deploy import fit_replicas

    texts = [f"paragraph {i}" for i in range(120)]
    for unit, part in enumerate(np.array_split(np.array(texts), 3)):
        commit_results(tmp_path, "r1", f"u{unit}", list(part))
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    index, stats = build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, shard_rows=32)
    assert stats.built_with_ray and stats.shards == 4 and stats.distinct_texts == 120
    assert fake.options and all("num_cpus" in kw for kw in fake.options)
    for node_cpus in (1, 2, 4, 8, 16):
        replicas, each = fit_replicas(node_cpus)
        left = node_cpus - replicas * each
        assert max(kw["num_cpus"] for kw in fake.options) <= left, (node_cpus, fake.options)
    assert index is not None
    index.load()  # maps the shards through the fake's `get`
    here, _ = build_index(str(tmp_path), "m1", LABELS, max_rows=1_000, shard_rows=32, use_ray=False)
    assert here is not None
    probe = hash_texts([*texts, "never committed"])
    assert (index.lookup(probe) == here.lookup(probe)).all() and index.lookup(probe)[-1] == -1

"""The in-memory answer lookup: `TextIndex`, the answers of one model version by text hash.

The index is cut by hash range into shards (`IndexShard`: sorted hashes and their answers),
each covering an equal slice of the int64 space, so a lookup routes each hash to its shard
and finds it there by binary search, whole batches at a time in numpy. The shards are held
here or in Ray's object store (mapped without a copy on first use). Built by `scan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.schema import OUTCOME_RESULT, RESULT_STATUS_OK, label_column, text_hashes

__all__ = [
    "SHARD_ROWS",
    "IndexShard",
    "TextIndex",
    "answer_columns",
    "answered",
    "hash_texts",
    "merge_slices",
    "shard_bounds",
]

#: Committed rows (copies of a text included) per shard and per reading task: a task's
#: memory is a small multiple of this times ~33 bytes, whatever the corpus.
SHARD_ROWS = 1 << 22


def hash_texts(texts: list[str | None]) -> np.ndarray:
    """The `text_hash` of each text (int64; 0 for a null text)."""
    return text_hashes(texts).fill_null(0).to_numpy()


def answered(model_version: str) -> pc.Expression:
    """Outcome rows that are committed answers of `model_version`: ok results with a text hash.

    Files a MERGE rewrote (a replay's) store their strings as string_view, the others as string;
    comparing a column cast to string holds for both (a plain comparison has no kernel for a view)."""
    return (
        (pc.field("model_version").cast(pa.string()) == model_version)
        & (pc.field("outcome").cast(pa.string()) == OUTCOME_RESULT)
        & (pc.field("status").cast(pa.string()) == RESULT_STATUS_OK)
        & pc.field("text_hash").is_valid()
    )


def answer_columns(
    rows: pa.Table | pa.RecordBatch, labels: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The answers `rows` hold, in their order: hashes (int64), probabilities (float32 [rows,
    labels]) and the truncation flag (a null one read as False)."""
    hashes = rows.column("text_hash").to_numpy()
    probs = np.column_stack([rows.column(label_column(x)).to_numpy(zero_copy_only=False) for x in labels]).astype(
        np.float32
    )
    truncated = rows.column("truncated").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    return hashes, probs, truncated


def shard_bounds(shards: int) -> np.ndarray:
    """The lowest hash of shards 1..`shards`-1: equal slices of the int64 space (BLAKE2b is
    uniform, so the shards are alike in size)."""
    width = -(-(1 << 64) // shards)
    return np.array([-(1 << 63) + k * width for k in range(1, shards)], dtype=np.int64)


@dataclass(frozen=True)
class IndexShard:
    """The answers of one hash range: `hashes` sorted and distinct, row k answering hash k."""

    hashes: np.ndarray  # int64 [n]
    probabilities: np.ndarray  # float32 [n, labels]
    truncated: np.ndarray  # bool [n]

    @property
    def nbytes(self) -> int:
        return int(self.hashes.nbytes + self.probabilities.nbytes + self.truncated.nbytes)


class _Rows:
    """One answer column of a sharded index, indexed by `TextIndex.lookup`'s positions."""

    def __init__(self, index: TextIndex, column: str) -> None:
        self._index, self._column = index, column

    def __getitem__(self, positions: np.ndarray | int) -> np.ndarray:
        if np.ndim(positions) == 0:
            return self[np.array([positions])][0]
        positions = np.asarray(positions, dtype=np.int64)
        shards = self._index.load()._loaded or ()
        offsets = self._index.offsets
        which = np.searchsorted(offsets, positions, side="right") - 1
        # Positions past the shards' are the answers added since (`TextIndex.add`).
        parts = [getattr(s, self._column) for s in (*shards, self._index._added)]
        out = np.empty((len(positions), *parts[0].shape[1:]), dtype=parts[0].dtype)
        for k in np.unique(which):
            sel = which == k
            out[sel] = parts[k][positions[sel] - offsets[k]]
        return out


class TextIndex:
    """Answers of one model version by text hash, cut by hash range into shards.

    `shards` are `IndexShard`s or Ray object references to them (resolved once, on first use,
    zero-copy); `limits[k]` is how many of shard k's rows count (fewer when capped). Positions
    from `lookup` index `probabilities`, `truncated` as if the shards were one array.

    Answers committed after it was built are added with `add_committed` (kept in this process,
    past the shards' positions), so a long-lived actor reuses what it committed itself."""

    def __init__(
        self,
        model_version: str,
        labels: tuple[str, ...],
        hashes: np.ndarray,
        probabilities: np.ndarray,
        truncated: np.ndarray,
    ) -> None:
        """One shard: `hashes` sorted and distinct, row k of the answers answering hash k."""
        self._setup(
            model_version,
            labels,
            np.empty(0, np.int64),
            [IndexShard(hashes, probabilities, truncated)],
            [len(hashes)],
        )

    @classmethod
    def of_shards(
        cls,
        model_version: str,
        labels: tuple[str, ...],
        bounds: np.ndarray,
        shards: Sequence[Any],
        limits: Sequence[int],
    ) -> TextIndex:
        """Shard k covers hashes from `bounds[k-1]` (inclusive) to `bounds[k]`; its first
        `limits[k]` rows count."""
        index = cls.__new__(cls)
        index._setup(model_version, labels, bounds, shards, limits)
        return index

    def _setup(
        self,
        model_version: str,
        labels: tuple[str, ...],
        bounds: np.ndarray,
        shards: Sequence[Any],
        limits: Sequence[int],
    ) -> None:
        assert len(shards) == len(limits) == len(bounds) + 1
        self.model_version = model_version
        self.labels = tuple(labels)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.shards = tuple(shards)
        self.limits = np.asarray(limits, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.limits)]).astype(np.int64)
        self._added = merge_slices(width=len(self.labels))
        self._loaded: tuple[IndexShard, ...] | None = None
        if all(isinstance(s, IndexShard) for s in self.shards):
            self._loaded = self.shards

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loaded"] = None  # a copy maps the shards itself
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if all(isinstance(s, IndexShard) for s in self.shards):
            self._loaded = self.shards

    def __len__(self) -> int:
        return int(self.offsets[-1]) + len(self._added.hashes)

    @property
    def nbytes(self) -> int:
        """Bytes of the shards (mapped, not copied, when they live in Ray's object store) and
        of the answers added since."""
        return sum(s.nbytes for s in self.load()._loaded or ()) + self._added.nbytes

    @classmethod
    def empty(cls, model_version: str, labels: tuple[str, ...]) -> TextIndex:
        """No answers yet: what `add_committed` adds to."""
        return cls(
            model_version, labels, np.empty(0, np.int64), np.empty((0, len(labels)), np.float32), np.empty(0, bool)
        )

    def add_committed(self, rows: pa.Table) -> int:
        """Adds the answers of `rows` (a unit's outcome rows, just committed: the caller's
        promise) that are results of this model version and not held yet; returns how many.
        They stay in this process: a copy elsewhere (another actor) does not see them."""
        names = set(rows.column_names)
        needed = {"outcome", "status", "model_version", "text_hash", "truncated", *map(label_column, self.labels)}
        if not rows.num_rows or not needed <= names:
            return 0
        rows = rows.filter(answered(self.model_version))
        if not rows.num_rows:
            return 0
        hashes, probs, truncated = answer_columns(rows, self.labels)
        new = self.lookup(hashes) < 0
        if not new.any():
            return 0
        before = len(self._added.hashes)
        self._added = merge_slices(self._added, IndexShard(hashes[new], probs[new], truncated[new]))
        return len(self._added.hashes) - before

    def load(self) -> TextIndex:
        """Maps the shards held in Ray's object store (once; a blocking `ray.get`). Returns self."""
        if self._loaded is None:
            import ray

            refs = [s for s in self.shards if not isinstance(s, IndexShard)]
            got = iter(ray.get(refs))
            self._loaded = tuple(s if isinstance(s, IndexShard) else next(got) for s in self.shards)
        return self

    @property
    def probabilities(self) -> _Rows:
        """float32 [positions, labels] by `lookup` position."""
        return _Rows(self, "probabilities")

    @property
    def truncated(self) -> _Rows:
        """bool [positions] by `lookup` position."""
        return _Rows(self, "truncated")

    def lookup(self, hashes: np.ndarray) -> np.ndarray:
        """For each hash, the position of its answer, or -1. Vectorized: one binary search per
        hash in its shard, one numpy pass per shard the batch touches."""
        hashes = np.asarray(hashes, dtype=np.int64)
        found = np.full(len(hashes), -1, dtype=np.int64)
        if not len(hashes) or not len(self):
            return found
        shards = self.load()._loaded or ()
        which = np.searchsorted(self.bounds, hashes, side="right")
        for k in np.unique(which):
            limit = int(self.limits[k])
            if not limit:
                continue
            sel = np.flatnonzero(which == k)
            keys = shards[k].hashes[:limit]
            pos = np.minimum(np.searchsorted(keys, hashes[sel]), limit - 1)
            hit = keys[pos] == hashes[sel]
            found[sel[hit]] = pos[hit] + self.offsets[k]
        added = self._added.hashes
        if len(added):
            sel = np.flatnonzero(found < 0)
            pos = np.minimum(np.searchsorted(added, hashes[sel]), len(added) - 1)
            hit = added[pos] == hashes[sel]
            found[sel[hit]] = pos[hit] + self.offsets[-1]
        return found


def merge_slices(*parts: IndexShard, width: int | None = None) -> IndexShard:
    """Slices of one hash range as one shard: sorted, one answer per hash (the first given)."""
    if not parts:
        return IndexShard(np.empty(0, np.int64), np.empty((0, width or 0), np.float32), np.empty(0, bool))
    hashes = np.concatenate([p.hashes for p in parts])
    order = np.argsort(hashes, kind="stable")
    hashes = hashes[order]
    first = np.ones(len(hashes), dtype=bool)
    first[1:] = hashes[1:] != hashes[:-1]
    keep = order[first]
    del order
    probs = np.concatenate([p.probabilities for p in parts])[keep]
    truncated = np.concatenate([p.truncated for p in parts])[keep]
    return IndexShard(np.ascontiguousarray(hashes[first]), np.ascontiguousarray(probs), truncated)

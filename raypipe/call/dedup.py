"""Identical work is done once: answers reused by text hash.

Every outcome row carries `text_hash`, a 64-bit BLAKE2b of its text's UTF-8 bytes. Before a
run sends anything, the committed results of the same `model_version` (the version string
names every setting that changes answers: `+len128`, `+bf16`, `+ov-int8`, ...; fp32 on either
runtime answers as the reference and keeps the card's version) become a `TextIndex`: per
distinct text its hash and its answer (one float32 per label and the truncation flag, 33
bytes a text with 6 labels). The actors look each row's hash up there; a row whose text
already has an answer costs no call, and its result is written under the row's own id,
`updated_at` and run (a paragraph whose metadata changed re-infers nothing). Within a unit,
duplicate texts are sent once.

The index is cut by hash range into shards (`IndexShard`: sorted hashes and their answers),
each covering an equal slice of the int64 space, so a lookup routes each hash to its shard
and finds it there by binary search, whole batches at a time in numpy. With Ray running,
the index is built as a shuffle of Ray tasks: each task reads a group of the table's files
and splits its rows by hash range; one task per shard merges its slices into distinct
texts. The shards live in Ray's object store and the driver holds only their references,
so its memory does not grow with the corpus; the actors map every shard without a copy.
Without Ray (tests, a notebook), the same steps run in the calling process.

`dedup.max_index_rows` bounds the index in distinct texts: over it, the index keeps that many
(the smallest hashes) and the run reuses those, inferring the others again; the log says so
and the report's `reuse_index` (`IndexStats`) shows `capped`. Reuse is never off without
saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.table import OUTCOME_RESULT, RESULT_STATUS_OK, OutcomeTable, label_column, text_hashes

__all__ = ["IndexShard", "IndexStats", "TextIndex", "build_index", "hash_texts", "shard_bounds"]

logger = logging.getLogger("raypipe")

#: Committed rows (copies of a text included) per shard and per reading task: a task's
#: memory is a small multiple of this times ~33 bytes, whatever the corpus.
SHARD_ROWS = 1 << 22

#: CPUs each index task asks for. A fraction: the default replica (`serve_app.deploy.fit_replicas`)
#: leaves 0.5 CPU of a node free, and a task asking for more is never scheduled, so the run
#: would wait on it forever. It bounds how many tasks run side by side, not how fast each runs.
TASK_CPUS = 0.25


def hash_texts(texts: list[str | None]) -> np.ndarray:
    """The `text_hash` of each text (int64; 0 for a null text)."""
    return text_hashes(texts).fill_null(0).to_numpy()


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
        parts = [getattr(s, self._column) for s in shards]
        out = np.empty((len(positions), *parts[0].shape[1:]), dtype=parts[0].dtype)
        for k in np.unique(which):
            sel = which == k
            out[sel] = parts[k][positions[sel] - offsets[k]]
        return out


class TextIndex:
    """Answers of one model version by text hash, cut by hash range into shards.

    `shards` are `IndexShard`s or Ray object references to them (resolved once, on first use,
    zero-copy); `limits[k]` is how many of shard k's rows count (fewer when capped). Positions
    from `lookup` index `probabilities`, `truncated` as if the shards were one array."""

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
        return int(self.offsets[-1])

    @property
    def nbytes(self) -> int:
        """Bytes of the shards (mapped, not copied, when they live in Ray's object store)."""
        return sum(s.nbytes for s in self.load()._loaded or ())

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
        return found


@dataclass(frozen=True)
class IndexStats:
    """How the reuse index was built: what the run report shows as `reuse_index`."""

    rows_read: int = 0
    """Committed results of the version read (copies of a text included)."""
    distinct_texts: int = 0
    """Distinct texts held: the answers reuse can give."""
    cap: int = 0
    """`dedup.max_index_rows`: the most distinct texts held."""
    capped: bool = False
    """More distinct texts than `cap` were committed: the others are inferred again."""
    committed_texts: int = 0
    """Distinct texts with a committed answer of the version (held or not)."""
    shards: int = 0
    """Hash ranges the index is cut into."""
    index_bytes: int = 0
    """Bytes of the shards (in Ray's object store when built with Ray)."""
    built_with_ray: bool = False
    """Built by Ray tasks (the driver holds only references) or in the calling process."""

    def to_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)


def build_index(
    output: str | OutcomeTable,
    model_version: str,
    labels: tuple[str, ...],
    *,
    max_rows: int,
    use_ray: bool | None = None,
    shard_rows: int = SHARD_ROWS,
) -> tuple[TextIndex | None, IndexStats]:
    """The committed answers of `model_version`, one per distinct text, at most `max_rows`.

    `use_ray` (default: whether Ray is initialized) builds the shards with Ray tasks into the
    object store, so the caller holds references only; otherwise in this process. Over
    `max_rows` distinct texts, the index keeps `max_rows` of them (the smallest hashes: a fixed
    choice) and reuse goes on for those; the log and the stats (`IndexStats.capped`) say so.
    None when there are no answers."""
    stats = IndexStats(cap=max_rows)
    table = output if isinstance(output, OutcomeTable) else OutcomeTable(output)  # a run passes its own
    if not table.exists():
        return None, stats
    dt = table.load()
    ds = dt.to_pyarrow_dataset()
    if "text_hash" not in ds.schema.names or not all(label_column(x) in ds.schema.names for x in labels):
        return None, stats
    # Only files whose statistics admit answers of this version (the plain expression meets the
    # statistics alone; the rows are filtered in `_split`).
    fragments = list(ds.get_fragments(filter=pc.field("model_version") == model_version))
    if not fragments:
        return None, stats
    rows = _committed_rows(dt, len(fragments))
    shards = max(1, math.ceil(rows / shard_rows))
    bounds = shard_bounds(shards)
    groups = [fragments[g::shards] for g in range(min(shards, len(fragments)))]
    source = (ds.schema, ds.format, ds.filesystem)
    if use_ray is None:
        import ray

        use_ray = ray.is_initialized()
    if use_ray:
        built, sizes, rows_read = _build_with_ray(source, groups, model_version, labels, bounds)
    else:
        built, sizes, rows_read = _build_here(source, groups, model_version, labels, bounds)
    committed = int(sum(sizes))
    limits = _cap(sizes, max_rows)
    capped = committed > max_rows
    held = int(sum(limits))
    per_text = 8 + 4 * len(labels) + 1
    stats = IndexStats(
        rows_read=rows_read,
        distinct_texts=held,
        cap=max_rows,
        capped=capped,
        committed_texts=committed,
        shards=shards,
        index_bytes=committed * per_text,
        built_with_ray=use_ray,
    )
    if capped:
        logger.warning(
            "%d distinct texts have committed answers of %s, more than dedup.max_index_rows (%d): %d of them "
            "are reused, the others are inferred again (raise dedup.max_index_rows to reuse them all)",
            committed,
            model_version,
            max_rows,
            held,
        )
    if not held:
        return None, stats
    # Shards wholly over the cap are let go (their memory too); the one the cap cuts is kept whole.
    kept = [s if n else _merge(width=len(labels)) for s, n in zip(built, limits, strict=True)]
    index = TextIndex.of_shards(model_version, tuple(labels), bounds, kept, limits)
    logger.info(
        "reusing answers of %s for %d distinct texts already committed (%d shards, %.0f MiB%s)",
        model_version,
        held,
        shards,
        stats.index_bytes / 2**20,
        " in Ray's object store" if use_ray else "",
    )
    return index, stats


def _committed_rows(dt: Any, files: int) -> int:
    """Rows in the table's files (every outcome and version: a bound on the rows read), from
    the log's file statistics; without them, a guess of a quarter shard a file."""
    import pyarrow as pa

    try:
        counts = pa.chunked_array(dt.get_add_actions(flatten=True).column("num_records"))
        total = pc.sum(counts).as_py()
        if total is not None and counts.null_count == 0:
            return int(total)
    except Exception:  # stats are optional in Delta: size by files then
        logger.debug("no row counts in the table's log", exc_info=True)
    return files * SHARD_ROWS // 4


def _cap(sizes: Sequence[int], cap: int) -> list[int]:
    """Rows kept per shard: the smallest hashes first, `cap` in all."""
    limits, left = [], cap
    for size in sizes:
        keep = max(0, min(int(size), left))
        limits.append(keep)
        left -= keep
    return limits


_Source = tuple[Any, Any, Any]  # schema, format, filesystem of the table's dataset


def _build_here(
    source: _Source, groups: list[list[Any]], model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[list[IndexShard], list[int], int]:
    """The shuffle in this process (no Ray): every shard ends up in this process's memory."""
    slices, rows_read = [], 0
    for group in groups:
        *parts, read = _split(source, group, model_version, labels, bounds)
        slices.append(parts)
        rows_read += read
    shards = [_merge(*[s[k] for s in slices]) for k in range(len(bounds) + 1)]
    return shards, [len(s.hashes) for s in shards], rows_read


def _build_with_ray(
    source: _Source, groups: list[list[Any]], model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[list[Any], list[int], int]:
    """The shuffle as Ray tasks: this process holds references; the shards stay in the object store."""
    import ray

    shards = len(bounds) + 1
    split: Any = ray.remote(_split).options(num_returns=shards + 1, num_cpus=TASK_CPUS)
    merge: Any = ray.remote(_merge_sized).options(num_returns=2, num_cpus=TASK_CPUS)
    slices = [split.remote(source, group, model_version, labels, bounds) for group in groups]
    rows_read = sum(ray.get([s[-1] for s in slices]))
    merged = [merge.remote(*[s[k] for s in slices]) for k in range(shards)]
    del slices  # each slice is freed as soon as its merge has run
    sizes = [int(n) for n in ray.get([m[1] for m in merged])]
    return [m[0] for m in merged], sizes, int(rows_read)


_Slice = tuple[np.ndarray, np.ndarray, np.ndarray]


def _split(
    source: _Source, fragments: list[Any], model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[Any, ...]:
    """One group of the table's files: its answers of the version, by shard (each slice sorted,
    distinct), and the rows read last."""
    import pyarrow.dataset as pds

    schema, fmt, filesystem = source
    ds = pds.FileSystemDataset(fragments, schema, fmt, filesystem)
    # Files a MERGE rewrote (a replay's) store their strings as string_view, the others as string;
    # comparing a column cast to string holds for both (a plain comparison has no kernel for a
    # view). `build_index` pruned the files by the log's statistics already (`scan_where`).
    flt = (
        (pc.field("model_version").cast(pa.string()) == model_version)
        & (pc.field("outcome").cast(pa.string()) == OUTCOME_RESULT)
        & (pc.field("status").cast(pa.string()) == RESULT_STATUS_OK)
        & pc.field("text_hash").is_valid()
    )
    columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
    shards = len(bounds) + 1
    parts: list[list[_Slice]] = [[] for _ in range(shards)]
    rows_read = 0
    for batch in ds.to_batches(columns=columns, filter=flt):
        if batch.num_rows == 0:
            continue
        rows_read += batch.num_rows
        hashes = batch.column("text_hash").to_numpy()
        probs = np.column_stack([batch.column(label_column(x)).to_numpy(zero_copy_only=False) for x in labels]).astype(
            np.float32
        )
        truncated = batch.column("truncated").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        which = np.searchsorted(bounds, hashes, side="right")
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(shards + 1))
        for k in range(shards):
            rows = order[cuts[k] : cuts[k + 1]]
            if len(rows):
                parts[k].append((hashes[rows], probs[rows], truncated[rows]))
    out: list[Any] = []
    for k in range(shards):
        shard = _merge(*[IndexShard(*p) for p in parts[k]], width=len(labels))
        parts[k] = []
        out.append(shard)
    return (*out, rows_read)


def _merge(*parts: IndexShard, width: int | None = None) -> IndexShard:
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


def _merge_sized(*parts: IndexShard) -> tuple[IndexShard, int]:
    shard = _merge(*parts)
    return shard, len(shard.hashes)

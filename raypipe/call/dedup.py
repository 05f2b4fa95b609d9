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

The index is kept beside the table (`StoredIndex`: a small Delta table of distinct texts and
their answers that names the table version it covers), so a run reads it and only the files the
log committed since, not every committed row; a lost, corrupt or unusable one is replaced by the
full read. A long-lived actor adds the answers it commits (`TextIndex.add_committed`).

`dedup.max_index_rows` bounds the index in distinct texts: over it, the index keeps that many
(the smallest hashes) and the run reuses those, inferring the others again; the log says so
and the report's `reuse_index` (`IndexStats`) shows `capped`. Reuse is never off without
saying so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.table import (
    OUTCOME_RESULT,
    RESULT_STATUS_OK,
    OutcomeTable,
    label_column,
    storage_options,
    text_hashes,
)
from raypipe.store import STATE_DIR

__all__ = ["IndexShard", "IndexStats", "StoredIndex", "TextIndex", "build_index", "hash_texts", "shard_bounds"]

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
        self._added = _merge(width=len(self.labels))
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
        ok = (
            (pc.field("outcome").cast(pa.string()) == OUTCOME_RESULT)
            & (pc.field("status").cast(pa.string()) == RESULT_STATUS_OK)
            & (pc.field("model_version").cast(pa.string()) == self.model_version)
            & pc.field("text_hash").is_valid()
        )
        rows = rows.filter(ok)
        if not rows.num_rows:
            return 0
        hashes = rows.column("text_hash").to_numpy()
        new = self.lookup(hashes) < 0
        if not new.any():
            return 0
        probs = np.column_stack(
            [rows.column(label_column(x)).to_numpy(zero_copy_only=False) for x in self.labels]
        ).astype(np.float32)
        truncated = rows.column("truncated").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
        before = len(self._added.hashes)
        self._added = _merge(self._added, IndexShard(hashes[new], probs[new], truncated[new]))
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
    from_stored: bool = False
    """Brought up to date from the stored index (`StoredIndex`) and the table's files committed
    since; False: the table's files were read whole (no stored index, or it could not be used)."""
    table_files_read: int = 0
    """The outcomes table's data files read."""
    log_entries_read: int = 0
    """The table's log entries read to find the files committed since the stored index."""
    stored_rows_written: int = 0
    """Distinct texts written to the stored index (its new rows, or all of them when replaced)."""

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
    stored: bool = True,
) -> tuple[TextIndex | None, IndexStats]:
    """The committed answers of `model_version`, one per distinct text, at most `max_rows`.

    `use_ray` (default: whether Ray is initialized) builds the shards with Ray tasks into the
    object store, so the caller holds references only; otherwise in this process. Over
    `max_rows` distinct texts, the index keeps `max_rows` of them (the smallest hashes: a fixed
    choice) and reuse goes on for those; the log and the stats (`IndexStats.capped`) say so.
    None when there are no answers.

    With `stored` (the default), the index kept beside the table (`StoredIndex`) is brought up
    to date from the files committed after the version it covers, and written back; without a
    usable one (none yet, lost, corrupt, or a commit since that may have dropped answers) the
    table is read whole, and that replaces it."""
    stats = IndexStats(cap=max_rows)
    table = output if isinstance(output, OutcomeTable) else OutcomeTable(output)  # a run passes its own
    if not table.exists():
        return None, stats
    dt = table.load()
    # The version first: the snapshot is shared with the run and may move on meanwhile; the
    # dataset then holds more than the version says, never less (what is read twice is merged).
    version = dt.version()
    ds = dt.to_pyarrow_dataset()
    if "text_hash" not in ds.schema.names or not all(label_column(x) in ds.schema.names for x in labels):
        return None, stats
    if use_ray is None:
        import ray

        use_ray = ray.is_initialized()
    store = StoredIndex.of(table, dt, model_version, labels) if stored else None
    plan = store.since(version, ds) if store is not None else None
    try:
        built = _build(ds, dt, plan, model_version, labels, bool(use_ray), shard_rows)
    except Exception:
        if plan is None:
            raise
        # The stored index or a file named by the log since could not be read (deleted under it,
        # corrupt): the full scan answers instead, and its result replaces the stored index.
        logger.warning(
            "the stored reuse index of %s could not be read: reading the table whole", model_version, exc_info=True
        )
        plan = None
        built = _build(ds, dt, plan, model_version, labels, bool(use_ray), shard_rows)
    if built is None:
        if store is not None:
            store.save(version, [], full=plan is None)
        return None, dataclasses.replace(
            stats, from_stored=plan is not None, log_entries_read=plan.entries if plan is not None else 0
        )
    shards, sizes, fresh, bounds, read = built
    if store is not None:
        written = store.save(version, fresh, full=plan is None)
        stats = dataclasses.replace(stats, stored_rows_written=written)
    committed = int(sum(sizes))
    limits = _cap(sizes, max_rows)
    capped = committed > max_rows
    held = int(sum(limits))
    per_text = 8 + 4 * len(labels) + 1
    stats = dataclasses.replace(
        stats,
        rows_read=read.rows,
        table_files_read=read.table_files,
        log_entries_read=plan.entries if plan is not None else 0,
        from_stored=plan is not None,
        distinct_texts=held,
        capped=capped,
        committed_texts=committed,
        shards=len(shards),
        index_bytes=committed * per_text,
        built_with_ray=bool(use_ray),
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
    kept = [s if n else _merge(width=len(labels)) for s, n in zip(shards, limits, strict=True)]
    index = TextIndex.of_shards(model_version, tuple(labels), bounds, kept, limits)
    logger.info(
        "reusing answers of %s for %d distinct texts already committed (%d shards, %.0f MiB%s; %s)",
        model_version,
        held,
        len(shards),
        stats.index_bytes / 2**20,
        " in Ray's object store" if use_ray else "",
        f"the stored index and {read.table_files} files committed since"
        if plan is not None
        else "the table read whole",
    )
    return index, stats


@dataclass(frozen=True)
class _Read:
    rows: int
    table_files: int


_Fresh = tuple[Any, int]  # the rows a shard adds to the stored index (an `IndexShard` or a Ray reference), how many
_Built = tuple[list[Any], list[int], list[_Fresh], np.ndarray, _Read]


def _build(
    ds: Any,
    dt: Any,
    plan: _Since | None,
    model_version: str,
    labels: tuple[str, ...],
    use_ray: bool,
    shard_rows: int,
) -> _Built | None:
    """The shuffle over the stored index's files and the table's files committed since (`plan`),
    or over every table file whose statistics admit answers of the version (`plan` None).
    Returns the shards, their sizes, the rows the stored index does not hold yet (by shard, with
    their count), the shards' bounds and what was read; None when there is nothing to read."""
    source = (ds.schema, ds.format, ds.filesystem)
    if plan is None:
        # Only files whose statistics admit answers of this version (the plain expression meets the
        # statistics alone; the rows are filtered in `_split`).
        fragments = list(ds.get_fragments(filter=pc.field("model_version") == model_version))
        held: list[Any] = []
        rows = _committed_rows(dt, len(fragments))
    else:
        fragments = [ds.format.make_fragment(path, ds.filesystem) for path in plan.paths]
        held = plan.held_fragments
        rows = plan.held_rows + plan.rows
    if not fragments and not held:
        return None
    shards = max(1, math.ceil(rows / shard_rows))
    bounds = shard_bounds(shards)
    groups: list[_Group] = []
    if held and plan is not None:
        groups += [(plan.held_source, held[g::shards], False) for g in range(min(shards, len(held)))]
    old = len(groups)
    groups += [(source, fragments[g::shards], True) for g in range(min(shards, len(fragments)))]
    run = _build_with_ray if use_ray else _build_here
    built, sizes, fresh, rows_read = run(groups, old, model_version, labels, bounds)
    return built, sizes, fresh, bounds, _Read(rows_read, len(fragments))


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


_Source = tuple[Any, Any, Any]  # schema, format, filesystem of a dataset
_Group = tuple[_Source, list[Any], bool]  # files of one reading task, and whether they are the table's


def _build_here(
    groups: list[_Group], old: int, model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[list[IndexShard], list[int], list[_Fresh], int]:
    """The shuffle in this process (no Ray): every shard ends up in this process's memory."""
    slices, rows_read = [], 0
    for source, group, table in groups:
        *parts, read = _split(source, group, model_version, labels, bounds, table)
        slices.append(parts)
        rows_read += read
    merged = [_merge_fresh(old, *[s[k] for s in slices]) for k in range(len(bounds) + 1)]
    return [m[0] for m in merged], [m[1] for m in merged], [(m[2], m[3]) for m in merged], rows_read


def _build_with_ray(
    groups: list[_Group], old: int, model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[list[Any], list[int], list[_Fresh], int]:
    """The shuffle as Ray tasks: this process holds references; the shards stay in the object
    store, and so do the rows the stored index lacks (written from there one shard at a time)."""
    import ray

    shards = len(bounds) + 1
    split: Any = ray.remote(_split).options(num_returns=shards + 1, num_cpus=TASK_CPUS)
    merge: Any = ray.remote(_merge_fresh).options(num_returns=4, num_cpus=TASK_CPUS)
    slices = [split.remote(source, group, model_version, labels, bounds, table) for source, group, table in groups]
    rows_read = sum(ray.get([s[-1] for s in slices]))
    merged = [merge.remote(old, *[s[k] for s in slices]) for k in range(shards)]
    del slices  # each slice is freed as soon as its merge has run
    sizes = [int(n) for n in ray.get([m[1] for m in merged])]
    fresh = [(m[2], int(n)) for m, n in zip(merged, ray.get([m[3] for m in merged]), strict=True)]
    return [m[0] for m in merged], sizes, fresh, int(rows_read)


_Slice = tuple[np.ndarray, np.ndarray, np.ndarray]


def _split(
    source: _Source,
    fragments: list[Any],
    model_version: str,
    labels: tuple[str, ...],
    bounds: np.ndarray,
    table: bool = True,
) -> tuple[Any, ...]:
    """One group of files: its answers of the version, by shard (each slice sorted, distinct),
    and the rows read last. The table's files are filtered to the version's answers; the stored
    index's hold nothing else."""
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
        if table
        else None
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


def _merge_fresh(old: int, *parts: IndexShard) -> tuple[IndexShard, int, IndexShard, int]:
    """One hash range's shard from its slices, the first `old` of them the stored index's (whose
    answers come first); its size; its rows the stored index does not hold, and their count."""
    shard = _merge(*parts)
    held = np.concatenate([p.hashes for p in parts[:old]]) if old else np.empty(0, np.int64)
    new = ~np.isin(shard.hashes, held)
    fresh = IndexShard(shard.hashes[new], shard.probabilities[new], shard.truncated[new])
    return shard, len(shard.hashes), fresh, len(fresh.hashes)


# -- the stored index ------------------------------------------------------------------------

INDEX_DIR = "reuse_index"
"""The stored indexes' folder under the output's state folder (`raypipe.store.STATE_DIR`)."""

INDEX_APP = "raypipe/reuse-index/covers"
"""The stored index's application transaction: its version is the outcomes table's version the
index covers (every answer committed up to it is held)."""

STORED_FILES_MAX = 16
"""Files the stored index holds before a run compacts it into one (each update appends one)."""

#: No time travel is needed on a cache: its log entries and replaced files go at the next upkeep.
_STORED_CONFIG = {
    "delta.logRetentionDuration": "interval 0 hours",
    "delta.deletedFileRetentionDuration": "interval 0 hours",
}


@dataclass(frozen=True)
class _Since:
    """What bringing the stored index up to date reads: its files, and the table's files
    committed after the version it covers."""

    held_source: _Source
    held_fragments: list[Any]
    held_rows: int
    paths: list[str]
    """The table's files committed after the stored index's version and still in the table, as
    its dataset names them."""
    rows: int
    """Their rows, by the log's statistics (a bound on the answers among them)."""
    entries: int
    """The log entries read."""


class StoredIndex:
    """The reuse index kept beside the table, so that a run reads only what was committed since.

    A small Delta table under `OUTPUT/_raypipe/reuse_index/<key>/` (the key digests the outcomes
    table's id, the model version and the labels), one row per distinct text: `text_hash`,
    `truncated` and the label columns, named as in the outcomes table, each as a committed
    result of that version holds them. Its application transaction `INDEX_APP` names the
    outcomes table's version it covers. It is a cache of committed rows, never a record: it
    holds only answers read from committed rows of the table's log (a fenced-off commit never
    lands there), so it is written without the output's fence, and whatever goes wrong with it
    (lost, corrupt, behind, written by two runs at once) costs the next run a full read of the
    table or calls, never an answer (docs/guarantees.md)."""

    def __init__(self, uri: str, labels: tuple[str, ...]) -> None:
        self.uri = uri
        self.options = storage_options(uri)
        self.columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
        self._dt: Any = None  # its snapshot, once opened: one per run

    def _open(self) -> Any:
        from deltalake import DeltaTable

        if self._dt is None:
            self._dt = DeltaTable(self.uri, storage_options=self.options)
        else:
            self._dt.update_incremental()
        return self._dt

    @classmethod
    def of(cls, table: OutcomeTable, dt: Any, model_version: str, labels: tuple[str, ...]) -> StoredIndex:
        key = hashlib.sha256("\0".join([dt.metadata().id, model_version, *labels]).encode()).hexdigest()[:32]
        return cls(f"{table.output_uri}/{STATE_DIR}/{INDEX_DIR}/{key}", tuple(labels))

    def since(self, version: int, ds: Any) -> _Since | None:
        """What brings it up to the table's `version` (`ds` its dataset); None when it cannot be used (none
        yet, unreadable, of another shape, ahead of the table, or the table's log since it is
        gone or holds a commit that may have dropped answers): the table is then read whole."""
        from deltalake import DeltaTable

        try:
            if not DeltaTable.is_deltatable(self.uri, storage_options=self.options):
                return None
            idt = self._open()
            covers = idt.transaction_version(INDEX_APP)
            if covers is None or covers > version or pa.schema(idt.schema().to_arrow()).names != self.columns:
                logger.warning("the stored reuse index at %s does not fit the table: reading the table whole", self.uri)
                return None
            log = _log_since(ds.filesystem, covers, version)
            if log is None:
                return None
            held_ds = idt.to_pyarrow_dataset()
            held = list(held_ds.get_fragments())
            paths, rows, entries = log
            return _Since(
                held_source=(held_ds.schema, held_ds.format, held_ds.filesystem),
                held_fragments=held,
                held_rows=_committed_rows(idt, len(held)),
                paths=paths,
                rows=rows,
                entries=entries,
            )
        except Exception:  # a cache: whatever is wrong with it, the full read answers
            logger.warning(
                "the stored reuse index at %s cannot be read: reading the table whole", self.uri, exc_info=True
            )
            return None

    def save(self, version: int, fresh: Sequence[_Fresh], *, full: bool) -> int:
        """Adds `fresh` (or, `full`, replaces what it holds with it) as covering the table's
        `version`; the distinct texts written. A failure is logged, not raised: it costs the
        next run a longer read, not this run its answers."""
        from deltalake import CommitProperties, Transaction

        rows = sum(n for _, n in fresh)
        props = CommitProperties(
            app_transactions=[Transaction(INDEX_APP, version)],
            custom_metadata={"raypipe.operation": "reuse-index", "raypipe.covers": str(version)},
        )
        try:
            self._write(fresh, rows, props, version, full=full)
        except Exception:
            if not full:
                logger.warning(
                    "the reuse index could not be stored at %s (the next run reads more)", self.uri, exc_info=True
                )
                return 0
            # A replacement over an index that cannot be opened at all (its log corrupt): it
            # starts afresh, else every run would read the table whole from now on.
            try:
                from fsspec.core import url_to_fs

                fs, path = url_to_fs(self.uri)
                fs.rm(path, recursive=True)
                self._dt = None
                self._write(fresh, rows, props, version, full=full)
            except Exception:
                logger.warning(
                    "the reuse index could not be stored at %s (the next run reads more)", self.uri, exc_info=True
                )
                return 0
        return rows

    def _write(self, fresh: Sequence[_Fresh], rows: int, props: Any, version: int, *, full: bool) -> None:
        from deltalake import DeltaTable, write_deltalake

        exists = DeltaTable.is_deltatable(self.uri, storage_options=self.options)
        if exists and not full and not rows:
            idt = self._open()
            if idt.transaction_version(INDEX_APP) == version:
                return
            idt.create_write_transaction([], mode="append", schema=idt.schema(), commit_properties=props)
        else:
            write_deltalake(
                self.uri,
                pa.RecordBatchReader.from_batches(self._schema(), self._batches(fresh)),
                mode="overwrite" if full or not exists else "append",
                storage_options=self.options,
                configuration=None if exists else _STORED_CONFIG,
                commit_properties=props,
            )
        self._upkeep(full)

    def _schema(self) -> pa.Schema:
        return pa.schema(
            [("text_hash", pa.int64()), ("truncated", pa.bool_()), *[(c, pa.float32()) for c in self.columns[2:]]]
        )

    def _batches(self, fresh: Sequence[_Fresh]) -> Iterator[pa.RecordBatch]:
        """The shards' rows in hash order (the shards are in hash order, each sorted), one shard
        at a time: from Ray's object store, a shard is mapped only while it is written."""
        schema = self._schema()
        for shard, n in fresh:
            if not n:
                continue
            s = shard if isinstance(shard, IndexShard) else _get(shard)
            columns = [pa.array(s.hashes, pa.int64()), pa.array(s.truncated, pa.bool_())]
            columns += [pa.array(s.probabilities[:, k], pa.float32()) for k in range(len(self.columns) - 2)]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)

    def _upkeep(self, full: bool) -> None:
        """After a replacement, or once it holds `STORED_FILES_MAX` files: one file, one
        checkpoint, and the replaced files and log entries deleted. A run reading it meanwhile
        may find a file gone; it then reads the table whole."""
        idt = self._open()
        if not full and len(idt.file_uris()) <= STORED_FILES_MAX:
            return
        if not full:
            idt.optimize.compact()
        idt.create_checkpoint()
        idt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
        idt.cleanup_metadata()


def _get(ref: Any) -> Any:
    import ray

    (got,) = ray.get([ref])
    return got


def _log_since(filesystem: Any, since: int, until: int) -> tuple[list[str], int, int] | None:
    """The files committed after version `since` up to `until` and still in the table (as its
    dataset names them), their rows by the log's statistics, and the entries read; None when an
    entry is gone (the log's retention) or a commit removed rows that may not come back.

    It reads the log's commit entries, Delta's documented format (`_delta_log/<version>.json`,
    one action a line), because delta-rs offers a snapshot's files and the history's commit
    infos but not the actions of one commit. Of raypipe's own commits, a unit's (an append, or a
    replay's MERGE, which rewrites dead letters only) and `compact`'s (the same rows in fewer
    files) keep every answer they remove; any other commit that removes rows (a DELETE, an
    overwrite by another tool) sends the run to the full read."""
    added: dict[str, int] = {}
    for version in range(since + 1, until + 1):
        try:
            with filesystem.open_input_stream(f"_delta_log/{version:020d}.json") as f:
                text = f.read().decode()
        except (FileNotFoundError, OSError):
            logger.info("the table's log before version %d is gone: reading the table whole", version)
            return None
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {}) or {}
        keeps_answers = info.get("raypipe.unit") is not None or info.get("raypipe.operation") == "compact"
        for action in actions:
            if (add := action.get("add")) is not None:
                if "://" in add["path"]:
                    return None  # a file outside the table (a shallow clone's): not ours to name
                stats = json.loads(add.get("stats") or "{}")
                added[unquote(add["path"])] = int(stats.get("numRecords", SHARD_ROWS // 4))
            elif (remove := action.get("remove")) is not None:
                if remove.get("dataChange", True) and not keeps_answers:
                    logger.info("version %d of the table removed rows: reading the table whole", version)
                    return None
                added.pop(unquote(remove["path"]), None)
    return list(added), sum(added.values()), until - since

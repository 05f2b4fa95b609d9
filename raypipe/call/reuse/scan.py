"""The full scan: the committed answers of a model version read into a `TextIndex`.

With Ray running, the index is built as a shuffle of Ray tasks: each task reads a group of the
table's files and splits its rows by hash range; one task per shard merges its slices into
distinct texts. The shards live in Ray's object store and the driver holds only their
references, so its memory does not grow with the corpus; the actors map every shard without a
copy. Without Ray (tests, a notebook), the same steps run in the calling process. With a usable
stored index (`stored`), the scan reads it and the table's files committed since instead of
every committed row, and writes the rows it lacks back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc

from raypipe.call.reuse.index import (
    SHARD_ROWS,
    IndexShard,
    TextIndex,
    answer_columns,
    answered,
    merge_slices,
    shard_bounds,
)
from raypipe.call.reuse.stored import Fresh, Since, Source, StoredIndex, committed_rows
from raypipe.commit.schema import label_column
from raypipe.commit.table import OutcomeTable

__all__ = ["TASK_CPUS", "IndexStats", "build_index"]

logger = logging.getLogger("raypipe")

#: CPUs each index task asks for. A fraction: the default replica (`serve_app.deploy.fit_replicas`)
#: leaves 0.5 CPU of a node free, and a task asking for more is never scheduled, so the run
#: would wait on it forever. It bounds how many tasks run side by side, not how fast each runs.
TASK_CPUS = 0.25


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
    kept = [s if n else merge_slices(width=len(labels)) for s, n in zip(shards, limits, strict=True)]
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


_Built = tuple[list[Any], list[int], list[Fresh], np.ndarray, _Read]


def _build(
    ds: Any,
    dt: Any,
    plan: Since | None,
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
        rows = committed_rows(dt, len(fragments))
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


def _cap(sizes: Sequence[int], cap: int) -> list[int]:
    """Rows kept per shard: the smallest hashes first, `cap` in all."""
    limits, left = [], cap
    for size in sizes:
        keep = max(0, min(int(size), left))
        limits.append(keep)
        left -= keep
    return limits


_Group = tuple[Source, list[Any], bool]  # files of one reading task, and whether they are the table's


def _build_here(
    groups: list[_Group], old: int, model_version: str, labels: tuple[str, ...], bounds: np.ndarray
) -> tuple[list[IndexShard], list[int], list[Fresh], int]:
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
) -> tuple[list[Any], list[int], list[Fresh], int]:
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
    source: Source,
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
    # `build_index` pruned the files by the log's statistics already (`scan_where`).
    flt = answered(model_version) if table else None
    columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
    shards = len(bounds) + 1
    parts: list[list[_Slice]] = [[] for _ in range(shards)]
    rows_read = 0
    for batch in ds.to_batches(columns=columns, filter=flt):
        if batch.num_rows == 0:
            continue
        rows_read += batch.num_rows
        hashes, probs, truncated = answer_columns(batch, labels)
        which = np.searchsorted(bounds, hashes, side="right")
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(shards + 1))
        for k in range(shards):
            rows = order[cuts[k] : cuts[k + 1]]
            if len(rows):
                parts[k].append((hashes[rows], probs[rows], truncated[rows]))
    out: list[Any] = []
    for k in range(shards):
        shard = merge_slices(*[IndexShard(*p) for p in parts[k]], width=len(labels))
        parts[k] = []
        out.append(shard)
    return (*out, rows_read)


def _merge_fresh(old: int, *parts: IndexShard) -> tuple[IndexShard, int, IndexShard, int]:
    """One hash range's shard from its slices, the first `old` of them the stored index's (whose
    answers come first); its size; its rows the stored index does not hold, and their count."""
    shard = merge_slices(*parts)
    held = np.concatenate([p.hashes for p in parts[:old]]) if old else np.empty(0, np.int64)
    new = ~np.isin(shard.hashes, held)
    fresh = IndexShard(shard.hashes[new], shard.probabilities[new], shard.truncated[new])
    return shard, len(shard.hashes), fresh, len(fresh.hashes)

"""Parquet footers: what planning learns from them without reading a row (`PlanObservations`:
the row groups, their `updated_at` statistics, the informational maximum), and a Parquet shard
cut into work units from its row groups."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.plan.listing import filesystem
from raypipe.plan.schema import check_columns, check_types
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit

__all__ = ["FOOTER_TAIL_BYTES", "PlanObservations", "cut_ranges", "plan_parquet", "recut_parquet"]


# What planning learnt without reading a row (the report's `planning`, the watermark).
@dataclass
class PlanObservations:
    """What planning learnt from footers and paths, without reading any row."""

    limit: datetime | None = None
    """updated_at beyond this (now + the allowed clock skew) is in the future: counted, never a watermark."""
    max_updated_at: datetime | None = None
    """Latest updated_at of the row groups wholly up to `limit` (statistics): what the input was
    read as of, informational (the watermark); it never decides what is read."""
    future_row_groups: int = 0
    """Row groups whose updated_at reaches beyond `limit` (a 9999-12-31 sentinel, a clock ahead):
    read like any other, left out of `max_updated_at`."""
    null_updated_at_rows: int = 0
    """Rows with a null updated_at in the shards planned (statistics); read with their file
    whenever it is new or changed, never by a `--since` window over an unchanged file."""
    row_groups_total: int = 0
    row_groups_pruned: int = 0
    """Row groups of unchanged files a daily `--since` did not re-read: their updated_at
    statistics lie wholly before it."""
    shards_pruned: int = 0
    """Shards a daily skipped by their Hive partition value (`input.updated_at_partition`)."""
    footers_read: int = 0
    """Parquet footers read at planning."""
    read_bytes: int = 0
    """Uncompressed bytes of the columns read (id, text, updated_at) in the footers read: with
    the shards' listed sizes, what a small shard planned whole holds in memory (`plan_listing`)."""
    whole_files: int = 0
    """Parquet shards planned as one unit from their listed size (`plan_listing`): their footers
    are read by the task that reads their rows, and the statistics above do not count them."""

    def add(self, other: PlanObservations) -> None:
        """Folds in what planning other shards learnt (`plan_units` plans each shard on its own)."""
        if other.max_updated_at is not None and (
            self.max_updated_at is None or other.max_updated_at > self.max_updated_at
        ):
            self.max_updated_at = other.max_updated_at
        self.future_row_groups += other.future_row_groups
        self.null_updated_at_rows += other.null_updated_at_rows
        self.row_groups_total += other.row_groups_total
        self.row_groups_pruned += other.row_groups_pruned
        self.shards_pruned += other.shards_pruned
        self.footers_read += other.footers_read
        self.whole_files += other.whole_files
        self.read_bytes += other.read_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_updated_at": None if self.max_updated_at is None else self.max_updated_at.isoformat(),
            "future_row_groups": self.future_row_groups,
            "null_updated_at_rows": self.null_updated_at_rows,
            "row_groups_total": self.row_groups_total,
            "row_groups_pruned": self.row_groups_pruned,
            "shards_pruned": self.shards_pruned,
            "footers_read": self.footers_read,
            "whole_files": self.whole_files,
        }


def _updated_at_stats(rg: Any, index: int | None) -> tuple[datetime | None, datetime | None, int]:
    """(min, max, null count) of a row group's updated_at, where the footer has them as timestamps."""
    if index is None:
        return None, None, 0
    stats = rg.column(index).statistics
    if stats is None:
        return None, None, 0
    nulls = int(stats.null_count or 0) if stats.has_null_count else 0
    if not stats.has_min_max or not isinstance(stats.min, datetime):
        return None, None, nulls
    lo, hi = stats.min, stats.max
    if lo.tzinfo is None:  # Parquet timestamps without a zone are UTC instants here
        lo, hi = lo.replace(tzinfo=UTC), hi.replace(tzinfo=UTC)
    return lo, hi, nulls


#: Bytes of a Parquet shard's end read by planning's one request: the footer, its length and
#: the magic. 64 KiB is what Arrow itself reads first; a larger footer costs a second request.
FOOTER_TAIL_BYTES = 64 * 2**10


def _read_footer(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A Parquet file's metadata from a ranged read of its tail: on S3 one GET of a suffix
    range (`bytes=-N`), which needs neither the size nor a HEAD, and holds no file object.

    Per shard, 1,000 of 50k shards on moto read one at a time (`bench.planning`, results in
    bench/results/bench-20261124T055216Z.md): before, `fs.open(..., cache_type="none")` +
    `pq.ParquetFile` made 1 GET and spent 9.0 ms of driver CPU after `list_input` (s3fs looks
    the size up in its listing cache by scanning the folder's 50k entries: quadratic in the
    shards), 1 HEAD + 1 GET and 4.7 ms without a listing; now 1 GET and 2.4 ms either way
    (s3fs/botocore's own cost of a request).
    """
    tail = fs.cat_file(path, start=-FOOTER_TAIL_BYTES)
    if len(tail) == FOOTER_TAIL_BYTES and tail[-4:] == b"PAR1":
        need = int.from_bytes(tail[-8:-4], "little") + 8
        if need > len(tail):  # a footer larger than the tail read: read it whole
            tail = fs.cat_file(path, start=-need)
    # Arrow parses the footer at the buffer's end; errors (no magic, a truncated file) are Arrow's.
    return pq.read_metadata(pa.BufferReader(tail))


@dataclass(frozen=True)
class _Group:
    """Rows of a row group that a unit may hold: its first row in the shard, how many, and the
    bytes of the columns read (uncompressed, as the footer states them)."""

    start: int
    rows: int
    bytes: int


def cut_ranges(groups: list[_Group], unit_rows: int, unit_bytes: int) -> list[tuple[int, int]]:
    """The row ranges of the units `groups` are cut into: consecutive groups joined while the
    unit stays within `unit_rows` rows and `unit_bytes` bytes (a group of more rows than
    `unit_rows` stays whole when its bytes fit: cutting it would make every piece re-read it);
    a group over `unit_bytes` cut into pieces of about `unit_bytes` (each piece re-reads the
    group, but the block it becomes is bounded). A gap between groups (a group a window
    skips) ends a unit."""
    ranges: list[tuple[int, int]] = []
    start = rows = size = 0
    for g in groups:
        if rows and (start + rows != g.start or rows + g.rows > unit_rows or size + g.bytes > unit_bytes):
            ranges.append((start, start + rows))
            rows = size = 0
        if g.bytes > unit_bytes and g.rows > 1:
            step = min(unit_rows, max(1, g.rows * unit_bytes // g.bytes))
            ranges += [(g.start + lo, g.start + min(g.rows, lo + step)) for lo in range(0, g.rows, step)]
            continue
        if not rows:
            start = g.start
        rows += g.rows
        size += g.bytes
    if rows:
        ranges.append((start, start + rows))
    return ranges


def _read_columns(meta: Any, columns: ColumnNames) -> list[int]:
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    return [i for i, name in enumerate(names) if name in (columns.id, columns.text, columns.updated_at)]


def _group_bytes(rg: Any, read: list[int]) -> int:
    return sum(rg.column(i).total_uncompressed_size for i in read)


def plan_parquet(
    shard: str,
    unit_rows: int,
    unit_bytes: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    seen: PlanObservations,
) -> list[WorkUnit]:
    """A Parquet shard's units from its footer (`cut_ranges`); with a `window` (a daily's
    `--since` over an unchanged file), the row groups its statistics say hold no row of it
    are skipped. A shard of no rows is one empty unit (its read records it)."""
    fs, path = filesystem(shard)
    meta = _read_footer(fs, path)
    seen.footers_read += 1
    schema = meta.schema.to_arrow_schema()
    check_columns(schema.names, shard, columns, need_updated_at)
    check_types(schema, shard, columns)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    ts_index = names.index(columns.updated_at) if columns.updated_at in names else None
    if window is not None and ts_index is None:
        return []  # no row names a time: every row was read with its file, and `--since` adds none
    read = _read_columns(meta, columns)
    groups: list[_Group] = []
    offset = 0  # first row of the current row group
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        n = rg.num_rows
        lo, hi, nulls = _updated_at_stats(rg, ts_index)
        seen.row_groups_total += 1
        seen.null_updated_at_rows += nulls
        future = hi is not None and seen.limit is not None and hi > seen.limit
        seen.future_row_groups += future
        if hi is not None and not future and (seen.max_updated_at is None or hi > seen.max_updated_at):
            seen.max_updated_at = hi
        size = _group_bytes(rg, read)
        seen.read_bytes += size
        if window is not None and (not window.may_hold(lo, hi) or (n > 0 and nulls == n)):
            seen.row_groups_pruned += 1
        else:
            groups.append(_Group(offset, n, size))
        offset += n
    ranges = cut_ranges(groups, unit_rows, unit_bytes)
    if not ranges and window is None:
        ranges = [(0, 0)]
    return [WorkUnit(shard, "parquet", lo, hi) for lo, hi in ranges]


def recut_parquet(units: list[WorkUnit], unit_rows: int, unit_bytes: int, columns: ColumnNames) -> list[list[WorkUnit]]:
    """Stored units of one shard cut again, each within its own rows, for `unit_bytes` (a
    resumed plan stored before units were cut by bytes, or for a larger size), from one read
    of the shard's footer: for each unit, itself where it fits, else pieces that cover its
    rows exactly once. A row group partly in a unit counts its share of the group's bytes."""
    fs, path = filesystem(units[0].shard)
    meta = _read_footer(fs, path)
    read = _read_columns(meta, columns)
    sizes = [(meta.row_group(i).num_rows, _group_bytes(meta.row_group(i), read)) for i in range(meta.num_row_groups)]
    out = []
    for unit in units:
        stop = meta.num_rows if unit.row_stop is None else unit.row_stop
        groups, offset = [], 0
        for rows, size in sizes:
            lo, hi = max(offset, unit.row_start), min(offset + rows, stop)
            if lo < hi:
                groups.append(_Group(lo, hi - lo, size * (hi - lo) // max(rows, 1)))
            offset += rows
        ranges = cut_ranges(groups, unit_rows, unit_bytes)
        if len(ranges) <= 1:
            out.append([unit])
        else:
            out.append([dataclasses.replace(unit, row_start=lo, row_stop=hi, name=None) for lo, hi in ranges])
    return out

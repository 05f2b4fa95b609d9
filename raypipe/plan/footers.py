"""Parquet footers: what planning learns from them without reading a row (`PlanObservations`:
the row groups, their `updated_at` statistics, the informational maximum), and a Parquet shard
cut into work units from its row groups."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.plan.listing import filesystem
from raypipe.plan.schema import check_columns, check_types
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit

__all__ = ["FOOTER_TAIL_BYTES", "PlanObservations", "plan_parquet"]


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


#: Uncompressed size above which a row group of more than 2 x unit_rows rows is cut into units.
CUT_GROUP_BYTES = 64 * 2**20


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


def plan_parquet(
    shard: str,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    seen: PlanObservations,
) -> list[WorkUnit]:
    fs, path = filesystem(shard)
    meta = _read_footer(fs, path)
    seen.footers_read += 1
    schema = meta.schema.to_arrow_schema()
    check_columns(schema.names, shard, columns, need_updated_at)
    check_types(schema, shard, columns)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    ts_index = names.index(columns.updated_at) if columns.updated_at in names else None
    units: list[WorkUnit] = []
    start = 0  # first row of the pending unit
    pending = 0  # rows in the pending unit
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
        skip = window is not None and (not window.may_hold(lo, hi) or (n > 0 and nulls == n))
        if skip:
            seen.row_groups_pruned += 1
        if pending and (skip or pending + n > unit_rows):
            units.append(WorkUnit(shard, "parquet", start, start + pending))
            pending = 0
        if skip:
            offset += n
            start = offset
            continue
        if not pending:
            start = offset
        if n > 2 * unit_rows and rg.total_byte_size > CUT_GROUP_BYTES:
            # A huge row group: cut it by rows (each unit re-reads the group, so only when it is
            # too big to hold as one unit; a group of many small rows stays whole).
            for lo_row in range(0, n, unit_rows):
                hi_row = min(n, lo_row + unit_rows)
                units.append(WorkUnit(shard, "parquet", offset + lo_row, offset + hi_row))
            start = offset + n
        else:
            pending += n
        offset += n
    if pending or (not units and window is None):
        units.append(WorkUnit(shard, "parquet", start, start + pending))
    return units

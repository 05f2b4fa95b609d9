"""Cutting shards into work units from their Parquet footers (or a JSON-lines file's first line).

Planning reads only Parquet footers (one ranged GET of a shard's tail each on S3) and the
first line of JSON-lines files, so a missing column fails the run before any inference, naming
the shard and the column. Shards are planned several at once (`plan_units`'s `threads`), and
a daily's window prunes row groups by their `updated_at` statistics, so its cost follows its
delta.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import islice
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.errors import InputError
from raypipe.plan.listing import filesystem
from raypipe.plan.plan import PlanObservations
from raypipe.plan.schema import check_columns, check_types
from raypipe.plan.units import ColumnNames, DeltaWindow, ShardFormat, WorkUnit

__all__ = ["CUT_GROUP_BYTES", "FOOTER_TAIL_BYTES", "PLANNING_THREADS", "plan_units"]


#: Shards planned at once when the caller does not say (`InputConfig.planning_threads`).
PLANNING_THREADS = 16


def plan_units(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool = False,
    on_bad_shard: Literal["fail", "record"] = "fail",
    window: DeltaWindow | None = None,
    observations: PlanObservations | None = None,
    fingerprints: dict[str, str] | None = None,
    threads: int = PLANNING_THREADS,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """Cuts shards into work units; returns (units, bad shards as {shard, error}).

    With on_bad_shard="fail" a shard that cannot be opened or lacks a column raises here,
    before any inference; with "record" it is returned in the second list instead. With a
    `window`, Parquet row groups whose updated_at statistics lie outside it get no unit, so
    a daily's cost follows its delta. `observations`, if given, collects what the footers say.

    Up to `threads` shards are planned at once, each on its own; their results are taken in
    shard order, so the plan is the one planning them one by one gives: the same units and
    observations, the same bad shards, and with "fail" the error of the first bad shard in
    shard order. At most 2 x `threads` shards are in flight: memory does not grow with the input.
    """
    units: list[WorkUnit] = []
    bad: list[dict[str, str]] = []
    seen = observations if observations is not None else PlanObservations()
    plan = functools.partial(
        _plan_shard,
        unit_rows=unit_rows,
        columns=columns,
        need_updated_at=need_updated_at,
        window=window,
        limit=seen.limit,
        fingerprints=fingerprints or {},
    )
    for done in _in_order(plan, shards, threads):
        seen.add(done.seen)  # a shard that failed half way counts what it saw, as before
        if done.error is None:
            units += done.units
        elif on_bad_shard == "fail":
            raise done.error from done.cause
        else:
            bad.append({"shard": done.shard, "format": done.format, "error": str(done.error)})
    return units, bad


@dataclass
class _ShardPlan:
    """One shard's part of a plan: its units and observations, or why it cannot be read."""

    shard: str
    format: ShardFormat
    units: list[WorkUnit]
    seen: PlanObservations
    error: InputError | None = None
    cause: BaseException | None = None


def _plan_shard(
    item: tuple[str, ShardFormat],
    *,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    limit: datetime | None,
    fingerprints: dict[str, str],
) -> _ShardPlan:
    shard, fmt = item
    seen = PlanObservations(limit=limit)
    try:
        if fmt == "parquet":
            planned = _plan_parquet(shard, unit_rows, columns, need_updated_at, window, seen)
        else:
            _check_jsonl_head(shard, columns, need_updated_at)
            planned = [WorkUnit(shard, "jsonl", 0, None)]
    except (OSError, pa.ArrowException, ValueError, InputError) as e:
        if isinstance(e, InputError):
            err: InputError = e
        else:
            err = InputError(f"cannot read {fmt} shard: {type(e).__name__}: {e}", shard=shard)
        return _ShardPlan(shard, fmt, [], seen, err, None if err is e else e)
    mark = fingerprints.get(shard)
    return _ShardPlan(
        shard, fmt, [dataclasses.replace(u, fingerprint=mark) for u in planned] if mark else planned, seen
    )


def _in_order(
    plan: Callable[[tuple[str, ShardFormat]], _ShardPlan], items: Sequence[tuple[str, ShardFormat]], threads: int
) -> Iterator[_ShardPlan]:
    """`plan(item)` for each item, run by up to `threads` threads, yielded in the items' order.

    A window of 2 x `threads` items runs ahead of the one yielded: enough to keep every thread
    busy while the caller takes results in order, and nothing more is held. When the caller
    stops (a failed shard under "fail"), the items not started are dropped."""
    if threads <= 1 or len(items) <= 1:
        yield from map(plan, items)
        return
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="raypipe-plan") as pool:
        todo = iter(items)
        running: deque[Future[_ShardPlan]] = deque(pool.submit(plan, item) for item in islice(todo, 2 * threads))
        try:
            while running:
                done = running.popleft().result()
                running.extend(pool.submit(plan, item) for item in islice(todo, 1))
                yield done
        finally:
            for future in running:
                future.cancel()


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


def _plan_parquet(
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
        if hi is not None and seen.limit is not None and hi > seen.limit:
            seen.future_row_groups += 1
            hi = lo if lo is not None and lo <= seen.limit else None
        if hi is not None and (seen.max_updated_at is None or hi > seen.max_updated_at):
            seen.max_updated_at = hi
        if hi is not None and (shard not in seen.shard_max or hi.isoformat() > seen.shard_max[shard]):
            seen.shard_max[shard] = hi.isoformat()
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


def _check_jsonl_head(shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    fs, path = filesystem(shard)
    with fs.open(path, "rb") as f:
        first = f.readline()
    if not first.strip():
        return  # an empty file is a unit of no rows
    try:
        row = json.loads(first)
    except json.JSONDecodeError as e:
        raise InputError(f"first line is not JSON: {e}", shard=shard) from e
    if not isinstance(row, dict):
        raise InputError("first line is not a JSON object", shard=shard)
    check_columns(row.keys(), shard, columns, need_updated_at)

"""Shards cut into work units, several at once (`plan_units`), and an input of many small
Parquet shards planned from its listing (`plan_listing`): a sample of footers read, the other
small shards planned whole from their listed sizes."""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any, Literal

import pyarrow as pa

from raypipe.errors import InputError
from raypipe.plan.footers import PlanObservations, plan_parquet
from raypipe.plan.jsonl import plan_jsonl
from raypipe.plan.units import ColumnNames, DeltaWindow, ShardFormat, WorkUnit

__all__ = ["FOOTER_SAMPLE", "PLANNING_THREADS", "UNIT_BYTES", "WHOLE_FILE_MAX_BYTES", "plan_listing", "plan_units"]


# Shards cut into work units from their Parquet footers (or a JSON-lines file's first line),
# several shards at once; a daily's window prunes row groups by their updated_at statistics.
#: Shards planned at once when the caller does not say (`InputConfig.planning_threads`).
PLANNING_THREADS = 16

#: Bytes per unit when the caller does not say (`InputConfig.unit_bytes`).
UNIT_BYTES = 64 * 2**20


def plan_units(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    unit_rows: int,
    columns: ColumnNames,
    unit_bytes: int = UNIT_BYTES,
    need_updated_at: bool = False,
    on_bad_shard: Literal["fail", "record"] = "fail",
    window: DeltaWindow | None = None,
    observations: PlanObservations | None = None,
    fingerprints: dict[str, str] | None = None,
    sizes: dict[str, int] | None = None,
    threads: int = PLANNING_THREADS,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """Cuts shards into work units of at most `unit_rows` rows and about `unit_bytes` bytes
    (`raypipe.plan.footers.cut_ranges`, `raypipe.plan.jsonl.plan_jsonl`: a JSON-lines file
    over `unit_bytes` by its listed size in `sizes`, else asked, is cut at line boundaries);
    returns (units, bad shards as {shard, error}).

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
        unit_bytes=unit_bytes,
        columns=columns,
        need_updated_at=need_updated_at,
        window=window,
        limit=seen.limit,
        fingerprints=fingerprints or {},
        sizes=sizes or {},
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
    unit_bytes: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    limit: datetime | None,
    fingerprints: dict[str, str],
    sizes: dict[str, int],
) -> _ShardPlan:
    shard, fmt = item
    seen = PlanObservations(limit=limit)
    try:
        if fmt == "parquet":
            planned = plan_parquet(shard, unit_rows, unit_bytes, columns, need_updated_at, window, seen)
        else:
            planned = plan_jsonl(shard, unit_rows, unit_bytes, columns, need_updated_at, sizes.get(shard))
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


# -- whole files -------------------------------------------------------------------------------
# An input of more than `FOOTER_SAMPLE` Parquet shards has a sample of its footers read and its
# other small shards planned whole from their listed sizes: no request per shard. Such a shard's
# columns are checked when its unit is read (`raypipe.run.read`).
#: Parquet shards whose footers planning reads before it plans the others from their listed
#: sizes (`InputConfig.footer_sample`).
FOOTER_SAMPLE = 1000


#: The largest shard `plan_listing` makes one unit from its listed size (its rows are one block).
WHOLE_FILE_MAX_BYTES = 64 * 2**20


def plan_listing(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    sizes: dict[str, int],
    footer_sample: int | None = FOOTER_SAMPLE,
    unit_rows: int,
    unit_bytes: int = UNIT_BYTES,
    columns: ColumnNames,
    on_bad_shard: Literal["fail", "record"] = "fail",
    observations: PlanObservations | None = None,
    fingerprints: dict[str, str] | None = None,
    threads: int = PLANNING_THREADS,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """`plan_units` for shards read whole (a backfill's, a daily's new files), without reading
    every footer when there are many.

    With at most `footer_sample` Parquet shards (or `footer_sample` None) every footer is read,
    as `plan_units` does. With more, the footers of `footer_sample` of them, spread evenly over
    the listing, are read first: they are checked (a wrong schema fails the run before any
    inference, as it fails in any shard planning reads) and they give the input's bytes per row
    and how its columns read expand. Each other Parquet shard whose listed size holds at most
    about 2 x `unit_rows` rows and `unit_bytes` bytes read at those rates (and at most
    `WHOLE_FILE_MAX_BYTES`) becomes one whole-file unit (`row_stop` None)
    without a request; its footer is read by the task that reads its rows, which checks its
    columns then (a bad one fails the run there under "fail", or is recorded under "record").
    The rest are planned from their footers.

    Why: a footer costs one request, and an input of 50k small shards waited ~4 min on them
    before its first unit (moto, `bench.planning`); the listing already holds what a unit of a
    small file needs. What it costs: the footers' `updated_at` statistics of the shards
    planned whole (the informational watermark does not count them).
    """
    seen = observations if observations is not None else PlanObservations()
    common: dict[str, Any] = {
        "unit_rows": unit_rows,
        "unit_bytes": unit_bytes,
        "columns": columns,
        "on_bad_shard": on_bad_shard,
        "observations": seen,
        "fingerprints": fingerprints,
        "sizes": sizes,
        "threads": threads,
    }
    parquet = [i for i, (shard, fmt) in enumerate(shards) if fmt == "parquet" and shard in sizes]
    if footer_sample is None or len(parquet) <= max(footer_sample, 1):
        return plan_units(shards, **common)
    step = len(parquet) / footer_sample
    sampled = {parquet[int(k * step)] for k in range(footer_sample)}
    sample = [shards[i] for i in sorted(sampled)]
    read_before = seen.read_bytes
    sample_units, sample_bad = plan_units(sample, **common)
    bad_shards = {b["shard"] for b in sample_bad}
    rows = sum(u.expected_rows or 0 for u in sample_units if u.shard not in bad_shards)
    size = sum(sizes[shard] for shard, _ in sample if shard not in bad_shards)
    read = max(seen.read_bytes - read_before, 1)  # a bad shard counts no bytes: its footer failed
    limit = min(WHOLE_FILE_MAX_BYTES, 2 * unit_rows * size / rows, unit_bytes * size / read) if rows else 0.0
    whole: list[WorkUnit] = []
    rest: list[tuple[str, ShardFormat]] = []
    for i, (shard, fmt) in enumerate(shards):
        if i in sampled:
            continue
        if fmt == "parquet" and shard in sizes and sizes[shard] <= limit:
            mark = (fingerprints or {}).get(shard)
            whole.append(WorkUnit(shard, "parquet", 0, None, fingerprint=mark))
        else:
            rest.append((shard, fmt))
    seen.whole_files += len(whole)
    rest_units, rest_bad = plan_units(rest, **common)
    order = {shard: i for i, (shard, _) in enumerate(shards)}
    units = sorted([*sample_units, *whole, *rest_units], key=lambda u: (order[u.shard], u.row_start))
    bad = sorted([*sample_bad, *rest_bad], key=lambda b: order[b["shard"]])
    return units, bad

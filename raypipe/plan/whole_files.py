"""Planning an input of many small Parquet shards without a request per shard.

An input of more than `FOOTER_SAMPLE` Parquet shards has a sample of its footers read and its
other small shards planned whole from their listed sizes (`plan_listing`): a 50k-shard
backfill waited on one request per shard before its first unit; such a shard's columns are
checked when its unit is read (`raypipe.run.read`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from raypipe.plan.footers import PLANNING_THREADS, plan_units
from raypipe.plan.plan import PlanObservations
from raypipe.plan.units import ColumnNames, ShardFormat, WorkUnit

__all__ = ["FOOTER_SAMPLE", "WHOLE_FILE_MAX_BYTES", "plan_listing"]


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
    inference, as it fails in any shard planning reads) and they give the input's bytes per row.
    Each other Parquet shard whose listed size holds at most about 2 x `unit_rows` rows at that
    rate (and at most `WHOLE_FILE_MAX_BYTES`) becomes one whole-file unit (`row_stop` None)
    without a request; its footer is read by the task that reads its rows, which checks its
    columns then (a bad one fails the run there under "fail", or is recorded under "record").
    The rest are planned from their footers.

    Why: a footer costs one request, and an input of 50k small shards waited ~4 min on them
    before its first unit (moto, `bench.planning`); the listing already holds what a unit of a
    small file needs. What it costs: row-group pruning and the footers' `updated_at`
    statistics (the latest per shard, which a daily re-reads a rewritten file after) for the
    shards planned whole; the run takes the latter from its committed rows instead
    (`raypipe.run.modes`), and a daily's windowed re-reads read footers as before.
    """
    seen = observations if observations is not None else PlanObservations()
    common: dict[str, Any] = {
        "unit_rows": unit_rows,
        "columns": columns,
        "on_bad_shard": on_bad_shard,
        "observations": seen,
        "fingerprints": fingerprints,
        "threads": threads,
    }
    parquet = [i for i, (shard, fmt) in enumerate(shards) if fmt == "parquet" and shard in sizes]
    if footer_sample is None or len(parquet) <= max(footer_sample, 1):
        return plan_units(shards, **common)
    step = len(parquet) / footer_sample
    sampled = {parquet[int(k * step)] for k in range(footer_sample)}
    sample = [shards[i] for i in sorted(sampled)]
    sample_units, sample_bad = plan_units(sample, **common)
    bad_shards = {b["shard"] for b in sample_bad}
    rows = sum(u.expected_rows or 0 for u in sample_units if u.shard not in bad_shards)
    size = sum(sizes[shard] for shard, _ in sample if shard not in bad_shards)
    limit = min(WHOLE_FILE_MAX_BYTES, 2 * unit_rows * size / rows) if rows else 0.0
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

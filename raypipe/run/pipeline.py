"""The Ray Data pipeline: units -> read tasks -> async actor pool -> unit summaries.

    read_datasource(UnitDatasource)          one read task and one block per work unit
      .map_batches(InferenceActor, ...)      actors infer, commit, return one summary per unit
      .iter_batches()                        the driver folds summaries into progress/report

Ray Data streams: read tasks run only as fast as the actors drain their blocks (its
backpressure policies bound the blocks in flight), so a 95M-row backfill holds a few units
per actor in memory, not the corpus.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import pyarrow as pa
from ray.data import ActorPoolStrategy, DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raypipe.call.actor import ActorSettings, InferenceActor
from raypipe.call.client import ModelClient
from raypipe.config import ActorPoolConfig, default_max_actors
from raypipe.errors import InputError, ShardChangedError
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit
from raypipe.report import UnitStats
from raypipe.run.driver import no_ray_data_usage_actor
from raypipe.run.read import marker_block, read_unit, unit_block_schema

__all__ = ["InProcessUnits", "UnitDatasource", "UnitResult", "run_units", "run_units_in_process", "unit_rows"]

logger = logging.getLogger("raypipe")


def _read_block(unit: WorkUnit, columns: ColumnNames, on_bad_shard: str) -> list[pa.Table]:
    """The unit's rows. A unit is read whole unless it carries its own `since` (a daily's
    `--since` over a file no run changed since it was read whole); a new or changed file is
    read whole whatever its rows' `updated_at`, null included, so no row is lost to a window."""
    window = None if unit.since is None else DeltaWindow.since(datetime.fromisoformat(unit.since))
    try:
        table = read_unit(unit, columns, window)
    except (OSError, pa.ArrowException, InputError, ValueError) as e:
        message = f"{type(e).__name__}: {e}"
        if on_bad_shard == "fail" and not isinstance(e, ShardChangedError):  # a rewrite is no corruption
            if isinstance(e, InputError):  # names the shard (and the column) already
                raise
            rows = "the file" if unit.row_stop is None else f"rows {unit.row_start}..{unit.row_stop}"
            raise InputError(f"cannot read {rows}: {message}", shard=unit.shard) from e
        return [marker_block(unit, error=message)]
    if table.num_rows == 0:
        return [marker_block(unit, error=None)]
    return [table]


class UnitDatasource(Datasource):
    """A Ray Data datasource with one read task per work unit, in plan order."""

    def __init__(
        self,
        units: Sequence[WorkUnit],
        columns: ColumnNames,
        on_bad_shard: Literal["fail", "record"] = "fail",
    ) -> None:
        self._units = list(units)
        self._columns = columns
        self._on_bad_shard = on_bad_shard

    def get_name(self) -> str:
        return "RaypipeUnits"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        schema = unit_block_schema()
        return [
            ReadTask(
                functools.partial(_read_block, unit, self._columns, self._on_bad_shard),
                BlockMetadata(num_rows=unit.expected_rows, size_bytes=None, exec_stats=None, input_files=(unit.shard,)),
                schema=schema,
            )
            for unit in self._units
        ]


@dataclass(frozen=True)
class UnitResult:
    unit: str
    error: str | None
    """The shard could not be read (recorded, not committed)."""
    stats: UnitStats | None
    fatal: str | None = None
    """JSON of the error (circuit_open, lease_lost) that stopped the unit: the run must stop."""


def run_units(
    units: Sequence[WorkUnit],
    *,
    columns: ColumnNames,
    on_bad_shard: Literal["fail", "record"],
    settings: ActorSettings,
    actors: ActorPoolConfig,
) -> Iterator[UnitResult]:
    """Runs the pipeline over units, yielding each unit's outcome as it is committed."""
    if not units:
        return
    import ray

    max_actors = actors.max_actors or max(
        actors.min_actors, default_max_actors(ray.cluster_resources().get("CPU", 0.0))
    )
    no_ray_data_usage_actor()
    ctx = DataContext.get_current()
    # Unit blocks must reach the actors whole: never split them into smaller blocks.
    ctx.target_max_block_size = max(ctx.target_max_block_size or 0, 512 * 1024 * 1024)
    ds = ray.data.read_datasource(
        UnitDatasource(units, columns, on_bad_shard),
        override_num_blocks=len(units),
        num_cpus=0.25,
    )
    ds = ds.map_batches(
        InferenceActor,
        fn_constructor_kwargs={"settings": settings},
        batch_size=None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ActorPoolStrategy(
            min_size=min(actors.min_actors, len(units)),
            max_size=max(1, min(max_actors, len(units))),
            # Twice the units an actor works on, so one is queued behind each running one
            # (its read is done before it is needed) and the pool may autoscale (Ray Data
            # grows it only above 175% of its running capacity).
            max_tasks_in_flight_per_actor=2 * actors.units_per_actor,
            max_concurrent_calls_per_actor=actors.units_per_actor,
        ),
        num_cpus=actors.num_cpus,
    )
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield from _results(batch)


def _results(summaries: pa.Table) -> Iterator[UnitResult]:
    for row in summaries.to_pylist():
        stats = None if row["summary"] is None else UnitStats.from_dict(json.loads(row["summary"]))
        yield UnitResult(row["unit"], row["error"], stats, row["fatal"])


def unit_rows(unit: WorkUnit, columns: ColumnNames, on_bad_shard: str) -> pa.Table:
    """The unit's rows in one table, as an actor takes them: what a read task's block holds."""
    return pa.concat_tables(_read_block(unit, columns, on_bad_shard))


class InProcessUnits:
    """Units run without Ray: each read by the same `_read_block` and handed whole to one
    `InferenceActor` in this process, one unit after another, on one event loop; the same
    outcomes as `run_units`, in plan order. The actor (its channel, breaker, limiter, text
    index) is kept across `run` calls until `close`: a watcher's tests hand it batch after
    batch; `run_units_in_process` hands it one run's units."""

    def __init__(self, settings: ActorSettings, client_factory: Callable[[], ModelClient] | None = None) -> None:
        self._actor = InferenceActor(settings, client_factory=client_factory)
        self._loop = asyncio.Runner()

    def run(
        self,
        units: Sequence[WorkUnit],
        *,
        columns: ColumnNames,
        on_bad_shard: Literal["fail", "record"],
        stopping: Callable[[], bool] = lambda: False,
    ) -> Iterator[UnitResult]:
        """Each unit's outcome as it is committed; `stopping()` is asked before each unit."""
        for unit in units:
            if stopping():
                return
            yield from _results(self._loop.run(self._actor(unit_rows(unit, columns, on_bad_shard))))

    def close(self) -> None:
        self._loop.close()


def run_units_in_process(
    units: Sequence[WorkUnit],
    *,
    columns: ColumnNames,
    on_bad_shard: Literal["fail", "record"],
    settings: ActorSettings,
    actors: ActorPoolConfig,
    client_factory: Callable[[], ModelClient] | None = None,
) -> Iterator[UnitResult]:
    """`run_units` without Ray (`InProcessUnits`, for one run). `client_factory` builds the
    actor's model client (default: the service the settings name). For tests of the whole run
    path (modes, protocol, table) that must not start Ray; `actors` is accepted for
    `run_units`' signature and not used."""
    runner = InProcessUnits(settings, client_factory)
    try:
        yield from runner.run(units, columns=columns, on_bad_shard=on_bad_shard)
    finally:
        runner.close()

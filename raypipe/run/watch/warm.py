"""The warm path: inference actors that live as long as the watcher.

A daily streams its units through a Ray Data job (`raypipe.run.pipeline.run_units`): a job
start, an actor pool started and torn down, per run. A watcher commits a few small units a
minute; a job per cut would pay that start every time. Here the same `InferenceActor` (its
gRPC channel, breaker, limiter and text index) is held by long-lived Ray actors, started once;
each unit is read by the actor that infers it (`raypipe.run.pipeline.unit_rows`, as a read
task reads it) and committed by it through the watcher's fenced `UnitCommitter`, as in a daily.

    WarmActors      Ray actors (`actors.min_actors` of them, `actors.num_cpus` each), at most
                    `actors.units_per_actor` units in flight on each
    InProcessUnits  one `InferenceActor` in this process on one event loop, for tests of the
                    watcher that must not start Ray (`raypipe.run.pipeline`'s, which
                    `run_units_in_process` runs a run's units with)

Both run a batch's units and yield each one's `UnitResult` as it is committed; `stopping()`
is asked before each unit is handed out, so a stop finishes the units in flight and hands out
no more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import pyarrow as pa

from raypipe.call.actor import ActorSettings, InferenceActor
from raypipe.config import ActorPoolConfig
from raypipe.plan.units import ColumnNames, WorkUnit

# The pipeline's own read of a unit and decoding of an actor's summaries: a warm actor reads and
# answers exactly as a Ray Data read task and actor do; the in-process runner is the pipeline's.
from raypipe.run.pipeline import InProcessUnits, UnitResult, _results, unit_rows

__all__ = ["InProcessUnits", "UnitRunner", "WarmActors"]


class UnitRunner(Protocol):
    def run(
        self,
        units: Sequence[WorkUnit],
        *,
        columns: ColumnNames,
        on_bad_shard: Literal["fail", "record"],
        stopping: Callable[[], bool],
    ) -> Iterator[UnitResult]: ...

    def close(self) -> None: ...


class _WarmActor:
    """One long-lived actor: reads a unit, infers and commits it (`InferenceActor`)."""

    def __init__(self, settings: ActorSettings) -> None:
        self._actor = InferenceActor(settings)

    async def run(self, unit: WorkUnit, columns: ColumnNames, on_bad_shard: str) -> pa.Table:
        return await self._actor(await asyncio.to_thread(unit_rows, unit, columns, on_bad_shard))

    def ready(self) -> bool:
        return True


class WarmActors:
    """`actors.min_actors` Ray actors holding an `InferenceActor` each, started once."""

    def __init__(self, settings: ActorSettings, actors: ActorPoolConfig) -> None:
        import ray

        remote: Any = ray.remote(_WarmActor).options(num_cpus=actors.num_cpus, max_restarts=0)
        self._actors: list[Any] = [remote.remote(settings) for _ in range(max(1, actors.min_actors))]
        self._per_actor = max(1, actors.units_per_actor)
        ray.get([a.ready.remote() for a in self._actors])  # started now, not on the first arrival

    def run(
        self,
        units: Sequence[WorkUnit],
        *,
        columns: ColumnNames,
        on_bad_shard: Literal["fail", "record"],
        stopping: Callable[[], bool],
    ) -> Iterator[UnitResult]:
        import ray

        todo = list(units)
        load = dict.fromkeys(range(len(self._actors)), 0)
        in_flight: dict[Any, int] = {}
        while in_flight or (todo and not stopping()):
            while todo and not stopping():
                index = min(load, key=lambda i: load[i])
                if load[index] >= self._per_actor:
                    break
                ref = self._actors[index].run.remote(todo.pop(0), columns, on_bad_shard)
                in_flight[ref] = index
                load[index] += 1
            if not in_flight:
                break
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                load[in_flight.pop(ref)] -= 1
                yield from _results(ray.get(ref))

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []

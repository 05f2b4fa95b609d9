"""The real run path over local files, with seams and no Ray.

`World` holds an input folder of Parquet files, an output (a real Delta table through
`deltalake`) and one `tests.fakes.CountingClient`; it runs `raypipe.run.modes` backfill, daily
and replay and `raypipe.commit.upkeep` as an operator would, with two seams:
- `ExecuteRun.runner` is `run_units_in_process` (each unit read by the real `_read_block` and
  inferred and committed by the real `InferenceActor`, in this process);
- `ModelService.ask` answers from the fake client (its labels and model version).

A *lost answer* carries out a write of the output store (the lease, a plan, files seen, a
report) and then raises as a dropped connection would.

A *kill* between two commit steps raises `Killed` (a `BaseException`, as nothing in the run
catches) at that step and leaves the output as a SIGKILL would: no abort, no report, the lease
still held (its heartbeat stopped). A kill just before a unit commit keeps that commit's
arguments as a *zombie*: an actor of the dead attempt that wakes later and commits.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.api import build_config
from raypipe.commit import upkeep
from raypipe.commit.fence import UnitCommitter
from raypipe.commit.lease import Lease
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import PipelineConfig
from raypipe.errors import SinkError
from raypipe.report import RunReport
from raypipe.run import modes
from raypipe.run.pipeline import run_units_in_process
from raypipe.run.steps import ExecuteRun, ModelService, ReportRun
from raypipe.store import OutputStore
from tests.fakes import CountingClient
from tests.modelcheck.reference import Row

KILL_POINTS = (
    "after_setup",
    "after_plan",
    "before_unit",
    "after_unit",
    "after_files_seen",
    "after_commit_run",
    "after_report",
)

LOST_ANSWERS = {"lease": "/lease.json", "plan": "/plan/", "files_seen": "/files_seen/", "report": "/runs/"}
"""Where a write's answer may be lost: a fragment of the path it writes."""

INVALID = "<invalid UTF-8>"
"""A row text the producer writes as bytes that are not UTF-8 (the row is an `invalid_text`)."""
INVALID_BYTES = b"caf\xe9"


class Killed(BaseException):
    """The driver died here (SIGKILL): nothing after this point of the run happens."""


@dataclass
class Zombie:
    """A unit commit of a killed attempt, still to come: the actor was stalled, not dead."""

    committer: UnitCommitter
    unit: str
    rows: pa.Table
    replace: bool
    run_id: str
    takeovers_at_kill: int


@dataclass
class Outcome:
    """How one run call ended."""

    report: RunReport | None = None
    error: BaseException | None = None
    killed: bool = False
    calls: set[str] = field(default_factory=set)
    """Texts the fake answered during the run."""
    had_results: set[str] = field(default_factory=set)
    """Texts with a committed result of the model version when the run started."""


def _settings(unit_rows: int) -> dict[str, Any]:
    return {
        "input": {"unit_rows": unit_rows},
        "client": {
            "micro_batch_size": 4,
            "retry": {"max_attempts": 2, "initial_backoff_s": 0.0005, "max_backoff_s": 0.001},
            "breaker": {
                "failure_threshold": 2,
                "reset_timeout_s": 0.005,
                "max_reset_timeout_s": 0.01,
                "max_wait_s": 0.02,
            },
            "limiter": {"kind": "fixed", "initial": 4},
        },
        "output": {"lease_s": 300.0, "lease_wait_s": 0.01},
        "metrics": {"ray_metrics": False},
        "progress_interval_s": 3600.0,
    }


class World:
    def __init__(self, root: Path, *, unit_rows: int = 2) -> None:
        self.input = root / "in"
        self.output = root / "out"
        self.input.mkdir(parents=True)
        self.client = CountingClient()
        self.unit_rows = unit_rows
        self.takeovers = 0
        self.zombies: list[Zombie] = []
        self._mtime = itertools.count(1_800_000_000_000_000_000, 1_000_000_000)
        self._dead = False
        self._kill_at: str | None = None
        self._lose_answer: str | None = None
        self._kill_unit = 0
        self._units_seen = 0
        self._stack = contextlib.ExitStack()
        self._patch()

    def close(self) -> None:
        self._stack.close()

    # -- the seams ---------------------------------------------------------------------------
    def _patch(self) -> None:
        patch = self._stack.enter_context(contextlib.ExitStack())
        world = self

        def set_attr(owner: Any, name: str, value: Any) -> None:
            old = owner.__dict__[name]
            setattr(owner, name, value)
            patch.callback(setattr, owner, name, old)

        set_attr(
            ExecuteRun,
            "runner",
            staticmethod(functools.partial(run_units_in_process, client_factory=lambda: world.client)),
        )

        def ask(service: Any, client: Any) -> ModelService:
            return ModelService(world.client.labels, world.client.version, client)

        set_attr(ModelService, "ask", staticmethod(ask))

        def after(step: str, method: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(method)
            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                out = method(self, *args, **kwargs)
                world._maybe_kill(step)
                return out

            return wrapped

        setup = CommitProtocol.setup_run

        def setup_run(self: CommitProtocol, labels: tuple[str, ...]) -> Any:
            world._protocol = self
            fence = setup(self, labels)
            world.takeovers += 1
            world._maybe_kill("after_setup")
            return fence

        set_attr(CommitProtocol, "setup_run", setup_run)
        set_attr(CommitProtocol, "save_plan", after("after_plan", CommitProtocol.save_plan))
        set_attr(CommitProtocol, "record_files_seen", after("after_files_seen", CommitProtocol.record_files_seen))
        set_attr(CommitProtocol, "commit_run", after("after_commit_run", CommitProtocol.commit_run))
        set_attr(CommitProtocol, "write_report", after("after_report", CommitProtocol.write_report))

        commit = UnitCommitter.commit

        def unit_commit(self: UnitCommitter, unit: str, rows: pa.Table, *, replace_dead_letters: bool = False) -> bool:
            world._units_seen += 1
            if world._kill_at == "before_unit" and world._units_seen == world._kill_unit:
                world.zombies.append(Zombie(self, unit, rows, replace_dead_letters, self.fence.run_id, world.takeovers))
                world._maybe_kill("before_unit")
            out = commit(self, unit, rows, replace_dead_letters=replace_dead_letters)
            if world._units_seen == world._kill_unit:
                world._maybe_kill("after_unit")
            return out

        set_attr(UnitCommitter, "commit", unit_commit)

        # A storage fault: the write is carried out, and its answer lost (a dropped connection).
        write_bytes = OutputStore.write_bytes

        def lossy_write(self: OutputStore, path: str, data: bytes) -> None:
            write_bytes(self, path, data)
            target = world._lose_answer
            if target is not None and LOST_ANSWERS[target] in path.replace(os.sep, "/"):
                world._lose_answer = None
                raise SinkError(f"cannot write: the answer was lost ({target})", path=path)

        set_attr(OutputStore, "write_bytes", lossy_write)

        # What a dead driver never does: abort, report, give the lease back.
        def unless_dead(method: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(method)
            def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
                if not world._dead:
                    return method(self, *args, **kwargs)
                return None

            return wrapped

        set_attr(modes.CommitRun, "abort", unless_dead(modes.CommitRun.abort))
        set_attr(ReportRun, "write", unless_dead(ReportRun.write))
        set_attr(CommitProtocol, "release", unless_dead(CommitProtocol.release))

    def _maybe_kill(self, step: str) -> None:
        if self._kill_at == step and not self._dead:
            self._dead = True
            raise Killed(step)

    # -- the producer ------------------------------------------------------------------------
    def write_file(self, name: str, rows: list[Row], *, ns: bool = False, stamps: bool = True) -> None:
        """Writes (or overwrites) an input file; `ns`: `updated_at` as timestamp[ns] with
        sub-microsecond digits; `stamps=False`: no `updated_at` column (every stamp is None)."""
        texts = [INVALID_BYTES if r.text == INVALID else r.text.encode() for r in rows]
        columns: dict[str, pa.Array] = {
            "id": pa.array([r.id for r in rows], pa.string()),
            # Parquet string columns hold any bytes; a binary column is read as strings.
            "text": pa.array(texts, pa.binary()) if INVALID_BYTES in texts else pa.array([r.text for r in rows]),
        }
        if stamps:
            us = pa.array([r.stamp for r in rows], pa.timestamp("us", tz="UTC"))
            if ns and all(r.stamp is None or r.stamp.year < 2262 for r in rows):  # int64 ns ends in 2262
                raw = us.cast(pa.int64()).to_pylist()
                columns["updated_at"] = pa.array([None if v is None else v * 1000 + 123 for v in raw], pa.int64()).cast(
                    pa.timestamp("ns", tz="UTC")
                )
            else:
                columns["updated_at"] = us
        path = self.input / name
        pq.write_table(pa.table(columns), path)
        # A real store's ETag changes with every write; a local mtime may not within a clock tick.
        stamp = next(self._mtime)
        os.utime(path, ns=(stamp, stamp))

    def delete_file(self, name: str) -> None:
        (self.input / name).unlink()

    def shard(self, name: str) -> str:
        return str(self.input / name)

    # -- the operator ------------------------------------------------------------------------
    def config(self, run_id: str | None, *, force: bool = False) -> PipelineConfig:
        settings = _settings(self.unit_rows)
        settings["output"]["take_over_lease"] = force
        return build_config(
            input=str(self.input), output=str(self.output), service="127.0.0.1:1", run_id=run_id, settings=settings
        )

    @contextlib.contextmanager
    def _run_faults(self, kill_at: str | None, kill_unit: int) -> Iterator[None]:
        self._kill_at, self._kill_unit, self._units_seen, self._dead = kill_at, kill_unit, 0, False
        self._protocol: CommitProtocol | None = None
        try:
            yield
        finally:
            if self._dead and self._protocol is not None and self._protocol._lease is not None:
                lease = self._protocol._lease
                lease._stop.set()  # the heartbeat dies with the driver; the lease file stays
                if lease._thread is not None:
                    lease._thread.join()
            self._kill_at, self._dead = None, False

    def run(
        self,
        mode: str,
        run_id: str | None,
        *,
        since: datetime | None = None,
        of_run: str | None = None,
        force: bool = False,
        kill_at: str | None = None,
        kill_unit: int = 1,
        lose_answer: str | None = None,
        had_results: set[str] | None = None,
    ) -> Outcome:
        config = self.config(run_id, force=force)
        out = Outcome(had_results=had_results or set())
        before = self.client.answered.copy()
        self._lose_answer = lose_answer
        with self._run_faults(kill_at, kill_unit):
            try:
                if mode == "backfill":
                    assert config.input is not None
                    out.report = modes.backfill(config, config.input, Output.at(config.output))
                elif mode == "daily":
                    assert config.input is not None
                    out.report = modes.daily(config, config.input, Output.at(config.output), since=since)
                else:
                    assert of_run is not None
                    out.report = modes.replay(config, Output.at(config.output), of_run=of_run)
            except Killed:
                out.killed = True
            except Exception as e:
                out.error = e
        self._lose_answer = None
        out.calls = {text for (_, text), n in (self.client.answered - before).items() if n}
        return out

    def expire_lease(self) -> None:
        Lease(OutputStore(str(self.output)), "operator").expire()

    def lease_holder(self) -> dict[str, Any] | None:
        return Lease(OutputStore(str(self.output)), "operator").current()

    # Maintenance holds the output as a run does: `OutputLockedError` while a run's lease is live.
    def compact(self) -> None:
        if (self.output / "outcomes").exists():
            upkeep.compact(self.config(None).output)

    def vacuum(self) -> None:
        if (self.output / "outcomes").exists():
            upkeep.vacuum(self.config(None).output, retention_hours=0, force=True)

    def quarantine(self, name: str) -> None:
        upkeep.quarantine(self.config(None).output, [self.shard(name)], reason="model-based test")

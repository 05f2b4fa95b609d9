"""The commit protocol: one object owns a run's story in the outcomes table.

In the manner of Spark's `FileCommitProtocol`, a run's output is set up, committed unit by
unit, committed as a whole, or aborted, each step one method, each commit one Delta commit
that either happens or raises::

    protocol = CommitProtocol(OutputStore(output_uri), run_id, holder=attempt)
    protocol.is_committed()            # the one truth of "run committed": its commit in the table
    protocol.setup_run(labels)         # table ready; take-over: every older attempt fenced off
    protocol.save_plan(d) / stored_plan()    # the plan, fenced (a file the table names)
    protocol.committed(units, replay=...)    # which units are committed already
    protocol.unit_committer()          # picklable: what the actors commit units through
    protocol.commit_unit(unit, rows)   # one unit's results and dead letters, one commit
    protocol.files_seen() / record_files_seen(update)   # the files read, fenced the same way
    protocol.commit_run(metadata)      # the run committed, fenced
    protocol.abort()                   # nothing of this attempt lands after it returns

**The fence** is the table's concurrency control (`raypipe.commit.table`): `setup_run` commits a new
generation of the run id to its slots; every later commit of this attempt (units, plan, files
seen, run) carries the run's slots at that generation and is built on a snapshot where they
still hold it, so once a newer attempt took over, none can land (`LeaseLostError`), however
long it was stalled. `abort` fences off this attempt's own writers the same way (a take-over
by nobody), unless a newer attempt already holds the run: the report a driver writes after
a failure is then final, and files an actor writes afterwards stay invisible (`raypipe
vacuum` removes them). What the lease does (`raypipe.run.lease`) is liveness only.

State beside the table is never a truth on its own: the plan and the files seen are new
immutable files under numbers no other writer uses, and the table names the current one (an
app transaction); an earlier release's `plan.json`, `files_seen.parquet` and `COMMITTED.json`
are read where the table names nothing.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from raypipe.commit.table import FILES_SEEN_APP, OutcomeTable, TableFence, UnitCommitter, plan_app
from raypipe.errors import SinkError
from raypipe.store import OutputStore

__all__ = ["CommitProtocol", "FilesSeen"]

FilesSeen = dict[str, tuple[str, str | None]]
"""Input file URI -> (fingerprint, the latest `updated_at` read in it, ISO, if known)."""

FILES_SEEN_DIR = "files_seen"
LEGACY_FILES_SEEN = "files_seen.parquet"
LEGACY_COMMITTED = "COMMITTED.json"


def _fresh_number() -> int:
    """A state file's number: random, so no two writers (a zombie included) share a file name."""
    return secrets.randbits(62) + 1


class CommitProtocol:
    """Set up a run, commit its units, commit the run, or abort (see the module docstring).

    `store` is the run's output, opened once by its owner (`raypipe.run.state.RunState`)."""

    def __init__(
        self,
        store: OutputStore,
        run_id: str,
        *,
        holder: str = "",
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.run_id = run_id
        self.holder = holder
        self.store = store
        self.table = OutcomeTable(store.uri)
        self._clock = clock
        self._sleep = sleep
        self._fence: TableFence | None = None

    # -- the one truth -------------------------------------------------------------------------
    def is_committed(self) -> bool:
        """Is the run committed? Its run commit in the table says so, nothing else."""
        return self.table.is_committed(self.run_id)

    # -- set up --------------------------------------------------------------------------------
    def setup_run(self, labels: tuple[str, ...]) -> TableFence:
        """Makes the table ready for `labels` and takes the run over: from here on no commit of
        an earlier attempt of this run id can land."""
        self.table.ensure(labels)
        self._fence = self.table.take_over(self.run_id, holder=self.holder)
        return self._fence

    @property
    def fence(self) -> TableFence:
        assert self._fence is not None, "setup_run() first"
        return self._fence

    # -- the plan ------------------------------------------------------------------------------
    def stored_plan(self) -> dict[str, Any] | None:
        """The plan the table names, else one an earlier release stored as `plan.json`."""
        number = self.table.pointer(plan_app(self.run_id))
        if number is not None:
            return dict(self.store.read_json(self.store.run_state(self.run_id, "plan", f"{number}.json")))
        legacy = self.store.read_json_or_none(self.store.run_state(self.run_id, "plan.json"))
        return None if legacy is None else dict(legacy)

    def save_plan(self, plan: dict[str, Any]) -> None:
        """Stores the plan as a new file and points the table at it, fenced."""

        def write(current: int | None) -> int:
            number = _fresh_number()
            self.store.write_json(self.store.run_state(self.run_id, "plan", f"{number}.json"), plan)
            return number

        self.table.set_pointer(self.fence, plan_app(self.run_id), write, operation="plan")

    # -- units ---------------------------------------------------------------------------------
    def committed(self, units: list[str], *, replay: bool = False) -> set[str]:
        """The units of `units` committed already (read after `setup_run`, so final for them).

        A backfill's or daily's units are listed from the log's file statistics (no data read);
        a replay's rows land in the run it replays, so its units are found by their own
        transactions."""
        if replay:
            return self.table.units_with_transaction(self.run_id, units)
        return self.table.committed_units(self.run_id) & set(units)

    def unit_committer(self) -> UnitCommitter:
        """What commits units of this attempt (picklable: the actors get one each)."""
        return UnitCommitter(self.fence, sleep=self._sleep, clock=self._clock)

    def commit_unit(self, unit: str, rows: pa.Table, *, replace_dead_letters: bool = False) -> bool:
        """Commits one unit's rows in one Delta commit; False if this attempt had already."""
        return self.unit_committer().commit(unit, rows, replace_dead_letters=replace_dead_letters)

    # -- files seen ----------------------------------------------------------------------------
    def files_seen(self) -> FilesSeen:
        """The input files runs of this output read whole (the state the table names)."""
        return read_files_seen(self.store, self.table.pointer(FILES_SEEN_APP))

    def record_files_seen(self, update: Callable[[FilesSeen], FilesSeen]) -> int:
        """Applies `update` (the entries to add or change, given the current state) and stores
        the result as a new file the table names, fenced; a concurrent change by another run
        makes it read and apply again. Returns how many entries changed."""
        if not update(self.files_seen()):
            return 0
        changed: FilesSeen = {}

        def write(current: int | None) -> int:
            seen = read_files_seen(self.store, current)
            changed.clear()
            changed.update(update(seen))
            seen.update(changed)
            files = sorted(seen)
            number = _fresh_number()
            table = pa.table(
                {
                    "path": files,
                    "fingerprint": [seen[f][0] for f in files],
                    "max_updated_at": pa.array([seen[f][1] for f in files], pa.string()),
                }
            )
            self.store.write_parquet(self.store.state(FILES_SEEN_DIR, f"{number}.parquet"), table)
            return number

        self.table.set_pointer(self.fence, FILES_SEEN_APP, write, operation="files-seen")
        return len(changed)

    # -- the run -------------------------------------------------------------------------------
    def commit_run(self, metadata: dict[str, str] | None = None) -> None:
        """Records, fenced, that every unit of the run is committed: the run is committed."""
        self.table.mark_committed(self.fence, {"raypipe.attempt": self.holder, **(metadata or {})})

    def abort(self) -> bool:
        """Fences off this attempt's own writers, unless a newer attempt holds the run already.

        Returns True if it did. Units committed before stay committed (a later attempt does
        not redo them); an actor's commit after this fails, and its files stay invisible."""
        if self._fence is None:
            return False
        return self.table.retire(self._fence)


def read_files_seen(store: OutputStore, number: int | None) -> FilesSeen:
    """The files-seen state numbered `number` (the table's `FILES_SEEN_APP`); with None, the
    one an earlier release kept as `_raypipe/files_seen.parquet`, if any."""
    path = store.state(LEGACY_FILES_SEEN) if number is None else store.state(FILES_SEEN_DIR, f"{number}.parquet")
    if not store.exists(path):
        if number is not None:
            raise SinkError(f"the files-seen state the table names is missing: {path}", path=path)
        return {}
    t = store.read_parquet(path)
    latest = t.column("max_updated_at").to_pylist() if "max_updated_at" in t.column_names else [None] * t.num_rows
    return {
        p: (fp, m)
        for p, fp, m in zip(t.column("path").to_pylist(), t.column("fingerprint").to_pylist(), latest, strict=True)
    }

"""The commit protocol: one object owns the story of a run's output, step by step.

In the manner of Spark's `FileCommitProtocol`, a run's output is set up, committed unit by
unit, committed as a whole, or aborted, each step one method, each commit one Delta commit
that either happens or raises. A run (`raypipe.run.modes._run`, through the steps of
`raypipe.run.steps`) calls it in this order; the modes and steps name the steps, the order
of the protocol's calls is told here::

    protocol = CommitProtocol(place, mode, run_id)  # place: the run's `Output`
    committed_report(protocol)       # a run id committed already: its report, done
                                     #   (`raypipe.run.steps`: rebuilt from the table if need be)
    protocol.setup_run(labels)       # the lease, the table made ready, the take-over: the fence
    protocol.plan(make_plan, ...)    # the stored plan, or a new one, stored (fenced); planning
                                     #   asks quarantined(), files_seen(), dead_letters_of()
    protocol.committed_units(plan)   # what the table holds committed; the rest is to do
    protocol.save_plan(plan)         # a resumed plan brought up to date with its input (fenced)
    ...                              # the actors commit each unit with the `UnitCommitter`
                                     #   `protocol.unit_committer()` hands out (fenced)
    protocol.record_files_seen(...)  # the files every unit of which is committed (fenced); it
                                     #   and commit_run first move the run's snapshot of the
                                     #   table past the actors' units (`units_landed`)
    protocol.commit_run(plan)        # the table holds every unit: the run is committed (fenced)
    protocol.advance_watermark(...)  # informational, never backwards (fenced)
    protocol.abort()                 # instead of the three above, when a step failed
    protocol.save_attempt(...)       # this attempt's calls, and then its report, unless a
    protocol.write_report(...)       #   newer holder fenced this one off (that one reports)
    protocol.drop_state()            # a completed run's plans and attempts, once it reported
    protocol.release()               # the lease, last, however the run ended

Maintenance (`raypipe.commit.upkeep`) holds the output the same way (`holding`: the lease,
then a take-over).

**The fence** is the table's concurrency control, one for the whole output; every commit
above carries it, and its mechanics are `raypipe.commit.fence`, which only this protocol
drives: once anyone took the output over (another attempt of this run id, a run of another
id after `raypipe lease expire`, maintenance), no commit of an older holder can land
(`LeaseLostError`), however long it was stalled. `abort` fences off this attempt's own
writers the same way (a take-over by nobody), unless a newer holder already took the output:
the report a driver writes after a failure is then final, and files an actor writes
afterwards stay invisible (`raypipe vacuum` removes them). "Committed" is the run's commit in
the table (`OutcomeTable.is_committed`), written only by `commit_run` after it found every
planned unit committed in the table (a run's own transactions expire after the table's
transaction retention; past it, its completed report stands for its commit: `committed_runs`).
The lease (`raypipe.commit.lease`) is liveness only: it
keeps a second run id from starting on the same output while the first is alive and lets a
retried attempt wait for a live one to expire; it fences nothing.

State beside the table is never a truth on its own: the plan, the files seen and the
quarantine are new immutable files under numbers no other writer uses, and the table names the
current one (an app transaction); the watermark is an app transaction of its own. Their formats
are `raypipe.commit.state`'s. An earlier release's `plan.json`, `files_seen.parquet`,
`watermark.json` and `COMMITTED.json` are read where the table names nothing. What lives where
under OUTPUT: `raypipe.store`.

Over ~500 lines, kept whole on purpose: it is the one owner of a run's output, and every step a
run asks of it, in the order it asks, reads in one place; the mechanics of each commit are
`raypipe.commit.fence`'s, the formats of the state beside the table `raypipe.commit.state`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.fence import TableFence, UnitCommitter, mark_committed, retire, set_pointer, take_over
from raypipe.commit.lease import Lease
from raypipe.commit.outcomes import Ledger, ledger_of, read_outcomes, versions_of
from raypipe.commit.output import Output
from raypipe.commit.schema import OUTCOME_DEAD_LETTER
from raypipe.commit.state import (
    FilesSeen,
    FilesSeenWrite,
    changes,
    drop_files_seen,
    fresh_number,
    read_files_seen,
    read_quarantine,
    read_watermark,
    watermark_micros,
    write_files_seen,
    write_quarantine,
)
from raypipe.commit.table import FILES_SEEN_APP, QUARANTINE_APP, WATERMARK_APP, plan_app, scan_where
from raypipe.errors import ConfigError, SinkError
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats, RunReport
from raypipe.store import OutputStore

__all__ = [
    "CommitProtocol",
    "committed_runs",
    "drop_run_state",
    "holding",
    "run_known",
]

logger = logging.getLogger("raypipe")


class CommitProtocol:
    """Set up a run, commit its units, commit the run, or abort; and everything else the run
    knows about its output (plan, files seen, watermark, attempts, report). See the module
    docstring for the order of the steps and the fence."""

    def __init__(
        self,
        place: Output,
        mode: str,
        run_id: str,
        *,
        attempt: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.mode = mode
        self.run_id = run_id
        self.attempt = attempt or uuid.uuid4().hex[:8]
        self.place = place  # the one the entry (api, cli, the watch, a maintenance command) built
        self.settings, self.store, self.table = place.settings, place.store, place.table
        self._lease: Lease | None = None
        self._clock = clock
        self._sleep = sleep
        self._fence: TableFence | None = None

    # -- a run committed already ---------------------------------------------------------------
    def is_committed(self) -> bool:
        """Is this run id committed? Its run commit in the table, or past the table's transaction
        retention (when that commit has expired) its completed report: `committed_runs`."""
        return self.run_id in committed_runs(self.place, {self.run_id})

    def stored_report(self) -> RunReport | None:
        """The report stored for this run id, if any (whatever its status)."""
        stored = self.store.read_json_or_none(self.store.report_file(self.run_id))
        return None if stored is None else RunReport.from_dict(stored)

    # -- set up --------------------------------------------------------------------------------
    def setup_run(self, labels: tuple[str, ...]) -> TableFence:
        """Takes the lease (a live attempt of this run id is waited out, or taken over with
        `output.take_over_lease`), makes the table ready for `labels` and takes the output over:
        from here on no commit of an earlier holder, of this run id or another, can land."""
        return self.take_output(labels)

    def take_output(self, labels: tuple[str, ...] | None = None) -> TableFence:
        """The lease, then the take-over: `setup_run`'s, and what maintenance
        (`raypipe.commit.upkeep`) holds the output by. With `labels` the table is made ready
        for them first (created if need be); without, it must exist."""
        lease = Lease(self.store, self.run_id, duration_s=self.settings.lease_s, wait_s=self.settings.lease_wait_s)
        if self.settings.require_conditional_writes:
            lease.check_conditional_writes()
        lease.acquire(force=self.settings.take_over_lease)
        self._lease = lease
        try:
            if labels is not None:
                self.table.ensure(labels)
            self._fence = take_over(self.table, self.run_id, holder=self.attempt)
        except BaseException:
            self.release()
            raise
        lease.generation = self._fence.generation
        logger.info("run %s: attempt %s holds generation %d", self.run_id, self.attempt, self._fence.generation)
        return self._fence

    @property
    def fence(self) -> TableFence:
        assert self._fence is not None, "setup_run() first"
        return self._fence

    @property
    def lease_lost(self) -> bool:
        """Has another attempt taken this attempt's output lease (or could it not be renewed)?"""
        return self._lease is not None and self._lease.lost

    def check_lease(self) -> None:
        """Raises `LeaseLostError` if another attempt took the output lease: a courtesy before a
        write, so a superseded driver stops at its next step (the fence is the table's)."""
        if self._lease is not None:
            self._lease.check()

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, make_plan: Callable[[], Plan], *, input_uri: str | None, model_version: str) -> tuple[Plan, bool]:
        """The run's plan: stored at its first start, read back on every later one.

        Returns (plan, resumed). A run id cannot be resumed as another mode or input, nor under
        another model version unless `OutputConfig.allow_model_change`.
        """
        plan = self.stored_plan()
        if plan is not None:
            if plan.mode != self.mode or plan.input != input_uri:
                raise ConfigError(
                    f"run {self.run_id} was started as a {plan.mode} of {plan.input}; "
                    f"it cannot be resumed as a {self.mode} of {input_uri}"
                )
            if plan.model_version not in (None, model_version):
                if not self.settings.allow_model_change:
                    raise ConfigError(
                        f"run {self.run_id} was started with model {plan.model_version} and the service now "
                        f"answers with {model_version}: serve {plan.model_version} again to resume it, start a "
                        "new run id, or set output.allow_model_change=true to finish it with both"
                    )
                logger.warning(
                    "run %s was started with model %s and resumes with %s: its rows will carry both versions",
                    self.run_id,
                    plan.model_version,
                    model_version,
                )
            return plan, True
        plan = make_plan()
        plan.model_version = model_version
        self.save_plan(plan)
        return plan, False

    def stored_plan(self) -> Plan | None:
        """The plan the table names, else one an earlier release stored as `plan.json`."""
        number = self.table.pointer(plan_app(self.run_id))
        if number is not None:
            return Plan.from_dict(self.store.read_json(self.store.run_state(self.run_id, "plan", f"{number}.json")))
        legacy = self.store.read_json_or_none(self.store.run_state(self.run_id, "plan.json"))
        return None if legacy is None else Plan.from_dict(legacy)

    def save_plan(self, plan: Plan) -> None:
        """Stores the plan as a new file and points the table at it, fenced."""
        self.check_lease()

        def write(current: int | None) -> int:
            number = fresh_number()
            self.store.write_json(self.store.run_state(self.run_id, "plan", f"{number}.json"), plan.to_dict())
            return number

        set_pointer(self.table, self.fence, plan_app(self.run_id), write, operation="plan", clock=self._clock)

    # -- units ---------------------------------------------------------------------------------
    def committed_units(self, plan: Plan) -> set[str]:
        """The run's units committed in the run's snapshot (read after `setup_run`, so final
        for earlier attempts' units; `units_landed` first for this attempt's). A backfill's or
        daily's are listed from the log's file statistics (no data read): every unit the run
        committed, so units a resumed plan adds are answered too. A replay's rows land in the
        run it replays, so its plan's units are found by their own transactions."""
        if plan.mode == "replay":
            return self.table.units_with_transaction(self.run_id, [u.key for u in plan.units])
        return self.table.committed_units(self.run_id)

    def dead_letters_of(self, run_id: str) -> tuple[int, Counter[str]] | None:
        """Run `run_id`'s committed dead letters by unit, and the table version they were read
        at (what a replay of it plans and counts against); None if the table holds no row of it."""
        dt = self.table.load()
        version = dt.version()
        rows = dt.to_pyarrow_dataset(partitions=[("run_id", "=", run_id)]).to_table(
            filter=pc.field("run_id") == run_id, columns=["unit", "outcome"]
        )
        if rows.num_rows == 0:
            return None
        dead = rows.filter(pc.equal(rows.column("outcome"), OUTCOME_DEAD_LETTER))
        return version, Counter(dead.column("unit").to_pylist())

    def unit_committer(self) -> UnitCommitter:
        """What commits units of this attempt (picklable: the actors get one each)."""
        return UnitCommitter(self.fence, sleep=self._sleep, clock=self._clock)

    def commit_unit(self, unit: str, rows: pa.Table, *, replace_dead_letters: bool = False) -> bool:
        """Commits one unit's rows in one Delta commit, and moves the run's snapshot past it;
        False if this attempt had already. (The run's actors commit with `unit_committer`s of
        their own; `units_landed` moves the snapshot past theirs.)"""
        done = self.unit_committer().commit(unit, rows, replace_dead_letters=replace_dead_letters)
        self.units_landed()
        return done

    def units_landed(self) -> None:
        """Moves the run's snapshot of the table past the units its actors committed (this run's
        own commits, made from snapshots of their own). `record_files_seen` and `commit_run`,
        the steps after the units, begin with it."""
        self.table.refresh()

    # -- files seen ----------------------------------------------------------------------------
    def quarantined(self) -> frozenset[str]:
        """The shards an operator set aside on this output (`raypipe.commit.upkeep.quarantine`)."""
        return frozenset(read_quarantine(self.store, self.table.pointer(QUARANTINE_APP)))

    def set_quarantine(self, shards: list[str], *, reason: str, release: bool = False) -> list[str]:
        """Adds shards to (or with `release`, removes them from) the quarantine, as a new file
        the table names (fenced; a concurrent change makes it apply again); returns the shards
        it holds now. `raypipe.commit.upkeep.quarantine` calls it holding the output."""
        held: dict[str, dict[str, str]] = {}

        def write(current: int | None) -> int:
            number, state = write_quarantine(self.store, current, shards, reason=reason, release=release)
            held.clear()
            held.update(state)
            return number

        set_pointer(self.table, self.fence, QUARANTINE_APP, write, operation="quarantine")
        return sorted(held)

    def files_seen(self) -> FilesSeen:
        """Input files a run of this output read (every unit committed): the state the table names."""
        return read_files_seen(self.store, self.table.pointer(FILES_SEEN_APP))

    def record_files_seen(self, plan: Plan, committed: set[str]) -> int:
        """Adds the plan's files whose every unit is committed (also in an incomplete run: its
        healthy files are not read again), fenced; returns how many were added or updated.

        The files seen are stored as a new file the table names, holding only what this run
        adds or updates (`raypipe.commit.state.write_files_seen`); once the table names it, the
        files a full copy replaces are deleted. A concurrent change by another run makes it
        read and apply again."""
        self.units_landed()  # the step after the units: the snapshot moves past the actors' commits
        by_shard: dict[str, list[WorkUnit]] = {}
        for u in plan.units:
            by_shard.setdefault(u.shard, []).append(u)
        bad = {b["shard"] for b in plan.bad_shards}
        latest = (plan.observations or {}).get("shard_max") or {}
        done = {
            shard: units[0].fingerprint
            for shard, units in by_shard.items()
            if shard not in bad and units[0].fingerprint and all(u.key in committed for u in units)
        }
        if not done or not changes(done, latest, self.files_seen()):
            return 0
        self.check_lease()
        written: list[FilesSeenWrite] = []

        def write(current: int | None) -> int:
            written[:] = [write_files_seen(self.store, current, done, latest)]
            return written[0].number

        set_pointer(self.table, self.fence, FILES_SEEN_APP, write, operation="files-seen")
        drop_files_seen(self.store, written[0].replaced)  # named by no pointer now
        return len(written[0].changed)

    # -- the run -------------------------------------------------------------------------------
    def commit_run(self, plan: Plan, metadata: dict[str, str] | None = None) -> None:
        """Commits the run, fenced, once the table holds every unit of `plan` committed: read
        here from the table, never taken from the driver's tally. Raises `SinkError` naming
        the units the table does not hold (the run stays uncommitted; a resume does them)."""
        self.units_landed()  # every unit committed so far, by this driver or its actors
        planned = {u.key for u in plan.units}
        missing = planned - self.committed_units(plan)
        # A unit committed with no rows has no file to list: its own transaction says so.
        missing -= self.table.units_with_transaction(self.run_id, sorted(missing))
        if missing:
            raise SinkError(
                f"run {self.run_id} cannot be committed: the table holds {len(planned) - len(missing)} of its "
                f"{len(planned)} units committed (missing {', '.join(sorted(missing)[:3])}"
                f"{', ...' if len(missing) > 3 else ''})",
                path=self.table.uri,
            )
        metadata = {"raypipe.attempt": self.attempt, **(metadata or {})}
        mark_committed(self.table, self.fence, self.run_id, metadata, clock=self._clock)

    def abort(self) -> bool:
        """Fences off this attempt's own writers, unless a newer holder took the output already.

        Returns True if it did. Units committed before stay committed (a later attempt does
        not redo them); an actor's commit after this fails, and its files stay invisible."""
        if self._fence is None:
            return False
        return retire(self.table, self._fence)

    def watermark(self) -> datetime | None:
        """The daily watermark: the table's `WATERMARK_APP`, else an earlier release's `watermark.json`."""
        return read_watermark(self.store, self.table.pointer(WATERMARK_APP))

    def advance_watermark(self, to: datetime) -> None:
        """Moves the daily watermark to `to`, never backwards (an older run finishing late keeps
        it): one fenced commit of the table's `WATERMARK_APP`, its version the instant in
        microseconds, taken as the later of it and what a concurrent commit set."""
        current = self.watermark()
        if current is not None and to <= current:
            logger.info("watermark stays at %s (this run reached %s)", current.isoformat(), to.isoformat())
            return
        self.check_lease()
        target = watermark_micros(to)
        floor = None if current is None else watermark_micros(current)

        def later(now: int | None) -> int:
            return max(x for x in (now, floor, target) if x is not None)

        set_pointer(self.table, self.fence, WATERMARK_APP, later, operation="watermark")
        logger.info("watermark advanced to %s", to.isoformat())

    # -- what the report counts ----------------------------------------------------------------
    def ledger(self) -> tuple[Ledger, dict[str, int]]:
        """The run's committed rows by outcome (the report's row counts), and its results by
        the model version that answered them: one read of the run's rows."""
        if not self.table.exists():
            return Ledger(), {}
        rows = read_outcomes(self.table, self.run_id, columns=["outcome", "status", "error_kind", "model_version"])
        return ledger_of(rows), versions_of(rows)

    def replay_ledger(self, plan: Plan) -> Ledger | None:
        """What a replay's committed units made of the dead letters it was planned on, from the
        table (so rows an attempt converted before it was killed or fenced off count): the rows
        that were dead letters at the plan's table version, as they are now. None for a plan
        stored without its table version."""
        version = (plan.observations or {}).get("table_version")
        if plan.replay_of is None or version is None:
            return None
        units = sorted(self.committed_units(plan))
        if not units:
            return Ledger()
        key = ["id", "unit", "source", "row"]
        in_units: dict[str, str | list[str]] = {"run_id": plan.replay_of, "unit": units}
        before = scan_where(
            self.table.load_version(int(version)).to_pyarrow_dataset(),
            {**in_units, "outcome": OUTCOME_DEAD_LETTER},
            key,
        )
        now = scan_where(
            self.table.load().to_pyarrow_dataset(partitions=[("run_id", "=", plan.replay_of)]),
            in_units,
            [*key, "outcome", "status", "error_kind"],
        )
        return ledger_of(before.join(now, key, join_type="inner"))

    def earlier_attempts(self) -> list[AttemptStats]:
        """The call statistics other attempts of this run saved."""
        folder = self.store.run_state(self.run_id, "attempts")
        paths = [p for p in self.store.list_files(folder, ".json") if not p.endswith(f"/{self.attempt}.json")]
        return [AttemptStats.from_dict(d) for _, d in self.store.read_many_json(paths)]

    def save_attempt(self, stats: AttemptStats) -> None:
        """This attempt's call statistics, so a later attempt's report still counts them."""
        self.store.write_json(self.store.run_state(self.run_id, "attempts", f"{self.attempt}.json"), stats.to_dict())

    def write_report(self, report: RunReport) -> None:
        self.store.write_json(self.store.report_file(self.run_id), report.to_dict())

    def drop_state(self) -> None:
        """Removes this run's state beside the table (its plans, its attempts' statistics and
        their actors' tallies) once its completed report is written: nothing reads them after
        (a rerun of the id finds the report), so the state an output keeps grows with no run.
        The report stays. A state that cannot be removed is left to `raypipe vacuum`."""
        try:
            drop_run_state(self.store, self.run_id)
        except OSError as e:
            logger.warning("run %s: its state stays until `raypipe vacuum` removes it: %s", self.run_id, e)

    def release(self) -> None:
        """Releases the output lease (the run's last step, however it ended)."""
        if self._lease is not None:
            self._lease.release()


@contextlib.contextmanager
def holding(place: Output, operation: str, *, labels: tuple[str, ...] | None = None) -> Iterator[CommitProtocol]:
    """Maintenance as a holder of the output (`raypipe.commit.upkeep`): the lease (a live run
    refuses it, `OutputLockedError`), then a take-over, so every older holder, of any run id,
    is fenced off before the operation and no run starts during it; the lease is released at
    the end. Commits made meanwhile carry the fence (`fence_transactions`)."""
    protocol = CommitProtocol(place, "maintenance", f"raypipe-{operation}")
    protocol.take_output(labels)
    try:
        yield protocol
    finally:
        protocol.release()


def drop_run_state(store: OutputStore, run_id: str) -> None:
    """Removes `_raypipe/runs/<run_id>/`: a finished run's plans and attempts (`raypipe vacuum`
    does it for runs finished before its retention, a completed run for itself)."""
    folder = store.run_state(run_id)
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm(folder, recursive=True)


def committed_runs(place: Output, candidates: set[str]) -> set[str]:
    """The run ids among `candidates` that are committed: the table's run commit says so while
    it is kept; a run's own transactions expire after `raypipe.commit.table.TRANSACTION_RETENTION`
    (so the log does not grow with the history), and past it the run's report, which a run
    writes as completed only after its run commit landed, stands for it. A run the table holds
    no commit of and no completed report of is not committed."""
    done = place.table.committed_runs(candidates)
    for run_id in sorted(candidates - done):
        report = place.store.read_json_or_none(place.store.report_file(run_id))
        if report is not None and report.get("status") == "completed":
            done.add(run_id)
    return done


def run_known(place: Output, run_id: str) -> bool:
    """Does the output know run `run_id`: committed (`committed_runs`: the table's run commit,
    or a completed report), reported at all, or holding rows of its? The one rule a replay's
    preflight and its planning ask: a run committed whose report was never written (its driver
    died right after the run commit) is known, and a replay of it finds nothing to do."""
    if committed_runs(place, {run_id}) or place.store.exists(place.store.report_file(run_id)):
        return True
    if not place.table.exists():
        return False
    dt = place.table.load()
    return bool(dt.to_pyarrow_dataset(partitions=[("run_id", "=", run_id)]).count_rows())

"""One owner of a run's state on its output: table, plan, lease, watermark, report.

`RunState` is what a run's steps (`raypipe.run.steps`, composed by `raypipe.run.modes._run`)
call, once per step:

    state = RunState(config.output, mode, run_id)
    state.committed_report()      # None, or the report of a run id already committed
    state.begin(labels)           # lease (one run id at a time), table ready, take over: fence
    plan = state.plan(make_plan)  # the stored plan, or a new one (stored once, fenced)
    todo = state.pending(plan)    # units not committed in the table
    ... the pipeline commits units through `raypipe.commit.table.UnitCommitter(state.fence)` ...
    state.record_files_seen(...)  # the files every unit of which is committed (fenced)
    state.protocol.commit_run()   # the run committed (fenced; `raypipe.commit.protocol`), or .abort()
    state.advance_watermark(...)  # informational, never backwards
    state.write_report(...)       # the report, from the table's rows and every attempt's calls

What lives where under OUTPUT:

    outcomes/                              the Delta table (results and dead letters; the truth)
    runs/<run_id>.json                     the run report
    _raypipe/lease.json                    who runs here now (liveness; not the fence)
    _raypipe/watermark.json                the latest updated_at read (informational; never backwards)
    _raypipe/files_seen/<n>.parquet        every input file read whole: path, size and ETag
    _raypipe/quarantine.json               shards an operator set aside (skipped, reported)
    _raypipe/runs/<run_id>/plan/<n>.json   the run's units, fixed at its first start
    _raypipe/runs/<run_id>/attempts/*.json each attempt's call statistics (for the report)
    _raypipe/runs/<run_id>/attempts/<a>/actors/*.json  its actors' call tallies (`raypipe.tally`)

**The fence is the table's**, and its story has one owner, `raypipe.commit.protocol.CommitProtocol`
(`self.protocol`): take-over, unit commits, the plan and files seen (new immutable files the
table names, so a fenced-off attempt's file is never named), the run commit ("committed" has
one truth: the run's commit in the table), and abort. The lease only keeps a second run id
from starting on the same output and lets a retried attempt wait for a live one to expire;
it fences nothing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime

import pyarrow.compute as pc

from raypipe.commit.outcomes import Ledger, ledger, ledger_of
from raypipe.commit.protocol import LEGACY_FILES_SEEN, CommitProtocol, read_files_seen
from raypipe.commit.table import TableFence
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError
from raypipe.plan.plan import Plan
from raypipe.plan.quarantine import quarantined
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats, RunReport
from raypipe.run.lease import Lease
from raypipe.store import OutputStore

__all__ = ["RunState", "read_files_seen"]

logger = logging.getLogger("raypipe")

FILES_SEEN = LEGACY_FILES_SEEN  # an earlier release's files seen, read where the table names none
WATERMARK = "watermark.json"


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


class RunState:
    """A run's on-output state and the steps that change it (see the module docstring)."""

    def __init__(self, output: OutputConfig, mode: str, run_id: str) -> None:
        self.output = output
        self.mode = mode
        self.run_id = run_id
        self.store = OutputStore(output.uri)
        self.attempt = uuid.uuid4().hex[:8]
        self.protocol = CommitProtocol(self.store, run_id, holder=self.attempt)
        self.table = self.protocol.table
        self.lease = Lease(self.store, run_id, duration_s=output.lease_s, wait_s=output.lease_wait_s)

    # -- steps ---------------------------------------------------------------------------------
    def committed_report(self) -> RunReport | None:
        """The stored report if this run id is committed already (then there is nothing to do)."""
        if not self.protocol.is_committed():
            return None
        stored = self.store.read_json_or_none(self.store.report_file(self.run_id))
        report = RunReport.from_dict(stored) if stored else RunReport(run_id=self.run_id, mode=self.mode)
        report.status = "completed"
        logger.info(
            "run %s is already committed: nothing to do (report %s)", self.run_id, self.store.report_file(self.run_id)
        )
        return report

    def begin(self, labels: tuple[str, ...]) -> TableFence:
        """Takes the lease, makes the table ready for `labels`, and takes the run over: from
        here on no commit of an earlier attempt of this run id can land."""
        if self.output.require_conditional_writes:
            self.lease.check_conditional_writes()
        self.lease.acquire(force=self.output.take_over_lease)
        try:
            fence = self.protocol.setup_run(labels)
        except BaseException:
            self.lease.release()
            raise
        self.lease.generation = fence.generation
        logger.info("run %s: attempt %s holds generation %d", self.run_id, self.attempt, fence.generation)
        return fence

    @property
    def fence(self) -> TableFence:
        return self.protocol.fence

    def plan(self, make_plan: Callable[[], Plan], *, input_uri: str | None, model_version: str) -> tuple[Plan, bool]:
        """The run's plan: stored at its first start, read back on every later one.

        Returns (plan, resumed). A run id cannot be resumed as another mode or input.
        """
        stored = self.protocol.stored_plan()
        if stored is not None:
            plan = Plan.from_dict(stored)
            if plan.mode != self.mode or plan.input != input_uri:
                raise ConfigError(
                    f"run {self.run_id} was started as a {plan.mode} of {plan.input}; "
                    f"it cannot be resumed as a {self.mode} of {input_uri}"
                )
            if plan.model_version not in (None, model_version):
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

    def save_plan(self, plan: Plan) -> None:
        """Stores the plan, fenced (`CommitProtocol.save_plan`)."""
        self.lease.check()
        self.protocol.save_plan(plan.to_dict())

    def pending(self, plan: Plan) -> list[WorkUnit]:
        """Units of the plan not committed yet (read after the takeover, so final).

        A backfill's or daily's units are listed from the log's file statistics; a replay's
        rows land in the run it replays, so its units are found by their own transactions."""
        done = self.protocol.committed([u.key for u in plan.units], replay=plan.mode == "replay")
        return [u for u in plan.units if u.key not in done]

    def replay_ledger(self, plan: Plan) -> Ledger | None:
        """What a replay's committed units made of the dead letters it was planned on, from the
        table (so rows an attempt converted before it was killed or fenced off count): the rows
        that were dead letters at the plan's table version, as they are now. None for a plan
        stored without its table version."""
        version = (plan.observations or {}).get("table_version")
        if plan.replay_of is None or version is None:
            return None
        units = sorted(self.protocol.committed([u.key for u in plan.units], replay=True))
        if not units:
            return Ledger()
        key = ["id", "unit", "source", "row"]
        in_units = (pc.field("run_id") == plan.replay_of) & pc.field("unit").isin(units)
        before = (
            self.table.load_version(int(version))
            .to_pyarrow_dataset()
            .to_table(filter=in_units & (pc.field("outcome") == "dead_letter"), columns=key)
        )
        now = (
            self.table.load()
            .to_pyarrow_dataset()
            .to_table(filter=in_units, columns=[*key, "outcome", "status", "error_kind"])
        )
        became = before.join(now, key, join_type="inner")
        return ledger_of(became)

    def watermark(self) -> datetime | None:
        mark = self.store.read_json_or_none(self.store.state(WATERMARK))
        return _parse(mark["updated_at"]) if mark else None

    def earlier_attempts(self) -> list[AttemptStats]:
        folder = self.store.run_state(self.run_id, "attempts")
        paths = [p for p in self.store.list_files(folder, ".json") if not p.endswith(f"/{self.attempt}.json")]
        return [AttemptStats.from_dict(d) for _, d in self.store.read_many_json(paths)]

    def save_attempt(self, stats: AttemptStats) -> None:
        """This attempt's call statistics, so a later attempt's report still counts them."""
        self.store.write_json(self.store.run_state(self.run_id, "attempts", f"{self.attempt}.json"), stats.to_dict())

    def ledger(self) -> Ledger:
        return ledger(self.output.uri, self.run_id)

    def advance_watermark(self, to: datetime) -> None:
        """Moves the daily watermark to `to`, never backwards (an older run finishing late keeps it)."""
        current = self.watermark()
        if current is not None and to <= current:
            logger.info("watermark stays at %s (this run reached %s)", current.isoformat(), to.isoformat())
            return
        self.lease.check()
        self.store.write_json(self.store.state(WATERMARK), {"updated_at": _iso(to), "run_id": self.run_id})
        logger.info("watermark advanced to %s", to.isoformat())

    def files_seen(self) -> dict[str, tuple[str, str | None]]:
        """Input files a run of this output read (every unit committed): URI -> (fingerprint,
        the latest updated_at read in it, if its footers said)."""
        return self.protocol.files_seen()

    def record_files_seen(self, plan: Plan, committed: set[str]) -> int:
        """Adds the plan's files whose every unit is committed (also in an incomplete run: its
        healthy files are not read again); returns how many were added or updated."""
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
        if not done:
            return 0
        self.lease.check()
        return self.protocol.record_files_seen(lambda seen: _changes(done, latest, seen))

    def quarantined(self) -> frozenset[str]:
        return quarantined(self.store)

    def write_report(self, report: RunReport) -> None:
        self.store.write_json(self.store.report_file(self.run_id), report.to_dict())

    def release(self) -> None:
        self.lease.release()


def _changes(
    done: dict[str, str], latest: dict[str, str], seen: dict[str, tuple[str, str | None]]
) -> dict[str, tuple[str, str | None]]:
    """The files-seen entries `done` (file -> fingerprint) adds or updates in `seen`."""
    out: dict[str, tuple[str, str | None]] = {}
    for shard, fingerprint in done.items():
        value = (fingerprint, _later(latest.get(shard), seen.get(shard, (None, None))[1]))
        if seen.get(shard) != value:
            out[shard] = value
    return out


def _later(a: str | None, b: str | None) -> str | None:
    return max((x for x in (a, b) if x is not None), default=None)

"""The watcher's loop: look, plan what arrived, cut, commit each unit as a daily does.

A `Watcher` holds the output for its whole life as one run, the watch id: one lease, renewed
by its heartbeat, and one take-over (`CommitProtocol.setup_run`), so every commit it makes
carries the same fence a daily's does, and an older holder (a killed watcher, a stalled daily)
can land nothing after it. Per tick:

    look            `ArrivalSource.look`: a listing of the input, or the S3 events queued
    plan arrivals   each file not committed in its present version (not in the files seen,
                    not pending, not set aside as bad) planned as a daily plans it
                    (`plan_listing`, whole, the daily's bad-shard policy), and held
                    (`Coalescer`)
    cut             when the pending files reach `input.unit_rows` or `input.unit_bytes`, or
                    the oldest has waited `watch.max_wait_s`: one batch, stored as the watch
                    id's plan (fenced, `CommitProtocol.save_plan`), so a successor finds it
    commit          its units through the warm actors, each committed by its actor in one
                    fenced unit commit (`UnitCommitter`); then the files every unit of which
                    is committed are recorded as seen (`CommitProtocol.record_files_seen`),
                    exactly as a daily records them

A tick with nothing new costs one look and no call. Between ticks the loop pauses until the
next tick or until the oldest pending arrival's `max_wait_s` is up, whichever comes first: a
listing's watcher sleeps, an events watcher spends the pause in the next tick's look, waiting
on the queue (`ArrivalSource.max_look_wait_s`), so a quiet tick is one blocking call and an
arrival is taken as soon as it is announced.

A successor (the same watch id: `watch-<digest of the input URI>` unless `run_id` names one)
takes the lease over (at once on the same host when the holder's process is gone, elsewhere
once it expires) and, before its first look, finishes the batch the stored plan holds: the
units the table does not hold committed are done, the rest skipped (`resume`), so every row
is committed once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

from raypipe.call.metrics import Metrics, emit_unit, emit_watch_freshness, emit_watch_tick
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import InputConfig, WatchConfig
from raypipe.errors import ConfigError
from raypipe.plan.footers import PlanObservations
from raypipe.plan.planning import Plan, plan_listing, resume
from raypipe.plan.selection import bad_shard_policy, columns_of
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats
from raypipe.run.steps import _fatal_error
from raypipe.run.watch.arrivals import ArrivalSource, Listed
from raypipe.run.watch.coalesce import Coalescer, Pending
from raypipe.run.watch.report import Freshness, WatchReport
from raypipe.run.watch.warm import UnitRunner

__all__ = ["Watcher", "default_watch_id"]

logger = logging.getLogger("raypipe")


def default_watch_id(input_uri: str) -> str:
    """The watch id of a watcher of `input_uri`: the same for every restart of it, so a
    successor resumes what its predecessor left (and two watchers of one input share a lease)."""
    return "watch-" + hashlib.sha1(input_uri.encode(), usedforsecurity=False).hexdigest()[:12]


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Watcher:
    """One watcher over one output, set up (lease and take-over) by its caller."""

    def __init__(
        self,
        protocol: CommitProtocol,
        input: InputConfig,
        settings: WatchConfig,
        *,
        runner: UnitRunner,
        source: ArrivalSource,
        metrics: Metrics,
        report: WatchReport,
        model_version: str,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.protocol = protocol
        self.input = input
        self.settings = settings
        self.runner = runner
        self.source = source
        self.metrics = metrics
        self.report = report
        self.model_version = model_version
        self.clock = clock
        self.coalescer = Coalescer(
            unit_rows=input.unit_rows, unit_bytes=input.unit_bytes, max_wait_s=settings.max_wait_s
        )
        self.freshness = Freshness()
        self.attempt = AttemptStats(attempt=protocol.attempt)
        self.on_bad_shard = bad_shard_policy(input, "daily")  # a bad file must not hold the others back
        self.stop = threading.Event()
        """Set to stop after the units in flight (a signal, the caller's stop)."""
        self._known: dict[str, str] = {}
        self._bad: dict[str, str] = {}

    # -- start ---------------------------------------------------------------------------------
    def resume(self) -> None:
        """Finishes the batch an earlier watcher of this id stored and did not finish, then
        reads the files seen (what is committed, by fingerprint) once: later ticks keep them."""
        protocol = self.protocol
        plan = protocol.stored_plan()
        if plan is not None:
            if plan.mode != "watch" or plan.input != self.input.uri:
                raise ConfigError(
                    f"run id {protocol.run_id} was a {plan.mode} of {plan.input}; it cannot watch {self.input.uri}"
                )
            done = protocol.committed_units(plan)
            plan, changed = resume(self.input, plan, done, quarantined=protocol.quarantined())
            plan = dataclasses.replace(plan, on_bad_shard=self.on_bad_shard)
            if changed:
                protocol.save_plan(plan)
            # A file another run committed and recorded since (a daily while no watcher ran) is
            # not read again, as a daily would not read it.
            seen = protocol.files_seen()
            todo = [u for u in plan.units if u.key not in done and seen.get(u.shard, ("",))[0] != u.fingerprint]
            if todo:
                logger.info("watch %s: finishing %d units an earlier watcher left", protocol.run_id, len(todo))
            committed = self._execute(plan, todo, arrived={})
            self.report.resumed_units += len(committed)
            # its files finished now count as this watcher's, as its rows do
            finished = {u.shard for u in plan.units if u.key in committed}
            self.report.files += sum(
                all(u.key in done or u.key in committed for u in plan.units if u.shard == shard) for shard in finished
            )
            protocol.record_files_seen(plan, done | committed)
        self._known = {uri: fp for uri, (fp, _) in protocol.files_seen().items()}

    # -- a tick --------------------------------------------------------------------------------
    def tick(self, wait_s: float = 0) -> None:
        """One look (waiting up to `wait_s` for an arrival, where the source can); what is new
        planned and held; a cut if one is due."""
        listed = self.source.look(wait_s, self.stop) if wait_s > 0 else self.source.look()
        self.report.ticks += 1
        self.report.listings += 1
        # one file once, though a look may see it twice (events' first look lists the input too)
        new = list({item.uri: item for item in listed if self._is_new(item)}.values())
        # a file seen in the version already committed (or set aside): its announcements may go,
        # as a watcher killed between a commit and its acks leaves them for its successor
        done = [item.uri for item in listed if item.fingerprint in (self._known.get(item.uri), self._bad.get(item.uri))]
        if done:
            self.source.settle(done)
        if new:
            for pending in self._plan_arrivals(new):
                self.coalescer.add(pending)
        self.cut_if_due()
        now = self.clock()
        emit_watch_tick(
            self.metrics,
            backlog_rows=self.coalescer.rows,
            backlog_files=self.coalescer.files,
            oldest_waiting_s=self.coalescer.oldest_waiting_s(now),
        )

    def _is_new(self, item: Listed) -> bool:
        fp = item.fingerprint
        return (
            self._known.get(item.uri) != fp
            and self.coalescer.fingerprint(item.uri) != fp
            and self._bad.get(item.uri) != fp
        )

    def _plan_arrivals(self, new: Sequence[Listed]) -> list[Pending]:
        """The new files planned as a daily plans new files: whole, cut into units."""
        input = self.input
        seen = PlanObservations(limit=self.clock() + timedelta(seconds=input.max_future_skew_s))
        units, bad = plan_listing(
            [(item.uri, item.format) for item in new],
            sizes={item.uri: item.size for item in new if item.size is not None},
            footer_sample=input.footer_sample,
            unit_rows=input.unit_rows,
            unit_bytes=input.unit_bytes,
            columns=columns_of(input),
            on_bad_shard=self.on_bad_shard,
            observations=seen,
            fingerprints={item.uri: item.fingerprint for item in new},
            threads=input.planning_threads,
        )
        by_file: dict[str, list[WorkUnit]] = {}
        for u in units:
            by_file.setdefault(u.shard, []).append(u)
        by_uri = {item.uri: item for item in new}
        for b in bad:
            self._set_aside(by_uri[b["shard"]], b.get("error", ""))
        return [
            Pending(item.uri, item.fingerprint, item.arrived_at, item.size, tuple(by_file[item.uri]))
            for item in new
            if item.uri in by_file
        ]

    def _set_aside(self, item: Listed | WorkUnit, error: str) -> None:
        uri = item.uri if isinstance(item, Listed) else item.shard
        fp = item.fingerprint or ""
        logger.warning(
            "watch %s: %s cannot be read (%s); it is read again once it changes", self.protocol.run_id, uri, error
        )
        self._bad[uri] = fp
        self.report.bad_files.append({"shard": uri, "error": error})
        del self.report.bad_files[:-100]  # the latest ones: a report of bounded size

    # -- a cut ---------------------------------------------------------------------------------
    def cut_if_due(self) -> bool:
        """Cuts and commits the pending arrivals if a cut is due; True if it did."""
        reason = self.coalescer.due(self.clock())
        if reason is None:
            return False
        batch = self.coalescer.cut()
        logger.info(
            "watch %s: cut %d files (%s) into %d units",
            self.protocol.run_id,
            len(batch),
            reason,
            sum(len(p.units) for p in batch),
        )
        self.commit_batch(batch)
        return True

    def commit_batch(self, batch: Sequence[Pending]) -> None:
        """Stores the batch as the watch id's plan, commits its units, records its files as seen."""
        input = self.input
        plan = Plan(
            "watch",
            input.uri,
            [u for p in batch for u in p.units],
            [],
            observations={"files": {"new": len(batch)}, "unit_bytes": input.unit_bytes},
            model_version=self.model_version,
            columns=columns_of(input),
            on_bad_shard=self.on_bad_shard,
            max_future_skew_s=input.max_future_skew_s,
        )
        self.protocol.save_plan(plan)  # fenced: a successor finishes this batch
        self.report.cuts += 1
        committed = self._execute(plan, plan.units, arrived={p.uri: p.arrived_at for p in batch})
        self.protocol.record_files_seen(plan, committed)
        settled = []
        for p in batch:
            if all(u.key in committed for u in p.units):
                self._known[p.uri] = p.fingerprint
                self.report.files += 1
                settled.append(p.uri)
            elif p.uri in self._bad:
                settled.append(p.uri)
            elif not self.stop.is_set():
                self.coalescer.add(p)  # not all committed (a stop came): the next cut takes it
        self.source.settle(settled)

    def _execute(self, plan: Plan, todo: Sequence[WorkUnit], *, arrived: dict[str, datetime]) -> set[str]:
        """Runs `todo` through the warm actors; returns the units committed now."""
        committed: set[str] = set()
        if not todo:
            return committed
        by_key = {u.key: u for u in todo}
        for outcome in self.runner.run(
            todo, columns=plan.columns, on_bad_shard=plan.on_bad_shard, stopping=self.stop.is_set
        ):
            if outcome.stats is not None:
                self.attempt.add(outcome.stats)
            if outcome.fatal is not None:
                raise _fatal_error(outcome.fatal)
            if self.protocol.lease_lost:
                self.protocol.check_lease()
            unit = by_key[outcome.unit]
            if outcome.error is not None:
                self._set_aside(unit, outcome.error)
            elif outcome.stats is not None:
                committed.add(outcome.unit)
                self.report.units += 1
                self.report.rows += outcome.stats.rows
                emit_unit(self.metrics, outcome.stats)
                if unit.shard in arrived:
                    self.freshness.add(arrived[unit.shard], self.clock())
        return committed

    # -- the report ----------------------------------------------------------------------------
    def write_report(self, *, close_window: bool = True) -> WatchReport:
        """Brings the report up to date (freshness over the window now closed, backlog), sends
        the freshness gauges and writes `OUTPUT/_raypipe/watch/<watch id>.json`."""
        report, now = self.report, self.clock()
        if close_window and len(self.freshness):
            report.freshness_p50_s, report.freshness_p95_s, report.freshness_units = self.freshness.close_window()
            emit_watch_freshness(self.metrics, report.freshness_p50_s, report.freshness_p95_s)
        report.backlog_rows = self.coalescer.rows
        report.backlog_files = self.coalescer.files
        report.oldest_waiting_s = round(self.coalescer.oldest_waiting_s(now), 3)
        report.updated_at = now.isoformat()
        if not self.protocol.lease_lost:
            store = self.protocol.store
            store.write_json(store.state("watch", f"{self.protocol.run_id}.json"), report.to_dict())
        return report

    # -- the loop ------------------------------------------------------------------------------
    def run(self, *, ticks: int | None = None, sleep: Callable[[float], bool] | None = None) -> None:
        """Ticks every `watch.every_s` until `stop` is set (or `ticks` looks were made), waking
        in between when a pending arrival's wait is up; a report every `watch.report_every_s`.
        With a source whose look can wait (events), the pause before a tick is spent in its look
        (what exceeds the look's longest wait asleep first)."""
        wait = sleep or self.stop.wait
        every, report_every = self.settings.every_s, self.settings.report_every_s
        longest_look = self.source.max_look_wait_s
        next_tick = next_report = time.monotonic()
        next_report += report_every
        looks = 0
        look_wait = 0.0  # the part of the last pause the coming tick's look waits on the queue
        while not self.stop.is_set():
            now = time.monotonic()
            if look_wait or now >= next_tick:
                self.tick(wait_s=look_wait)
                looks += 1
                next_tick = (time.monotonic() if look_wait else now) + every
                if ticks is not None and looks >= ticks:
                    return
            else:
                self.cut_if_due()
            if time.monotonic() >= next_report:
                self.write_report()
                next_report = time.monotonic() + report_every
            wake = next_tick
            deadline = self.coalescer.deadline()
            if deadline is not None:
                wake = min(wake, time.monotonic() + max(0.0, (deadline - self.clock()).total_seconds()))
            pause = max(0.0, min(wake, next_report) - time.monotonic())
            # SQS waits whole seconds: a shorter pause is slept, and the tick at its end looks
            look_wait = min(pause, longest_look) if pause >= 1 else 0.0
            if pause > look_wait:
                wait(pause - look_wait)

"""`raypipe watch` without Ray: coalescing by rows, bytes and age on an injected clock; the
tick loop over a real local output with the actor in this process and a fake model client
(nothing new, no call; every id committed once; files recorded as seen as a daily records
them); SIGTERM's graceful stop and a successor that finishes what it left; the lease against
a daily; the report; the CLI's durations."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.api import build_config
from raypipe.commit.lease import Lease
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import ClientConfig, PipelineConfig, run_input
from raypipe.errors import OutputLockedError
from raypipe.plan.units import WorkUnit
from raypipe.run import steps
from raypipe.run.watch.coalesce import Coalescer, Pending
from raypipe.run.watch.command import duration
from raypipe.run.watch.mode import watch
from raypipe.run.watch.report import Freshness, WatchReport, percentile
from raypipe.run.watch.warm import InProcessUnits
from raypipe.run.watch.watcher import default_watch_id
from raypipe.store import OutputStore
from tests.fakes import LABELS, CountingClient

T0 = datetime(2026, 11, 28, 0, 0, tzinfo=UTC)


# -- coalescing ---------------------------------------------------------------------------------
def pending(uri: str, *, rows: int | None, size: int = 100, at: datetime = T0) -> Pending:
    stop = None if rows is None else rows
    return Pending(uri, f"{size}:x", at, size, (WorkUnit(uri, "parquet", 0, stop),))


def test_arrivals_wait_until_they_reach_unit_rows():
    c = Coalescer(unit_rows=100, unit_bytes=10**9, max_wait_s=60)
    c.add(pending("a", rows=60))
    assert c.due(T0 + timedelta(seconds=1)) is None
    c.add(pending("b", rows=40))
    assert c.due(T0 + timedelta(seconds=1)) == "rows"
    assert [p.uri for p in c.cut()] == ["a", "b"]
    assert c.files == 0 and c.due(T0 + timedelta(hours=1)) is None


def test_arrivals_are_cut_at_unit_bytes_when_their_rows_are_unknown():
    c = Coalescer(unit_rows=100, unit_bytes=1000, max_wait_s=60)
    c.add(pending("a", rows=None, size=600))
    assert c.rows == 0 and c.due(T0) is None
    c.add(pending("b", rows=None, size=400))
    assert c.due(T0) == "bytes"


def test_the_oldest_arrival_is_cut_once_it_has_waited_max_wait():
    c = Coalescer(unit_rows=100, unit_bytes=10**9, max_wait_s=60)
    c.add(pending("late", rows=1, at=T0 + timedelta(seconds=30)))
    c.add(pending("early", rows=1, at=T0))
    assert c.deadline() == T0 + timedelta(seconds=60)
    assert c.due(T0 + timedelta(seconds=59.9)) is None
    assert c.oldest_waiting_s(T0 + timedelta(seconds=45)) == 45
    assert c.due(T0 + timedelta(seconds=60)) == "age"
    assert [p.uri for p in c.cut()] == ["early", "late"]  # oldest first


def test_a_rewritten_file_replaces_its_pending_version():
    c = Coalescer(unit_rows=100, unit_bytes=10**9, max_wait_s=60)
    c.add(pending("a", rows=10, size=1))
    c.add(pending("a", rows=20, size=2))
    assert c.files == 1 and c.rows == 20 and c.fingerprint("a") == "2:x"


# -- the report -----------------------------------------------------------------------------------
def test_freshness_is_the_nearest_rank_percentile_of_its_window():
    f = Freshness()
    for s in range(1, 101):
        f.add(T0, T0 + timedelta(seconds=s))
    assert f.close_window() == (50.0, 95.0, 100)
    assert f.close_window() == (0.0, 0.0, 0)  # a new window
    assert percentile([3.0], 95) == 3.0


def test_durations_take_seconds_and_units():
    assert [duration(v) for v in ("60", "60s", "2m", "1.5h", "500ms")] == [60, 60, 120, 5400, 0.5]
    with pytest.raises(argparse.ArgumentTypeError):
        duration("soon")


def test_the_cli_refuses_a_bad_duration_with_exit_2(capsys):
    from raypipe.cli import main

    with pytest.raises(SystemExit) as e:
        main(["watch", "--input", "in", "--output", "out", "--every", "soon"])
    assert e.value.code == 2
    assert "not a duration" in capsys.readouterr().err


# -- a watcher in this process ------------------------------------------------------------------
def write(folder: Path, name: str, ids: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    pq.write_table(pa.table({"id": ids, "text": [f"text of {i}" for i in ids]}), tmp)
    path = folder / f"{name}.parquet"
    os.replace(tmp, path)  # arrives whole, as an S3 object does
    return path


class Service:
    """The fake model service: `ModelService.ask` answers without a network; one client counts."""

    def __init__(self, monkeypatch: Any) -> None:
        self.client = CountingClient()
        self.classify_calls = 0
        self.on_call: Any = None
        original = self.client.classify

        async def classify(ids: Any, texts: Any) -> Any:
            self.classify_calls += 1
            if self.on_call is not None:
                self.on_call()
            return await original(ids, texts)

        self.client.classify = classify  # type: ignore[method-assign]
        monkeypatch.setattr(
            steps.ModelService, "ask", classmethod(lambda cls, s, c: cls(LABELS, "fake-1", ClientConfig()))
        )

    def runner(self, settings: Any) -> InProcessUnits:
        return InProcessUnits(settings, client_factory=lambda: self.client)


def config(tmp_path: Path, **watch: Any) -> PipelineConfig:
    return build_config(
        output=str(tmp_path / "out"),
        settings={"watch": {"every_s": 0.01, "max_wait_s": 0, **watch}, "dedup": {"enabled": False}},
    )


def run_watch(tmp_path: Path, service: Service, **kwargs: Any) -> WatchReport:
    cfg = config(tmp_path)
    return watch(
        cfg, run_input(cfg, str(tmp_path / "in"), "watch"), Output.at(cfg.output), runner=service.runner, **kwargs
    )


def committed_ids(tmp_path: Path) -> list[str]:
    return sorted(read_outcomes(str(tmp_path / "out"), columns=["id"]).column("id").to_pylist())


def test_a_watcher_commits_each_arrival_once_and_a_look_with_nothing_new_makes_no_call(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    write(tmp_path / "in", "a", ["a1", "a2"])
    report = run_watch(tmp_path, service, ticks=1)
    assert committed_ids(tmp_path) == ["a1", "a2"]
    calls = service.classify_calls
    assert calls >= 1 and report.units == 1 and report.rows == 2 and report.status == "stopped"

    report = run_watch(tmp_path, service, ticks=3)  # a successor: nothing new in three looks
    assert service.classify_calls == calls
    assert report.ticks == 3 and report.units == 0

    write(tmp_path / "in", "b", ["b1"])
    run_watch(tmp_path, service, ticks=2)
    assert committed_ids(tmp_path) == ["a1", "a2", "b1"]
    store = OutputStore(str(tmp_path / "out"))
    assert not store.exists(store.state("lease.json")), "the lease is released"


def test_a_watcher_records_the_files_it_committed_as_a_daily_records_them(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    a = write(tmp_path / "in", "a", ["a1"])
    run_watch(tmp_path, service, ticks=1)
    cfg = config(tmp_path)
    seen = CommitProtocol(Output.at(cfg.output), "daily", "d").files_seen()
    assert set(seen) == {str(a)}

    from raypipe.plan.planning import plan_input

    plan = plan_input(
        run_input(cfg, str(tmp_path / "in"), "daily"),
        "daily",
        CommitProtocol(Output.at(cfg.output), "daily", "d"),
    )
    assert plan.units == [], "a daily after the watcher has nothing to read"


def test_arrivals_wait_for_max_wait_before_their_commit(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    write(tmp_path / "in", "a", ["a1"])
    cfg = config(tmp_path, max_wait_s=3600)
    report = watch(
        cfg, run_input(cfg, str(tmp_path / "in"), "watch"), Output.at(cfg.output), runner=service.runner, ticks=2
    )
    assert service.classify_calls == 0 and report.backlog_files == 1 and report.backlog_rows == 1
    assert report.units == 0


def test_sigterm_finishes_the_unit_in_flight_releases_the_lease_and_a_successor_does_the_rest(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    for name in ("a", "b", "c"):
        write(tmp_path / "in", name, [f"{name}1", f"{name}2"])
    # Arrives while the first unit is inferred: the handler the watcher installed is called as
    # Python calls it for a SIGTERM. A real signal (test_watch_faults sends one to a watcher
    # process) interrupts whatever native code the main thread is in, and the suite's process
    # holds native thread pools (TensorFlow, OpenVINO) of earlier tests' in-process replicas:
    # delivered here, it crashed the test process (SIGSEGV), even sent to the main thread.
    service.on_call = lambda: signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    report = run_watch(tmp_path, service, ticks=5)
    assert report.status == "stopped" and report.units == 1
    assert committed_ids(tmp_path) in (["a1", "a2"], ["b1", "b2"], ["c1", "c2"])
    store = OutputStore(str(tmp_path / "out"))
    assert not store.exists(store.state("lease.json"))
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back

    service.on_call = None
    report = run_watch(tmp_path, service, ticks=1)
    assert report.resumed_units == 2, "the successor finishes the stored batch first"
    assert report.files == 2 and report.rows == 4, "the files it finished are its files, as their rows are"
    assert committed_ids(tmp_path) == ["a1", "a2", "b1", "b2", "c1", "c2"]


def test_the_report_is_written_with_freshness_backlog_and_holder(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    write(tmp_path / "in", "a", ["a1"])
    report = run_watch(tmp_path, service, ticks=1)
    store = OutputStore(str(tmp_path / "out"))
    stored = WatchReport.from_dict(store.read_json(store.state("watch", f"{report.watch_id}.json")))
    assert stored.watch_id == default_watch_id(str(tmp_path / "in"))
    assert stored.units == 1 and stored.freshness_units == 1 and stored.freshness_p95_s > 0
    assert stored.lease_holder.startswith(stored.watch_id) and stored.status == "stopped"


def test_a_daily_refuses_an_output_a_watcher_holds_naming_it(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    write(tmp_path / "in", "a", ["a1"])
    stop, started = threading.Event(), threading.Event()
    service.on_call = started.set
    cfg = config(tmp_path, every_s=0.05)
    thread = threading.Thread(
        target=watch,
        args=(cfg, run_input(cfg, str(tmp_path / "in"), "watch"), Output.at(cfg.output)),
        kwargs={"runner": service.runner, "stop": stop},
    )
    thread.start()
    try:
        assert started.wait(30)
        daily = CommitProtocol(Output.at(cfg.output), "daily", "daily-1")
        with pytest.raises(OutputLockedError) as e:
            daily.setup_run(LABELS)
        assert e.value.holder == default_watch_id(str(tmp_path / "in"))
        assert default_watch_id(str(tmp_path / "in")) in str(e.value)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_a_watcher_refuses_an_output_a_daily_holds_naming_it(tmp_path, monkeypatch):
    service = Service(monkeypatch)
    cfg = config(tmp_path)
    store = Output.at(cfg.output).store
    lease = Lease(store, "daily-7")
    lease.acquire()
    try:
        with pytest.raises(OutputLockedError, match="daily-7"):
            run_watch(tmp_path, service, ticks=1)
    finally:
        lease.release()


# -- arrivals from S3 events ----------------------------------------------------------------------
class FakeQueue:
    """`SqsArrivals`' surface: `poll` hands out what was put, `ack` records what was deleted."""

    def __init__(self) -> None:
        self.queued: list[Any] = []
        self.acked: list[Any] = []

    def poll(self, max_messages: int = 100, wait_s: float = 0) -> list[Any]:
        out, self.queued = self.queued, []
        return out

    def ack(self, arrivals: Any) -> None:
        self.acked += list(arrivals)


def test_event_arrivals_list_once_then_read_only_the_queue_and_ack_after_the_commit(tmp_path):
    from types import SimpleNamespace

    from raypipe.config import InputConfig
    from raypipe.run.watch.arrivals import EventArrivals

    in_dir = tmp_path / "in"
    first = write(in_dir, "first", ["f1"])
    queue = FakeQueue()
    source = EventArrivals(InputConfig(uri=str(in_dir)), queue)
    assert [x.uri for x in source.look()] == [str(first)], "the first look lists the input"

    second = write(in_dir, "second", ["s1"])
    when = T0 + timedelta(seconds=5)
    arrived = SimpleNamespace(uri=str(second), size=None, arrived_at=when)
    elsewhere = SimpleNamespace(uri=str(tmp_path / "other" / "x.parquet"), size=1, arrived_at=when)
    hidden = SimpleNamespace(uri=str(in_dir / "_SUCCESS"), size=0, arrived_at=when)
    queue.queued = [arrived, elsewhere, hidden]
    write(in_dir, "listed-only", ["l1"])  # no event: a look reads the queue, not the input
    looked = source.look()
    assert [(x.uri, x.arrived_at) for x in looked] == [(str(second), when)]
    assert queue.acked == [elsewhere, hidden], "what is not the input's is deleted at once"
    source.settle([str(second)])
    assert queue.acked == [elsewhere, hidden, arrived], "an arrival's message goes once it is committed"


class Clock:
    """The watcher loop's monotonic clock: moved on only by what the loop waits for."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> bool:
        self.slept.append(round(seconds, 3))
        self.now += seconds
        return False


class WaitingQueue(FakeQueue):
    """A queue with nothing in it: a poll answers after its whole wait, as SQS's long poll does."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.waits: list[float] = []

    def poll(self, max_messages: int = 100, wait_s: float = 0) -> list[Any]:
        self.waits.append(round(wait_s, 3))
        self.clock.now += wait_s
        return super().poll(max_messages, wait_s)


def idle_watcher(tmp_path: Path, queue: FakeQueue, **watch: Any) -> Any:
    """A watcher of the empty folder `tmp_path/in` through `queue`'s events: its ticks find
    nothing, so no output, runner or service is reached."""
    from types import SimpleNamespace

    from protos.telemetry import NullMetrics
    from raypipe.config import InputConfig, WatchConfig
    from raypipe.run.watch.arrivals import EventArrivals
    from raypipe.run.watch.watcher import Watcher

    (tmp_path / "in").mkdir()
    input = InputConfig(uri=str(tmp_path / "in"))
    return Watcher(
        SimpleNamespace(attempt=1, run_id="watch-idle", lease_lost=False),  # type: ignore[arg-type]
        input,
        WatchConfig(**watch),
        runner=None,  # type: ignore[arg-type]
        source=EventArrivals(input, queue),
        metrics=NullMetrics(),
        report=WatchReport(watch_id="watch-idle", output="out", input="in", started_at=T0.isoformat()),
        model_version="fake-1",
    )


@pytest.mark.parametrize(
    ("every_s", "polls", "sleeps"),
    [(5.0, [0, 5, 5], []), (60.0, [0, 20, 20], [40, 40])],
    ids=["every-5s", "every-60s"],
)
def test_an_idle_events_tick_is_one_long_poll_of_the_queue_and_no_listing(
    tmp_path, monkeypatch, every_s, polls, sleeps
):
    """With events the pause between ticks is spent waiting on the queue (SQS's long poll, 20 s
    at most; what exceeds it asleep first): a quiet tick is one receive that waits, and the
    input is listed once, at the start."""
    from raypipe.run.watch import arrivals, watcher

    clock = Clock()
    monkeypatch.setattr(watcher.time, "monotonic", clock.monotonic)
    listings = []
    list_input = arrivals.list_input
    monkeypatch.setattr(arrivals, "list_input", lambda *a, **k: listings.append(a) or list_input(*a, **k))
    queue = WaitingQueue(clock)
    w = idle_watcher(tmp_path, queue, every_s=every_s, report_every_s=3600)

    w.run(ticks=3, sleep=clock.sleep)

    assert len(listings) == 1, "one listing, at the first look"
    assert queue.waits == polls, "the first look's poll does not wait; each later look is one long poll"
    assert clock.slept == sleeps
    assert w.report.ticks == 3


def test_a_stop_during_a_long_poll_returns_without_waiting_for_the_queue_s_answer(tmp_path):
    """A SIGTERM (the stop) while the watcher waits on the queue ends the wait at once: the poll
    is left to answer alone, and what it receives is never acked (it comes back to a successor)."""
    polling, answer = threading.Event(), threading.Event()

    class BlockingQueue(FakeQueue):
        def poll(self, max_messages: int = 100, wait_s: float = 0) -> list[Any]:
            if wait_s > 0:
                polling.set()
                answer.wait(60)  # SQS answers an empty queue's long poll at the end of its wait
            return []

    queue = BlockingQueue()
    w = idle_watcher(tmp_path, queue, every_s=20, report_every_s=3600)
    loop = threading.Thread(target=w.run, daemon=True)
    try:
        loop.start()
        assert polling.wait(30), "the watcher waits on the queue, not asleep"
        w.stop.set()
        loop.join(30)  # a bound for a stuck test, not a measure: the poll answers only when told
        assert not loop.is_alive() and not answer.is_set(), "the watcher stopped before the queue answered"
        assert queue.acked == []
    finally:
        answer.set()


def test_a_successor_does_not_read_again_a_file_another_run_recorded_as_read_meanwhile(tmp_path, monkeypatch):
    """A watcher stopped mid-batch leaves its batch stored; a daily then reads the files it left
    and records them as read. The successor skips them, as a daily after that daily would."""
    from raypipe.plan.planning import plan_input

    service = Service(monkeypatch)
    for name in ("a", "b", "c"):
        write(tmp_path / "in", name, [f"{name}1"])
    service.on_call = lambda: signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as the SIGTERM test says
    assert run_watch(tmp_path, service, ticks=5).units == 1
    service.on_call = None

    cfg = config(tmp_path)
    daily = CommitProtocol(Output.at(cfg.output), "daily", "daily-1")
    daily.setup_run(LABELS)
    try:
        plan = plan_input(run_input(cfg, str(tmp_path / "in"), "daily"), "daily", daily)
        assert len(plan.units) == 2
        daily.record_files_seen(plan, {u.key for u in plan.units})
    finally:
        daily.release()

    calls = service.classify_calls
    report = run_watch(tmp_path, service, ticks=1)
    assert report.resumed_units == 0 and report.units == 0
    assert service.classify_calls == calls

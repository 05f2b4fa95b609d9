"""The output lease on a local output (the S3 path is covered by the integration tests)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket

import pytest

from raypipe.commit.lease import Lease
from raypipe.errors import LeaseLostError, OutputLockedError
from raypipe.store import OutputStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_second_run_is_refused_naming_the_holder(tmp_path):
    store = OutputStore(str(tmp_path))
    first = Lease(store, "run-a", duration_s=60)
    first.acquire()
    try:
        with pytest.raises(OutputLockedError, match="run-a") as info:
            Lease(store, "run-b", duration_s=60).acquire()
        assert info.value.holder == "run-a"
    finally:
        first.release()
    with Lease(store, "run-b", duration_s=60):  # free again once released
        pass


def test_expired_lease_is_taken_over(tmp_path):
    store = OutputStore(str(tmp_path))
    clock = Clock()
    dead = Lease(store, "run-a", duration_s=60, clock=clock)
    dead.acquire()
    dead._stop.set()  # the holder dies: no more heartbeats, no release
    clock.now += 61
    taker = Lease(store, "run-b", duration_s=60, clock=clock)
    taker.acquire()
    assert taker.held() and not dead.held()
    taker.release()


def test_same_run_id_waits_for_a_live_lease_then_the_earlier_attempt_finds_it_lost(tmp_path):
    """A retried job (same run id) waits out the live lease, then takes it: the first finds it
    lost at its next check (the table, not the lease, fences its writes off)."""
    store = OutputStore(str(tmp_path))
    clock = Clock()
    first = Lease(store, "run-a", duration_s=60, clock=clock)
    first.acquire()
    first._stop.set()  # it hangs: no heartbeat, but it may still try to write
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        clock.now += s

    second = Lease(store, "run-a", duration_s=60, clock=clock, sleep=sleep)
    second.acquire()
    assert sum(slept) >= 60  # it waited for the expiry
    assert second.generation == first.generation + 1
    with pytest.raises(LeaseLostError, match="generation 2"):
        first.check()
    assert first.lost
    second.check()  # the holder passes
    second.release()
    assert not store.exists(store.state("lease.json"))


def test_same_run_id_stops_waiting_for_an_attempt_that_keeps_renewing(tmp_path):
    """The earlier attempt is alive (it renews while the new one waits): after `wait_s` the new
    attempt gives up with `OutputLockedError` naming that attempt and `--force`, taking nothing."""
    store = OutputStore(str(tmp_path))
    clock = Clock()
    first = Lease(store, "run-a", duration_s=60, clock=clock)
    first.acquire()
    first._stop.set()  # its renewals are made by `sleep` below, on the injected clock
    slept: list[float] = []

    def sleep(s: float) -> None:  # time passes, and the earlier attempt renews meanwhile
        slept.append(s)
        clock.now += s
        _, tag = first._read()
        assert first._replace(tag, first.generation)

    second = Lease(store, "run-a", duration_s=60, wait_s=100, clock=clock, sleep=sleep)
    with pytest.raises(OutputLockedError, match=r"--force") as info:
        second.acquire()
    message = str(info.value)
    assert f"generation 1, host {socket.gethostname()}, pid {os.getpid()}" in message
    assert "still renews its lease, last at 1970-01-01T00:18:" in message  # the last renewal, on the clock
    assert "waiting 100 s (output.lease_wait_s)" in message
    assert info.value.holder == "run-a"
    assert sum(slept) == pytest.approx(100)  # never past the bound
    assert first.held() and not second.held()
    first.check()  # the earlier attempt keeps the run
    first.release()


def test_force_takes_a_live_lease_of_the_same_run_at_once(tmp_path):
    store = OutputStore(str(tmp_path))
    first = Lease(store, "run-a", duration_s=600)
    first.acquire()
    first._stop.set()

    def no_sleep(s: float) -> None:
        raise AssertionError("force must not wait")

    second = Lease(store, "run-a", duration_s=600, sleep=no_sleep)
    second.acquire(force=True)
    assert second.held() and not first.held()
    with pytest.raises(LeaseLostError):
        first.check()
    second.release()


def test_force_does_not_take_another_runs_live_lease(tmp_path):
    store = OutputStore(str(tmp_path))
    with Lease(store, "run-a", duration_s=600), pytest.raises(OutputLockedError, match="run-a"):
        Lease(store, "run-b", duration_s=600).acquire(force=True)


def _take_over(path: str, barrier, results) -> None:
    lease = Lease(OutputStore(path), "run-x", duration_s=600)
    barrier.wait()
    try:
        lease.acquire(force=True)
        results.put((lease._token, lease.generation))
    except OutputLockedError as e:  # pragma: no cover - force on the same run never refuses
        results.put(("refused", str(e)))
    lease._stop.set()


def test_two_processes_racing_to_take_over_get_distinct_generations(tmp_path):
    """Two attempts racing for the lease at the same instant: each takeover is a compare-and-swap,
    so every winner gets its own generation and only the last one still holds the lease."""
    ctx = multiprocessing.get_context("spawn")
    store = OutputStore(str(tmp_path))
    stale = Lease(store, "run-x", duration_s=600)
    stale.acquire()
    stale._stop.set()
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_take_over, args=(str(tmp_path), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    got = [results.get(timeout=5) for _ in procs]
    generations = sorted(g for _, g in got)
    assert generations == [2, 3]
    holder = json.loads((tmp_path / "_raypipe" / "lease.json").read_text())
    winner = max(got, key=lambda tg: tg[1])
    assert holder["token"] == winner[0] and holder["generation"] == 3
    with pytest.raises(LeaseLostError):
        stale.check()


class _DownStore(OutputStore):
    """The object store went away: its client raises what botocore raises (not an OSError)."""

    down = False

    def read_bytes(self, path: str) -> bytes:
        if self.down:
            raise RuntimeError("EndpointConnectionError: Could not connect to the endpoint URL")
        return super().read_bytes(path)


def test_a_lease_that_cannot_be_renewed_before_it_expires_is_lost(tmp_path, caplog):
    """Every store exception in a renewal is a missed renewal; past expiry the attempt stops."""
    store = _DownStore(str(tmp_path))
    clock = Clock()
    lease = Lease(store, "run-a", duration_s=60, clock=clock)
    lease.acquire()
    try:
        renewed_at = lease.renew(clock())
        assert renewed_at == clock() and not lease.lost
        store.down = True
        clock.now += 30
        assert lease.renew(renewed_at) == renewed_at and not lease.lost  # missed once: retried
        assert "could not renew the output lease (RuntimeError: EndpointConnectionError" in caplog.text
        clock.now += 30
        lease.renew(renewed_at)
        assert lease.lost
        with pytest.raises(LeaseLostError):
            lease.check()
    finally:
        store.down = False
        lease.release()


def test_a_renewal_finds_the_lease_taken_by_another_attempt(tmp_path):
    store = OutputStore(str(tmp_path))
    clock = Clock()
    first = Lease(store, "run-a", duration_s=60, clock=clock)
    first.acquire()
    second = Lease(store, "run-a", duration_s=60, clock=clock)
    second.acquire(force=True)
    try:
        first.renew(clock())
        assert first.lost and not second.lost
        second.renew(clock())
        assert not second.lost
    finally:
        first.release()
        second.release()


def test_an_operator_declares_a_dead_attempt_dead_and_the_waiting_resume_takes_over_at_once(tmp_path, caplog):
    store = OutputStore(str(tmp_path))
    clock = Clock()
    killed = Lease(store, "run-a", duration_s=120, clock=clock)
    killed.acquire()
    killed._stop.set()  # the driver was killed: no heartbeat, no release
    slept: list[float] = []
    operator_acted = False

    def sleep(s: float) -> None:
        nonlocal operator_acted
        slept.append(s)
        if not operator_acted:  # while the resume waits, the operator runs `raypipe lease expire`
            expired = Lease(store, "raypipe-cli", clock=clock).expire(run_id="run-a")
            assert expired is not None and expired["holder"] == "run-a" and expired["generation"] == 1
            operator_acted = True

    resume = Lease(store, "run-a", duration_s=120, clock=clock, sleep=sleep)
    with caplog.at_level("WARNING", logger="raypipe"):
        resume.acquire()
    try:
        assert slept == [30.0]  # one wait, then the expired lease was taken: no 120 s
        waiting = caplog.records[0].getMessage()
        assert "waiting 120 s for the output lease" in waiting and "raypipe lease expire --output" in waiting
        assert resume.held() and resume.generation == 2
        with pytest.raises(LeaseLostError):
            killed.check()  # had it been alive after all, it stops at its next step
    finally:
        resume.release()


def test_expire_refuses_another_runs_lease_and_says_when_there_is_none(tmp_path):
    store = OutputStore(str(tmp_path))
    assert Lease(store, "cli").expire() is None
    with Lease(store, "run-b", duration_s=60), pytest.raises(OutputLockedError, match="run-b"):
        Lease(store, "cli").expire(run_id="run-a")


def _hold_and_wait(output: str, held) -> None:
    Lease(OutputStore(output), "run-a", duration_s=600).acquire()
    held.set()
    import time

    time.sleep(600)  # killed long before


def _no_sleep(s: float) -> None:
    raise AssertionError("the lease was waited for")


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    """A driver SIGKILLed on this host leaves a lease that looks live for `duration_s`; its
    process is gone, so the resume (or another run id) takes the lease over without waiting."""
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_hold_and_wait, args=(str(tmp_path), held))
    holder.start()
    assert held.wait(60)
    holder.kill()
    holder.join(30)
    store = OutputStore(str(tmp_path))
    assert Lease(store, "run-a").current()["pid"] == holder.pid
    resumed = Lease(store, "run-a", duration_s=600, sleep=_no_sleep)
    resumed.acquire()
    assert resumed.held() and resumed.generation == 2
    resumed.release()


def _record_of_a_holder(store: OutputStore, **process: str) -> Lease:
    """A live lease held by this process, its record's process fields then replaced by `process`."""
    lease = Lease(store, "run-a", duration_s=600)
    lease.acquire()
    lease._stop.set()
    record = lease.current()
    assert record is not None and record["process"] is not None
    record["process"] = {**record["process"], **process}
    store.write_bytes(store.state("lease.json"), json.dumps(record).encode())
    return lease


def test_a_holder_whose_pid_now_names_another_process_is_dead(tmp_path):
    store = OutputStore(str(tmp_path))
    _record_of_a_holder(store, started="1")  # our pid, but a process started at another time
    taker = Lease(store, "run-b", duration_s=600, sleep=_no_sleep)
    taker.acquire()
    assert taker.held()
    taker.release()


@pytest.mark.parametrize(
    "process",
    [
        {},  # the holder is this very process: alive
        {"host": "another-host", "pid": "999999999"},  # another machine's pid says nothing here
        {"pidns": "pid:[1]", "pid": "999999999"},  # another container's pid namespace neither
    ],
)
def test_a_holder_not_known_dead_keeps_its_live_lease(tmp_path, process):
    store = OutputStore(str(tmp_path))
    holder = _record_of_a_holder(store, **process)
    with pytest.raises(OutputLockedError, match="run-a"):
        Lease(store, "run-b", duration_s=600, sleep=_no_sleep).acquire()
    holder.release()


class _LostAnswersFs:
    """An S3 of conditional PUTs in memory whose first create and first `If-Match` replace are
    carried out and then answered as the client's retry finds them: the condition failed."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lose = {"create": 1, "replace": 1}

    def _etag(self, path: str) -> str:
        import hashlib

        return hashlib.md5(self.objects[path]).hexdigest()

    def pipe_file(self, path: str, data: bytes, mode: str = "overwrite") -> None:
        if mode == "create" and path in self.objects:
            raise FileExistsError(path)
        self.objects[path] = data
        if mode == "create" and self.lose["create"]:
            self.lose["create"] -= 1
            raise FileExistsError(path)  # the retry's 412

    def call_s3(self, method: str, *, Bucket: str, Key: str, Body: bytes, IfMatch: str) -> None:
        path = f"{Bucket}/{Key}"
        if path not in self.objects or self._etag(path) != IfMatch:
            raise OSError(22, "Precondition Failed")
        self.objects[path] = Body
        if self.lose["replace"]:
            self.lose["replace"] -= 1
            raise OSError(22, "Precondition Failed")  # the retry's 412

    def cat_file(self, path: str) -> bytes:
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path]

    def info(self, path: str) -> dict[str, str]:
        return {"ETag": self._etag(path)}

    def rm_file(self, path: str) -> None:
        self.objects.pop(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        pass


def test_a_lease_write_whose_answer_was_lost_is_recognised_as_ours(tmp_path):
    """S3 carried out the lease's conditional PUT and lost the answer: the retry's 412 is our
    own write, so the attempt holds the lease (it neither waits on itself nor gives up)."""
    store = OutputStore("s3://bucket/out")
    fs = _LostAnswersFs()
    store._fs = fs  # type: ignore[assignment]
    clock = Clock()
    first = Lease(store, "run-a", duration_s=60, clock=clock, sleep=_no_sleep)
    first.acquire()
    first._stop.set()
    assert first.held() and fs.lose["create"] == 0
    clock.now += 61  # it died; the resume takes the expired lease over with an If-Match replace
    resumed = Lease(store, "run-a", duration_s=60, clock=clock, sleep=_no_sleep)
    resumed.acquire()
    resumed._stop.set()
    assert resumed.held() and resumed.generation == 2 and fs.lose["replace"] == 0

"""The output lease on a local output (the S3 path is covered by the integration tests)."""

from __future__ import annotations

import pytest

from raypipe.errors import OutputLockedError
from raypipe.lease import Lease
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


def test_same_run_id_may_take_over_a_live_lease(tmp_path):
    store = OutputStore(str(tmp_path))
    crashed = Lease(store, "run-a", duration_s=600)
    crashed.acquire()
    crashed._stop.set()
    resumed = Lease(store, "run-a", duration_s=600)
    resumed.acquire()
    assert resumed.held() and not crashed.held()
    resumed.release()
    assert not store.exists(store.state("lease.json"))

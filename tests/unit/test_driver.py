"""The driver around a run (`raypipe.run.driver`): SIGTERM stops a run as Ctrl-C would, once,
and the handler before it is back afterwards; the autoscaler monitor of an in-process cluster is
stopped. No Ray cluster."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

from raypipe.errors import RunStopped
from raypipe.run.driver import quiet, sigterm_stops_the_run


def test_sigterm_raises_run_stopped_where_the_driver_is_and_a_second_one_is_ignored(caplog):
    """The handler the run sets, called as Python calls it on SIGTERM (no signal is sent: other
    tests' native libraries share this process)."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped, match="SIGTERM"), sigterm_stops_the_run():
        on_sigterm = signal.getsignal(signal.SIGTERM)
        assert callable(on_sigterm) and on_sigterm is not before
        try:
            on_sigterm(signal.SIGTERM, None)
            pytest.fail("SIGTERM did not stop the run")
        except RunStopped:
            on_sigterm(signal.SIGTERM, None)  # while the run writes its report: ignored
            raise
    assert "the run is already stopping" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_no_handler_is_set():
    seen: list[object] = []

    def run() -> None:
        with sigterm_stops_the_run():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]


def test_quiet_runs_the_run_and_keeps_what_it_returns(caplog):
    caplog.set_level(logging.INFO, logger="raypipe")

    @quiet
    def run(x: int) -> int:
        logging.getLogger("raypipe").info("running")
        return x + 1

    assert run(1) == 2 and "running" in caplog.text and run.__name__ == "run"


def test_the_autoscaler_monitor_of_a_cluster_started_here_is_stopped_and_a_joined_one_left(monkeypatch):
    """A fake of Ray's node object around a real child process standing in for the monitor."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import ray

    from raypipe.run.driver import _stop_autoscaler_monitor

    monitor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started_here = SimpleNamespace(
            all_processes={"monitor": [SimpleNamespace(process=monitor)], "raylet": [SimpleNamespace(process=other)]}
        )
        monkeypatch.setattr(ray._private.worker, "_global_node", started_here, raising=False)
        _stop_autoscaler_monitor()
        assert monitor.poll() is not None and other.poll() is None
        _stop_autoscaler_monitor()  # already stopped: nothing to do
        monkeypatch.setattr(ray._private.worker, "_global_node", SimpleNamespace(all_processes={}), raising=False)
        _stop_autoscaler_monitor()  # joined a running cluster: owns no Ray process
        monkeypatch.setattr(ray._private.worker, "_global_node", None, raising=False)
        _stop_autoscaler_monitor()
    finally:
        for p in (monitor, other):
            p.kill()
            p.wait()

"""The driver around a run (`raypipe.run.driver`): SIGTERM stops a run as Ctrl-C would, once,
and the handler before it is back afterwards; the autoscaler monitor of an in-process cluster is
stopped; the Ray settings raypipe's local clusters and runs start with. No Ray cluster."""

from __future__ import annotations

import logging
import os
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


def test_local_clusters_start_with_fast_connect_retries_unless_the_environment_sets_them(monkeypatch):
    """`ray start` (`raypipe serve` with no cluster) and `ray.init` of a new local cluster get
    `FAST_START_ENV`; a value the user's environment sets stays."""
    import subprocess
    from types import SimpleNamespace

    import ray

    from raypipe.run import driver

    key, other = sorted(driver.FAST_START_ENV)
    monkeypatch.setenv(key, "250")
    monkeypatch.setenv(other, "")  # so that teardown restores it as it was, set or not
    monkeypatch.delenv(other)
    seen: list[dict[str, str]] = []

    def fake_run(cmd, **kwargs):
        seen.append(kwargs["env"])
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    driver.start_local_cluster()
    assert seen[0][key] == "250" and seen[0][other] == driver.FAST_START_ENV[other]

    environ_at_init: list[dict[str, str]] = []
    monkeypatch.setattr(ray, "init", lambda **kw: environ_at_init.append(dict(os.environ)))
    monkeypatch.setattr(driver, "_stop_autoscaler_monitor", lambda: None)
    monkeypatch.setattr(driver, "quiet_ray_loggers", lambda: None)
    driver.start_local_ray(address="local")
    assert environ_at_init[0][key] == "250" and environ_at_init[0][other] == driver.FAST_START_ENV[other]


def test_runs_record_no_ray_data_usage_unless_the_environment_says(monkeypatch):
    from raypipe.run.driver import no_ray_data_usage_actor

    monkeypatch.setenv("RAY_DATA_USAGE_DISABLED", "")  # so that teardown restores it as it was
    monkeypatch.delenv("RAY_DATA_USAGE_DISABLED")
    no_ray_data_usage_actor()
    assert os.environ["RAY_DATA_USAGE_DISABLED"] == "1"
    monkeypatch.setenv("RAY_DATA_USAGE_DISABLED", "0")
    no_ray_data_usage_actor()
    assert os.environ["RAY_DATA_USAGE_DISABLED"] == "0"

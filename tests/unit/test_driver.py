"""The driver around a run (`raypipe.run.driver`): SIGTERM stops a run as Ctrl-C would, once,
and the handler before it is back afterwards. No Ray."""

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

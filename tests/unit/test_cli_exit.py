"""The console entry point's quick exit (`raypipe.cli.run`, defined in `raypipe.cli.entry`):
main's exit code, with everything a normal exit would have done first (non-daemon threads
joined, atexit handlers run, buffered output flushed). A child process, since the entry point ends its process."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

_SCRIPT = """
import atexit, sys, threading, time
atexit.register(lambda: print("exit handler ran"))
def late():
    # Until the exit has begun (the main thread counts as stopped once it joins the others),
    # so only an exit that waits for this thread sees its line.
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    print("thread finished")
print("buffered line")
threading.Thread(target=late).start()
sys.argv = ["raypipe", "report", "--output", sys.argv[1], "--run-id", "x"]
import raypipe.cli.entry as entry
entry._disconnect_ray = lambda: print("ray disconnected")
entry.run()
print("not reached")
"""


def test_the_entry_point_exits_with_mains_code_after_what_a_normal_exit_does(tmp_path: Path) -> None:
    # stdout is a pipe, so every print is buffered until the exit flushes it.
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr  # main's code for a run with no report
    assert "no report for run x" in done.stderr
    assert done.stdout.splitlines() == ["buffered line", "thread finished", "ray disconnected", "exit handler ran"]


def test_ray_is_disconnected_as_a_caller_does_not_as_its_exit_hook_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray.shutdown()` with no arguments: Ray's own atexit hook passes `_exiting_interpreter=True`,
    which sleeps half a second first; its later call finds Ray down and does nothing."""
    from raypipe.cli import entry

    calls: list[dict[str, object]] = []
    fake_ray = types.SimpleNamespace(is_initialized=lambda: not calls, shutdown=lambda **kw: calls.append(kw))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    entry._disconnect_ray()
    entry._disconnect_ray()
    assert calls == [{}]


def test_no_ray_is_no_disconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    from raypipe.cli import entry

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    entry._disconnect_ray()  # a command that never imported Ray does not import it to exit
    assert "ray" not in sys.modules

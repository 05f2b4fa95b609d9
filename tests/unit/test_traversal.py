"""No path outside the output: every run id and replay id that names a file is checked (CLI and
API), and the output-inside-input check compares real paths (`..`, symlinks, globs). No Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe import api
from raypipe.commit.output import Output
from raypipe.config import PipelineConfig
from raypipe.errors import ConfigError
from raypipe.run import modes
from raypipe.run.preflight import _check_output

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYPIPE_")}
    env["RAY_ADDRESS"] = ""
    return subprocess.run(
        [sys.executable, "-m", "raypipe", *args], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A JSON file outside the output, where `../../secret/leak` from `out/runs/` points."""
    leak = tmp_path / "secret" / "leak.json"
    leak.parent.mkdir()
    leak.write_text(json.dumps({"password": "hunter2"}))
    (tmp_path / "out" / "runs").mkdir(parents=True)
    return leak


def test_report_refuses_a_run_id_that_walks_out_of_the_output(tmp_path: Path, secret: Path) -> None:
    done = cli("report", "--output", str(tmp_path / "out"), "--run-id", "../secret/leak", "--json")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "hunter2" not in done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--run-id" in lines[0] and "letters, digits" in lines[0]


@pytest.mark.parametrize("run_id", ["../secret/leak", "../../secret/leak", "/etc/passwd", "a/../../b", ".."])
def test_read_report_refuses_a_path_for_a_run_id(tmp_path: Path, secret: Path, run_id: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits"):
        api.read_report(str(tmp_path / "out"), run_id)
    with pytest.raises(ConfigError, match="letters, digits"):
        api.report_dict(str(tmp_path / "out"), run_id)


def test_replay_refuses_a_run_id_that_walks_out_of_the_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = cli("replay", "--output", str(out), "--run-id", "../x", "--service", "127.0.0.1:1")
    assert done.returncode == 2, done.stderr
    assert "letters, digits" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_the_replay_id_is_checked_where_it_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's own id comes from `replay_run_id` and is set with `model_copy`, which runs no
    validator: it is checked before it names any state."""
    config = PipelineConfig.model_validate({"output": {"uri": str(tmp_path / "out")}})
    monkeypatch.setattr(modes, "replay_run_id", lambda store, of_run: "../../evil")
    ran: list[object] = []
    monkeypatch.setattr(modes, "_run", lambda *a, **k: ran.append(a))
    with pytest.raises(ConfigError, match="replay id"):
        modes.replay(config, Output.at(config.output), of_run="run-1")
    with pytest.raises(ConfigError, match="replayed run id"):
        modes.replay(config, Output.at(config.output), of_run="../run-1")
    assert not ran and not (tmp_path / "evil").exists()


def _refused(output: str | Path, input: str | Path) -> bool:
    try:
        _check_output(str(output), input_uri=str(input))
    except ConfigError as e:
        assert "is inside input" in str(e)
        return True
    return False


def test_an_output_inside_the_input_is_seen_through_dots_symlinks_and_globs(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "in").mkdir(parents=True)
    (data / "in" / "a.jsonl").write_text("{}\n")
    assert _refused(data / "in" / "out", data / "in")
    assert _refused(data / "elsewhere" / ".." / "in" / "out", data / "in"), "`..` in the output"
    assert _refused(data / "out", data / "in" / ".."), "`..` in the input"
    link = tmp_path / "link"
    link.symlink_to(data / "in")
    assert _refused(link / "out", data / "in"), "the output through a symlink"
    assert _refused(data / "in" / "out", link), "the input through a symlink"
    assert _refused(data / "in" / "out", data / "in" / "*"), "a glob whose part matches the output"
    assert _refused(data / "in" / "out", data / "**" / "*.jsonl"), "a recursive glob"
    assert _refused(data / "in" / "out", f"{data}/i?/*.jsonl"), "a glob above the output"
    assert not _refused(data / "in" / "out", data / "in" / "*.jsonl"), "the glob cannot name the output"
    assert not _refused(data / "results", data / "in")
    assert not _refused(data / "in-2", data / "in")

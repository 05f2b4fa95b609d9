"""Generated code is generated: it must match what the one codegen command writes today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_modules_match_the_protos(tmp_path):
    # In a child process, as `make protos` runs it: protoc's C++ runtime and TensorFlow's
    # (loaded by other tests in this process) cannot share one process.
    done = subprocess.run(
        [sys.executable, str(REPO / "protos" / "codegen.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    generated = [tmp_path / line for line in done.stdout.split()]
    assert generated, "no .proto files found"
    for path in generated:
        committed = REPO / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} drifted from its .proto: run `make protos`"


def test_protos_live_only_under_protos():
    stray = [p for p in REPO.rglob("*.proto") if ".venv" not in p.parts and p.parts[len(REPO.parts)] != "protos"]
    assert stray == []

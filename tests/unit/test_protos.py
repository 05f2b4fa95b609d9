"""Generated code is generated: it must match what the one codegen command writes today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _codegen():
    spec = importlib.util.spec_from_file_location("codegen", REPO / "protos" / "codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_match_the_protos(tmp_path):
    codegen = _codegen()
    generated = codegen.generate(tmp_path)
    assert generated, "no .proto files found"
    for path in generated:
        committed = REPO / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} drifted from its .proto: run `make protos`"


def test_protos_live_only_under_protos():
    stray = [p for p in REPO.rglob("*.proto") if ".venv" not in p.parts and p.parts[len(REPO.parts)] != "protos"]
    assert stray == []

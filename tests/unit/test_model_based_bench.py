"""The long run of the model-based test (`bench/modelcheck.py`): chunks with seeds of their own,
resumed from its results file, a failure counted and its story kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import modelcheck


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(examples, seed) of each chunk run; seed 3 fails."""
    ran: list[tuple[int, int]] = []

    def run_chunk(examples: int, seed: int) -> dict[str, Any]:
        ran.append((examples, seed))
        failure = "AssertionError: [latest_answer] ..." if seed == 3 else None
        return {
            "seed": seed,
            "examples": examples,
            "steps": 11 * examples,
            "failure": failure,
            "seconds": 1.0,
            "cpu_s": 1.0,
        }

    monkeypatch.setattr(modelcheck, "run_chunk", run_chunk)
    return ran


def test_chunks_have_seeds_of_their_own_and_the_last_one_is_short(chunks, tmp_path):
    out = tmp_path / "mbt.json"
    result = modelcheck.run_modelcheck(25, out, chunk=10, seed=0)
    assert chunks == [(10, 0), (10, 1), (5, 2)]
    assert result["summary"]["examples"] == 25 and result["summary"]["steps"] == 275
    assert json.loads(out.read_text()) == result


def test_a_run_resumes_from_its_results_file_and_counts_failures(chunks, tmp_path):
    out = tmp_path / "mbt.json"
    modelcheck.run_modelcheck(20, out, chunk=10, seed=2)  # seeds 2 and 3: the first hold
    result = modelcheck.run_modelcheck(40, out, chunk=10, seed=2)  # resumed for 40: only 4 and 5 are new
    assert chunks == [(10, 2), (10, 3), (10, 4), (10, 5)]
    assert result["summary"]["examples"] == 40 and result["summary"]["failures"] == 1
    assert [c["seed"] for c in json.loads(out.read_text())["chunks"]] == [2, 3, 4, 5]


def test_no_chunk_starts_once_the_budget_is_spent(chunks, tmp_path):
    modelcheck.run_modelcheck(30, tmp_path / "mbt.json", chunk=10, max_seconds=0)
    assert chunks == []

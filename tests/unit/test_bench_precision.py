"""The precision section of the bench (`bench.precision`): its table and the docs block it writes."""

from __future__ import annotations

import json
from pathlib import Path

from bench import precision


def _figures(speedup: float, agreement: float, gate: bool) -> dict[str, object]:
    return {
        "agreement_in": agreement,
        "agreement_out": agreement,
        "lower_bound_in": agreement - 0.005,
        "lower_bound_out": agreement - 0.005,
        "max_abs_dp": 0.01,
        "gate": gate,
        "speedup": speedup,
        "spread": [speedup - 0.1, speedup + 0.1],
        "para_per_s": 100 * speedup,
    }


RESULTS = {
    "started_at": "2026-01-01T00:00:00+00:00",
    "cpu": "Test CPU",
    "cores": 2,
    "threads": 2,
    "cpu_flags": ["amx_bf16", "avx512_bf16"],
    "versions": {"openvino": "2026.4"},
    "models": {
        "real-weights-minilm": {
            "shape": "bert-6x384",
            "max_sequence_length": 128,
            "texts": {"in_domain": 900, "out_of_domain": 1000, "timed": 400, "rounds": 5},
            "precisions": {
                "fp32": _figures(1.0, 1.0, True),
                "bf16": _figures(2.4, 0.99, False),
                "bf16-recheck": _figures(2.1, 1.0, True),
            },
            "int8": "",
            "served": "bf16-recheck",
        }
    },
}


def test_the_table_names_every_candidate_its_verdict_and_what_the_gate_serves() -> None:
    text = "\n".join(precision.render(RESULTS, file="bench/results/precision-x.md"))
    assert "the gate serves **bf16-recheck**" in text
    assert "| bf16 | 2.40x (2.30-2.50) |" in text and "| refused |" in text
    assert "| bf16-recheck | 2.10x" in text
    assert "amx_bf16 avx512_bf16" in text and "bench/results/precision-x.md" in text


def test_the_docs_block_is_rewritten_from_the_newest_results_file(tmp_path: Path) -> None:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "precision-20260101T000000Z.json").write_text(json.dumps({**RESULTS, "models": {}}))
    (results / "precision-20260102T000000Z.json").write_text(json.dumps(RESULTS))
    doc = f"# Performance\n{precision.BEGIN}\nold figures\n{precision.END}\nafter\n"
    new = precision.rewrite_docs(doc, results)
    assert "old figures" not in new and new.endswith(f"{precision.END}\nafter\n")
    assert "precision-20260102T000000Z.md" in new and "bf16-recheck" in new
    assert precision.rewrite_docs("no block here", results) == "no block here"

"""The precision section of the bench (`bench.precision`): its table and the docs block it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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


def _int8_dir(tmp_path: Path, meta: dict[str, object]) -> Path:
    (tmp_path / "openvino").mkdir()
    (tmp_path / "openvino" / "int8.json").write_text(json.dumps(meta))
    return tmp_path


def test_a_missing_int8_build_is_built_the_way_optimize_builds_it(tmp_path: Path, monkeypatch: Any) -> None:
    from serve_app import compiled, optimize

    model_dir = tmp_path
    calls: list[tuple[str, object]] = []

    def no_build(path: Path) -> Path:
        raise compiled.OpenVinoError(path, "no int8 build")

    def build(
        path: Path, model: object, calibration: object, *, max_drop: float, max_reverts: int
    ) -> dict[str, object]:
        calls.append(("build", (max_drop, max_reverts)))
        _int8_dir(path, {"accuracy_control": "2 reverts", "seconds": 12})
        return {"accuracy_control": "2 reverts"}

    monkeypatch.setattr(optimize, "int8_ir", no_build)
    monkeypatch.setattr(compiled, "export_ir", lambda path: calls.append(("ir", path)))
    monkeypatch.setattr(optimize, "build_int8", build)
    note = precision.ensure_int8(model_dir, object(), object(), max_reverts=3)
    assert calls == [("ir", model_dir), ("build", (pytest.approx(1 - precision.MIN_AGREEMENT), 3))]
    assert "2 reverts" in note and "12 s" in note


def test_a_current_int8_build_is_reused(tmp_path: Path, monkeypatch: Any) -> None:
    from serve_app import optimize

    model_dir = _int8_dir(tmp_path, {"accuracy_control": "no revert needed", "seconds": 5})
    monkeypatch.setattr(optimize, "int8_ir", lambda path: path / "openvino" / "int8.xml")
    monkeypatch.setattr(optimize, "build_int8", lambda *a, **k: pytest.fail("rebuilt a current int8 build"))
    assert "no revert needed" in precision.ensure_int8(model_dir, object(), object(), max_reverts=3)


def test_an_int8_build_nncf_refuses_is_reported_not_measured(tmp_path: Path, monkeypatch: Any) -> None:
    from serve_app import compiled, optimize

    def no_build(path: Path) -> Path:
        raise compiled.OpenVinoError(path, "no int8 build")

    monkeypatch.setattr(optimize, "int8_ir", no_build)
    monkeypatch.setattr(compiled, "export_ir", lambda path: path)
    monkeypatch.setattr(optimize, "build_int8", lambda *a, **k: {"error": "no quantizable op"})
    note = precision.ensure_int8(tmp_path, object(), object(), max_reverts=3)
    assert note.startswith("not measured") and "no quantizable op" in note


def test_the_trained_models_note_says_what_it_is_and_how_well_it_answers() -> None:
    card = {
        "labels": ["a", "b", "c", "d", "e", "f"],
        "note": "bert-base's shape trained here on generated text, not the published checkpoint",
        "trained": {
            "in_domain_accuracy": 0.8,
            "in_domain_texts": 300,
            "median_margin_in": 0.5,
            "median_margin_out": 0.2,
        },
    }
    note = precision.trained_note(card)
    assert "not the published checkpoint" in note
    assert "80.0% (chance 16.7%)" in note and "0.500 in domain, 0.200 out of domain" in note


def test_a_model_the_newest_run_left_out_keeps_its_figures_from_an_older_file(tmp_path: Path) -> None:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "precision-20260101T000000Z.json").write_text(json.dumps(RESULTS))
    newer = {**RESULTS, "models": {"trained-bert-base": {**RESULTS["models"]["real-weights-minilm"], "served": "fp32"}}}
    (results / "precision-20260102T000000Z.json").write_text(json.dumps(newer))
    new = precision.rewrite_docs(f"{precision.BEGIN}\n{precision.END}\n", results)
    assert "**trained-bert-base**" in new and "**real-weights-minilm**" in new
    assert new.index("precision-20260102T000000Z.md") < new.index("precision-20260101T000000Z.md")
    assert new.count("**real-weights-minilm**") == 1


def _passing(speedup: float, low: float, high: float, agreement: float = 1.0) -> dict[str, Any]:
    return {**_figures(speedup, agreement, True), "spread": [low, high]}


def test_the_bench_names_what_a_replica_serves_by_the_replica_s_rule_not_the_highest_median() -> None:
    texts = {"in_domain": 900, "out_of_domain": 1000, "timed": 120, "rounds": 5}
    figures = {
        "fp32": {**_figures(1.0, 1.0, True), "spread": [1.0, 1.0]},
        # The highest median, but within the spread of one with a higher gate figure: a tie.
        "bf16-dense-recheck m0.02": _passing(1.80, 1.64, 2.02, agreement=0.9956),
        "bf16-recheck m0.07": _passing(1.70, 1.54, 1.98, agreement=0.9978),
        # A wider margin of the same precision is never preferred over a narrower passing one.
        "bf16-recheck m0.1": _passing(1.41, 1.32, 1.73, agreement=1.0),
        "bf16": {**_figures(2.8, 0.95, False)},
    }
    assert precision.served(figures, texts) == "bf16-recheck m0.07"
    figures["bf16-dense-recheck m0.02"]["spread"] = [2.0, 2.1]
    figures["bf16-dense-recheck m0.02"]["speedup"] = 2.05
    assert precision.served(figures, texts) == "bf16-dense-recheck m0.02"
    assert precision.served({"fp32": figures["fp32"]}, texts) == "fp32"

"""The benchmark's pure parts: corpus statistics, the FLOP formula, derived ratios, rendering.

No Ray, no TensorFlow, no timing: the measured numbers come from `make bench`, never from tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import corpus
from bench.flops import Shape, useful_flops
from bench.models import SHAPES
from bench.render import derive, render_markdown


def test_lengths_are_lognormal_around_the_median_with_a_long_tail():
    lengths = corpus.target_lengths(20_000, seed=1)
    stats = corpus.length_stats(lengths, max_length=512)
    assert 55 <= stats["median"] <= 65
    assert stats["p99"] > 5 * stats["median"]  # the long tail
    assert 0.001 < stats["truncated_share"] < 0.02  # a few cut at bert-base's 512
    assert corpus.length_stats(lengths, max_length=256)["truncated_share"] > stats["truncated_share"]
    # log-lengths are symmetric around the median, as a lognormal's are
    logs = np.log(lengths)
    assert abs(np.mean(logs) - np.log(corpus.MEDIAN_TOKENS)) < 0.02
    assert np.std(logs) == pytest.approx(corpus.SIGMA, rel=0.05)


def test_corpus_is_seeded_and_sized_in_words():
    a, b = corpus.paragraphs(200, seed=3), corpus.paragraphs(200, seed=3)
    assert a == b and a != corpus.paragraphs(200, seed=4)
    words = np.array([len(t.split()) for t in a])
    wanted = np.maximum(1, np.rint((corpus.target_lengths(200, seed=3) - 2) / corpus.TOKENS_PER_WORD))
    assert (words == wanted).all()


def test_flops_formula_matches_a_hand_count_for_bert_base():
    shape = SHAPES["bert-base"]
    t, h, i = 128, 768, 3072
    per_layer = 2 * t * (3 * h * h) + 2 * t * h * h + 2 * t * h * i * 2 + 2 * 2 * t * t * h
    assert useful_flops(shape, t) == pytest.approx(12 * per_layer + 2 * h * h + 2 * h * 6)
    # ~22.5 GFLOP for 128 tokens: the usual "2 x parameters x tokens" plus attention
    assert 2.1e10 < useful_flops(shape, t) < 2.4e10
    assert useful_flops(SHAPES["minilm-l6"], t) < useful_flops(shape, t) / 7


def test_model_shapes_are_the_ones_the_issue_names():
    assert (SHAPES["bert-base"].layers, SHAPES["bert-base"].hidden, SHAPES["bert-base"].intermediate) == (12, 768, 3072)
    assert (SHAPES["minilm-l6"].layers, SHAPES["minilm-l6"].hidden, SHAPES["minilm-l6"].intermediate) == (6, 384, 1536)
    assert {s.heads for s in SHAPES.values()} == {12} and {s.labels for s in SHAPES.values()} == {6}


def _results():
    shape = Shape("tiny", layers=2, hidden=8, heads=2, intermediate=16, max_length=64)
    lines = {
        "a": {"ok": 100, "paragraphs": 100, "wall_s": 1.0, "cpu_s": 2.0, "padded_tokens": 120, "real_tokens": 100},
        "b": {"ok": 50, "paragraphs": 50, "wall_s": 1.0, "cpu_s": 2.0, "retries": 3},
        "c": {"ok": 10, "paragraphs": 10, "wall_s": 1.0, "cpu_s": 1.0},
        "d": {"ok": 80, "paragraphs": 80, "wall_s": 1.0, "cpu_s": 2.0, "latency_ms": {"p50": 12.0, "p99": 40.0}},
    }
    for line in lines.values():
        line["useful_flops_per_para"] = 1e9
    derive(lines, gemm_flops_per_s=1e12)
    return {
        "started_at": "2026-01-01T00:00:00+00:00",
        "env": {
            "git_commit": "abc",
            "git_dirty": True,
            "command": "python -m bench.run --quick",
            "cpu": {"model": "Test CPU", "usable_cpus": 2, "logical_cpus": 2, "flags": ["avx512_bf16"]},
            "cluster_cpus": 2,
            "server_defaults": {"batch_max_calls": 8},
            "unbatched_settings": {"batch_max_calls": 1},
        },
        "models": {"tiny": {"shape": shape.to_dict(), "gemm": {"flops_per_s": 1e12}, "lines": lines}},
        "memory": {
            "runs": [
                {"rows": 10, "wall_s": 1.0, "peak_rss_bytes": 2**30, "peak_rss_started_bytes": 2**28},
                {"rows": 100, "wall_s": 5.0, "peak_rss_bytes": 1.1 * 2**30, "peak_rss_started_bytes": 2**28},
            ],
            "ratio_all": 1.1,
            "ratio_driver": 1.0,
            "met": True,
        },
        "precision": {"skipped": "no precision setting"},
    }


def test_derived_ratios():
    lines = _results()["models"]["tiny"]["lines"]
    assert lines["a"]["para_per_s"] == 100 and lines["d"]["vs_a"] == pytest.approx(0.8)
    assert lines["d"]["vs_b"] == pytest.approx(1.6) and lines["c"]["vs_b"] == pytest.approx(0.2)
    assert lines["a"]["cpu_s_per_para"] == pytest.approx(0.02)
    assert lines["a"]["padded_per_real"] == pytest.approx(1.2) and lines["b"]["padded_per_real"] is None
    assert lines["a"]["gemm_share"] == pytest.approx(0.1)  # 100 para/s x 1 GFLOP over 1 TFLOP/s


def test_markdown_names_the_cpu_the_lines_and_the_targets():
    md = render_markdown(_results())
    assert "Test CPU" in md and "avx512_bf16" in md and "dirty" in md
    table = [row for row in md.splitlines() if row.startswith("| (")]
    assert len(table) == 4 and "| 0.80 | 1.60 |" in table[3] and "12/40" in table[3]
    assert "**met**" in md and "skipped: no precision setting" in md


def test_markdown_shows_agreement_per_domain_speed_per_setting_and_the_profile():
    results = _results()
    results["precision"] = {
        "cpu_flags": ["avx2"],
        "agreement": {
            "in domain": {"texts": 2000, "openvino:fp32": {"agreement": 1.0, "max_abs_dp": 2e-6}},
            "out of domain": {"texts": 900, "openvino:fp32": {"agreement": 0.9989, "max_abs_dp": 0.0123}},
        },
        "models": {
            "tiny": {
                "resolved": {"auto:auto": "openvino:fp32"},
                "errors": {"openvino:int8": "no int8 build\nmore"},
                "settings": {
                    "tensorflow:fp32": {
                        "inproc_speedup": 1.0,
                        "inproc_para_per_s": 10.0,
                        "e2e_speedup": 1.0,
                        "e2e_para_per_s": 8.0,
                        "d_over_a": 0.8,
                        "profile": {
                            "calls": 10,
                            "call_ms": 100.0,
                            "shares": {"tokenize": 0.05, "batching wait": 0.25, "model": 0.5, "proxy/other": 0.2},
                        },
                    },
                    "auto:auto": {"inproc_speedup": 1.3, "inproc_para_per_s": 13.0, "e2e_speedup": 1.25},
                },
            }
        },
    }
    md = render_markdown(results)
    assert "| setting | in domain | out of domain |" in md
    assert "| openvino:fp32 | 100.00% (0.0000) | 99.89% (0.0123) |" in md
    assert "| tiny | tensorflow:fp32 | 1.00 | 10.0 | 1.00 | 8.0 | 0.80 |" in md
    assert "| tiny | auto → openvino:fp32 | 1.30 | 13.0 | 1.25 |" in md
    assert "| tiny | openvino:int8 | error: no int8 build |" in md
    assert "| tiny | tensorflow:fp32 | 100.0 | 5% | 25% | 50% | 20% |" in md

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


def _planning():
    run = {
        "threads": 1,
        "shards": 50_000,
        "list_s": 2.0,
        "plan_s": 298.0,
        "total_s": 300.0,
        "cpu_s": 150.0,
        "moto_cpu_s": 160.0,
        "peak_rss_bytes": 400 * 2**20,
        "list_requests": {"ListObjectsV2": 50},
        "plan_requests": {"GetObject": 50_000},
    }
    return {
        "shards": 50_000,
        "rows_per_shard": 8,
        "input_bytes": 230 * 2**20,
        "upload_s": 200.0,
        "runs": {
            "sequential": run,
            "parallel": {**run, "threads": 16, "plan_s": 98.0, "total_s": 100.0},
            "sampled": {
                **run,
                "threads": 16,
                "footers_read": 1000,
                "whole_files": 49_000,
                "plan_s": 3.0,
                "total_s": 5.0,
                "plan_requests": {"GetObject": 1000},
            },
        },
        "speedup": 3.0,
        "speedup_sampled": 60.0,
        "requests": {
            "sample": 1000,
            "before_cold": {"per_shard": {"GetObject": 1.0, "HeadObject": 1.0}, "ms_per_shard": 8.6},
            "now_cold": {"per_shard": {"GetObject": 1.0}, "ms_per_shard": 4.3, "cpu_ms_per_shard": 2.1},
        },
        "latency": {
            "latency_ms": 20.0,
            "sequential": {**run, "shards": 1000, "plan_s": 28.0},
            "parallel": {**run, "shards": 1000, "threads": 16, "plan_s": 4.0},
            "speedup": 7.0,
        },
        "first_commit": {
            "steps_s": {"planned": 110.0, "pipeline_started": 115.0, "first_commit": 140.0},
            "driver_peak_rss_bytes": 700 * 2**20,
        },
        "met": True,
    }


def test_markdown_shows_the_planning_line():
    results = _results()
    results["planning"] = _planning()
    md = render_markdown(results)
    assert "### Planning 50,000 shards (moto S3)" in md
    sequential = "| sequential | 1 | 50,000 | 0 | 2.0 | 298.0 | **300.0** | 167 | 150.0 | 160.0 | 400 "
    assert sequential + "| 1.00 GetObject |" in md
    assert "| parallel | 16 | 50,000 | 0 | 2.0 | 98.0 | **100.0** | 500 |" in md and "**3.00×**" in md
    assert "| sampled | 16 | 1,000 | 49,000 | 2.0 | 3.0 | **5.0** | 10000 |" in md and "**60.00×**" in md
    assert "0.02 GetObject" in md
    assert "50.00 ListObjectsV2" in md
    assert (
        "| before | cold | 1 GetObject, 1 HeadObject | 8.6 | – |" in md
        and "| now | cold | 1 GetObject | 4.3 | 2.1 |" in md
    )
    assert "one at a time 28.0 s, 16 threads 4.0 s: **7.00×**" in md
    assert "**first unit committed at 140.0**" in md and "**700 MB**" in md and "**met**" in md


def test_first_commit_is_the_first_log_entry_that_adds_files(tmp_path):
    import fsspec

    from bench.planning import _unit_commits

    fs, log, read = fsspec.filesystem("file"), tmp_path / "_delta_log", set()
    assert not _unit_commits(fs, str(log), read)  # no table yet
    log.mkdir()
    (log / "00000.json").write_text('{"protocol":{}}\n{"metaData":{}}\n{"commitInfo":{}}\n')
    (log / "00001.json").write_text('{"txn":{"appId":"a","version":1}}\n{"commitInfo":{}}\n')  # a takeover
    assert not _unit_commits(fs, str(log), read)
    (log / "00002.json").write_text('{"txn":{}}\n{"add":{"path":"run_id=r/u.parquet"}}\n{"commitInfo":{}}\n')
    assert _unit_commits(fs, str(log), read) and not _unit_commits(fs, str(log), read)


def test_markdown_shows_the_pool_lines_with_ids_checked_and_tokens():
    line = {
        "nodes": 1,
        "report_rows_per_s": 30.0,
        "retries": 0,
        "every_id_once": True,
        "replica_cpu_s_per_para": 0.032,
        "replica_cpu_vs_inprocess": 1.2,
        "real_tokens": 1000,
        "padded_tokens": 1150,
        "replica_cpu_per_token_vs_inprocess": 1.04,
        "replicas_over_time": [(0.0, 1), (1.0, 1)],
    }
    lost = {
        **line,
        "nodes": 2,
        "every_id_once": False,
        "replicas_over_time": [(0.0, 2), (9.0, 1)],
        "killed_after_units": 10,
        "longest_pause_after_kill_s": 4.9,
        "median_gap_before_kill_s": 3.0,
        "status_counts": {"OK": 128},
    }
    results = _results()
    results["pool"] = {
        "rows": 4000,
        "node_cpus": 1.0,
        "host_cpus": 2,
        "inprocess_para_per_s": 37.2,
        "inprocess_cpu_s_per_para": 0.0268,
        "inprocess_padded_per_real": 1.06,
        "ratio_2_vs_1_nodes": 0.97,
        "node_lost_wall_vs_nodes_2": 0.91,
        "lines": {"nodes-1": line, "node-lost": lost},
    }
    md = render_markdown(results)
    assert "| nodes-1 | 1 | 30.0 | 0 | yes | 32.00 | 1.20 | 1.15 | 1.04 | 1 |  |" in md
    assert "| node-lost | 2 | 30.0 | 0 | **NO** |" in md and "| 2→1 | pool-1 killed after 10 units" in md
    assert "**0.97×** rows/s" in md and "pad to 1.06×" in md


def test_the_speed_table_has_a_line_per_model_and_where_its_cpu_went() -> None:
    from bench.speed import _profile, speed_tables

    cost = {
        "paragraphs": 1000,
        "cpu_s": 40.0,
        "wall_s": 20.0,
        "model_cpu_s": 34.0,
        "groups": {"serve replica": 35.0, "driver": 2.0, "serve proxy": 3.0},
    }
    profile = _profile(cost, 2)
    assert profile["outside_model_over_model"] == round(6 / 34, 3)
    assert profile["outside_replica_over_replica"] == round(5 / 35, 3)
    assert profile["cores_busy"] == 2.0 and profile["idle_ms_per_para"] == 0.0
    e2e = {"para_per_s": 50.0, "retries": 0, "peak_rss_bytes": 3 * 2**30, "answered_by": {"openvino:fp32": 1000}}
    speed = {
        "cpu": "AMD EPYC",
        "cpu_flags": ["avx2"],
        "models": {
            "minilm-l6": {
                "paragraphs": 1000,
                "inproc": {"setting": "openvino:fp32", "para_per_s": 55.0},
                "e2e": e2e,
                "ratio": 50 / 55,
                "run_ratio": 0.93,
                "short_ratio": 0.86,
                "agreement": {"in domain": 1.0, "out of domain": 0.995},
                "profile": profile,
            },
            "bert-base": {
                "paragraphs": 500,
                "inproc": {"setting": "openvino:fp32", "para_per_s": 5.0},
                "e2e": {**e2e, "para_per_s": 4.7},
                "ratio": 0.94,
                "run_ratio": 0.95,
                "agreement": {},
                "profile": {},
            },
        },
    }
    text = "\n".join(speed_tables(speed))
    assert "| minilm-l6 | openvino:fp32 | 55.0 | 50.0 | **0.91** | 0.93 | 0.86 | 100.00% / 99.50% |" in text
    assert "| 0.176 | 0.143 | 2.0 | 0 | 3.00 |" in text
    assert "| bert-base | openvino:fp32 | 5.0 | 4.7 | **0.94** | 0.95 | – |" in text
    assert "CPU per paragraph, minilm-l6" in text and "| replica outside the model | 1.000 |" in text
    assert "Start-up of each" not in text  # no line reported its start-up figures


def test_the_speed_section_shows_where_each_commands_wall_went_before_the_first_call() -> None:
    from bench.speed import speed_tables

    line = {"paragraphs": 6000, "para_per_s": 300.0, "wall_s": 20.0, "report_wall_s": 19.0}
    model = {
        "paragraphs": 6000,
        "inproc": {"setting": "openvino:bf16", "para_per_s": 350.0},
        "e2e": {**line, "startup": {"ray_s": 0.2, "first_call_s": 1.4, "first_unit_s": 5.0}},
        "short": {**line, "startup": {"ray_s": 0.25}},  # no call went out: no line
        "ratio": 0.86,
        "run_ratio": 0.9,
        "agreement": {},
        "profile": {},
    }
    text = "\n".join(speed_tables({"models": {"minilm-l6": model}}))
    assert "| minilm-l6 | 6,000 | 20.00 | 1.00 | 0.20 | 1.40 | 5.00 | 0.120 |" in text
    assert text.count("| minilm-l6 | 6,000 |") == 1


def test_the_speed_section_shows_what_the_served_cluster_costs_with_no_run_in_it() -> None:
    from bench.speed import background_figures, speed_tables

    bg = background_figures({"serve controller": 0.1, "ray gcs": 0.05, "serve proxy": 0.1}, 10.0, 2)
    assert bg["ms_per_s"] == {"serve controller": 10.0, "serve proxy": 10.0, "ray gcs": 5.0}
    assert bg["total_ms_per_s"] == 25.0 and bg["cores_share"] == 0.0125
    model = {
        "paragraphs": 6000,
        "inproc": {"setting": "openvino:bf16", "para_per_s": 350.0},
        "e2e": {"para_per_s": 300.0, "run_para_per_s": 312.5},
        "ratio": 0.86,
        "run_ratio": 0.89,
        "agreement": {},
        "profile": {"total_ms_per_para": 8.0},
        "background": bg,
    }
    text = "\n".join(speed_tables({"models": {"minilm-l6": model, "bert-base": {**model, "background": None}}}))
    head = "| model | in all | share of the cores | ms per paragraph | share of the run's CPU | serve controller |"
    assert head in text
    # 25 ms a second at 312.5 paragraphs a second: 0.080 ms a paragraph, 1% of 8 ms
    assert "| minilm-l6 | 25.0 | 0.013 | 0.080 | 0.010 | 10.0 | 10.0 | 5.0 |" in text
    assert "| bert-base | 25.0 |" not in text

"""A real run's report says which setting answered and what the run cost (`raypipe.run.cost`).

The shared Serve app serves the demo model with default settings and no measured record for
this CPU: the fastest setting with the reference's answers (OpenVINO fp32), whose model version
is the card's own.
"""

from __future__ import annotations

import json

import pytest
import ray

import raypipe
from raypipe.samples import write_sample_corpus
from serve_app.model import read_model_card


def test_a_default_run_is_answered_by_the_equal_answer_setting_and_reports_its_cost(
    tmp_path, serve_address, demo_model_dir, monkeypatch
):
    # Ray's usage stats on, as in a user's shell (the tests turn them off): the run still starts
    # no usage collection actor of Ray Data's (`raypipe.run.driver.no_ray_data_usage_actor`).
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    monkeypatch.setenv("RAY_DATA_USAGE_DISABLED", "")  # so that teardown restores it as it was
    monkeypatch.delenv("RAY_DATA_USAGE_DISABLED")
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=600, parquet_shards=2, jsonl_shards=0, bad_fraction=0.0)
    report = raypipe.backfill(corpus.uri, str(tmp_path / "out"), service=serve_address, run_id="cost")
    assert report.status == "completed"
    # No record for this CPU: OpenVINO fp32, versioned as the reference (no suffix).
    assert report.model_version == read_model_card(demo_model_dir).version
    answered = sum(report.answered_by.values())
    assert set(report.answered_by) == {"openvino:fp32"}
    assert answered + report.rows_copied == report.rows_ok
    cost = report.cost
    assert cost is not None
    assert cost["paragraphs"] == report.rows_this_attempt == 600
    assert cost["cpu_s"] > 0 and cost["cpu_s_per_1k"] > 0 and cost["usd_per_million"] > 0
    assert {"serve replica", "driver"} <= set(cost["groups"])
    # The model's CPU (the runtime's threads) is part of the replica's.
    assert 0 < cost["model_cpu_s"] <= cost["groups"]["serve replica"]
    assert 0 < cost["model_share"] <= 1
    assert "CPU-s per 1,000 paragraphs" in report.render()
    saved = json.loads((tmp_path / "out" / "runs" / "cost.json").read_text())
    assert saved["cost"]["cpu_s"] == cost["cpu_s"] and saved["answered_by"] == report.answered_by
    with pytest.raises(ValueError):
        ray.get_actor("DataUsageCollectionActor", namespace="DataUsageCollectionActor")

"""The whole path: S3 shards (moto) -> Ray Data -> async actors -> Serve gRPC BERT -> a Delta table on S3."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pytest

import raypipe
from raypipe.commit.schema import label_column
from raypipe.errors import NoShardsError, SchemaError, ServiceUnavailable
from raypipe.samples import write_sample_corpus


def read_results(s3, uri: str):
    """The committed results, read as users read them (through the table's log on S3)."""
    rows = raypipe.read_outcomes(uri)
    return rows.filter(pc.equal(rows.column("outcome"), "result"))


@pytest.fixture(scope="module")
def corpus(s3):
    bucket = s3.bucket("corpus")
    return write_sample_corpus(f"{bucket}/e2e", rows=2400, parquet_shards=4, jsonl_shards=1, bad_fraction=0.02, seed=11)


@pytest.fixture(scope="module")
def e2e_run(s3, corpus, serve_address):
    out = f"{s3.bucket('results')}/e2e"
    report = raypipe.backfill(
        corpus.uri, out, service=serve_address, run_id="e2e", settings={"input": {"unit_rows": 300}}
    )
    return out, report


def test_every_input_id_lands_exactly_once(s3, corpus, e2e_run):
    out, report = e2e_run
    table = read_results(s3, out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice in the results"
    assert sorted(ids) == sorted(corpus.ids)
    assert report.status == "completed"
    assert report.rows_in == len(corpus.ids) == report.rows_results
    assert report.rows_dead_letters == 0
    assert report.rows_empty_text == len(corpus.bad_ids) > 0


def test_bad_rows_carry_their_status_and_no_probabilities(s3, corpus, e2e_run):
    out, _ = e2e_run
    rows = {r["id"]: r for r in read_results(s3, out).to_pylist()}
    for pid in corpus.bad_ids:
        assert rows[pid]["status"] == "empty_text"
        assert rows[pid]["top_label"] is None and rows[pid]["prob_joy"] is None
    good = [r for pid, r in rows.items() if pid not in set(corpus.bad_ids)]
    assert {r["status"] for r in good} == {"ok"}


def test_probabilities_are_distributions(s3, e2e_run):
    out, report = e2e_run
    table = read_results(s3, out)
    ok = table.filter(pc.equal(table.column("status"), "ok"))
    probs = np.column_stack([ok.column(label_column(lab)).to_numpy() for lab in report.labels])
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    top = np.array(report.labels)[probs.argmax(axis=1)]
    assert (top == np.array(ok.column("top_label").to_pylist())).all()


def test_served_probabilities_equal_an_in_process_call(s3, corpus, e2e_run, demo_model_dir):
    from serve_app.model import EmotionModel

    out, report = e2e_run
    rows = {r["id"]: r for r in read_results(s3, out).to_pylist() if r["status"] == "ok"}
    sample = random.Random(3).sample(sorted(rows), 60)
    texts = _texts_by_id(s3, corpus.uri)
    model = EmotionModel.load(demo_model_dir)
    local = model.predict([texts[pid] for pid in sample]).probabilities
    served = np.array([[rows[pid][label_column(lab)] for lab in report.labels] for pid in sample])
    np.testing.assert_allclose(served, local, atol=1e-4)
    assert tuple(report.labels) == model.card.labels
    assert {rows[pid]["model_version"] for pid in sample} == {model.card.version}


def test_results_carry_run_metadata_and_report_is_written(s3, e2e_run):
    out, report = e2e_run
    table = read_results(s3, out)
    assert set(table.column("run_id").to_pylist()) == {"e2e"}
    assert s3.fs().exists(f"{out.removeprefix('s3://')}/outcomes/_delta_log/00000000000000000000.json")
    assert table.column("updated_at").null_count < table.num_rows  # the input's, in a backfill too
    assert table.column("inferred_at").null_count == 0
    written = json.loads(s3.fs().cat(f"{out.removeprefix('s3://')}/runs/e2e.json"))
    assert written["rows_in"] == report.rows_in and written["status"] == "completed"
    assert written["status_counts"]["OK"] == report.calls > 0
    assert written["latency_ms"]["p50"] is not None


def test_missing_column_fails_before_inference_naming_shard_and_column(s3, serve_address):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = s3.bucket("corpus")
    with s3.fs().open(f"{bucket.removeprefix('s3://')}/nocol/part-0.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["a"], "body": ["text"]}), f)
    with pytest.raises(SchemaError, match=r"'text' is missing.*nocol/part-0\.parquet"):
        raypipe.backfill(f"{bucket}/nocol/", f"{bucket}/nocol-out", service=serve_address)


def test_input_matching_no_shards_is_an_error(s3, serve_address):
    bucket = s3.bucket("corpus")
    with pytest.raises(NoShardsError):
        raypipe.backfill(f"{bucket}/does-not-exist/", f"{bucket}/x-out", service=serve_address)


def test_unreachable_service_fails_fast_with_its_address(s3, ray_cluster):
    """Its own input and output bucket, so it runs alone (`-k unreachable`) as well as after the others."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.integration.conftest import free_port

    bucket = s3.bucket("unreachable")
    with s3.fs().open(f"{bucket.removeprefix('s3://')}/in/part-0.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["a", "b"], "text": ["one text", "another"]}), f)
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ServiceUnavailable, match=address):
        raypipe.backfill(
            f"{bucket}/in/", f"{bucket}/never", service=address, settings={"service": {"connect_timeout_s": 2}}
        )
    assert not s3.fs().exists(f"{bucket.removeprefix('s3://')}/never")  # refused before anything was written


def _texts_by_id(s3, uri: str) -> dict[str, str]:
    fs = s3.fs()
    root = uri.removeprefix("s3://")
    texts: dict[str, str] = {}
    for fmt, ext in (("parquet", "parquet"), ("json", "jsonl")):
        files = fs.glob(f"{root}/*.{ext}")
        if files:
            t = pads.dataset(files, format=fmt, filesystem=fs).to_table(columns=["id", "text"])
            texts.update(zip(t.column("id").to_pylist(), t.column("text").to_pylist(), strict=True))
    return texts

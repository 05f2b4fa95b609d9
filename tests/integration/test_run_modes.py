"""Run modes on a real cluster: kill-and-resume, daily deltas, bad input, leases, a job without the token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray import serve

import raypipe
from raypipe.commit.lease import Lease
from raypipe.errors import InputError, OutputLockedError, SchemaError
from raypipe.samples import write_sample_corpus
from raypipe.store import OutputStore
from tests.integration.conftest import wait_for
from tests.integration.helpers import assert_nothing_lost, committed_units, dead_letters, results

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "raypipe", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def test_job_submission_without_the_token_is_refused(ray_cluster):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run(
        [str(Path(PYTHON).parent / "ray"), "job", "list", "--address", ray_cluster.dashboard_url],
        capture_output=True, text=True, timeout=60, env={**env, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert refused.returncode != 0
    assert "token" in (refused.stdout + refused.stderr).lower()


def _answered(app: str) -> int:
    return int(serve.get_app_handle(app).stats.remote().result()["paragraphs"].get("OK", 0))


@pytest.mark.timeout(420)
def test_killed_backfill_resumes_without_redoing_committed_work(tmp_path, ray_cluster, serve_address):
    app = "raypipe"  # the session's shared app: tests run one at a time, so its count since `start` is this test's
    start = _answered(app)
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=3000, parquet_shards=3, jsonl_shards=0,
                                 bad_fraction=0.0, row_group_size=50, seed=31)  # fmt: skip
    out = tmp_path / "out"
    args = ["backfill", "--input", corpus.uri, "--output", str(out), "--service", serve_address,
            "--run-id", "resume-1", "--set", f"service.application={app}", "--set", "input.unit_rows=50",
            "--set", "actors.max_actors=1", "--set", "actors.units_per_actor=2",
            "--set", "output.lease_s=15"]  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    driver = subprocess.Popen([PYTHON, "-m", "raypipe", *args], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    units_total = 60
    try:
        wait_for(lambda: committed_units(out, "resume-1") >= 0.3 * units_total, 240, "30% of the units committed")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    committed_at_kill = committed_units(out, "resume-1")
    assert committed_at_kill < units_total, "the run finished before it could be killed"
    time.sleep(2)  # let Ray reap the dead driver's actors

    # The killed attempt's lease is live for up to 15 s: the resumed run waits it out.
    report = raypipe.backfill(corpus.uri, str(out), service=serve_address, run_id="resume-1",
                              settings={"service": {"application": app}, "input": {"unit_rows": 50}})  # fmt: skip
    assert report.status == "completed"
    results_ids, dead = assert_nothing_lost(out, corpus.ids)
    assert len(results_ids) == len(corpus.ids) and dead == []
    assert report.units_skipped_committed >= committed_at_kill
    assert report.rows_skipped_committed == 50 * report.units_skipped_committed
    assert report.rows_in == len(corpus.ids)  # totals span both attempts
    # The server's own count: every paragraph inferred across both attempts, committed or not.
    served = _answered(app) - start
    # (A unit sends a text once: the distinct texts are the least the server can have seen.)
    assert len(set(corpus.texts)) <= served <= 1.10 * len(corpus.ids), served
    print(
        f"resume: committed at kill {committed_at_kill}/{units_total} units; skipped "
        f"{report.rows_skipped_committed} rows; server inferred {served}"
    )


def _write_day2(input_dir: Path, day1_ids: list[str], when: datetime) -> tuple[list[str], list[str]]:
    """Adds a shard with 40 changed paragraphs (same ids, new text) and 60 new ones."""
    changed = day1_ids[:40]
    new = [f"new{i:04d}" for i in range(60)]
    ids = changed + new
    texts = [f"I am furious and outraged, this is infuriating ({i})" for i in changed] + [
        f"What a wonderful, joyful surprise party ({i})" for i in new
    ]
    table = pa.table(
        {"id": ids, "text": texts, "updated_at": pa.array([when] * len(ids), pa.timestamp("us", tz="UTC"))}
    )
    pq.write_table(table, input_dir / "day2.parquet")
    return changed, new


@pytest.mark.timeout(420)
def test_daily_runs_send_only_new_and_changed_rows(tmp_path, serve_address):
    app = "raypipe"  # shared: counts are taken from this test's start
    start = _answered(app)
    day1 = datetime(2026, 1, 1, tzinfo=UTC)
    input_dir = tmp_path / "in"
    corpus = write_sample_corpus(str(input_dir), rows=500, parquet_shards=2, jsonl_shards=1, bad_fraction=0.0,
                                 updated_at=day1, seed=41)  # fmt: skip
    out = str(tmp_path / "out")
    cfg = {"service": {"application": app}, "input": {"unit_rows": 100}}

    r1 = raypipe.daily(input_dir.as_posix(), out, service=serve_address, settings=cfg)
    assert r1.status == "completed" and r1.rows_in == 500
    after_day1 = _answered(app) - start
    assert after_day1 == 500

    changed, new = _write_day2(input_dir, corpus.ids, day1 + timedelta(days=1, hours=12))
    r2 = raypipe.daily(input_dir.as_posix(), out, service=serve_address, settings=cfg)
    sent_day2 = _answered(app) - start - after_day1
    assert sent_day2 == len(changed) + len(new) == r2.rows_in
    assert r2.planning["files"] == {"new": 1, "unchanged": 3}

    # A third run with nothing new sends nothing and still commits (and moves the watermark).
    r3 = raypipe.daily(input_dir.as_posix(), out, service=serve_address, settings=cfg)
    assert r3.status == "completed" and r3.rows_in == 0
    assert _answered(app) - start - after_day1 == sent_day2

    latest = raypipe.latest(out)  # the README's SQL view, run by DuckDB over the committed files
    rows = {r["id"]: r for r in latest.to_pylist()}
    assert len(rows) == len(latest) == 500 + len(new)
    assert all(rows[i]["run_id"] == r2.run_id for i in changed + new)
    assert {rows[i]["top_label"] for i in changed} == {"anger"}
    assert all(rows[i]["run_id"] == r1.run_id for i in corpus.ids[40:])

    # A rerun over an earlier window, explicitly: the rows updated after `since` are read again.
    r4 = raypipe.daily(input_dir.as_posix(), out, service=serve_address, since=day1 + timedelta(days=1), settings=cfg)
    assert r4.status == "completed" and r4.rows_in == len(changed) + len(new)


def test_bad_input_outcomes(tmp_path, serve_address):
    good = write_sample_corpus(str(tmp_path / "in"), rows=300, parquet_shards=2, jsonl_shards=0, bad_fraction=0.0,
                               seed=51)  # fmt: skip
    in_dir = tmp_path / "in"
    (in_dir / "corrupt.parquet").write_bytes(b"PAR1" + os.urandom(300) + b"PAR1")
    pq.write_table(pa.table({"paragraph_id": ["x1"], "body": ["other schema"]}), in_dir / "other_schema.parquet")
    pq.write_table(pa.table({"id": pa.array([10, 11], pa.int64()), "text": ["int id one", "int id two"]}),
                   in_dir / "int_ids.parquet")  # fmt: skip
    dup_ids = good.ids[:3]
    pq.write_table(pa.table({"id": dup_ids, "text": ["dup a", "dup b", "dup c"]}), in_dir / "dups.parquet")
    # JSON lines Arrow's reader refuses whole: a cut-off line, an array, integer and string ids.
    (in_dir / "lines.jsonl").write_text('{"id": "j1", "text": "a good line"}\n{"id": "j2", "text": "cut of\n[1]\n'
                                        '{"id": 12, "text": "an integer id"}\n')  # fmt: skip
    out = tmp_path / "out"

    # Default: a bad shard stops the run before any inference, naming the shard.
    with pytest.raises(InputError, match=r"corrupt\.parquet"):
        raypipe.backfill(str(in_dir), str(out), service=serve_address)
    assert results(out) is None and dead_letters(out) is None

    # on_bad_shard=record: bad shards are listed, the rest is processed, the run is incomplete.
    report = raypipe.backfill(str(in_dir), str(out), service=serve_address, run_id="bad",
                              settings={"input": {"on_bad_shard": "record"}})  # fmt: skip
    assert report.status == "incomplete"
    assert sorted(Path(b["shard"]).name for b in report.bad_shards) == ["corrupt.parquet", "other_schema.parquet"]
    assert any("column 'id' is missing" in b["error"] for b in report.bad_shards)
    table = results(out)
    ids = table.column("id").to_pylist()
    assert {"10", "11"} <= set(ids)  # integer ids become their decimal strings
    # Duplicate ids: every occurrence is inferred and kept, told apart by source and row.
    for dup in dup_ids:
        rows = [r for r in table.to_pylist() if r["id"] == dup]
        assert len(rows) == 2 and len({r["source"] for r in rows}) == 2
    assert sorted(set(ids)) == sorted(set(good.ids) | {"10", "11", "j1", "12"})
    # Each malformed line is a dead letter with its reason, the id it names kept; nothing else is lost.
    lines = {r["row"]: r for r in dead_letters(out).to_pylist() if r["source"].endswith("lines.jsonl")}
    assert {row: (r["id"], r["error_kind"]) for row, r in lines.items()} == {
        1: ("j2", "invalid_row"),
        2: (None, "invalid_row"),
    }
    assert "line 2 is not JSON" in lines[1]["message"] and report.dead_letter_kinds == {"invalid_row": 2}

    # Fixing the bad shards and running the same run id again completes the run.
    pq.write_table(pa.table({"id": ["fixed2"], "text": ["renamed columns, fixed"]}), in_dir / "other_schema.parquet")
    pq.write_table(pa.table({"id": ["fixed1"], "text": ["the corrupt shard, rewritten"]}), in_dir / "corrupt.parquet")
    again = raypipe.backfill(str(in_dir), str(out), service=serve_address, run_id="bad",
                             settings={"input": {"on_bad_shard": "record"}})  # fmt: skip
    assert again.status == "completed" and again.bad_shards == []
    assert {"fixed1", "fixed2"} <= set(results(out).column("id").to_pylist())
    assert again.units_skipped_committed == report.units_committed

    with pytest.raises(SchemaError, match="ids must be strings or integers"):
        pq.write_table(pa.table({"id": [1.5], "text": ["float id"]}), tmp_path / "float.parquet")
        raypipe.backfill(str(tmp_path / "float.parquet"), str(tmp_path / "out2"), service=serve_address)


def test_cli_exit_codes_and_clear_errors(tmp_path, serve_address, ray_cluster):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    bad_key = cli("backfill", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--set", "clinet.x=1", env=env)
    assert bad_key.returncode == 2 and "clinet: unknown setting" in bad_key.stderr
    bad_uri = cli("backfill", "--input", "gs://bucket/x", "--output", str(tmp_path / "o"), env=env)
    assert bad_uri.returncode == 2 and "scheme 'gs' is not supported" in bad_uri.stderr
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=50, parquet_shards=1, jsonl_shards=0, seed=61)
    ok = cli("backfill", "--input", corpus.uri, "--output", str(tmp_path / "o"), "--service", serve_address,
             "--run-id", "cli-1", env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "run cli-1 (backfill): COMPLETED" in ok.stdout
    shown = cli("report", "--output", str(tmp_path / "o"), "--run-id", "cli-1", env=env)
    assert shown.returncode == 0 and "rows          in 50" in shown.stdout


def test_two_runs_on_one_s3_output_cannot_both_write(s3):
    store = OutputStore(f"{s3.bucket('leases')}/out")
    first = Lease(store, "run-a", duration_s=60)
    first.acquire()
    try:
        with pytest.raises(OutputLockedError, match="run-a"):
            Lease(store, "run-b", duration_s=60).acquire()
    finally:
        first.release()
    second = Lease(store, "run-b", duration_s=60)
    second.acquire()
    assert second.held()
    second.release()
    assert not store.exists(store.state("lease.json"))


def test_a_bad_shard_planned_whole_from_its_size_stops_the_run_where_it_is_read(tmp_path, serve_address):
    """Beyond `input.footer_sample` shards, planning opens a sample only: a small shard without
    the text column is found when its unit is read. Under "fail" the run stops there, naming the
    shard and the column, with what was committed kept; under "record" it is listed as bad and
    every other id is there; mended, the same run id completes."""
    in_dir = tmp_path / "in"
    in_dir.mkdir()
    expected = []
    for k in range(6):
        ids_ = [f"s{k}-{i}" for i in range(20)]
        if k == 4:
            pq.write_table(pa.table({"id": ids_, "body": ["no text column"] * 20}), in_dir / f"part-{k}.parquet")
            continue
        expected += ids_
        pq.write_table(pa.table({"id": ids_, "text": [f"shard {k}, a calm paragraph {i}" for i in range(20)]}),
                       in_dir / f"part-{k}.parquet")  # fmt: skip
    out = str(tmp_path / "out")
    cfg = {"input": {"footer_sample": 2}}
    with pytest.raises(SchemaError, match=r"part-4\.parquet.*'text' is missing|'text' is missing.*part-4\.parquet"):
        raypipe.backfill(str(in_dir), out, service=serve_address, run_id="w", settings=cfg)
    record = {"input": {"footer_sample": 2, "on_bad_shard": "record"}}
    report = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="w", settings=record)
    assert report.status == "incomplete" and report.planning["whole_files"] == 4
    assert [Path(b["shard"]).name for b in report.bad_shards] == ["part-4.parquet"]
    assert "'text' is missing" in report.bad_shards[0]["error"]
    assert_nothing_lost(out, expected)
    pq.write_table(pa.table({"id": [f"s4-{i}" for i in range(20)], "text": ["mended"] * 20}), in_dir / "part-4.parquet")
    again = raypipe.backfill(str(in_dir), out, service=serve_address, run_id="w", settings=record)
    assert again.status == "completed" and again.bad_shards == []
    assert_nothing_lost(out, [*expected, *(f"s4-{i}" for i in range(20))])

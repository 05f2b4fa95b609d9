"""Bad input refused before anything happens, with a live service and on S3; and the deadline
of `raypipe serve` on a real cluster (a replica no node can hold)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "raypipe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or dict(os.environ),
        cwd=REPO,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raypipe: "), done.stderr
    return lines[0]


def test_a_missing_input_with_the_service_up_leaves_the_output_untouched(tmp_path, serve_address):
    out = tmp_path / "out"
    done = cli("backfill", "--input", "/nonexistent", "--output", str(out), "--service", serve_address)
    assert done.returncode == 2
    assert "input /nonexistent does not exist" in one_line(done)
    assert not out.exists(), "a refused run created its output (table, lease, attempt or report)"


def test_bad_input_on_s3_writes_nothing_to_the_output(s3):
    import fsspec

    bucket = s3.bucket("preflight")
    fs = fsspec.filesystem("s3")
    done = cli("backfill", "--input", f"{bucket}/missing", "--output", f"{bucket}/out", "--service", "127.0.0.1:1")
    assert done.returncode == 2 and f"input {bucket}/missing does not exist" in one_line(done)
    with fs.open(f"{bucket}/in/a.parquet", "wb") as f:
        pq.write_table(pa.table({"id": ["1"], "body": ["x"]}), f)
    done = cli("backfill", "--input", f"{bucket}/in", "--output", f"{bucket}/out", "--service", "127.0.0.1:1")
    assert done.returncode == 2 and "column 'text' is missing" in one_line(done)
    done = cli("backfill", "--input", f"{bucket}/in", "--output", "s3://no-such-bucket/out", "--service", "127.0.0.1:1")
    assert done.returncode == 2 and "bucket 'no-such-bucket' does not exist" in one_line(done)
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/out"), fs.find(f"{bucket}/out")


@pytest.mark.timeout(300)
def test_serve_stops_at_its_deadline_naming_what_the_replica_waits_for(
    ray_cluster, serve_address, grpc_port, demo_model_dir
):
    from ray import serve

    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    try:
        done = cli(
            "serve", "--model", str(demo_model_dir), "--detach", "--grpc-port", str(grpc_port),
            "--app-name", "stuck", "--num-cpus", "64", "--wait-s", "5",
            env=env,
        )  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr
        line = one_line(done)
        assert "application 'stuck' not RUNNING after 5 s" in line
        assert "deployment EmotionClassifier" in line and "0/1 replicas RUNNING" in line
        assert "each needs CPU 64" in line and "no alive node has that free" in line
        assert "127.0.0.1" in line, "names the node it looked at"
    finally:
        serve.delete("stuck")

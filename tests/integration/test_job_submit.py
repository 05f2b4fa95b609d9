"""`ray job submit` as from another machine: the README's runtime_env form, submitted from a
directory that is not the repository, so the job's code comes from the runtime_env alone.

The shared cluster's Python could import raypipe from the repository by itself (its virtualenv
holds an editable install, and its processes were started in the repository), so the job reports
where its `raypipe` came from: a copy that Ray unpacked from the runtime_env's `py_modules`, not
the repository. The runtime_env's `working_dir` (the submitting directory, without raypipe) is
where the entrypoint runs, as on a remote head it runs in a directory of Ray's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import raypipe
from raypipe.samples import write_sample_corpus

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"


@pytest.mark.timeout(420)
def test_backfill_submitted_from_another_directory_gets_raypipe_from_the_runtime_env(
    tmp_path, s3, ray_cluster, serve_address
):
    bucket = s3.bucket("job-submit")
    corpus = write_sample_corpus(f"{bucket}/in", rows=300, parquet_shards=1, jsonl_shards=1, seed=5)
    out = f"{bucket}/out"
    (tmp_path / "job.txt").write_text("a directory of the user's, not the repository\n")
    runtime_env = {"working_dir": ".", "py_modules": [str(REPO / "raypipe"), str(REPO / "protos")]}
    where = "import os, raypipe; print('in', os.getcwd()); print('raypipe from', raypipe.__file__)"
    backfill = (
        f"python -m raypipe backfill --input {bucket}/in/ --output {out} --service {serve_address}"
        " --run-id submitted-1 --set input.unit_rows=150"
    )
    submit = subprocess.run(
        [
            str(RAY), "job", "submit", "--address", ray_cluster.dashboard_url,
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "sh", "-c", f'python -c "{where}" && {backfill}',
        ],
        capture_output=True, text=True, timeout=360, cwd=tmp_path,
    )  # fmt: skip
    printed = submit.stdout + submit.stderr
    assert submit.returncode == 0, printed[-4000:]
    assert "succeeded" in submit.stdout, printed[-4000:]
    (origin,) = [line.split("raypipe from ", 1)[1] for line in printed.splitlines() if "raypipe from " in line]
    assert not Path(origin).is_relative_to(REPO), printed[-3000:]  # Ray's unpacked copy, not the checkout
    assert "runtime_resources" in origin, origin

    report = json.loads(s3.fs().cat(f"{out}/runs/submitted-1.json".removeprefix("s3://")))
    assert report["status"] == "completed" and report["rows_in"] == 300, report
    ids = raypipe.read_outcomes(out, "submitted-1").column("id").to_pylist()
    assert sorted(ids) == sorted(corpus.ids)

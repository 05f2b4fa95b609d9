"""Runs end on the service `raypipe serve` deploys with no sizing flag.

The default replica takes every CPU of the node but `serve_app.deploy.RESERVED_CPUS`. Every run
but the first on an output builds the reuse index with Ray tasks first: asking for a whole CPU
each, they were never scheduled, and a daily after a backfill (or a second backfill onto the
same output) waited in `ray.get` forever. Each run here is bounded, so a hang fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raypipe
from raypipe.samples import write_sample_corpus
from raypipe.store import OutputStore
from tests.integration.conftest import SESSION_APP, default_options
from tests.integration.helpers import dead_letters, ids, results

REPO = Path(__file__).resolve().parents[2]

#: Longest one small run may take here (a few hundred rows; a run takes seconds to tens of
#: seconds on the shared 2 cores): past it, the run is taken to wait on something that never comes.
RUN_BOUND_S = 150


def _run(*args: str, env: dict[str, str]) -> dict:
    """One `raypipe` command, bounded; its run report."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "raypipe", *args],
            capture_output=True,
            text=True,
            timeout=RUN_BOUND_S,
            env=env,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        pytest.fail(f"`raypipe {args[0]}` had not ended after {RUN_BOUND_S} s: {tail!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    print(f"raypipe {args[0]}: {time.monotonic() - started:.1f} s")
    out = args[args.index("--output") + 1]
    store = OutputStore(out)
    return store.read_json(store.report_file(args[args.index("--run-id") + 1]))


def _replica_cpus() -> list[float]:
    from ray.util.state import list_actors

    replicas = list_actors(
        filters=[("class_name", "=", f"ServeReplica:{SESSION_APP}:EmotionClassifier"), ("state", "=", "ALIVE")],
        detail=True,
    )
    return [float(a.required_resources.get("CPU", 0.0)) for a in replicas]


@pytest.mark.timeout(4 * RUN_BOUND_S + 120)
def test_backfill_daily_and_a_second_backfill_end_on_the_default_sizing(tmp_path, ray_cluster, serve_address):
    """On the session app as `raypipe serve` sizes it (no flag): a backfill, a daily after it
    over a new file, and a second backfill onto the same output each end, the last two through
    the reuse index built by Ray tasks (the second backfill calls nothing: every text is known)."""
    assert _replica_cpus() == [default_options().num_cpus], "the session app is not at the default sizing"
    corpus = write_sample_corpus(str(tmp_path / "in"), rows=200, parquet_shards=2, jsonl_shards=0,
                                 bad_fraction=0.0, row_group_size=50, seed=45)  # fmt: skip
    out = str(tmp_path / "out")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address}
    common = ["--output", out, "--service", serve_address, "--set", f"service.application={SESSION_APP}"]

    first = _run("backfill", "--input", corpus.uri, *common, "--run-id", "b1", env=env)
    assert first["status"] == "completed"

    new_ids = [f"new{i}" for i in range(50)]
    pq.write_table(
        pa.table(
            {
                "id": new_ids,
                "text": [f"a new paragraph, number {i}" for i in new_ids],
                "updated_at": pa.array([datetime.now(UTC)] * len(new_ids), pa.timestamp("us", tz="UTC")),
            }
        ),
        tmp_path / "in" / "new.parquet",
    )
    daily = _run("daily", "--input", corpus.uri, *common, "--run-id", "d1", env=env)
    assert daily["status"] == "completed"
    assert daily["planning"]["reuse_index"]["built_with_ray"]

    again = _run("backfill", "--input", corpus.uri, *common, "--run-id", "b2", env=env)
    assert again["status"] == "completed"
    assert again["planning"]["reuse_index"]["built_with_ray"]
    assert again["calls"] == 0 and again["rows_copied"] == again["rows_in"] > 0
    # The second backfill answers every input row again, all from the index, under its own run id.
    every = sorted([*corpus.ids, *new_ids])
    assert sorted(ids(results(out, "b2"))) == every and dead_letters(out, "b2") is None
    assert sorted(raypipe.latest(out).column("id").to_pylist()) == every

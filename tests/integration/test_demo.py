"""`raypipe demo` (what `make demo` runs) where a cluster and a Serve app already run on the machine.

A user who followed the README's serve step has a local cluster (found by `ray.init()`, or named by
RAY_ADDRESS) and a gRPC proxy on port 9000. The demo starts a cluster of its own beside them and
takes a free port, instead of joining theirs (which failed with Ray's traceback) or replacing
their app.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc

import raypipe


def test_the_demo_runs_on_its_own_cluster_beside_a_running_one_and_a_taken_port(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    with socket.socket() as taken:  # as another Serve app's gRPC proxy holds it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A cluster address in the environment: joining it is what failed before. Nothing listens there.
        env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
        work = tmp_path / "demo"
        args = ["demo", "--workdir", str(work), "--rows", "300", "--grpc-port", str(port)]
        done = subprocess.run(
            [sys.executable, "-m", "raypipe", *args, "--model-dir", str(demo_model_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"demo: port {port} is taken" in done.stdout
    assert "run demo (backfill): COMPLETED" in done.stdout
    assert "Traceback" not in done.stderr

    # Every id of the sample corpus is in the table: a result or a dead letter.
    outcomes = raypipe.latest(str(work / "output"))
    assert outcomes.num_rows == 300
    assert pc.count_distinct(outcomes.column("id")).as_py() == 300

"""Commit throughput of the outcomes table: concurrent unit commits on moto's S3 server.

W writer threads, each an actor's `UnitCommitter` of one attempt (same fence), commit N
units of `rows` rows each into one Delta table on S3 (moto on 127.0.0.1), as the actors of a
run do. Reports commits per second and the time of one commit. Units of one slot conflict and
retry (see `raypipe.commit.table`); the figure includes those retries.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["run_commits"]


def _rows(unit: str, n: int, labels: tuple[str, ...]) -> Any:
    import numpy as np
    import pyarrow as pa

    from raypipe.commit.schema import label_column

    rng = np.random.default_rng(abs(hash(unit)) % 2**32)
    probs = rng.dirichlet(np.ones(len(labels)), size=n).astype(np.float32)
    cols: dict[str, Any] = {
        "id": [f"{unit}-{i}" for i in range(n)],
        "outcome": ["result"] * n,
        "unit": [unit] * n,
        "run_id": ["bench"] * n,
        "status": ["ok"] * n,
        "model_version": ["bench-model"] * n,
        "top_label": [labels[i] for i in probs.argmax(axis=1)],
        "top_score": probs.max(axis=1),
        "source": ["s3://corpus/in/part-0.parquet"] * n,
        "row": list(range(n)),
    }
    for j, label in enumerate(labels):
        cols[label_column(label)] = probs[:, j]
    return pa.table(cols)


def run_commits(writers: int = 8, units_per_writer: int = 10, rows: int = 2000) -> dict[str, Any]:
    from bench.s3server import MotoServer
    from raypipe.commit.fence import UnitCommitter, take_over
    from raypipe.commit.table import OutcomeTable

    labels = ("anger", "fear", "joy", "love", "sadness", "surprise")
    server = MotoServer().start()
    port = server.port
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(
        {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    )
    try:
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1").create_bucket(
            Bucket="bench"
        )
        table = OutcomeTable("s3://bench/out")
        table.ensure(labels)
        fence = take_over(table, "bench")
        payloads = {
            f"w{w}-u{u}": _rows(f"w{w}-u{u}", rows, labels) for w in range(writers) for u in range(units_per_writer)
        }
        times: list[float] = []
        lock = threading.Lock()

        def writer(w: int) -> None:
            committer = UnitCommitter(fence)
            for u in range(units_per_writer):
                key = f"w{w}-u{u}"
                t0 = time.monotonic()
                committer.commit(key, payloads[key])
                with lock:
                    times.append(time.monotonic() - t0)

        started = time.monotonic()
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        committed = len(table.committed_units("bench"))
        times.sort()
        return {
            "writers": writers,
            "commits": len(times),
            "rows_per_commit": rows,
            "units_committed": committed,
            "wall_s": round(wall, 2),
            "commits_per_s": round(len(times) / wall, 2),
            "commit_s_p50": round(times[len(times) // 2], 3),
            "commit_s_max": round(times[-1], 3),
        }
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


if __name__ == "__main__":
    print(json.dumps(run_commits(), indent=1))

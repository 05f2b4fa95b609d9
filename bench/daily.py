"""The daily-delta line: on N input rows with a 1% delta, what a daily run reads and how long it takes.

The input lives in moto's S3 server behind a counting TCP proxy; every S3 call of the run
(planning, footers, row groups, its own output) goes through the proxy, so bytes answered by
the server are bytes the run read. Layouts: ``appended`` is an append-only table (shards in
time order, rows sorted by ``updated_at`` within them, the delta in the newest shard);
``scattered`` puts the delta's rows at random places in every shard (pruning cannot help).
The daily run is compared with a backfill of the delta rows alone, on the tiny demo model.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import corpus as corpus_mod
from bench.cluster import Cluster, heavy_lock, run_measured
from bench.tcp_proxy import TcpProxy, free_port

if TYPE_CHECKING:
    from bench.run import Bench

__all__ = ["run_daily"]

WATERMARK = datetime(2026, 6, 1, tzinfo=UTC)
_SHARDS = 20
_ROW_GROUP = 10_000
_BUCKET = "bench"


def make_table(rows: int, *, seed: int, layout: str) -> tuple[list[Any], Any, int, Any]:
    """(shard tables, the delta table, delta rows, the older rows). 1% of rows are newer than `WATERMARK`."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    delta = max(1, rows // 100)
    old = rows - delta
    texts = corpus_mod.paragraphs(rows, seed=seed)
    year = 365 * 24 * 3600
    old_ts = np.sort(rng.uniform(-year, 0, old))
    new_ts = np.sort(rng.uniform(1, 24 * 3600, delta))
    old_ids = np.array([f"r{i:08d}" for i in range(old)], dtype=object)
    # Half of the delta is new rows, half updates of existing ids whose text is unchanged
    # (a metadata-only change): those cost no call, their answers are reused by text hash.
    updated = rng.choice(old, size=delta // 2, replace=False)
    new_ids = np.concatenate([old_ids[updated], [f"r{old + i:08d}" for i in range(delta - delta // 2)]])
    texts = texts[:old] + [texts[i] for i in updated] + texts[old + len(updated) :]

    def table(ids: Any, ts: Any, txt: list[str]) -> Any:
        stamps = [WATERMARK + timedelta(seconds=float(s)) for s in ts]
        return pa.table(
            {
                "id": pa.array(list(ids), pa.string()),
                "text": pa.array(txt, pa.string()),
                "updated_at": pa.array(stamps, pa.timestamp("us", tz="UTC")),
            }
        )

    delta_table = table(new_ids, new_ts, texts[old:])
    old_table = table(old_ids, old_ts, texts[:old])
    if layout == "appended":
        bounds = [round(k * old / _SHARDS) for k in range(_SHARDS + 1)]
        shards = [table(old_ids[lo:hi], old_ts[lo:hi], texts[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        shards.append(delta_table)
    else:
        everything = pa.concat_tables([old_table, delta_table])
        order = rng.permutation(rows)
        everything = everything.take(pa.array(order))
        bounds = [round(k * rows / _SHARDS) for k in range(_SHARDS + 1)]
        shards = [everything.slice(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]
    return shards, delta_table, delta, old_table


def _seed_backfill(root: str, old: Any, files: int, demo: Path, direct: Any, *, rewritten: bool) -> None:
    """What a backfill of the older rows would have left: the first `files` input files recorded
    as read (with a stale fingerprint when the layout rewrote them since), and committed answers
    for their texts, of the demo model's version (made up: only their text hashes matter here)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from raypipe.commit.fence import UnitCommitter, take_over
    from raypipe.commit.schema import text_hashes
    from raypipe.commit.state import LEGACY_FILES_SEEN as FILES_SEEN
    from raypipe.commit.table import OutcomeTable
    from raypipe.plan.planning import fingerprint
    from raypipe.store import OutputStore

    card = json.loads((demo / "model.json").read_text())
    labels = tuple(card["labels"])
    table = OutcomeTable(f"{root}/out-daily")
    table.ensure(labels)
    committer = UnitCommitter(take_over(table, "seed-backfill"))
    chunk = 100_000
    for k in range(0, old.num_rows, chunk):
        part = old.slice(k, chunk)
        n = part.num_rows
        rows = pa.table(
            {
                "id": part.column("id"),
                "outcome": ["result"] * n,
                "unit": [f"seed-{k}"] * n,
                "run_id": ["seed-backfill"] * n,
                "status": ["ok"] * n,
                "model_version": [card["version"]] * n,
                "updated_at": part.column("updated_at"),
                "text_hash": text_hashes(part.column("text")),
                "top_label": [labels[0]] * n,
                **{f"prob_{x}": pa.array([1.0 / len(labels)] * n, pa.float32()) for x in labels},
            }
        )
        committer.commit(f"seed-{k}", rows)
    paths = sorted(direct.ls(f"{root.removeprefix('s3://')}/input/"))[:files]
    fps = ["0:before-the-rewrite" if rewritten else fingerprint(direct.info(p)) for p in paths]
    read_up_to = pc.max(old.column("updated_at")).as_py().isoformat()
    store = OutputStore(f"{root}/out-daily")
    seen = {"path": [f"s3://{p}" for p in paths], "fingerprint": fps, "max_updated_at": [read_up_to] * len(paths)}
    store.write_parquet(store.state(FILES_SEEN), pa.table(seen))


def _lookup_bytes(fs: Any, table_dir: str) -> int:
    """What the text-hash lookup reads of the outcomes table the seed wrote: the footers and the
    column chunks of `text_hash`, `truncated` and the probabilities (from the Parquet metadata)."""
    import pyarrow.parquet as pq

    wanted = ("text_hash", "truncated", "prob_")
    total = 0
    for path in fs.find(f"{table_dir}/run_id=seed-backfill/"):
        if not path.endswith(".parquet"):
            continue
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        total += meta.serialized_size + 8
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                if col.path_in_schema.startswith(wanted):
                    total += col.total_compressed_size
    return total


def run_daily(bench: Bench, demo: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq
    import s3fs

    from bench.s3server import MotoServer

    args = bench.args
    moto_port = free_port()
    server = MotoServer(moto_port)
    server.start()
    proxy = TcpProxy(moto_port).start()  # counts the bytes the runs fetch
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    direct = s3fs.S3FileSystem(
        key="testing", secret="testing", client_kwargs={"endpoint_url": f"http://127.0.0.1:{moto_port}"}
    )
    try:
        direct.mkdir(_BUCKET)
        shards, delta_table, delta_rows, old_table = make_table(
            args.daily_rows, seed=args.seed, layout=args.daily_layout
        )
        input_bytes = 0
        for k, t in enumerate(shards):
            buf = io.BytesIO()
            pq.write_table(t, buf, row_group_size=_ROW_GROUP)
            direct.pipe(f"{_BUCKET}/input/part-{k:03d}.parquet", buf.getvalue())
            input_bytes += buf.tell()
        buf = io.BytesIO()
        pq.write_table(delta_table, buf, row_group_size=_ROW_GROUP)
        direct.pipe(f"{_BUCKET}/delta-only/part-000.parquet", buf.getvalue())

        env = {**creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
        # The daily starts as if a backfill had covered the older rows: their files recorded as
        # read, their answers committed (answers made up: only their text hashes matter here).
        # Seeded straight into moto: delta-rs holds the GIL through some calls, so it cannot go
        # through the counting proxy, a thread of this process (the measured runs do: their own).
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}"})
        try:
            _seed_backfill(
                f"s3://{_BUCKET}", old_table, _SHARDS, demo, direct, rewritten=args.daily_layout != "appended"
            )
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value

        runs: dict[str, dict[str, Any]] = {}
        with heavy_lock(bench.lock), Cluster(num_cpus=args.cluster_cpus, env=env, logs=bench.logs) as cluster:
            address = cluster.serve(demo)
            for name, cmd in (
                ("delta_backfill", ["backfill", "--input", f"s3://{_BUCKET}/delta-only/", "--run-id", "delta"]),
                ("daily", ["daily", "--input", f"s3://{_BUCKET}/input/", "--run-id", "daily"]),
            ):
                out = f"s3://{_BUCKET}/out-{'daily' if name == 'daily' else 'delta'}"
                full = [sys.executable, "-m", "raypipe", *cmd, "--output", out, "--service", address]
                proxy.reset()
                wall, usage, code = run_measured(
                    full, env=cluster.env, marker=cluster.marker, timeout_s=1800, log=bench.logs / f"daily-{name}.log"
                )
                report = direct.cat(f"{_BUCKET}/{out.split('/', 3)[3]}/runs/{cmd[-1]}.json")
                rep = json.loads(report)
                runs[name] = {
                    "exit_code": code,
                    "wall_s": wall,
                    "rows": rep["rows_in"],
                    "status": rep["status"],
                    "calls": rep["calls"],
                    "rows_copied": rep.get("rows_copied", 0),
                    "commit_s": rep.get("commit_s"),
                    "bytes_read": proxy.down,
                    "bytes_sent": proxy.up,
                    "cpu_s": usage.cpu_s,
                }
        lookup_bytes = _lookup_bytes(direct, f"{_BUCKET}/out-daily/outcomes")
    finally:
        proxy.stop()
        server.stop()
    share = (runs["daily"]["bytes_read"] - lookup_bytes) / input_bytes
    ratio = runs["daily"]["wall_s"] / runs["delta_backfill"]["wall_s"]
    return {
        "input_rows": args.daily_rows,
        "input_objects": len(shards),
        "input_bytes": input_bytes,
        "layout": args.daily_layout,
        "delta_rows": delta_rows,
        "watermark": WATERMARK.isoformat(),
        "delta_backfill": runs["delta_backfill"],
        "daily": runs["daily"],
        "bytes_share": share,
        "lookup_bytes": lookup_bytes,
        "bytes_share_with_lookup": runs["daily"]["bytes_read"] / input_bytes,
        "wall_ratio": ratio,
        "calls_ratio": runs["daily"]["calls"] / max(1, runs["delta_backfill"]["calls"]),
        # Half the delta's texts are unchanged: half the calls (0.55 leaves room for batch rounding).
        "met": share <= 0.05
        and ratio <= 3.0
        and runs["daily"]["rows"] == delta_rows
        and runs["daily"]["calls"] <= 0.55 * runs["delta_backfill"]["calls"],
    }

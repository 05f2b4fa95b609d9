"""The planning line: a backfill over N small Parquet shards on moto's S3 server (default 50k).

What does a 95M-row, ~50k-shard backfill wait before its first result? The input is
N shards of a few rows each (id, text, updated_at) in one bucket of moto's server (its own
process), uploaded once per section. Each step runs in a child process, as a driver would:

1. **plan**: `list_input` and `plan_listing` as a backfill's `raypipe.plan.planning.plan_input` calls them, on the
   same listing: every footer read one shard at a time (`planning_threads=1`,
   `footer_sample=None`), every footer read with the default threads, and the defaults (a
   sample of footers read, the other small shards planned whole from their listed sizes): wall
   time, driver CPU, moto's CPU, peak RSS (`getrusage`), and the S3 requests by operation
   (botocore's `before-call` events);
2. **requests**: on a sample of shards, the requests per footer of the read planning made
   before (`fs.open(..., cache_type="none")` + `pq.ParquetFile`) and of `raypipe.plan.footers._read_footer`,
   with s3fs's listing cache warm (after `list_input`, as in a run) and cold, and the driver's
   CPU per footer (also of Arrow's C++ S3 client, which raypipe does not use, for comparison);
3. **latency**: plan on the same sample one at a time and in parallel through a proxy that
   delays each request by `--planning-latency-ms` (moto on loopback answers at once; S3 does not);
4. **first commit**: `raypipe backfill` over the whole input against the demo model on a local
   Ray cluster, until the outcomes table's log holds the first unit's commit (then the driver is
   killed): the time of each step from the driver's log, and the driver's peak RSS.

Moto answers every request in Python (~3 ms of CPU each, one process): on these 2 cores it
competes with the driver and bounds the request rate, which real S3 does not; its CPU is
reported beside the driver's so the two can be told apart.
"""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cluster import Cluster, ProcessSampler, heavy_lock
from bench.lines import RESULT_PREFIX, parse_result
from bench.tcp_proxy import TcpProxy

if TYPE_CHECKING:
    from bench.run import Bench

__all__ = ["GOAL_PLAN_S", "GOAL_RSS_BYTES", "run_planning"]

#: The goals for 50k shards: planned within 2 minutes, in at most 1 GiB of driver memory.
GOAL_PLAN_S = 120.0
GOAL_RSS_BYTES = 2**30

_BUCKET = "bench"
#: The run's output lives in a bucket of its own: moto lists a prefix by going through every key
#: of its bucket (~0.5 s of CPU with 50k shards), so polling the log beside the input would slow
#: the very planning it measures.
_OUT_BUCKET = "bench-out"
_PREFIX = "planning/in"
_ROWS_PER_SHARD = 8
_SAMPLE = 1000
_CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _shard_bytes(k: int, texts: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = _ROWS_PER_SHARD
    start = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=k)
    table = pa.table(
        {
            "id": pa.array([f"p{k:06d}-{i}" for i in range(n)], pa.string()),
            "text": pa.array([texts[(k * n + i) % len(texts)] for i in range(n)], pa.string()),
            "updated_at": pa.array([start + timedelta(seconds=i) for i in range(n)], pa.timestamp("us", tz="UTC")),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _upload(fs: Any, shards: int, seed: int) -> dict[str, Any]:
    """N shards under s3://bench/planning/in/, 16 PUTs at a time (moto answers one at a time anyway)."""
    from bench import corpus as corpus_mod

    texts = corpus_mod.paragraphs(4000, seed=seed)
    started = time.perf_counter()
    total = 0

    def put(k: int) -> int:
        data = _shard_bytes(k, texts)
        fs.pipe_file(f"{_BUCKET}/{_PREFIX}/part-{k:06d}.parquet", data)
        return len(data)

    with ThreadPoolExecutor(16) as pool:
        total = sum(pool.map(put, range(shards)))
    return {"upload_s": round(time.perf_counter() - started, 1), "input_bytes": total}


# -- the child: what a driver does, measured from inside -----------------------------------------


def _count_requests(fs: Any) -> Counter[str]:
    """S3 calls of the (cached) s3fs instance `url_to_fs` hands raypipe, by operation."""
    from fsspec.asyn import sync

    counts: Counter[str] = Counter()
    sync(fs.loop, fs.set_session)

    def on_call(model: Any, **_: Any) -> None:
        counts[model.name] += 1

    fs.s3.meta.events.register("before-call.s3", on_call)
    return counts


def _usage() -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024


def child_plan(payload: dict[str, Any]) -> dict[str, Any]:
    """`list_input` + `plan_listing` as a backfill's planning calls them (`every_footer`: footer_sample None)."""
    import fsspec

    from raypipe.config import InputConfig
    from raypipe.plan.planning import PlanObservations, list_input, plan_listing
    from raypipe.plan.units import ColumnNames

    overrides: dict[str, Any] = {"planning_threads": payload["threads"]} if payload.get("threads") else {}
    if payload.get("every_footer"):
        overrides["footer_sample"] = None
    cfg = InputConfig(uri=payload["uri"], **overrides)
    counts = _count_requests(fsspec.filesystem("s3"))
    cpu0, _ = _usage()
    t0 = time.perf_counter()
    listing = list_input(cfg.uri, format=cfg.format)
    if payload.get("sample"):
        listing.shards = listing.shards[: payload["sample"]]
    t1 = time.perf_counter()
    listed = dict(counts)
    seen = PlanObservations(limit=datetime.now(UTC) + timedelta(seconds=cfg.max_future_skew_s))
    units, bad = plan_listing(
        listing.shards,
        sizes=listing.sizes,
        footer_sample=cfg.footer_sample,
        unit_rows=cfg.unit_rows,
        columns=ColumnNames(cfg.id_column, cfg.text_column, cfg.updated_at_column),
        on_bad_shard="fail",
        observations=seen,
        fingerprints=listing.fingerprints,
        threads=cfg.planning_threads,
    )
    t2 = time.perf_counter()
    cpu, rss = _usage()
    planned = Counter(counts)
    planned.subtract(listed)
    return {
        "threads": cfg.planning_threads,
        "footer_sample": cfg.footer_sample,
        "footers_read": seen.footers_read,
        "whole_files": seen.whole_files,
        "shards": len(listing.shards),
        "units": len(units),
        "bad": len(bad),
        "list_s": round(t1 - t0, 2),
        "plan_s": round(t2 - t1, 2),
        "total_s": round(t2 - t0, 2),
        "cpu_s": round(cpu - cpu0, 1),
        "peak_rss_bytes": rss,
        "list_requests": listed,
        "plan_requests": {k: v for k, v in planned.items() if v},
        "row_groups": seen.row_groups_total,
    }


def _footer_before(fs: Any, path: str) -> Any:
    """How planning read a footer before `raypipe.plan.footers._read_footer` (`raypipe.run.read._open_parquet`)."""
    import pyarrow.parquet as pq

    with fs.open(path, "rb", cache_type="none") as f:
        return pq.ParquetFile(f).metadata


def child_requests(payload: dict[str, Any]) -> dict[str, Any]:
    """Requests per footer, before and now, with s3fs's listing cache warm and cold."""
    import fsspec

    from raypipe.plan.footers import _read_footer
    from raypipe.plan.planning import list_input

    fs = fsspec.filesystem("s3")
    counts = _count_requests(fs)
    paths = [uri.removeprefix("s3://") for uri, _ in list_input(payload["uri"]).shards[: payload["sample"]]]
    out: dict[str, Any] = {"sample": len(paths)}
    for name, read in (("before", _footer_before), ("now", _read_footer), ("arrow", _arrow_reader(fs))):
        for cache in ("warm", "cold") if name != "arrow" else ("warm",):
            if cache == "warm":
                fs.find(f"{_BUCKET}/{_PREFIX}/", detail=True)  # what list_input leaves in a driver
            else:
                fs.invalidate_cache()
            counts.clear()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for path in paths:
                read(fs, path)
            wall = time.perf_counter() - t0
            out[f"{name}_{cache}"] = {
                "per_shard": {k: round(v / len(paths), 3) for k, v in sorted(counts.items())},
                "ms_per_shard": round(1000 * wall / len(paths), 2),
                "cpu_ms_per_shard": round(1000 * (time.process_time() - cpu0) / len(paths), 2),
            }
    out["arrow_warm"]["per_shard"] = {"GET (not seen by botocore)": 1}
    return out


def _arrow_reader(fs: Any) -> Any:
    """A footer read by Arrow's C++ S3 client with the size from the listing (no HEAD; the
    sizes held in a dict: s3fs's `info` from its listing cache scans the folder's entries)."""
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    scheme, host = os.environ["AWS_ENDPOINT_URL"].split("://", 1)
    arrow_fs = pafs.S3FileSystem(
        endpoint_override=host,
        scheme=scheme,
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ["AWS_DEFAULT_REGION"],
    )
    fmt = ds.ParquetFileFormat()
    sizes = {path: info["size"] for path, info in fs.find(f"{_BUCKET}/{_PREFIX}/", detail=True).items()}

    def read(_: Any, path: str) -> Any:
        fragment = fmt.make_fragment(path, arrow_fs, file_size=sizes[path])
        fragment.ensure_complete_metadata()
        return fragment.metadata

    return read


# -- the parent ------------------------------------------------------------------------------


def _child(kind: str, payload: dict[str, Any], *, env: dict[str, str], log: Path, moto_pid: int) -> dict[str, Any]:
    import psutil

    moto = psutil.Process(moto_pid)
    moto_cpu0 = sum(moto.cpu_times()[:2])
    t0 = time.perf_counter()
    with log.open("w") as out:
        cmd = [sys.executable, "-m", "bench.planning", kind, json.dumps(payload)]
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600).returncode
    result = parse_result(log.read_text(errors="replace"))
    if code != 0 or result is None:
        raise RuntimeError(f"bench.planning {kind} failed (exit {code}); see {log}")
    result["process_wall_s"] = round(time.perf_counter() - t0, 2)
    result["moto_cpu_s"] = round(sum(moto.cpu_times()[:2]) - moto_cpu0, 1)
    return result


def _unit_commits(fs: Any, log_dir: str, read: set[str]) -> bool:
    """Whether a commit not read yet in the Delta log adds files (a unit's rows; the table's
    creation and the takeover add none)."""
    try:
        names = sorted(p for p in fs.ls(log_dir, refresh=True) if p.endswith(".json"))
    except FileNotFoundError:
        return False
    found = False
    for name in names:
        if name in read:
            continue
        read.add(name)
        found = found or any('"add"' in line[:20] for line in fs.cat_file(name).decode().splitlines())
    return found


#: Lines of the driver's log that mark its steps (INFO, raypipe.run.modes).
_MILESTONES = {"planned": "planned ", "pipeline_started": " units to do, "}


def first_commit(
    bench: Bench, demo: Path, *, fs: Any, env: dict[str, str], uri: str, timeout_s: float
) -> dict[str, Any]:
    """`raypipe backfill` over the input until its first unit commit; the driver is then killed."""
    out_uri = f"s3://{_OUT_BUCKET}/planning"
    log = bench.logs / "planning-backfill.log"
    with Cluster(num_cpus=bench.args.cluster_cpus, env=env, logs=bench.logs) as cluster:
        address = cluster.serve(demo)
        cmd = [sys.executable, "-m", "raypipe", "backfill", "--input", uri, "--output", out_uri]
        cmd += ["--service", address, "--run-id", "planning"]
        sampler = ProcessSampler(marker=None)
        steps: dict[str, float] = {}
        read: set[str] = set()
        with log.open("w") as out, sampler:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)
            sampler.add_root(proc.pid)
            try:
                while "first_commit" not in steps and proc.poll() is None and time.perf_counter() - t0 < timeout_s:
                    time.sleep(0.5)
                    text = log.read_text(errors="replace")
                    for step, marker in _MILESTONES.items():
                        if step not in steps and marker in text:
                            steps[step] = round(time.perf_counter() - t0, 1)
                    if _unit_commits(fs, f"{_OUT_BUCKET}/planning/outcomes/_delta_log/", read):
                        steps["first_commit"] = round(time.perf_counter() - t0, 1)
            finally:
                exit_code = proc.poll()
                proc.kill()
                proc.wait()
        usage = sampler.usage()
    result: dict[str, Any] = {
        "steps_s": steps,
        "driver_peak_rss_bytes": usage.peak_rss_started_bytes,
        "driver_cpu_s": round(usage.cpu_s, 1),
        "log": str(log),
    }
    if "first_commit" not in steps:
        result["error"] = (
            f"no unit committed in {timeout_s:.0f} s"
            if exit_code is None
            else f"the driver exited ({exit_code}) before a unit committed"
        ) + f"; see {log}"
    return result


def _with_latency(bench: Bench, server: Any, env: dict[str, str], sample: dict[str, Any], pid: int) -> dict[str, Any]:
    """Planning the sample one at a time and in parallel with a delay added to every request."""
    delay_ms = bench.args.planning_latency_ms
    proxy = TcpProxy(int(server.endpoint.rsplit(":", 1)[1]), delay_s=delay_ms / 1000).start()
    slow = {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    out: dict[str, Any] = {"latency_ms": delay_ms}
    try:
        for name, threads in (("sequential", 1), ("parallel", None)):
            log = bench.logs / f"planning-latency-{name}.log"
            payload = {**sample, "threads": threads, "every_footer": True}
            out[name] = _child("plan", payload, env=slow, log=log, moto_pid=pid)
    finally:
        proxy.stop()
    par_s, seq_s = out["parallel"]["plan_s"], out["sequential"]["plan_s"]
    out["speedup"] = round(seq_s / par_s, 2) if par_s else None
    return out


def run_planning(bench: Bench, demo: Path) -> dict[str, Any]:
    """The whole section; holds ``--lock`` throughout (every step loads both cores)."""
    import s3fs

    from bench.s3server import MotoServer

    args = bench.args
    shards = args.planning_shards
    uri = f"s3://{_BUCKET}/{_PREFIX}/"
    with heavy_lock(bench.lock), MotoServer() as server:
        assert server._proc is not None
        s3env = {**_CREDS, "AWS_ENDPOINT_URL": server.endpoint}
        env = {**bench.env, **s3env}
        fs = s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": server.endpoint})
        fs.mkdir(_BUCKET)
        fs.mkdir(_OUT_BUCKET)
        result: dict[str, Any] = {"shards": shards, "rows_per_shard": _ROWS_PER_SHARD}
        result.update(_upload(fs, shards, args.seed))
        print(f"bench: planning: {shards} shards uploaded in {result['upload_s']} s", flush=True)
        pid = server._proc.pid
        runs = {}
        for name, threads, every in (("sequential", 1, True), ("parallel", None, True), ("sampled", None, False)):
            payload = {"uri": uri, "threads": threads, "every_footer": every}
            runs[name] = _child("plan", payload, env=env, log=bench.logs / f"planning-{name}.log", moto_pid=pid)
            print(f"bench: planning: {name} {runs[name]['total_s']} s", flush=True)
        result["runs"] = runs
        sample = {"uri": uri, "sample": min(_SAMPLE, shards)}
        result["requests"] = _child("requests", sample, env=env, log=bench.logs / "planning-requests.log", moto_pid=pid)
        if args.planning_latency_ms:
            result["latency"] = _with_latency(bench, server, env, sample, pid)
        if args.planning_first_commit:
            result["first_commit"] = first_commit(bench, demo, fs=fs, env=s3env, uri=uri, timeout_s=1800)
    seq, par, default = runs["sequential"], runs["parallel"], runs["sampled"]
    result["speedup"] = round(seq["total_s"] / par["total_s"], 2) if par["total_s"] else None
    result["speedup_sampled"] = round(seq["total_s"] / default["total_s"], 2) if default["total_s"] else None
    rss = max(default["peak_rss_bytes"], (result.get("first_commit") or {}).get("driver_peak_rss_bytes") or 0)
    result["met"] = default["total_s"] <= GOAL_PLAN_S * shards / 50_000 and rss <= GOAL_RSS_BYTES
    return result


def main(argv: list[str]) -> int:
    kind, payload = argv[0], json.loads(argv[1])
    result = {"plan": child_plan, "requests": child_requests}[kind](payload)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    sys.exit(main(sys.argv[1:]))

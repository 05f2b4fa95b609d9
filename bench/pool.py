"""The CPU pool section: the model service on 1 vs 2 pool nodes, autoscaling, a node lost.

Clusters as the manifests run them, on this host (`bench.cluster.LocalNodes`): a service
cluster (a head with no CPUs, pool nodes advertising `raypipe_pool`) and a jobs cluster (a head
with no CPUs, one worker node) whose `raypipe backfill` calls the service's gRPC proxy.

Lines, one run of the same corpus each:
- `nodes-1`, `nodes-2`: one replica per pool node (fixed), each node `--node-cpus` CPUs;
  rows/s and their ratio (same run), and the replicas' CPU-seconds per paragraph (every
  process named ServeReplica, sampled) against line (a)'s in-process CPU-seconds per paragraph
  at the same threads per pass: the efficiency a large pool sees once the jobs' actors and
  driver live on other nodes.
- `auto`: `--num-replicas auto` on 2 nodes: replicas over time (1 → 2 → 1).
- `node-lost`: 2 fixed replicas, one pool node SIGKILLed once a third of the units are
  committed: the run completes; longest pause between commits after the kill (recovery) and
  wall time against `nodes-2`.

On one 2-core host the pool nodes, the jobs' actors and the driver share the same cores: the
1 vs 2 node ratio is bounded by them, and the report says what the cores were.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.cluster import LocalNodes, ProcessSampler, ReplicaWatch, bench_env

__all__ = ["run_pool"]

ROOT = Path("/tmp/rppool")  # short: Ray's socket paths must fit in 107 bytes
SVC_PORT, SVC_DASH, JOB_PORT, JOB_DASH, GRPC, HTTP = 6431, 8231, 6432, 8232, 9231, 8233


def _commit_times(output: Path) -> list[float]:
    from deltalake import DeltaTable

    history = DeltaTable(str(output / "outcomes")).history()
    return sorted(h["timestamp"] / 1000 for h in history if h.get("operation") in ("WRITE", "MERGE"))


def _line(
    bench: Any,
    model_dir: Path,
    shards: Path,
    name: str,
    *,
    nodes: int,
    node_cpus: float,
    auto: bool = False,
    kill_at: float | None = None,
) -> dict[str, Any]:
    env = bench_env({"RAY_ADDRESS": ""})
    env.pop("RAY_ADDRESS")
    shutil.rmtree(ROOT, ignore_errors=True)
    output = bench.work / f"out-pool-{name}"
    shutil.rmtree(output, ignore_errors=True)
    with (
        LocalNodes(ROOT / "svc", port=SVC_PORT, dashboard_port=SVC_DASH, env=env) as svc,
        LocalNodes(ROOT / "job", port=JOB_PORT, dashboard_port=JOB_DASH, env=env) as jobs,
    ):
        for k in range(nodes):
            svc.add_node(f"pool-{k}", num_cpus=node_cpus, resources={"raypipe_pool": 1000})
        jobs.add_node("job-0", num_cpus=2)
        svc_env = {**svc.env, "RAY_ADDRESS": svc.address}
        serve = [sys.executable, "-m", "raypipe", "serve", "--model", str(model_dir), "--detach"]
        serve += ["--grpc-port", str(GRPC), "--http-port", str(HTTP), "--num-cpus", str(node_cpus)]
        if auto:
            serve += ["--num-replicas", "auto", "--upscale-delay-s", "5", "--downscale-delay-s", "20"]
        else:
            serve += ["--num-replicas", str(nodes)]
        with (bench.logs / f"pool-{name}-serve.log").open("w") as out:
            subprocess.run(serve, env=svc_env, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        cmd = [sys.executable, "-m", "raypipe", "backfill", "--input", str(shards), "--output", str(output)]
        cmd += ["--service", f"127.0.0.1:{GRPC}", "--run-id", f"pool-{name}"]
        job_env = {**jobs.env, "RAY_ADDRESS": jobs.address}
        killed: dict[str, float] = {}
        replicas = ReplicaWatch("raypipe", env=svc_env, log=bench.logs / f"pool-{name}-replicas.jsonl")
        sampler = ProcessSampler(marker="ServeReplica")
        with replicas, sampler, (bench.logs / f"pool-{name}.log").open("w") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(cmd, env=job_env, stdout=log, stderr=subprocess.STDOUT)
            if kill_at is not None:
                threading.Thread(target=_kill_later, args=(svc, output, kill_at, killed), daemon=True).start()
            code = proc.wait(timeout=3600)
            wall = time.perf_counter() - started
            if auto:  # watch the replicas come back down after the load
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and [len(s.get("replicas", [])) for s in replicas.read()][-1:] != [1]:
                    time.sleep(1)
        tokens = None if auto or kill_at is not None else _replica_tokens(svc_env)
        if code != 0:
            raise RuntimeError(f"pool line {name} failed (exit {code}); see {bench.logs}/pool-{name}.log")
    report = json.loads((output / "runs" / f"pool-{name}.json").read_text())
    import pyarrow.dataset as pads

    from raypipe.commit.outcomes import read_outcomes

    wanted = pads.dataset(str(shards), format="parquet").to_table(columns=["id"]).column("id").to_pylist()
    got = read_outcomes(str(output), f"pool-{name}", columns=["id"]).column("id").to_pylist()
    usage = sampler.usage()
    line: dict[str, Any] = {
        "nodes": nodes,
        "node_cpus": node_cpus,
        "paragraphs": report["rows_in"],
        "ok": report["rows_ok"],
        "dead_letters": report["rows_dead_letters"],
        "wall_s": round(wall, 2),
        "report_rows_per_s": report["throughput_rows_per_s"],
        "retries": report["retries"],
        "status_counts": report["status_counts"],
        "every_id_once": len(got) == len(set(got)) and sorted(got) == sorted(wanted),
        "replica_cpu_s": round(usage.cpu_s, 2),
        "replica_cpu_s_per_para": usage.cpu_s / max(report["rows_ok"], 1),
        "replicas_over_time": [(s["t"], len(s["replicas"])) for s in replicas.samples if "replicas" in s],
    }
    if tokens and tokens["padded_tokens"]:
        line.update(tokens)
        line["replica_cpu_ms_per_kpadded"] = 1e6 * usage.cpu_s / tokens["padded_tokens"]
    if killed:
        times = _commit_times(output)
        after = [t for t in times if t > killed["at"]]
        gaps = [b - a for a, b in itertools.pairwise([killed["at"], *after])]
        before = [b - a for a, b in itertools.pairwise(t for t in times if t <= killed["at"])]
        line.update(
            killed_after_units=killed["units"],
            longest_pause_after_kill_s=round(max(gaps), 2) if gaps else None,
            median_gap_before_kill_s=round(sorted(before)[len(before) // 2], 2) if before else None,
            run_end_after_kill_s=round(after[-1] - killed["at"], 2) if after else None,
        )
    return line


_STATS = """
import json, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
handle = serve.get_app_handle("raypipe")
print(json.dumps([handle.stats.remote().result() for _ in range(24)]))
"""


def _replica_tokens(env: dict[str, str]) -> dict[str, int] | None:
    """The replicas' forward-pass counts (`EmotionClassifier.stats`: real and padded tokens,
    passes), summed over the replicas alive at the end. A call reaches one replica, chosen by
    Serve: 24 calls see every replica of a small pool, and each replica's counts, fixed once
    the run is over, are told apart by their values (two replicas with equal counts would
    count once: not seen with thousands of tokens each)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _STATS], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        answers = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError):
        return None
    unique = {json.dumps(a["model"], sort_keys=True): a["model"] for a in answers}
    return {
        "replicas_seen": len(unique),
        "real_tokens": sum(int(m.get("tokens", 0)) for m in unique.values()),
        "padded_tokens": sum(int(m.get("padded_tokens", 0)) for m in unique.values()),
        "passes": sum(int(m.get("batches", 0)) for m in unique.values()),
    }


def _kill_later(svc: LocalNodes, output: Path, share: float, killed: dict[str, float]) -> None:
    plan = output / "_raypipe"
    while True:
        time.sleep(0.5)
        try:
            units = len(json.loads(next(plan.glob("runs/*/plan/*.json")).read_text())["units"])
            done = sum(1 for p in (output / "outcomes" / "_delta_log").glob("*.json")) - 1
        except (StopIteration, FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
        if done >= max(1, int(share * units)):
            killed.update(at=time.time(), units=done)
            svc.kill_node("pool-1")
            return


def run_pool(bench: Any, model_dir: Path, corpus: Path, *, rows: int, node_cpus: float = 1.0) -> dict[str, Any]:
    """The pool section's lines (see the module's docstring)."""
    # Units of ~125 rows (a few seconds each): the pause after a node is lost reads against them.
    shards = bench.write_shards(corpus, rows, bench.work / "input-pool", shards=max(8, rows // 125))
    inproc = bench.child(
        "inproc",
        {"model_dir": str(model_dir), "corpus": str(corpus), "n": min(rows, 1500), "threads": int(node_cpus)},
        name="pool-inproc",
    )
    lines = {
        "nodes-1": _line(bench, model_dir, shards, "nodes-1", nodes=1, node_cpus=node_cpus),
        "nodes-2": _line(bench, model_dir, shards, "nodes-2", nodes=2, node_cpus=node_cpus),
        "auto": _line(bench, model_dir, shards, "auto", nodes=2, node_cpus=node_cpus, auto=True),
        "node-lost": _line(bench, model_dir, shards, "node-lost", nodes=2, node_cpus=node_cpus, kill_at=1 / 3),
    }
    inproc_cpu = inproc.get("cpu_s_self", inproc["wall_s"] * node_cpus) / max(inproc["ok"], 1)
    # The same per computed token: the replicas pad the rows of each call's micro-batches, the
    # in-process line sorts all its rows by length at once, so it pads less.
    inproc_kpadded = 1e6 * inproc.get("cpu_s_self", 0.0) / max(inproc.get("padded_tokens", 0), 1)
    for line in lines.values():
        line["replica_cpu_vs_inprocess"] = round(line["replica_cpu_s_per_para"] / inproc_cpu, 3)
        if line.get("replica_cpu_ms_per_kpadded"):
            line["replica_cpu_per_token_vs_inprocess"] = round(line["replica_cpu_ms_per_kpadded"] / inproc_kpadded, 3)
    r1, r2 = lines["nodes-1"]["report_rows_per_s"], lines["nodes-2"]["report_rows_per_s"]
    return {
        "rows": rows,
        "node_cpus": node_cpus,
        "host_cpus": len(os.sched_getaffinity(0)),
        "inprocess_cpu_s_per_para": inproc_cpu,
        "inprocess_para_per_s": inproc["ok"] / inproc["wall_s"],
        "inprocess_cpu_ms_per_kpadded": inproc_kpadded,
        "inprocess_padded_per_real": inproc.get("padded_tokens", 0) / max(inproc.get("real_tokens", 0), 1),
        "ratio_2_vs_1_nodes": round(r2 / r1, 3) if r1 else None,
        "node_lost_wall_vs_nodes_2": round(lines["node-lost"]["wall_s"] / lines["nodes-2"]["wall_s"], 3),
        "lines": lines,
    }

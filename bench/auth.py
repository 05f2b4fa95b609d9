"""What Ray's token authentication costs the end-to-end line: the same backfill on a cluster with
``RAY_AUTH_MODE=token`` (as `raypipe serve --detach` starts one, and as every bench cluster now
runs) and on one with ``RAY_AUTH_MODE=disabled``, in one run.

    python -m bench.auth [--model minilm-l6] [--rows 6000] [--order disabled,token,token,disabled]
                         [--lock FILE]

Each entry of ``--order`` is a fresh lean cluster (`bench.cluster.Cluster`), ``raypipe serve``
with defaults and ``raypipe backfill`` of the same shards with defaults, timed and sampled as
the speed section's end-to-end line is. The default order is ABBA, so a drift of the machine's
load over the run falls on both modes alike. Token authentication checks Ray's own RPCs (task
and actor submission, object transfers, the GCS); the model calls go to Serve's gRPC proxy
either way. Writes ``bench/results/auth-<UTC time>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cluster import Cluster, heavy_lock, measured_backfill
from bench.flops import cpu_info
from bench.models import SHAPES, ensure_model

__all__ = ["main", "render"]

MODES = ("token", "disabled")


def _run(args: argparse.Namespace, mode: str, i: int, model_dir: Path, shards: Path, work: Path) -> dict[str, Any]:
    logs = work / "logs"
    name = f"auth-{i}-{mode}"
    with Cluster(num_cpus=args.cluster_cpus, env={"RAY_AUTH_MODE": mode}, logs=logs) as cluster:
        started = time.perf_counter()
        address = cluster.serve(model_dir)
        serve_s = time.perf_counter() - started
        wall, usage, report = measured_backfill(
            cluster, address, shards, work / f"out-{name}", name, logs / f"{name}.log"
        )
    return {
        "mode": mode,
        "position": i,
        "rows": report["rows_in"],
        "ok": report["rows_ok"],
        "wall_s": round(wall, 3),
        "para_per_s": round(report["rows_ok"] / wall, 2),
        "run_para_per_s": round(report["throughput_rows_per_s"], 2),
        "cpu_s": round(usage.cpu_s, 2),
        "cpu_ms_per_para": round(1000 * usage.cpu_s / max(report["rows_ok"], 1), 3),
        "serve_s": round(serve_s, 2),
        "calls": report["calls"],
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode, the median of its runs; and token over disabled for throughput and CPU."""
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in ("para_per_s", "run_para_per_s", "cpu_ms_per_para")}
        for m, rs in by_mode.items()
        if rs
    }
    out: dict[str, Any] = {"median": med}
    if len(med) == 2:
        out["token_over_disabled"] = {
            k: round(med["token"][k] / med["disabled"][k], 4)
            for k in ("para_per_s", "run_para_per_s", "cpu_ms_per_para")
        }
    return out


def render(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [
        f"# Ray token authentication: cost to the end-to-end line ({results['started_at']})",
        "",
        f"`{env['command']}` at {env['git_commit']}; {env['cpu'].get('model', '?')}, "
        f"{env['cluster_cpus']} cluster CPUs; model {results['model']}, {results['rows']:,} paragraphs per run.",
        "",
        "| # | RAY_AUTH_MODE | para/s (command) | para/s (run report) | CPU ms / paragraph | serve s | load 1m |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['position']} | {r['mode']} | {r['para_per_s']:.1f} | {r['run_para_per_s']:.1f} | "
            f"{r['cpu_ms_per_para']:.2f} | {r['serve_s']:.1f} | {r['load_avg_1m_after']:.2f} |"
        )
    ratio = results["summary"].get("token_over_disabled")
    if ratio:
        lines += [
            "",
            f"Token over disabled (medians): throughput {ratio['para_per_s']:.3f} (command), "
            f"{ratio['run_para_per_s']:.3f} (run report); CPU per paragraph {ratio['cpu_ms_per_para']:.3f}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm-l6", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=6000)
    p.add_argument("--order", default="disabled,token,token,disabled")
    p.add_argument("--cluster-cpus", type=int, default=2)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--workdir", default=".cache/bench-work")
    p.add_argument("--models-cache", default=".cache/bench-models")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--lock", help="flock file held while the clusters run")
    args = p.parse_args(argv)
    order = args.order.split(",")
    if not order or set(order) - set(MODES):
        p.error(f"--order: a comma-separated list of {', '.join(MODES)}")

    from bench.run import Bench, _git
    from serve_app.demo_model import build_demo_model, default_demo_model_dir

    bench = Bench(argparse.Namespace(workdir=args.workdir, lock=args.lock, seed=args.seed))
    bench.work.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC)
    commit, dirty = _git()
    results: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "env": {
            "git_commit": commit,
            "git_dirty": dirty,
            "command": "python -m bench.auth " + shlex.join(argv),
            "cpu": cpu_info(),
            "cluster_cpus": args.cluster_cpus,
        },
        "model": args.model,
        "rows": args.rows,
        "runs": [],
    }
    with heavy_lock(args.lock):
        demo = build_demo_model(default_demo_model_dir())
        model_dir = ensure_model(SHAPES[args.model], demo_model_dir=demo, cache=Path(args.models_cache), env=bench.env)
    corpus = bench.write_corpus(args.rows)
    shards = bench.write_shards(corpus, args.rows, bench.work / f"input-auth-{args.rows}")
    with heavy_lock(args.lock):
        for i, mode in enumerate(order):
            print(f"bench.auth: run {i} RAY_AUTH_MODE={mode}", flush=True)
            results["runs"].append(_run(args, mode, i, model_dir, shards, bench.work))
    results["summary"] = summarize(results["runs"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"auth-{started.strftime('%Y%m%dT%H%M%SZ')}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    stem.with_suffix(".md").write_text(render(results))
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

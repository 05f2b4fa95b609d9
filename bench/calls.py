"""Call size: end to end at default settings, with the client's micro-batch size varied.

    python -m bench.calls --model DIR --input SHARDS [--sizes 32,64,128] [--repeat 1]

One ``ray start --head`` cluster and one ``raypipe serve --model DIR`` app with no flags (the
README path), then ``raypipe backfill`` over the same shards once per size (sizes interleaved
when repeated, so drift of the machine falls on every size alike), with only
``client.micro_batch_size`` set. Each line: paragraphs per second over the command's wall, and
the run report's cost (`raypipe.run.cost`: CPU-s per 1,000 paragraphs of every process, the
model's share, cores busy). Writes bench/results/calls-<UTC>.json and .md with the CPU model
and flags and the model's shape.

The question it answers: how much of the CPU outside the model is paid per call (proxy,
actor, replica loop), and so what a bigger call buys at the same answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cluster import Cluster, measured_backfill
from bench.flops import cpu_info

RESULTS = Path(__file__).parent / "results"


def backfill(cluster: Cluster, address: str, shards: Path, work: Path, name: str, size: int) -> dict[str, Any]:
    flags = ["--set", f"client.micro_batch_size={size}"]
    output, log = work / f"out-{name}", work / f"{name}.log"
    wall, _, report = measured_backfill(cluster, address, shards, output, name, log, flags)
    if report["status"] != "completed":
        raise RuntimeError(f"{name}: status {report['status']}; see {work / name}.log")
    cost = report.get("cost") or {}
    return {
        "micro_batch_size": size,
        "paragraphs": report["rows_in"],
        "wall_s": round(wall, 2),
        "para_per_s": round(report["rows_in"] / wall, 1),
        "calls": report["calls"],
        "retries": report["retries"],
        "answered_by": report.get("answered_by"),
        "cpu_s_per_1k": cost.get("cpu_s_per_1k"),
        "model_share": cost.get("model_share"),
        "cores_busy": cost.get("cores_busy"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--input", type=Path, required=True, help="a folder of Parquet shards")
    parser.add_argument("--sizes", default="32,64,128")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path(".cache/bench-work/calls"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    card = json.loads((args.model / "model.json").read_text())
    lines: list[dict[str, Any]] = []
    with Cluster(num_cpus=2, logs=args.work / "logs") as cluster:
        address = cluster.serve(args.model)
        for r in range(args.repeat):
            for size in sizes:
                line = backfill(cluster, address, args.input, args.work, f"calls-{size}-{r}", size)
                print(json.dumps(line), flush=True)
                lines.append(line)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    cpu = cpu_info()
    result = {
        "command": "python -m bench.calls " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu,
        "model": {k: card.get(k) for k in ("version", "parameters", "max_sequence_length")},
        "lines": lines,
        "at": stamp,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"calls-{stamp}.json").write_text(json.dumps(result, indent=2))
    rows = [
        f"| {x['micro_batch_size']} | {x['para_per_s']} | {x['calls']} | {x['retries']} | {x['cpu_s_per_1k']} "
        f"| {x['model_share']} | {x['cores_busy']} |"
        for x in lines
    ]
    md = [
        f"# Call size, end to end at default settings ({stamp})",
        "",
        f"- CPU: {cpu}",
        f"- model: {result['model']}; command `{result['command']}`",
        f"- shards: {args.input} ({lines[0]['paragraphs'] if lines else 0} paragraphs)",
        "- one cluster and one app (`raypipe serve` with no flags) for every line",
        "",
        "| micro_batch_size | para/s (wall) | calls | retries | CPU-s per 1k para | model share | cores busy |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    (RESULTS / f"calls-{stamp}.md").write_text("\n".join(md))
    print(f"bench: wrote {RESULTS / f'calls-{stamp}.md'}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"bench.calls: {time.perf_counter() - t0:.0f} s")
    raise SystemExit(code)

"""The freshness line: a watcher under a steady producer, and what it costs against one daily.

On a cluster of its own (`LocalNodes`: its processes are marked by its temp dir and killed at
the end; no `ray stop`, which would stop every cluster of the host), with the real-weights
MiniLM served by `raypipe serve --detach`:

1. idle: `raypipe watch` started on an empty input; the cluster's CPU over `--idle-s` seconds
   with nothing arriving, against the same cluster idle without the watcher (the ticks' cost);
2. load: a producer writes a file every `--file-every` seconds at `--rate` paragraphs a second
   for `--minutes` minutes (each file written aside and renamed in, whole, as an S3 PUT
   lands); the watcher commits them; the cluster's CPU while it does;
3. the watcher is stopped with SIGTERM (exit 0, its report written): freshness p50/p95 over
   every unit (arrival = the file's mtime, to its unit's commit);
4. one `raypipe daily` over the same files into a fresh output: its CPU, for the ratio.

    python -m bench.freshness --rate 7 --minutes 4 --every 60s --model DIR

writes `bench/results/freshness-<UTC stamp>.json`. Run it under the shared heavy lock.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["run_freshness"]

ROOT = Path(__file__).resolve().parent.parent


def _texts(n: int, start: int) -> list[str]:
    from bench import corpus

    return corpus.paragraphs(n, seed=start)


def _write(folder: Path, name: str, start: int, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [f"p{start + i:09d}" for i in range(n)]
    tmp = folder / f".{name}.tmp"
    pq.write_table(pa.table({"id": ids, "text": _texts(n, start)}), tmp)
    os.replace(tmp, folder / f"{name}.parquet")


def _cpu(marker: str, seconds: float, roots: tuple[int, ...] = ()) -> float:
    """CPU seconds of the cluster's processes (and `roots`' trees) over `seconds`."""
    from bench.cluster import ProcessSampler

    sampler = ProcessSampler(marker=marker)
    for pid in roots:
        sampler.add_root(pid)
    with sampler:
        time.sleep(seconds)
    return sampler.usage().cpu_s


def run_freshness(
    *,
    model: Path,
    rate: float,
    minutes: float,
    every: str,
    max_wait: str,
    file_every_s: float,
    idle_s: float,
    out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The figures, filled into `out` as they are measured (a run stopped early keeps them)."""
    from bench.cluster import LocalNodes, ProcessSampler, bench_env, run_measured
    from bench.tcp_proxy import free_port

    work = Path(tempfile.mkdtemp(prefix="rpfresh-"))
    root = Path(f"/tmp/rpfresh-{os.getpid()}")
    grpc_port, http_port = free_port(), free_port()
    base_env = bench_env()
    base_env.pop("RAY_ADDRESS", None)  # bench_env's names the shared bench cluster: this one has its own
    nodes = LocalNodes(root, port=free_port(), dashboard_port=free_port(), env=base_env, head_cpus=2, multi_node=False)
    out = {} if out is None else out
    out |= {"rate_per_s": rate, "minutes": minutes, "every": every, "max_wait": max_wait,
                           "file_every_s": file_every_s, "model": str(model)}  # fmt: skip
    try:
        with nodes:
            env = {**nodes.env, "RAY_ADDRESS": nodes.address}
            marker = str(root)
            raypipe = [sys.executable, "-m", "raypipe"]
            serve = [*raypipe, "serve", "--model", str(model), "--grpc-port", str(grpc_port), "--http-port",
                     str(http_port), "--detach"]  # fmt: skip
            subprocess.run(
                serve, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            service = f"127.0.0.1:{grpc_port}"
            in_dir, output = work / "in", work / "out"
            in_dir.mkdir()
            out["idle_cluster_cpu_per_s"] = round(_cpu(marker, idle_s) / idle_s, 4)

            log = (work / "watch.log").open("w")
            cmd = [*raypipe, "watch", "--input", str(in_dir), "--output", str(output), "--service", service,
                   "--every", every, "--max-wait", max_wait, "--set", "watch.report_every_s=100000"]  # fmt: skip
            watcher = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                reports = output / "_raypipe" / "watch"
                deadline = time.monotonic() + 300
                while not (reports.exists() and any(reports.iterdir())):
                    if watcher.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the watcher did not start; see {log.name}")
                    time.sleep(1)
                time.sleep(5)  # past its start-up
                idle = _cpu(marker, idle_s, (watcher.pid,))
                out["idle_with_watcher_cpu_per_s"] = round(idle / idle_s, 4)
                out["idle_ticks_share_of_a_core"] = round(
                    out["idle_with_watcher_cpu_per_s"] - out["idle_cluster_cpu_per_s"], 4
                )
                per_file = max(1, round(rate * file_every_s))
                files, written = 0, 0
                load = ProcessSampler(marker=marker)
                load.add_root(watcher.pid)
                with load:
                    started = time.monotonic()
                    while time.monotonic() - started < minutes * 60:
                        _write(in_dir, f"f{files:05d}", written, per_file)
                        files, written = files + 1, written + per_file
                        time.sleep(max(0.0, started + files * file_every_s - time.monotonic()))
                    from raypipe.commit.outcomes import read_outcomes

                    deadline = time.monotonic() + 600
                    while time.monotonic() < deadline:
                        try:
                            if read_outcomes(str(output), columns=["id"]).num_rows >= written:
                                break
                        except Exception:  # the table is not there yet
                            pass
                        time.sleep(2)
                    load_wall = time.monotonic() - started
                out.update(files=files, paragraphs=written, load_wall_s=round(load_wall, 1))
                out["watch_cpu_s"] = round(load.usage().cpu_s, 2)
                out["watch_cpu_s_per_1000"] = round(
                    (load.usage().cpu_s - out["idle_cluster_cpu_per_s"] * load_wall) / written * 1000, 3
                )
            finally:
                watcher.send_signal(signal.SIGTERM)
                out["watch_exit"] = watcher.wait(timeout=120)
                log.close()
            report = json.loads(next((output / "_raypipe" / "watch").glob("*.json")).read_text())
            out["report"] = report
            out["freshness_p50_s"], out["freshness_p95_s"] = report["freshness_p50_s"], report["freshness_p95_s"]

            daily_out = work / "daily-out"
            cmd = [*raypipe, "daily", "--input", str(in_dir), "--output", str(daily_out), "--service", service]
            wall, usage, code = run_measured(cmd, env=env, marker=marker, timeout_s=900, log=work / "daily.log")
            if code != 0:
                raise RuntimeError(f"the daily failed (exit {code}); see {work / 'daily.log'}")
            out["daily_wall_s"] = round(wall, 1)
            out["daily_cpu_s_per_1000"] = round(
                (usage.cpu_s - out["idle_cluster_cpu_per_s"] * wall) / written * 1000, 3
            )
            out["cpu_ratio_watch_over_daily"] = round(out["watch_cpu_s_per_1000"] / out["daily_cpu_s_per_1000"], 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.freshness", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a served model directory (the real-weights MiniLM)")
    p.add_argument("--rate", type=float, default=7.0, help="paragraphs a second the producer writes")
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--every", default="60s")
    p.add_argument("--max-wait", default="60s")
    p.add_argument("--file-every-s", type=float, default=5.0)
    p.add_argument("--idle-s", type=float, default=60.0)
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    figures: dict[str, Any] = {"complete": False}
    try:
        run_freshness(
            model=Path(args.model),
            rate=args.rate,
            minutes=args.minutes,
            every=args.every,
            max_wait=args.max_wait,
            file_every_s=args.file_every_s,
            idle_s=args.idle_s,
            out=figures,
        )
        figures["complete"] = True
    finally:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = Path(args.results) / f"freshness-{stamp}.json"
        path.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "report"}, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The freshness line: a watcher under a steady producer, and what it costs against one daily.

On a cluster of its own (`LocalNodes`: its processes are marked by its temp dir and killed at
the end; no `ray stop`, which would stop every cluster of the host), with the real-weights
MiniLM served by `raypipe serve --detach`:

1. daily: the rows the producer will write, as the same files, read by one `raypipe daily`
   into an output of its own: its CPU per 1,000 paragraphs, the comparison's side (first, so
   the ratio is written whenever the watch's figures are);
2. idle: `raypipe watch` started on an empty input; the cluster's CPU over `--idle-s` seconds
   with nothing arriving, against the same cluster idle without the watcher (the ticks' cost);
3. load: a producer writes a file every `--file-every` seconds at `--rate` paragraphs a second
   for `--minutes` minutes (each file written aside and renamed in, whole, as an S3 PUT
   lands); the watcher commits them; the cluster's CPU while it does;
4. the watcher is stopped with SIGTERM (exit 0, its report written): freshness p50/p95 over
   every unit (arrival = the file's mtime, to its unit's commit);
5. the idle cluster again. Every idle figure is taken once the cluster has settled (10-s
   windows until two agree within 0.03 of a core), and CPU is charged against the mean of the
   idle figure before and after; the ratio each alone would give is recorded beside it.

With `--events` the input is a bucket of moto's S3 server on 127.0.0.1 (its own process, whose
CPU is not counted: it stands for S3), its notifications sent to a queue of the same server's
SQS by `raypipe.plan.events.configure_bucket_notifications`; the producer PUTs each file, and
the watcher reads the queue (`--events-queue`) instead of listing: arrival = the event's time.

    python -m bench.freshness --rate 7 --minutes 4 --every 60s --model DIR
    python -m bench.freshness --events --rate 7 --minutes 3 --every 5s --max-wait 10s --model DIR

writes `bench/results/freshness-<UTC stamp>.json`. Run it under the shared heavy lock.
"""

from __future__ import annotations

import argparse
import contextlib
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
BUCKET = "fresh"


def _texts(n: int, start: int) -> list[str]:
    from bench import corpus

    return corpus.paragraphs(n, seed=start)


def _parquet(start: int, n: int) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"p{start + i:09d}" for i in range(n)], "text": _texts(n, start)}), buf)
    return buf.getvalue()


class _Folder:
    """The input as a local folder: a file written aside, then renamed in, whole."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.uri = folder, str(folder)

    def write(self, name: str, start: int, n: int) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(_parquet(start, n))
        os.replace(tmp, self.folder / f"{name}.parquet")


class _Bucket:
    """The input as a prefix of a bucket of moto's S3 server: a file is one PUT."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.uri = f"s3://{bucket}/{prefix}"

    def write(self, name: str, start: int, n: int) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}{name}.parquet", Body=_parquet(start, n))


def _s3_with_events(stack: contextlib.ExitStack) -> tuple[dict[str, str], Any, str]:
    """moto's server on 127.0.0.1 (closed with `stack`), a bucket whose `in/` notifications go to
    a queue: (the environment that reaches it, an S3 client, the queue's URL)."""
    import botocore.session

    from bench.s3server import MotoServer
    from raypipe.plan.events import configure_bucket_notifications

    server = MotoServer().start()
    stack.callback(server.stop)
    env = {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env)  # this process's clients (the producer's, the notifications') reach it too
    session = botocore.session.get_session()
    s3, sqs = session.create_client("s3"), session.create_client("sqs")
    s3.create_bucket(Bucket=BUCKET)
    queue = sqs.create_queue(QueueName="arrivals")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    configure_bucket_notifications(BUCKET, arn, "in/")
    return env, s3, queue


def _cpu(marker: str, seconds: float, roots: tuple[int, ...] = ()) -> float:
    """CPU seconds of the cluster's processes (and `roots`' trees) over `seconds`."""
    from bench.cluster import ProcessSampler

    sampler = ProcessSampler(marker=marker)
    for pid in roots:
        sampler.add_root(pid)
    with sampler:
        time.sleep(seconds)
    return sampler.usage().cpu_s


def _cpu_snapshot(marker: str, roots: tuple[int, ...] = ()) -> dict[int, tuple[str, float]]:
    """Each process of the cluster (and `roots`' trees): its name and CPU seconds so far."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in arg for arg in p.info.get("cmdline") or []):
            found[p.pid] = p
            with contextlib.suppress(psutil.Error):
                found |= {c.pid: c for c in p.children(recursive=True)}
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found |= {pid: root} | {c.pid: c for c in root.children(recursive=True)}
    snapshot = {}
    for pid, p in found.items():
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            snapshot[pid] = ("watcher (driver)" if pid in roots else p.name(), t.user + t.system)
    return snapshot


def _by_process(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float
) -> dict[str, float]:
    """CPU per second of wall time between two snapshots, by process name, largest first."""
    rates: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        rates[name] = rates.get(name, 0.0) + (cpu - before.get(pid, (name, 0.0))[1]) / wall_s
    return {name: round(rate, 4) for name, rate in sorted(rates.items(), key=lambda kv: -kv[1]) if rate >= 0.0005}


def _settled_idle(
    marker: str,
    seconds: float,
    roots: tuple[int, ...] = (),
    *,
    window_s: float = 10.0,
    tolerance: float = 0.03,
    max_windows: int = 12,
) -> tuple[float, list[float]]:
    """The cluster's idle CPU rate (CPU-s per s) once it has settled: windows of `window_s` until
    two in a row differ by less than `tolerance` of a core (a replica still warming or measuring
    its settings in the background is not idle), then one window of `seconds`. Returns the rate
    and the settling windows' rates (the record shows how long it took)."""
    history: list[float] = []
    for _ in range(max_windows):
        history.append(round(_cpu(marker, window_s, roots) / window_s, 4))
        if len(history) >= 2 and abs(history[-1] - history[-2]) < tolerance:
            break
    return _cpu(marker, seconds, roots) / seconds, history


def _charge(out: dict[str, Any], baseline: float, daily_paragraphs: int) -> None:
    """CPU per 1,000 paragraphs of the daily and the watch, each less the idle cluster over its
    wall time, and their ratio; with the ratio the two single baselines would give (its spread)."""

    def per_1000(cpu_s: float, wall_s: float, paragraphs: int, idle: float) -> float:
        return (cpu_s - idle * wall_s) / paragraphs * 1000

    out["daily_cpu_s_per_1000"] = round(
        per_1000(out["daily_cpu_s"], out["daily_wall_s"], daily_paragraphs, baseline), 3
    )
    if "watch_cpu_s" not in out:
        return
    out["watch_cpu_s_per_1000"] = round(
        per_1000(out["watch_cpu_s"], out["load_wall_s"], out["paragraphs"], baseline), 3
    )
    out["cpu_ratio_watch_over_daily"] = round(out["watch_cpu_s_per_1000"] / out["daily_cpu_s_per_1000"], 3)
    ratios = [
        per_1000(out["watch_cpu_s"], out["load_wall_s"], out["paragraphs"], idle)
        / per_1000(out["daily_cpu_s"], out["daily_wall_s"], daily_paragraphs, idle)
        for idle in (out["idle_cluster_cpu_per_s"], out["idle_cluster_after_cpu_per_s"])
    ]
    out["cpu_ratio_by_single_baseline"] = [round(r, 3) for r in ratios]


def run_freshness(
    *,
    model: Path,
    rate: float,
    minutes: float,
    every: str,
    max_wait: str,
    file_every_s: float,
    idle_s: float,
    events: bool = False,
    out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The figures, filled into `out` as they are measured (a run stopped early keeps them)."""
    from bench.cluster import LocalNodes, ProcessSampler, bench_env, run_measured
    from bench.tcp_proxy import free_port

    work = Path(tempfile.mkdtemp(prefix="rpfresh-"))
    root = Path(f"/tmp/rpfresh-{os.getpid()}")
    grpc_port, http_port = free_port(), free_port()
    out = {} if out is None else out
    out |= {"rate_per_s": rate, "minutes": minutes, "every": every, "max_wait": max_wait,
            "file_every_s": file_every_s, "model": str(model),
            "arrivals": "events" if events else "listing"}  # fmt: skip
    per_file = max(1, round(rate * file_every_s))
    n_files = max(1, round(minutes * 60 / file_every_s))
    try:
        with contextlib.ExitStack() as stack:
            base_env = bench_env()
            base_env.pop("RAY_ADDRESS", None)  # bench_env's names the shared bench cluster: this one has its own
            queue = ""
            if events:
                s3_env, s3, queue = _s3_with_events(stack)
                base_env |= s3_env  # the cluster's workers read the input there
                source: _Folder | _Bucket = _Bucket(s3, BUCKET, "in/")
                daily_source: _Folder | _Bucket = _Bucket(s3, BUCKET, "daily/")  # no notifications
            else:
                source, daily_source = _Folder(work / "in"), _Folder(work / "daily-in")
            nodes = LocalNodes(root, port=free_port(), dashboard_port=free_port(), env=base_env,
                               head_cpus=2, multi_node=False)  # fmt: skip
            stack.enter_context(nodes)
            env = {**nodes.env, "RAY_ADDRESS": nodes.address}
            marker = str(root)
            raypipe = [sys.executable, "-m", "raypipe"]
            serve = [*raypipe, "serve", "--model", str(model), "--grpc-port", str(grpc_port), "--http-port",
                     str(http_port), "--detach"]  # fmt: skip
            subprocess.run(
                serve, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            service = f"127.0.0.1:{grpc_port}"
            output = work / "out"
            before, since = _cpu_snapshot(marker), time.monotonic()
            idle_before, out["idle_settling_cpu_per_s"] = _settled_idle(marker, idle_s)
            out["idle_cluster_by_process"] = _by_process(before, _cpu_snapshot(marker), time.monotonic() - since)
            out["idle_cluster_cpu_per_s"] = round(idle_before, 4)

            # The comparison first: the same rows, as the same files, in one daily.
            for i in range(n_files):
                daily_source.write(f"f{i:05d}", i * per_file, per_file)
            cmd = [*raypipe, "daily", "--input", daily_source.uri, "--output", str(work / "daily-out"),
                   "--service", service]  # fmt: skip
            wall, usage, code = run_measured(cmd, env=env, marker=marker, timeout_s=900, log=work / "daily.log")
            if code != 0:
                raise RuntimeError(f"the daily failed (exit {code}); see {work / 'daily.log'}")
            out["daily_paragraphs"] = n_files * per_file
            out["daily_wall_s"] = round(wall, 1)
            out["daily_cpu_s"] = round(usage.cpu_s, 2)

            log = (work / "watch.log").open("w")
            cmd = [*raypipe, "watch", "--input", source.uri, "--output", str(output), "--service", service,
                   "--every", every, "--max-wait", max_wait, "--set", "watch.report_every_s=100000"]  # fmt: skip
            if queue:
                cmd += ["--events-queue", queue]
            watcher = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                reports = output / "_raypipe" / "watch"
                deadline = time.monotonic() + 300
                while not (reports.exists() and any(reports.iterdir())):
                    if watcher.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the watcher did not start; see {log.name}")
                    time.sleep(1)
                time.sleep(5)  # past its start-up
                before, since = _cpu_snapshot(marker, (watcher.pid,)), time.monotonic()
                idle, _ = _settled_idle(marker, idle_s, (watcher.pid,))
                out["idle_with_watcher_cpu_per_s"] = round(idle, 4)
                # where an idle watcher's CPU goes: its driver, its warm actors, the cluster's own
                out["idle_with_watcher_by_process"] = _by_process(
                    before, _cpu_snapshot(marker, (watcher.pid,)), time.monotonic() - since
                )
                files, written = 0, 0
                load = ProcessSampler(marker=marker)
                load.add_root(watcher.pid)
                with load:
                    started = time.monotonic()
                    while files < n_files:
                        source.write(f"f{files:05d}", written, per_file)
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
            finally:
                watcher.send_signal(signal.SIGTERM)
                out["watch_exit"] = watcher.wait(timeout=120)
                log.close()
            # The baseline again, the watcher gone: the figures are charged against the mean of
            # the two, and both are kept, so a baseline that moved (other work on the host, a
            # replica's background measurement) shows in the record instead of in the ratio.
            idle_after, _ = _settled_idle(marker, idle_s)
            out["idle_cluster_after_cpu_per_s"] = round(idle_after, 4)
            baseline = (idle_before + idle_after) / 2
            out["idle_baseline_cpu_per_s"] = round(baseline, 4)
            _charge(out, baseline, n_files * per_file)
            if "idle_with_watcher_cpu_per_s" in out:
                out["idle_ticks_share_of_a_core"] = round(out["idle_with_watcher_cpu_per_s"] - baseline, 4)
            report = json.loads(next((output / "_raypipe" / "watch").glob("*.json")).read_text())
            out["report"] = report
            out["freshness_p50_s"], out["freshness_p95_s"] = report["freshness_p50_s"], report["freshness_p95_s"]
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
    p.add_argument("--events", action="store_true", help="the input a bucket of moto's S3, read through its events")
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
            events=args.events,
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

"""The peers section: raypipe beside what a user would otherwise write, in one run, on the same
cores, with the same texts, model and setting.

    python -m bench.run --sections peers [--models minilm-l6,bert-base] [--peer-rounds 3] [--lock FILE]

For each model, the setting a replica with default settings serves on this CPU (`serve_app.runtimes.resolve`
with `ServerSettings()`: the fastest that passes the gate, OpenVINO fp32 where there is no record)
runs the same paragraphs of the bench corpus through four builds:

- (a) **in process**: the model's own batch predict (`bench.lines` ``inproc``), one pass at a time
  on every core; no Ray, no network. The wall and CPU are those of the predict call.
- (b) **Ray Data native**: ``read_parquet -> map_batches(a class holding the model) -> write_parquet``
  with Ray Data's defaults (an autoscaling actor pool, one CPU per actor, the default batch size);
  each actor loads the model with as many threads as Ray gave it CPUs. No Serve, no gRPC.
- (c) **raypipe**: ``raypipe serve --model DIR`` with no runtime or precision flag, then
  ``raypipe backfill`` with defaults (the speed section's end-to-end line).
- (d) **the reference build's client**: PySpark ``local[2]``, an iterator pandas UDF that sends one
  paragraph per Classify call under an asyncio semaphore of 50 (grpc.aio, the repository's protos
  and the service token), against the same served model as (c). It needs a JRE (Java 17) and
  ``pyspark`` (the ``bench`` extra).

(b), (c) and (d) are timed as commands (their wall includes their start: Ray Data's actors loading
the model, the backfill's driver, Spark's JVM); their CPU is that of the command's process tree and
of every process of the cluster (`bench.cluster.ProcessSampler`). The cluster is a single node
with as many CPUs as the machine (`LocalNodes`), new for (b) and for (c)+(d), so no line runs
beside another's actors. The machine may be shared: each round runs the lines in another order,
and the figures are the median over rounds with the lowest and highest beside it; a ratio is the
median of the per-round ratios (lines of one round ran minutes apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.cluster import LocalNodes, TreeUsage, bench_env, heavy_lock, run_measured
from bench.lines import RESULT_PREFIX, parse_result
from bench.tcp_proxy import free_port

__all__ = [
    "LINES",
    "TARGETS",
    "line_figures",
    "peers_docs_block",
    "peers_tables",
    "round_orders",
    "run_peers",
    "summarize",
]

#: The lines, in the order of the first round.
LINES = ("a", "b", "c", "d")
LINE_NAMES = {
    "a": "in process (the model's batch predict)",
    "b": "Ray Data map_batches (actor pool, defaults)",
    "c": "raypipe (serve + backfill, defaults)",
    "d": "PySpark local[2] pandas UDF, 1 paragraph per call, 50 in flight",
}
#: What the issue asks of the ratios and of raypipe's cores busy (of the machine's cores).
TARGETS = {"c/b": 0.97, "c/d": 2.0, "cores_busy": 1.9}
#: Paragraphs per line: a round of the four lines stays within a few minutes on 2 cores, so it fits
#: one hold of a shared machine's lock (the speed section's sizes would take most of an hour).
ROWS = {"bert-base": 300, "trained-bert-base": 300}
DEFAULT_ROWS = 3000
#: Semaphore of the reference build's client (calls in flight per UDF).
SPARK_CONCURRENCY = 50


# -- pure pieces (unit-tested) -----------------------------------------------------------------
def line_figures(*, paragraphs: int, ok: int, wall_s: float, cpu_s: float, cores: int) -> dict[str, Any]:
    """One sample of a line: paragraphs per second, CPU ms per paragraph, cores busy."""
    if wall_s <= 0 or ok <= 0:
        raise ValueError(f"a line needs a positive wall and answers (wall_s={wall_s}, ok={ok})")
    return {
        "paragraphs": paragraphs,
        "ok": ok,
        "wall_s": round(wall_s, 3),
        "cpu_s": round(cpu_s, 3),
        "para_per_s": ok / wall_s,
        "cpu_ms_per_para": 1000 * cpu_s / ok,
        "cores_busy": cpu_s / wall_s,
        "cores_busy_share": cpu_s / wall_s / cores,
    }


def round_orders(rounds: int, lines: Sequence[str] = LINES) -> list[list[str]]:
    """The order of the lines in each round: rotated by one each round, so a line runs first,
    second, ... in turn and a slow stretch of a shared machine does not always hit the same one.
    (c) and (d) share a served cluster and stay next to each other, in either order."""
    groups: list[list[str]] = []
    for line in lines:
        if line == "d" and "c" in lines:
            continue
        groups.append(["c", "d"] if line == "c" and "d" in lines else [line])
    orders = []
    for r in range(rounds):
        k = r % len(groups)
        rotated = groups[k:] + groups[:k]
        if r % 2:
            rotated = [list(reversed(g)) for g in rotated]
        orders.append([line for g in rotated for line in g])
    return orders


def _spread(values: Sequence[float]) -> dict[str, float | int]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(samples: dict[str, list[dict[str, Any]]], *, cores: int) -> dict[str, Any]:
    """Medians and spread per line from the rounds' samples, and the ratios (c)/(a), (c)/(b),
    (c)/(d), each the median of its per-round ratios, against `TARGETS`."""
    lines = {
        name: {
            key: _spread([s[key] for s in runs]) for key in ("para_per_s", "cpu_ms_per_para", "cores_busy", "wall_s")
        }
        for name, runs in samples.items()
        if runs
    }
    ratios: dict[str, Any] = {}
    for other in ("a", "b", "d"):
        # Paired by round (samples without one, by position): a line that failed in a round leaves
        # that round out of its ratios rather than pairing the others' rounds wrongly.
        theirs = {s.get("round", k): s for k, s in enumerate(samples.get(other, []))}
        pairs = [
            (c, theirs[c.get("round", k)]) for k, c in enumerate(samples.get("c", [])) if c.get("round", k) in theirs
        ]
        if pairs:
            ratios[f"c/{other}"] = _spread([c["para_per_s"] / o["para_per_s"] for c, o in pairs])
    met: dict[str, bool | None] = {
        "c/b": ratios["c/b"]["median"] >= TARGETS["c/b"] if "c/b" in ratios else None,
        "c/d": ratios["c/d"]["median"] >= TARGETS["c/d"] if "c/d" in ratios else None,
        # Cores busy is of the machine's cores; the target is for 2 (1.9 of 2: 95%).
        "cores_busy": lines["c"]["cores_busy"]["median"] >= TARGETS["cores_busy"] * cores / 2 if "c" in lines else None,
    }
    return {"lines": lines, "ratios": ratios, "targets": TARGETS, "met": met}


def peers_tables(peers: dict[str, Any], *, source: str | None = None) -> list[str]:
    """The section as Markdown: one table per model (medians, lowest-highest), its ratios."""
    cpu = peers.get("cpu") or {}
    out = [
        f"### Peers: {cpu.get('model') or 'CPU'} ({', '.join(cpu.get('flags') or [])}), {cpu.get('usable_cpus')} cores",
        "",
    ]
    for label, m in (peers.get("models") or {}).items():
        shape = m.get("shape") or {}
        where = m.get("source") or source
        dims = f"{shape.get('layers')}×{shape.get('hidden')}, max {shape.get('max_length')} tokens" if shape else ""
        out += [
            f"**{label}** ({dims}; setting {m.get('setting')}; {m.get('paragraphs'):,} paragraphs per line, "
            f"{m.get('rounds')} rounds{'; ' + where if where else ''})",
            "",
            "| line | para/s (median, lowest–highest) | CPU ms per paragraph | cores busy | wall s |",
            "|---|---:|---:|---:|---:|",
        ]
        summary = m.get("summary") or {}
        for name in LINES:
            f = (summary.get("lines") or {}).get(name)
            if not f:
                out.append(f"| ({name}) {LINE_NAMES[name]} | – | – | – | – |")
                continue
            out.append(
                f"| ({name}) {LINE_NAMES[name]} | {_range(f['para_per_s'], 1)} | {_range(f['cpu_ms_per_para'], 2)} "
                f"| {_range(f['cores_busy'], 2)} | {f['wall_s']['median']:.1f} |"
            )
        ratios = summary.get("ratios") or {}
        met = summary.get("met") or {}
        parts = []
        for key in ("c/a", "c/b", "c/d"):
            if key in ratios:
                target = TARGETS.get(key)
                verdict = "" if target is None else f" (target ≥ {target:g}: {'met' if met.get(key) else 'not met'})"
                parts.append(f"({key[0]})/({key[2]}) **{_range(ratios[key], 3)}**{verdict}")
        out += ["", "Ratios: " + "; ".join(parts) + "." if parts else "Ratios: –.", ""]
        for name, error in (m.get("errors") or {}).items():
            out += [f"Failed: ({name}): {error}", ""]
    return out[:-1]


def _range(s: dict[str, Any], digits: int) -> str:
    if s.get("n", 1) <= 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def peers_docs_block(results_dir: Path) -> list[str]:
    """docs/performance.md's peers tables: per CPU (newest run first), each model's newest peers
    figures (smoke runs left out), each naming its results file; nothing where no run has any."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("bench-*.json"), reverse=True):  # names sort by start time
        results = json.loads(path.read_text(encoding="utf-8"))
        env = results.get("env") or {}
        peers = results.get("peers") or {}
        if env.get("quick"):
            continue
        file = path.with_suffix(".md").relative_to(results_dir.parent.parent)
        source = f"`{file}` ({str(env.get('git_commit') or '')[:7]})"
        cpu = peers.get("cpu") or {}
        key = f"{cpu.get('model')} {cpu.get('flags')}"
        for label, m in (peers.get("models") or {}).items():
            if (m.get("summary") or {}).get("lines"):
                entry = found.setdefault(key, {"cpu": cpu, "models": {}})
                entry["models"].setdefault(label, {**m, "source": source})
    out: list[str] = []
    for entry in found.values():
        out += ["", *peers_tables(entry)]
    return out


# -- the measurement (Ray, Serve, Spark) ---------------------------------------------------------
def run_peers(
    bench: Any,
    models: dict[str, Path],
    corpus: Path,
    shapes: dict[str, Any],
    results: dict[str, Any],
    save: Callable[[], None],
) -> dict[str, Any]:
    """The section's results, as ``results["peers"]`` (bench is `bench.run.Bench`; `shapes` the
    models' `Shape`s); `save` writes the results file after each round, so a run stopped early
    keeps the rounds it measured."""
    from bench.flops import cpu_info

    cores = bench.args.threads
    out: dict[str, Any] = {"cpu": cpu_info(), "cores": cores, "models": {}}
    results["peers"] = out
    for label, model_dir in models.items():
        print(f"bench: peers {label}", flush=True)
        rows = bench.args.peer_rows or ROWS.get(label, DEFAULT_ROWS)
        out["models"][label] = {}
        _model(bench, model_dir, corpus, rows, shapes.get(label), out["models"][label], save)
    return out


#: The trained models the section can also run, beside the random-weight shapes: what a user
#: serves, with the setting this CPU's record gates for them (random weights answer near uniform
#: probabilities, so every faster precision is refused on them and they run fp32).
TRAINED = {"trained-bert-base": "bert-base", "real-weights-minilm": "minilm-l6"}


def peer_models(
    labels: list[str], model_dirs: dict[str, Path], *, demo: Path, cache: Path, env: dict[str, str], lock: str | None
) -> tuple[dict[str, Path], dict[str, Any]]:
    """The model directory and shape of each label: a shape's from ``model_dirs``, a trained one's
    built on first use (`bench.models`) and measured on this CPU with ``raypipe model optimize
    --no-int8`` where it has no record, as a user's export does. Returns (dirs, shapes)."""
    from dataclasses import replace

    from bench.models import SHAPES, ensure_real_weights_model, ensure_trained_model
    from serve_app.model import read_model_card
    from serve_app.runtimes import resolve
    from serve_app.settings import ServerSettings

    dirs: dict[str, Path] = {}
    shapes: dict[str, Any] = {}
    for label in labels:
        if label in SHAPES:
            dirs[label], shapes[label] = model_dirs[label], SHAPES[label]
            continue
        if label not in TRAINED:
            raise SystemExit(f"bench: --peer-models takes {', '.join([*SHAPES, *TRAINED])}, not {label!r}")
        with heavy_lock(lock):
            if label == "trained-bert-base":
                model_dir = ensure_trained_model(SHAPES["bert-base"], demo_model_dir=demo, cache=cache, env=env)
            else:
                found = ensure_real_weights_model(cache=cache, env=env)
                if found is None:
                    raise SystemExit("bench: the real-weights MiniLM is not installed (make venv)")
                model_dir = found
            if resolve(model_dir, ServerSettings()).unmeasured:
                cmd = [sys.executable, "-m", "raypipe", "model", "optimize", str(model_dir), "--no-int8"]
                subprocess.run(cmd, env=env, check=True)
        dirs[label] = model_dir
        card = read_model_card(model_dir)
        shapes[label] = replace(SHAPES[TRAINED[label]], max_length=card.max_sequence_length)
    return dirs, shapes


def _model(
    bench: Any, model_dir: Path, corpus: Path, rows: int, shape: Any, entry: dict[str, Any], save: Callable[[], None]
) -> None:
    """Fills `entry` with the model's rounds, saving after each line (a run stopped part-way, as a
    hold of a shared lock running out, keeps what it measured)."""
    from serve_app.runtimes import resolve
    from serve_app.settings import ServerSettings

    serving = resolve(model_dir, ServerSettings())
    cores = bench.args.threads
    shards = bench.write_shards(corpus, rows, bench.work / f"input-peers-{model_dir.name}")
    entry.update(
        {
            "model_dir": str(model_dir),
            "shape": shape.to_dict() if shape is not None else None,
            "setting": f"{serving.setting}" + ("" if serving.margin is None else f" m{serving.margin:g}"),
            "paragraphs": rows,
            "rounds": bench.args.peer_rounds,
            "orders": round_orders(bench.args.peer_rounds),
            "samples": {name: [] for name in LINES},
            "errors": {},
        }
    )
    samples: dict[str, list[dict[str, Any]]] = entry["samples"]
    for r, order in enumerate(entry["orders"]):
        k = 0
        # One hold of the lock per round (a few minutes): the four lines run on the same quiet
        # stretch of a shared machine rather than each after another queue.
        with heavy_lock(bench.lock):
            while k < len(order):
                line = order[k]
                group = order[k : k + 2] if line in ("c", "d") else [line]
                k += len(group)
                try:
                    for name, sample in _run_group(bench, group, model_dir, corpus, shards, rows, f"r{r}").items():
                        detail = sample.pop("detail", None)
                        samples[name].append({"round": r + 1, **line_figures(cores=cores, **sample)})
                        if detail:
                            samples[name][-1]["detail"] = detail
                except Exception as e:  # a failed line is reported with the others' figures
                    entry["errors"][f"{','.join(group)}, round {r + 1}"] = f"{type(e).__name__}: {e}"[:500]
                entry["summary"] = summarize(samples, cores=cores)
                save()


def _run_group(
    bench: Any, group: list[str], model_dir: Path, corpus: Path, shards: Path, rows: int, tag: str
) -> dict[str, dict[str, Any]]:
    name = f"peers-{model_dir.name}-{tag}"
    if group == ["a"]:
        payload = {
            "model_dir": str(model_dir),
            "corpus": str(corpus),
            "n": rows,
            "threads": bench.args.threads,
            "layout": "intra",
            "runtime": "auto",
            "precision": "auto",
        }
        result, _, _ = _child(
            ["bench.lines", "inproc", json.dumps(payload)], bench.env, None, bench.logs / f"{name}-a.log"
        )
        # The predict call's own wall and CPU (the process's start and the model's load are not the line).
        return {"a": _sample(result, result["wall_s"], result["cpu_s_self"])}
    out: dict[str, dict[str, Any]] = {}
    with _cluster(bench.args.threads) as cluster:
        if group == ["b"]:
            payload = {"address": cluster.address, "model_dir": str(model_dir), "input": str(shards)}
            payload["output"] = str(bench.work / f"out-{name}-b")
            # write_parquet adds files beside any there: an earlier run's would count as answers.
            shutil.rmtree(payload["output"], ignore_errors=True)
            result, wall, usage = _child(
                ["bench.peers", "raydata", json.dumps(payload)],
                cluster.env,
                str(cluster.root),
                bench.logs / f"{name}-b.log",
            )
            return {"b": _sample(result, wall, usage.cpu_s)}
        address = _serve(cluster, model_dir, bench.logs / f"{name}-serve.log")
        for line in group:
            if line == "c":
                wall, usage, report = _backfill(
                    cluster, address, shards, bench.work / f"out-{name}-c", f"{name}-c", bench.logs
                )
                out["c"] = {
                    "paragraphs": report["rows_in"],
                    "ok": report["rows_ok"],
                    "wall_s": wall,
                    "cpu_s": usage.cpu_s,
                    # Where raypipe's CPU went, by process group (`raypipe.run.cost`), and its start-up.
                    "detail": {
                        "cost": report.get("cost"),
                        "startup": report.get("startup"),
                        "run_wall_s": report["wall_s"],
                    },
                }
            else:
                payload = {
                    "address": address,
                    "input": str(shards),
                    "output": str(bench.work / f"out-{name}-d"),
                    "concurrency": SPARK_CONCURRENCY,
                    "app": "raypipe",
                    "cores": bench.args.threads,
                }
                result, wall, usage = _child(
                    ["bench.peers", "spark", json.dumps(payload)],
                    cluster.env,
                    str(cluster.root),
                    bench.logs / f"{name}-d.log",
                )
                out["d"] = _sample(result, wall, usage.cpu_s)
    return out


def _backfill(
    cluster: _PeerCluster, address: str, shards: Path, output: Path, name: str, logs: Path
) -> tuple[float, TreeUsage, dict[str, Any]]:
    """`raypipe backfill` with defaults, as the speed section runs it (`bench.cluster.measured_backfill`)."""
    shutil.rmtree(output, ignore_errors=True)
    cmd = [sys.executable, "-m", "raypipe", "backfill", "--input", str(shards), "--output", str(output)]
    cmd += ["--service", address, "--run-id", name]
    wall, usage, code = run_measured(
        cmd, env=cluster.env, marker=cluster.marker, timeout_s=1800, log=logs / f"{name}.log"
    )
    report = output / "runs" / f"{name}.json"
    if code != 0 or not report.exists():
        raise RuntimeError(f"raypipe backfill {name} failed (exit {code}); see {logs / name}.log")
    return wall, usage, json.loads(report.read_text())


def _sample(result: dict[str, Any], wall_s: float, cpu_s: float) -> dict[str, Any]:
    return {"paragraphs": result["paragraphs"], "ok": result["ok"], "wall_s": wall_s, "cpu_s": cpu_s}


def _child(
    module_args: list[str], env: dict[str, str], marker: str | None, log: Path
) -> tuple[dict[str, Any], float, TreeUsage]:
    cmd = [sys.executable, "-m", *module_args]
    wall, usage, code = run_measured(cmd, env=env, marker=marker, timeout_s=1800, log=log)
    result = parse_result(log.read_text(errors="replace"))
    if code != 0 or result is None:
        raise RuntimeError(f"{module_args[0]} {module_args[1]} failed (exit {code}); see {log}")
    return result, wall, usage


class _PeerCluster(LocalNodes):
    """A single-node cluster with every CPU of the machine, on free ports, whose processes carry
    its own temp dir (``marker``): `LocalNodes` stops only those (``ray stop`` would stop every
    Ray cluster on the machine)."""

    @property
    def marker(self) -> str:
        return str(self.root)

    def __enter__(self) -> _PeerCluster:
        super().__enter__()
        return self


@contextlib.contextmanager
def _cluster(cores: int) -> Iterator[_PeerCluster]:
    with _PeerCluster(
        Path("/tmp") / f"rppeers-{os.getpid()}",
        port=free_port(),
        dashboard_port=free_port(),
        env=bench_env(),
        head_cpus=cores,
        object_store_mb=1024,
        multi_node=False,
        start_args=("--include-log-monitor=false",),
    ) as cluster:
        # Every command of the line (the backfill, `raypipe serve`, the children) joins this cluster.
        cluster.env["RAY_ADDRESS"] = cluster.address
        yield cluster


def _serve(cluster: _PeerCluster, model_dir: Path, log: Path) -> str:
    """``raypipe serve --model DIR --detach`` with the CLI's defaults; returns host:port."""
    grpc_port = free_port()
    cmd = [sys.executable, "-m", "raypipe", "serve", "--model", str(model_dir), "--detach"]
    cmd += ["--grpc-port", str(grpc_port), "--http-port", str(free_port())]
    with log.open("w") as out:
        subprocess.run(cmd, env=cluster.env, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=600)
    return f"127.0.0.1:{grpc_port}"


# -- the children: python -m bench.peers raydata|spark ARGS_JSON ---------------------------------
def _ray_data(args: dict[str, Any]) -> dict[str, Any]:
    """(b): Ray Data's own path as its docs write it, the model in a callable class."""
    import numpy as np
    import pyarrow.parquet as pq
    import ray

    model_dir = args["model_dir"]

    class Classify:
        def __init__(self) -> None:
            from serve_app import model as model_mod
            from serve_app.runtimes import resolve
            from serve_app.settings import ServerSettings

            serving = resolve(model_dir, ServerSettings())
            threads = max(1, round(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
            if serving.runtime == "tensorflow":
                model_mod.configure_tf_threads(threads, 1)
                model_mod.configure_precision(serving.precision)
            self.model = model_mod.EmotionModel.load(
                model_dir,
                precision=serving.precision,
                runtime=serving.runtime,
                threads=threads,
                recheck_margin=serving.margin,
            )
            self.labels = np.array(self.model.card.labels)

        def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
            p = self.model.predict(list(batch["text"])).probabilities
            return {"id": batch["id"], "label": self.labels[p.argmax(axis=1)], "score": p.max(axis=1)}

    ray.init(address=args["address"], logging_level=logging.ERROR, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ray.data.read_parquet(args["input"]).map_batches(Classify).write_parquet(args["output"])
    ok = sum(pq.ParquetFile(p).metadata.num_rows for p in Path(args["output"]).glob("*.parquet"))
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in Path(args["input"]).glob("*.parquet"))
    return {"paragraphs": rows, "ok": ok}


def _spark(args: dict[str, Any]) -> dict[str, Any]:
    """(d): the reference build's client, a PySpark iterator pandas UDF calling the served model."""
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(f"local[{args['cores']}]")
        .appName("reference-client")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(args["cores"]))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        classify = _classify_udf(args["address"], args["app"], _token(), args["concurrency"])
        frame = spark.read.parquet(args["input"])
        frame.select("id", classify("text").alias("label")).write.mode("overwrite").parquet(args["output"])
    finally:
        spark.stop()
    out = Path(args["output"])
    labels = pq.read_table(out, columns=["label"]).column("label")
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in Path(args["input"]).glob("*.parquet"))
    return {"paragraphs": rows, "ok": len(labels) - labels.null_count}


def _token() -> str | None:
    from protos.credential import default_token_file, read_token

    return read_token(str(default_token_file()))


def _classify_udf(address: str, app: str, token: str | None, concurrency: int) -> Any:
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    metadata = (("application", app), *((("authorization", f"Bearer {token}"),) if token else ()))

    def classify(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        for texts in batches:
            yield pd.Series(asyncio.run(_classify_batch(address, metadata, list(texts), concurrency)))

    # Spark reads the hints to tell an iterator UDF; this module's postponed annotations are strings
    # it would resolve in the module's globals, where pandas is not imported.
    classify.__annotations__ = {"batches": Iterator[pd.Series], "return": Iterator[pd.Series]}
    return pandas_udf(classify, "string")  # type: ignore[call-overload,unused-ignore]


async def _classify_batch(
    address: str, metadata: tuple[tuple[str, str], ...], texts: list[str], concurrency: int
) -> list[str | None]:
    """One Classify call per paragraph, at most `concurrency` in flight; the top label (None on failure)."""
    import grpc

    from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc

    semaphore = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)

        async def one(i: int, text: str) -> str | None:
            request = emotion_pb2.ClassifyRequest(paragraphs=[emotion_pb2.Paragraph(id=str(i), text=text)])
            async with semaphore:
                try:
                    response = await stub.Classify(request, timeout=300, metadata=metadata)
                except grpc.aio.AioRpcError:
                    return None
            probabilities = list(response.predictions[0].probabilities)
            return str(response.labels[probabilities.index(max(probabilities))])

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(texts))))


def main(argv: list[str]) -> None:
    kind, args = argv[0], json.loads(argv[1])
    started = time.perf_counter()
    if kind == "raydata":
        result = _ray_data(args)
    elif kind == "spark":
        result = _spark(args)
    else:
        raise SystemExit(f"unknown peer line {kind!r}")
    result["inner_wall_s"] = time.perf_counter() - started
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The measured lines that run in a child process each: python -m bench.lines KIND ARGS_JSON.

- ``inproc``: the compute ceiling, `serve_app.model.EmotionModel` called in this process on the
  whole sample at once (it sorts by length, pads per bucket, keeps each pass under the token
  budget: the best batching the model offers) on all the cores; no Ray, no network. ``runtime``
  and ``precision`` are resolved as a replica resolves them (``auto``: the measured record).
- ``async``: the reference build's final client, one Classify RPC per paragraph under an
  asyncio semaphore of 50 (grpc.aio), against an unbatched server.
- ``sync``: the reference build's start, blocking calls one paragraph at a time.

Each prints one ``BENCH_RESULT {json}`` line; the parent adds CPU and memory of the whole tree.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

__all__ = ["RESULT_PREFIX", "parse_result"]

RESULT_PREFIX = "BENCH_RESULT "
_TRANSIENT = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED"}


def parse_result(output: str) -> dict[str, Any] | None:
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    return None


def _read_corpus(path: str, n: int) -> tuple[list[str], list[str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["id", "text"]).slice(0, n)
    return table.column("id").to_pylist(), table.column("text").to_pylist()


def _percentiles_ms(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50": None, "p95": None, "p99": None}
    a = np.asarray(latencies) * 1000
    return {name: round(float(np.quantile(a, q)), 2) for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}


def inproc(args: dict[str, Any]) -> dict[str, Any]:
    from serve_app import model as model_mod

    # "passes": `threads` single-threaded forward passes at once (the server's default layout);
    # "intra": one pass at a time on `threads` threads.
    layout = args.get("layout", "intra")
    workers = args["threads"] if layout == "passes" else 1
    intra_op = 1 if layout == "passes" else args["threads"]
    model_mod.configure_tf_threads(intra_op, workers)
    # The runtime x precision as a replica resolves it: "auto" reads the model's measured record.
    from serve_app.runtimes import resolve
    from serve_app.settings import ServerSettings

    precision = args.get("precision") or "fp32"
    # A setting named explicitly is measured even where the gate would refuse to serve it (that
    # is what is being measured); ``auto`` is never forced, so it picks as a replica does.
    settings = ServerSettings(
        runtime=args.get("runtime", "tensorflow"),
        precision=precision,
        force_precision=args.get("force", precision != "auto"),
    )
    serving = resolve(args["model_dir"], settings)
    precision, runtime = serving.precision, serving.runtime
    if runtime == "tensorflow":
        # The server's own switch, process-wide, set before any graph runs (as a replica does).
        model_mod.configure_precision(precision)
    # OpenVINO converts on first use (the bench runs `raypipe model optimize` first); not timed.
    model = model_mod.EmotionModel.load(
        args["model_dir"],
        precision=precision,
        runtime=runtime,
        threads=intra_op,
        streams=workers,
        recheck_margin=serving.margin,
    )
    _, texts = _read_corpus(args["corpus"], args["n"])
    counts = {"padded": 0, "real": 0, "passes": 0}
    run = model._run

    lock = threading.Lock()

    def counting(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with lock:
            counts["padded"] += int(input_ids.size)
            counts["real"] += int(attention_mask.sum())
            counts["passes"] += 1
        return run(input_ids, attention_mask)

    model._run = counting
    model.predict(texts[: args.get("warmup", 32)])  # first-run costs of TF, not of the model
    counts.update(padded=0, real=0, passes=0)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    predictions = _predict(model, texts, workers)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {
        "paragraphs": len(texts),
        "ok": len(texts),
        "wall_s": wall,
        "cpu_s_self": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "padded_tokens": counts["padded"],
        "real_tokens": counts["real"],
        "forward_passes": counts["passes"],
        "token_budget": model.token_budget,
        "max_sequence_length": model.card.max_sequence_length,
        "retries": 0,
        "precision": precision,
        "runtime": runtime,
        "layout": layout,
    }
    if args.get("return_top"):
        out["top"] = predictions.probabilities.argmax(axis=1).tolist()
        out["probabilities"] = np.round(predictions.probabilities, 6).tolist()
    return out


def _predict(model: Any, texts: list[str], workers: int) -> Any:
    """`model.predict(texts)`; with several workers, the length-sorted rows are cut into
    slices of about two passes each, which the workers take in order (as the server's model
    threads take batches)."""
    if workers == 1:
        return model.predict(texts)
    from concurrent.futures import ThreadPoolExecutor

    from serve_app.model import Predictions, Tokenized

    tokenized = model.tokenize(texts)
    order = sorted(range(len(texts)), key=lambda i: len(tokenized.ids[i]))
    slices, current, tokens = [], [], 0
    for i in order:
        current.append(i)
        tokens += len(tokenized.ids[i])
        if tokens >= 2 * model.token_budget:
            slices.append(current)
            current, tokens = [], 0
    if current:
        slices.append(current)

    def run(rows: list[int]) -> Any:
        part = Tokenized(ids=[tokenized.ids[i] for i in rows], truncated=tokenized.truncated[rows])
        return model.infer(part)

    probabilities = np.empty((len(texts), len(model.card.labels)), dtype=np.float32)
    with ThreadPoolExecutor(workers) as pool:
        for rows, predictions in zip(slices, pool.map(run, slices), strict=True):
            probabilities[rows] = predictions.probabilities
    return Predictions(probabilities=probabilities, truncated=tokenized.truncated)


async def _async_client(args: dict[str, Any]) -> dict[str, Any]:
    import grpc

    from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc

    ids, texts = _read_corpus(args["corpus"], args["n"])
    metadata = (("application", args["app"]),)
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    retries = failed = 0
    async with grpc.aio.insecure_channel(args["address"]) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)
        semaphore = asyncio.Semaphore(args["concurrency"])

        async def one(pid: str, text: str) -> None:
            nonlocal retries, failed
            request = emotion_pb2.ClassifyRequest(paragraphs=[emotion_pb2.Paragraph(id=pid, text=text)])
            async with semaphore:
                for attempt in range(args["attempts"]):
                    started = time.perf_counter()
                    try:
                        await stub.Classify(request, timeout=args["timeout_s"], metadata=metadata)
                    except grpc.aio.AioRpcError as e:
                        statuses[e.code().name] += 1
                        if e.code().name in _TRANSIENT and attempt + 1 < args["attempts"]:
                            retries += 1
                            continue
                        failed += 1
                        return
                    latencies.append(time.perf_counter() - started)
                    statuses["OK"] += 1
                    return

        started = time.perf_counter()
        await asyncio.gather(*(one(i, t) for i, t in zip(ids, texts, strict=True)))
        wall = time.perf_counter() - started
    return _client_result(len(ids), wall, statuses, latencies, retries, failed)


def _sync_client(args: dict[str, Any]) -> dict[str, Any]:
    import grpc

    from protos.raypipe.v1 import emotion_pb2, emotion_pb2_grpc

    ids, texts = _read_corpus(args["corpus"], args["n"])
    metadata = (("application", args["app"]),)
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    retries = failed = 0
    with grpc.insecure_channel(args["address"]) as channel:
        stub = emotion_pb2_grpc.EmotionClassifierStub(channel)
        begun = time.perf_counter()
        for pid, text in zip(ids, texts, strict=True):
            request = emotion_pb2.ClassifyRequest(paragraphs=[emotion_pb2.Paragraph(id=pid, text=text)])
            for attempt in range(args["attempts"]):
                started = time.perf_counter()
                try:
                    stub.Classify(request, timeout=args["timeout_s"], metadata=metadata)
                except grpc.RpcError as e:
                    statuses[e.code().name] += 1
                    if e.code().name in _TRANSIENT and attempt + 1 < args["attempts"]:
                        retries += 1
                        continue
                    failed += 1
                    break
                latencies.append(time.perf_counter() - started)
                statuses["OK"] += 1
                break
        wall = time.perf_counter() - begun
    return _client_result(len(ids), wall, statuses, latencies, retries, failed)


def _client_result(
    n: int, wall: float, statuses: Counter[str], latencies: list[float], retries: int, failed: int
) -> dict[str, Any]:
    return {
        "paragraphs": n,
        "ok": n - failed,
        "failed": failed,
        "wall_s": wall,
        "retries": retries,
        "status_counts": dict(statuses),
        "latency_ms": _percentiles_ms(latencies),
    }


def main(argv: list[str]) -> None:
    kind, args = argv[0], json.loads(argv[1])
    if kind == "inproc":
        result = inproc(args)
    elif kind == "async":
        result = asyncio.run(_async_client(args))
    elif kind == "sync":
        result = _sync_client(args)
    else:
        raise SystemExit(f"unknown line kind {kind!r}")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_self_bytes"] = usage.ru_maxrss * 1024
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

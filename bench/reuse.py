"""Reuse at scale: the driver's memory, the object store and the lookup rate of the reuse index.

    python -m bench.reuse [--texts 10000000,30000000] [--labels 6]

For each N, writes a Delta table of N distinct committed results (synthetic hashes: a bijection
of 0..N-1, so distinct by construction; random probabilities) under a temporary directory,
then, in a fresh child process of its own (so its peak RSS is the build's alone), starts a local Ray
cluster and builds the index with `raypipe.call.reuse.build_index` as a run's driver does (Ray
tasks; the shards in the object store). It reports the driver's peak RSS (`VmHWM`) and
its RSS before the build, the index's bytes in the object store, the build's seconds, and in
an actor (a separate process that maps the shards, as the inference actors do) the lookup
rate for batches of half hits, half misses, answers gathered. Writes
bench/results/reuse-<UTC>.json and .md with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.flops import cpu_info

RESULTS = Path(__file__).parent / "results"
LOOKUP_BATCH = 8_192
LOOKUP_HASHES = 2_000_000


def synthetic_hashes(i: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of `i` as int64: a bijection, so distinct ids give distinct hashes."""
    z = i.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def write_table(output: Path, n: int, labels: tuple[str, ...], *, rows_per_file: int = 2_000_000) -> float:
    """N committed results of model version `m1`, in files of `rows_per_file`; seconds taken."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import write_deltalake

    from raypipe.commit.schema import label_column, outcome_schema
    from raypipe.commit.table import OutcomeTable

    start = time.perf_counter()
    table = OutcomeTable(str(output))
    table.ensure(labels)
    schema = outcome_schema(labels)
    rng = np.random.default_rng(1)

    def constant(value: str, m: int) -> pa.Array:
        return pc.cast(pa.DictionaryArray.from_arrays(np.zeros(m, np.int32), [value]), pa.string())

    for lo in range(0, n, rows_per_file):
        m = min(rows_per_file, n - lo)
        given = {
            "outcome": constant("result", m),
            "run_id": constant("bench", m),
            "status": constant("ok", m),
            "model_version": constant("m1", m),
            "text_hash": pa.array(synthetic_hashes(np.arange(lo, lo + m))),
            "truncated": pa.array(rng.random(m) < 0.01),
            **{label_column(x): pa.array(rng.random(m, dtype=np.float32)) for x in labels},
        }
        cols = [given.get(f.name, pa.nulls(m, f.type)) for f in schema]
        write_deltalake(table.uri, pa.table(cols, schema=schema), mode="append", partition_by=["run_id"])
    return time.perf_counter() - start


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _build_child(output: str, n: int, labels: tuple[str, ...], queue: Any) -> None:
    """The run's driver: a local Ray cluster, `build_index`, and one actor's lookups."""
    import ray

    from raypipe.call.reuse import build_index

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        # VmHWM, the peak RSS of this process's own memory map: ru_maxrss would carry over the
        # parent's peak through fork and exec.
        before_kib = _status_kib("VmHWM")
        start = time.perf_counter()
        index, stats = build_index(output, "m1", labels, max_rows=1 << 62, use_ray=True)
        build_s = time.perf_counter() - start
        peak_kib = _status_kib("VmHWM")
        assert index is not None and stats.distinct_texts == n and not stats.capped, stats
        ref = ray.put(index)  # what the run hands its actors
        # The reference travels inside a list, so the task gets the reference and maps the index
        # itself, as an actor does from its settings.
        from bench import reuse  # by module name: Ray's workers cannot import a spawned child's __main__

        lookup = ray.get(ray.remote(num_cpus=1)(reuse._lookup_rate_impl).remote([ref], n))
        queue.put(
            {
                "texts": n,
                "labels": len(labels),
                "driver_rss_before_build_mib": before_kib / 1024,
                "driver_peak_rss_mib": peak_kib / 1024,
                "driver_rss_end_mib": {
                    "anon": _status_kib("RssAnon") / 1024,
                    "shmem": _status_kib("RssShmem") / 1024,
                    "file": _status_kib("RssFile") / 1024,
                },
                "build_s": build_s,
                "object_store_bytes": stats.index_bytes,
                "object_store_bytes_per_text": stats.index_bytes / n,
                "shards": stats.shards,
                "rows_read": stats.rows_read,
                "lookup": lookup,
            }
        )
    finally:
        ray.shutdown()


def _lookup_rate_impl(ref_holder: list[Any], n: int) -> dict[str, Any]:
    import ray

    start = time.perf_counter()
    index = ray.get(ref_holder[0]).load()
    map_s = time.perf_counter() - start
    rng = np.random.default_rng(2)
    hits = synthetic_hashes(rng.integers(0, n, LOOKUP_HASHES // 2))
    misses = synthetic_hashes(rng.integers(n, 2 * n + 1, LOOKUP_HASHES // 2))  # never committed
    probe = np.concatenate([hits, misses])
    rng.shuffle(probe)
    found_total = 0
    start = time.perf_counter()
    for lo in range(0, len(probe), LOOKUP_BATCH):
        pos = index.lookup(probe[lo : lo + LOOKUP_BATCH])
        hit = pos >= 0
        _ = index.probabilities[pos[hit]], index.truncated[pos[hit]]
        found_total += int(hit.sum())
    took = time.perf_counter() - start
    assert found_total == LOOKUP_HASHES // 2, found_total
    return {
        "batch": LOOKUP_BATCH,
        "hashes": len(probe),
        "hit_share": found_total / len(probe),
        "hashes_per_s": len(probe) / took,
        "map_s": map_s,
        "actor_rss_mib": {"anon": _status_kib("RssAnon") / 1024, "shmem": _status_kib("RssShmem") / 1024},
    }


def measure(n: int, labels: tuple[str, ...], work: Path) -> dict[str, Any]:
    output = work / f"table-{n}"
    write_s = write_table(output, n, labels)
    parquet_bytes = sum(p.stat().st_size for p in (output / "outcomes").rglob("*.parquet"))
    queue: Any = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_build_child, args=(str(output), n, labels, queue))
    child.start()
    line = None
    while line is None:
        try:
            line = queue.get(timeout=5)
        except Exception:  # queue.Empty: a child that died says nothing more
            if not child.is_alive():
                raise RuntimeError(f"the build's process exited {child.exitcode} without a line") from None
    child.join(timeout=120)
    shutil.rmtree(output, ignore_errors=True)
    return {**line, "write_s": write_s, "parquet_bytes": parquet_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="10000000,30000000", help="distinct texts per line, comma-separated")
    parser.add_argument("--labels", type=int, default=6)
    parser.add_argument("--project", type=int, default=95_000_000, help="N to project the figures to")
    args = parser.parse_args()
    labels = tuple(f"label{k}" for k in range(args.labels))
    sizes = [int(x) for x in args.texts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="raypipe-reuse-"))
    try:
        lines = [measure(n, labels, work) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    projection = _project(lines, args.project)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {
        "bench": "reuse",
        "utc": stamp,
        "cpu": cpu_info(),
        "cpus": os.cpu_count(),
        "command": "python -m bench.reuse --texts " + args.texts,
        "lines": lines,
        "projection": projection,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"reuse-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"reuse-{stamp}.md").write_text(_markdown(result))
    print(_markdown(result))
    print(f"written bench/results/reuse-{stamp}.json and .md")


def _project(lines: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """A straight line through the measured points (a projection, not a measurement)."""
    xs = np.array([line["texts"] for line in lines], dtype=float)
    out: dict[str, Any] = {"texts": n, "measured": False}
    for key in ("driver_peak_rss_mib", "build_s"):
        ys = np.array([line[key] for line in lines], dtype=float)
        if len(xs) >= 2:
            slope, icept = np.polyfit(xs, ys, 1)
            out[key] = float(icept + slope * n)
            out[key + "_per_million_texts"] = float(slope * 1e6)
    per_text = lines[-1]["object_store_bytes_per_text"]
    out["object_store_bytes"] = per_text * n
    return out


def _markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    rows = [
        f"# Reuse index at scale ({result['utc']})",
        "",
        f"CPU: {cpu.get('model')}, {result['cpus']} cores, flags {' '.join(cpu.get('flags', []))}",
        f"Command: `{result['command']}`",
        "",
        "| distinct texts | driver peak RSS (MiB) | driver RSS before build (MiB) | object store (MiB) | shards "
        "| build (s) "
        "| actor lookups/s (batch) | actor map (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in result["lines"]:
        lk = line["lookup"]
        rows.append(
            f"| {line['texts']:,} | {line['driver_peak_rss_mib']:.0f} | {line['driver_rss_before_build_mib']:.0f} "
            f"| {line['object_store_bytes'] / 2**20:.0f} | {line['shards']} | {line['build_s']:.1f} "
            f"| {lk['hashes_per_s'] / 1e6:.2f} M ({lk['batch']}) | {lk['map_s']:.2f} |"
        )
    p = result["projection"]
    if "driver_peak_rss_mib" in p:
        rows += [
            "",
            f"Projection to {p['texts']:,} texts (a straight line through the rows above, not measured): driver peak "
            f"RSS {p['driver_peak_rss_mib']:.0f} MiB ({p['driver_peak_rss_mib_per_million_texts']:.2f} MiB per "
            f"million texts), build {p['build_s']:.0f} s, object store {p['object_store_bytes'] / 2**30:.2f} GiB.",
        ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()

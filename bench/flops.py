"""Model FLOPs per paragraph, the machine's GEMM rate, and the CPU it was measured on.

Useful FLOPs count what a BERT encoder must do for a paragraph's real (unpadded, truncated)
tokens: multiply-adds of the Q/K/V/O projections and the feed-forward layers, plus the two
attention products, 2 FLOPs per multiply-add. Padding, softmax, layer norms and the
embedding lookup are not useful work and not counted. Dividing useful FLOP/s by the measured
fp32 GEMM rate at the model's own matrix shapes gives the hardware utilisation.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Shape", "cpu_info", "measure_gemm", "useful_flops"]

_INTERESTING_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "avx512_fp16",
)


@dataclass(frozen=True)
class Shape:
    """A BERT encoder's shape and the length it truncates to."""

    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    max_length: int
    labels: int = 6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def useful_flops(shape: Shape, tokens: int) -> float:
    """FLOPs of one paragraph of ``tokens`` real tokens (already truncated) through ``shape``."""
    h, i, t = shape.hidden, shape.intermediate, tokens
    per_layer = 2 * t * (4 * h * h + 2 * h * i) + 2 * 2 * t * t * h
    head = 2 * h * h + 2 * h * shape.labels  # pooler + classifier, on [CLS] only
    return float(shape.layers * per_layer + head)


def gemm_shapes(shape: Shape, rows: int = 4096) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's dense layers for a batch of ``rows`` tokens."""
    h, i = shape.hidden, shape.intermediate
    return [(rows, h, h), (rows, h, i), (rows, i, h)]


def _rate(fn: Any, flops: float, min_seconds: float) -> float:
    fn()  # first call: allocation, library start-up
    runs, started = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return runs * flops / elapsed


def measure_gemm(shape: Shape, *, threads: int, min_seconds: float = 1.0) -> dict[str, Any]:
    """fp32 matmul FLOP/s with numpy and TensorFlow at the model's shapes; best of the two.

    Call in a fresh process: it fixes TensorFlow's thread pools.
    """
    from serve_app._tf import tensorflow

    tf = tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    per_shape = []
    for m, k, n in gemm_shapes(shape):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        flops = 2.0 * m * k * n
        ta, tb = tf.constant(a), tf.constant(b)
        per_shape.append(
            {
                "m": m,
                "k": k,
                "n": n,
                "numpy_flops_per_s": _rate(lambda a=a, b=b: a @ b, flops, min_seconds),
                "tf_flops_per_s": _rate(lambda ta=ta, tb=tb: tf.linalg.matmul(ta, tb).numpy(), flops, min_seconds),
            }
        )
    # Harmonic means weighted by each shape's FLOPs: the rate a model made of these would see.
    weights = [2.0 * s["m"] * s["k"] * s["n"] for s in per_shape]
    rates = {}
    for lib in ("numpy", "tf"):
        rates[lib] = sum(weights) / sum(w / s[f"{lib}_flops_per_s"] for w, s in zip(weights, per_shape, strict=True))
    return {
        "threads": threads,
        "shapes": per_shape,
        "numpy_flops_per_s": rates["numpy"],
        "tf_flops_per_s": rates["tf"],
        "flops_per_s": max(rates.values()),
        "numpy_blas": _numpy_blas(),
    }


def _numpy_blas() -> str:
    try:
        config = np.show_config(mode="dicts")
        blas = config.get("Build Dependencies", {}).get("blas", {})
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except (TypeError, AttributeError):
        return "unknown"


def cpu_info() -> dict[str, Any]:
    """CPU model, core counts and the SIMD/matrix flags that decide bf16/int8 paths."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "flags": sorted(f for f in _INTERESTING_FLAGS if f in flags),
        "machine": platform.machine(),
    }


if __name__ == "__main__":
    # python -m bench.flops SHAPE_JSON THREADS: print the GEMM measurement as JSON.
    print(json.dumps(measure_gemm(Shape(**json.loads(sys.argv[1])), threads=int(sys.argv[2]))))

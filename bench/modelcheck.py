"""The long run of the model-based test that searches for loss (tests/unit/test_model_based.py).

`make test` runs the state machine at a bounded number of examples; this runs it for
`--examples` (20,000 by default) in chunks of `--chunk`, each in a process of its own with a
seed of its own (`--seed` + the chunk's number), so a failure can be run again from its seed
and a chunk's memory and scratch files go with its process. After every chunk the results file
(`--out`, default `bench/results/mbt-<UTC stamp>.json`) is written again: examples and steps
run, failures (with the story Hypothesis printed), seconds, CPU seconds and the CPU model.

The run is resumable: given an existing `--out`, it skips the chunks recorded there. With
`--max-seconds` it starts no chunk after that budget is spent, so a run under a shared lock
can be cut into holds of bounded length and continued:

    python -m bench.modelcheck --examples 20000 --max-seconds 540 --out bench/results/mbt-x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "run_chunk", "run_modelcheck"]

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def chunk_here(examples: int, seed: int) -> dict[str, Any]:
    """Runs one chunk in this process; returns examples, steps and the failure (or None)."""
    from hypothesis import seed as with_seed
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from tests.unit.test_model_based import LossSearch

    counts = {"examples": 0, "steps": 0}

    class Counted(LossSearch):
        def check_invariants(self, *args: Any, **kwargs: Any) -> None:
            counts["steps"] += 1  # once after each step, the initial one included
            super().check_invariants(*args, **kwargs)

        def teardown(self) -> None:
            counts["examples"] += 1
            super().teardown()

    chunk_settings = settings(LossSearch.TestCase.settings, max_examples=examples, database=None, print_blob=True)
    failure = notes = None
    try:
        run_state_machine_as_test(with_seed(seed)(Counted), settings=chunk_settings)
    except BaseException as e:  # the failure is the result; the next chunk runs anyway
        failure = f"{type(e).__name__}: {e}"
        # Hypothesis attaches the shrunk steps and the reproduce blob to the exception as notes
        # (it does not print them), so they travel in the result, not in the process's output.
        notes = "\n".join(getattr(e, "__notes__", [])) or None
    return {**counts, "failure": failure, "notes": notes}


def run_chunk(examples: int, seed: int) -> dict[str, Any]:
    """One chunk in a process of its own: its counts, seconds and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "bench.modelcheck", "--one-chunk", str(seed), "--chunk", str(examples)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        out = {"examples": 0, "steps": 0, "failure": f"the chunk's process ended with rc {done.returncode}"}
    notes = out.pop("notes", None)
    if out["failure"] is not None:  # the shrunk steps and blob, else the output's tail
        out["story"] = notes or (done.stdout + done.stderr)[-20000:]
    return {"seed": seed, **out, "seconds": round(seconds, 1), "cpu_s": round(cpu, 1), "commit": _commit()}


def summary(chunks: list[dict[str, Any]], target: int) -> dict[str, Any]:
    return {
        "target_examples": target,
        "examples": sum(c["examples"] for c in chunks),
        "steps": sum(c["steps"] for c in chunks),
        "failures": sum(c["failure"] is not None for c in chunks),
        "seconds": round(sum(c["seconds"] for c in chunks), 1),
        "cpu_s": round(sum(c["cpu_s"] for c in chunks), 1),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The commit the chunks ran (a run resumed after a change mixes two: each chunk has its own)."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def run_modelcheck(
    examples: int, out: Path, *, chunk: int = 500, seed: int = 0, max_seconds: float | None = None
) -> dict[str, Any]:
    """Runs the chunks `out` does not record yet (rewriting it after each); returns its content."""
    done: list[dict[str, Any]] = json.loads(out.read_text())["chunks"] if out.exists() else []
    seeds = {c["seed"] for c in done}
    started = time.monotonic()
    for n in range(-(-examples // chunk)):
        if seed + n in seeds:
            continue
        if max_seconds is not None and time.monotonic() - started >= max_seconds:
            break
        done.append(run_chunk(min(chunk, examples - n * chunk), seed + n))
        result = {"summary": summary(done, examples), "chunks": done}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in done[-1].items() if k != "story"}), flush=True)
    return {"summary": summary(done, examples), "chunks": done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--chunk", type=int, default=500, help="examples per process")
    parser.add_argument("--seed", type=int, default=0, help="the first chunk's seed; chunk n runs seed + n")
    parser.add_argument("--out", type=Path, default=None, help="results file; an existing one is resumed")
    parser.add_argument("--max-seconds", type=float, default=None, help="start no chunk after this")
    parser.add_argument("--one-chunk", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_chunk is not None:
        print(json.dumps(chunk_here(args.chunk, args.one_chunk)))
        return 0
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "bench" / "results" / f"mbt-{stamp}.json"
    result = run_modelcheck(args.examples, out, chunk=args.chunk, seed=args.seed, max_seconds=args.max_seconds)
    print(json.dumps(result["summary"]))
    print(f"results: {out}")
    return 1 if result["summary"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

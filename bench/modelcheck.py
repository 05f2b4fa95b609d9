"""The long run of the model-based test that searches for loss (tests/unit/test_model_based.py).

`make test` runs the state machine at a bounded number of examples; this runs it at
`--examples` (20,000 by default) in a pytest process of its own, derandomized with a seed so a
failure can be run again, and writes the outcome (examples, seconds, pass or the failing
story) as JSON to `--out` (default `bench/results/modelcheck-<UTC stamp>.json`).

    python -m bench.modelcheck --examples 20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["run_modelcheck"]

ROOT = Path(__file__).resolve().parent.parent


def run_modelcheck(examples: int, *, seed: int = 0) -> dict[str, object]:
    """Runs the state machine for `examples` examples; returns what happened."""
    env = {**os.environ, "RAYPIPE_MODELCHECK_EXAMPLES": str(examples), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/unit/test_model_based.py",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--hypothesis-seed={seed}",
    ]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds = round(time.monotonic() - t0, 1)
    return {
        "examples": examples,
        "seed": seed,
        "seconds": seconds,
        "passed": done.returncode == 0,
        "output": done.stdout[-20000:] if done.returncode else done.stdout.strip().splitlines()[-1:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run_modelcheck(args.examples, seed=args.seed)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "bench" / "results" / f"modelcheck-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "output"}))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

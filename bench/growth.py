"""The growth line: many dailies over one output, and whether what each costs stays flat.

A corpus of `--files` small Parquet files is backfilled once; then `--dailies` dailies run, each
after a producer added one file and rewrote one in place (a changed file is read whole). After
each daily it records the size of the table's log (`outcomes/_delta_log`), of raypipe's state
beside it (`_raypipe/`), the number of files in each, what opening a snapshot reads (the log
entries after the last checkpoint, the checkpoint's bytes), and the daily's planning and wall time.
The runs go through the real run path (modes, protocol, Delta table on a local disk) with the
model-based test's seams: units inferred in this process by a fake model client, no Ray, so
the figures are the bookkeeping's, not the model's.

    python -m bench.growth --files 50000 --dailies 1000

writes `bench/results/growth-<UTC stamp>.json` (after every sample, so a run stopped early keeps
what it measured): a row per sampled daily and the ratio of the last sample to the first for each
figure (flat is ~1; growth with the history is >> 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

__all__ = ["run_growth"]

ROOT = Path(__file__).resolve().parent.parent


def _tree(path: Path) -> tuple[int, int]:
    """(bytes, files) under `path`."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return sum(p.stat().st_size for p in files), len(files)


def _log_tail(log: Path) -> tuple[int, int]:
    """(log entries after the last checkpoint, the checkpoint's bytes): what opening a snapshot
    reads. The log's files on disk are bounded by its retention in time (30 days), which a bench
    that runs a thousand dailies in an hour does not reach, so this is the figure that stays flat."""
    marker = log / "_last_checkpoint"
    version = json.loads(marker.read_text())["version"] if marker.exists() else -1
    tail = sum(1 for p in log.glob("*.json") if int(p.stem) > version)
    checkpoint = sum(p.stat().st_size for p in log.glob(f"{version:020d}.checkpoint*.parquet"))
    return tail, checkpoint


def run_growth(files: int, dailies: int, *, samples: int = 20, results: Path | None = None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from raypipe.run.steps import PlanRun
    from tests.modelcheck.reference import Row
    from tests.modelcheck.world import World

    planned: list[float] = []
    plan = PlanRun.plan

    def timed_plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return plan(self, *args, **kwargs)
        finally:
            planned.append(time.monotonic() - started)

    PlanRun.plan = timed_plan  # type: ignore[method-assign]
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    with tempfile.TemporaryDirectory(prefix="raypipe-growth-") as tmp:
        world = World(Path(tmp), unit_rows=1000)
        try:
            for k in range(files):
                world.write_file(f"f{k:06d}.parquet", [Row(f"r{k}", f"text {k}", t0)])
            started = time.monotonic()
            out = world.run("backfill", "backfill-0")
            if out.error is not None:
                raise RuntimeError(f"the backfill failed: {out.error!r}")
            backfill_s = time.monotonic() - started
            every = max(1, dailies // samples)
            rows: list[dict[str, Any]] = []
            for day in range(1, dailies + 1):
                stamp = t0 + timedelta(days=day)
                world.write_file(f"new{day:06d}.parquet", [Row(f"n{day}", f"new text {day}", stamp)])
                k = day % files
                world.write_file(f"f{k:06d}.parquet", [Row(f"r{k}", f"text {k} day {day}", stamp)])
                started = time.monotonic()
                out = world.run("daily", f"daily-{day}")
                wall = time.monotonic() - started
                if out.error is not None or out.report is None or out.report.status != "completed":
                    raise RuntimeError(f"daily {day} did not complete: {out.error!r}")
                if day == 1 or day % every == 0 or day == dailies:
                    log_bytes, log_files = _tree(world.output / "outcomes" / "_delta_log")
                    log_tail, checkpoint_bytes = _log_tail(world.output / "outcomes" / "_delta_log")
                    state_bytes, state_files = _tree(world.output / "_raypipe")
                    rows.append(
                        {
                            "daily": day,
                            "wall_s": round(wall, 3),
                            "planning_s": round(planned[-1], 3),
                            "calls": len(out.calls),
                            "log_bytes": log_bytes,
                            "log_files": log_files,
                            "log_tail": log_tail,
                            "checkpoint_bytes": checkpoint_bytes,
                            "state_bytes": state_bytes,
                            "state_files": state_files,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
                    if results is not None:  # a run stopped early keeps what it measured
                        results.write_text(json.dumps(_result(files, dailies, backfill_s, rows), indent=1) + "\n")
        finally:
            world.close()
            PlanRun.plan = plan  # type: ignore[method-assign]
    return _result(files, dailies, backfill_s, rows)


def _result(files: int, dailies: int, backfill_s: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    first, last = rows[0], rows[-1]

    def ratio(key: str) -> float | None:
        a, b = first.get(key), last.get(key)
        return None if not a or b is None else round(b / a, 3)

    return {
        "files": files,
        "dailies": dailies,
        "dailies_done": last["daily"],
        "backfill_s": round(backfill_s, 1),
        "samples": rows,
        "last_over_first": {
            k: ratio(k) for k in ("wall_s", "planning_s", "log_bytes", "checkpoint_bytes", "state_bytes", "state_files")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--dailies", type=int, default=1_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "bench" / "results" / f"growth-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_growth(args.files, args.dailies, samples=args.samples, results=out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["last_over_first"]))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

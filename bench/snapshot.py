"""What a unit commit costs as a run goes on: one delta-rs snapshot moved incrementally, against
one opened anew, against raypipe's `OutcomeTable.refresh` (which opens it anew every
`REOPEN_AFTER` versions).

A run commits every unit through one snapshot of the outcomes table (`UnitCommitter` asks
`OutcomeTable.refresh` before each commit). This appends `--commits` one-row units, each with its
app transaction as a unit commit carries, to a fresh local table (`delta.checkpointInterval` as
raypipe sets it), three ways, and reports the seconds per commit in each fifth of the run:

- `incremental`: one `DeltaTable`, `update_incremental` before each commit (raypipe before
  `REOPEN_AFTER`);
- `reopened`: a `DeltaTable` opened anew before each commit;
- `refresh`: `OutcomeTable.refresh` before each commit.

Flat is a last fifth about as costly as the first (the table's files grow, so some rise is the
table's); growth with the commits made is a last fifth many times the first.

    python -m bench.snapshot [--commits 1000]

writes bench/results/snapshot-<UTC stamp>.json with the CPU model and the deltalake version.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["run_snapshot"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _fifths(way: str, commits: int, folder: Path) -> list[float]:
    import pyarrow as pa
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    from raypipe.commit.table import CHECKPOINT_INTERVAL, OutcomeTable

    uri = str(folder / way / "outcomes")
    schema = pa.schema([("id", pa.string()), ("run_id", pa.string()), ("unit", pa.string())])
    first = pa.table({"id": ["a"], "run_id": ["r0"], "unit": ["u"]}, schema=schema)
    write_deltalake(
        uri, first, partition_by=["run_id"], configuration={"delta.checkpointInterval": str(CHECKPOINT_INTERVAL)}
    )
    table, dt = OutcomeTable(str(folder / way)), DeltaTable(uri)
    step = max(1, commits // 5)
    fifths: list[float] = []
    started = time.perf_counter()
    for i in range(commits):
        if way == "incremental":
            dt.update_incremental()
        elif way == "reopened":
            dt = DeltaTable(uri)
        else:
            dt = table.refresh()
        rows = pa.table({"id": [f"x{i}"], "run_id": ["r1"], "unit": [f"u{i}"]}, schema=schema)
        props = CommitProperties(app_transactions=[Transaction(f"raypipe-unit-{i}", 1)])
        write_deltalake(dt, rows, mode="append", partition_by=["run_id"], commit_properties=props)
        if (i + 1) % step == 0:
            fifths.append(round((time.perf_counter() - started) / step, 4))
            started = time.perf_counter()
    return fifths


def run_snapshot(commits: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import deltalake

    from bench.modelcheck import cpu_model
    from raypipe.commit.table import REOPEN_AFTER

    ways: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raypipe-snapshot-") as tmp:
        for way in ("incremental", "reopened", "refresh"):
            fifths = _fifths(way, commits, Path(tmp))
            ways[way] = {"s_per_commit_by_fifth": fifths, "last_over_first": round(fifths[-1] / fifths[0], 2)}
            print(way, ways[way], flush=True)
    return {
        "commits": commits,
        "reopen_after": REOPEN_AFTER,
        "ways": ways,
        "cpu_model": cpu_model(),
        "deltalake": deltalake.__version__,
        "at": datetime.now(UTC).isoformat(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or RESULTS / f"snapshot-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    results = run_snapshot(args.commits)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

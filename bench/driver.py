"""The driver's memory and time for a run of many units (50k units: a 95M-row backfill).

Builds a plan of N units (as a backfill of N x 2,000 rows would) and measures what the driver
holds for it; then writes an outcomes table whose log references N unit files (one commit;
the log is what the driver reads, the files themselves are not opened) and measures listing
the committed units from the log's file statistics, and folding N unit summaries into the
attempt's statistics. Python-heap peaks from `tracemalloc` (the driver's own allocations).
"""

from __future__ import annotations

import json
import tempfile
import time
import tracemalloc
from typing import Any

__all__ = ["run_driver_memory"]


def run_driver_memory(units: int = 50_000) -> dict[str, Any]:
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction

    from raypipe.commit.table import OutcomeTable
    from raypipe.plan.planning import Plan
    from raypipe.plan.units import WorkUnit
    from raypipe.report import AttemptStats, UnitStats

    out: dict[str, Any] = {"units": units}
    with tempfile.TemporaryDirectory(prefix="raypipe-driver-") as tmp:
        tracemalloc.start()
        plan = Plan(
            "backfill",
            "s3://corpus/in/",
            [
                WorkUnit(f"s3://corpus/in/part-{i // 50:05d}.parquet", "parquet", (i % 50) * 2000, (i % 50 + 1) * 2000)
                for i in range(units)
            ],
            [],
        )
        text = json.dumps(plan.to_dict())
        _, out["plan_peak_mb"] = (x / 1e6 for x in tracemalloc.get_traced_memory())
        tracemalloc.stop()
        out["plan_json_mb"] = round(len(text) / 1e6, 2)
        del text

        table = OutcomeTable(tmp)
        table.ensure(("joy", "sadness"))
        dt = DeltaTable(table.uri)
        now = int(time.time() * 1000)
        adds = [
            AddAction(
                f"run_id=r/{u.key}.parquet",
                10_000,
                {"run_id": "r"},
                now,
                True,
                json.dumps({"numRecords": 2000, "minValues": {"unit": u.key}, "maxValues": {"unit": u.key}}),
            )
            for u in plan.units
        ]
        dt.create_write_transaction(adds, mode="append", schema=dt.schema(), partition_by=["run_id"])  # type: ignore[arg-type]
        del adds

        tracemalloc.start()
        started = time.monotonic()
        done = table.committed_units("r")
        out["list_committed_s"] = round(time.monotonic() - started, 2)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out["list_committed_peak_mb"] = round(peak / 1e6, 2)
        out["units_listed"] = len(done)

        sample = UnitStats(unit="u", shard="s", attempt="a", actor="actor", rows=2000, ok=2000, calls=63)
        sample.status_counts["OK"] = 63
        for ms in (40, 55, 80, 120):
            sample.latency.add(ms / 1000)
        marker = json.dumps(sample.to_dict())
        tracemalloc.start()
        started = time.monotonic()
        attempt = AttemptStats()
        for _ in range(units):
            attempt.add(UnitStats.from_dict(json.loads(marker)))
        out["fold_s"] = round(time.monotonic() - started, 1)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out["fold_peak_mb"] = round(peak / 1e6, 2)
        out["rows_folded"] = attempt.rows
    out["plan_peak_mb"] = round(out["plan_peak_mb"], 2)
    return out


if __name__ == "__main__":
    print(json.dumps(run_driver_memory(), indent=1))

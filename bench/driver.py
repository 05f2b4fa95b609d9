"""The driver's memory for a run of many units (run-mode hardening, item 6).

Builds a plan of N units (as a backfill of N × 2,000 rows would), stores it, writes N commit
markers to a local output, then measures what the driver holds: the plan, the listing of
committed keys, and the streamed fold of every marker into the run report. Python-heap
peaks from `tracemalloc`, so the figure is the driver's own allocation, not the interpreter's.
"""

from __future__ import annotations

import json
import tempfile
import time
import tracemalloc
from typing import Any

__all__ = ["run_driver_memory"]


def run_driver_memory(units: int = 50_000) -> dict[str, Any]:
    from raypipe.modes import _Plan
    from raypipe.report import RunReport, UnitStats
    from raypipe.sinks import committed_keys, iter_committed
    from raypipe.sources import WorkUnit
    from raypipe.store import OutputStore

    out: dict[str, Any] = {"units": units}
    with tempfile.TemporaryDirectory(prefix="raypipe-driver-") as tmp:
        store = OutputStore(tmp)
        tracemalloc.start()
        plan = _Plan(
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
        store.write_bytes(store.run_state("r", "plan.json"), text.encode())
        del text

        sample = UnitStats(unit="u", shard="s", attempt="a", actor="actor", rows=2000, ok=2000, calls=63)
        sample.status_counts["OK"] = 63
        for ms in (40, 55, 80, 120):
            sample.latency.add(ms / 1000)
        marker = json.dumps(sample.to_dict()).encode()
        for u in plan.units:
            store.write_bytes(store.run_state("r", "units", f"{u.key}.json"), marker)

        tracemalloc.start()
        started = time.monotonic()
        keys = committed_keys(store, "r")
        report = RunReport(run_id="r", mode="backfill")
        report.merge_units(iter_committed(store, "r", keys))
        out["fold_s"] = round(time.monotonic() - started, 1)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out["fold_peak_mb"] = round(peak / 1e6, 2)
        out["rows_folded"] = report.rows_in
    out["plan_peak_mb"] = round(out["plan_peak_mb"], 2)
    return out


if __name__ == "__main__":
    print(json.dumps(run_driver_memory(), indent=1))

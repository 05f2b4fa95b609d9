"""The growth line: many dailies over one output, and whether what each costs stays flat.

A corpus of `--files` small Parquet files is backfilled once; then `--dailies` dailies run, each
after a producer added one file and rewrote one in place (a changed file is read whole). After
each daily it records the size of the table's log (`outcomes/_delta_log`), of raypipe's state
beside it (`_raypipe/`), the number of files in each, what opening a snapshot reads (the log
entries after the last checkpoint, the checkpoint's bytes), the daily's planning and wall time,
and what its reuse index read (the stored index's rows, and the table's files and log entries
committed since: `raypipe.call.reuse.StoredIndex`) and the stored index's size on disk.
The runs go through the real run path (modes, protocol, Delta table on a local disk) with the
model-based test's seams: units inferred in this process by a fake model client, no Ray, so
the figures are the bookkeeping's, not the model's.

Time is compressed: a daily runs in about two seconds, so the table's retentions (log entries
30 days, expiring transactions 90 days, removed files 7 days) would never pass. With `--day-s S`
the bench sets them to as many times S seconds, through the table's own properties as a user
would (`DeltaTable.alter.set_table_properties` after the backfill), and every `--maintain-every`
dailies it runs `raypipe compact` and `raypipe vacuum` (retention 0, forced: the bench's only
writer is between dailies), as the maintenance CronJob does weekly. The results file says so.

    python -m bench.growth --files 50000 --dailies 1000
    python -m bench.growth --files 50000 --dailies 1000 --state DIR --minutes 9 --out FILE   # in parts:
    # the same command again goes on from DIR where the last part stopped, adding to FILE

writes `bench/results/growth-<UTC stamp>.json` (after every sample, so a run stopped early keeps
what it measured): a row per sampled daily and the ratio of the last sample to the first for each
figure (flat is ~1; growth with the history is >> 1).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
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


def run_growth(
    files: int,
    dailies: int,
    *,
    samples: int = 20,
    results: Path | None = None,
    state: Path | None = None,
    minutes: float | None = None,
    day_s: float = 2.0,
    maintain_every: int = 7,
) -> dict[str, Any]:
    """The backfill and the dailies; with `state`, the output and the progress are kept there
    after every daily, so a run stopped (by `minutes`, or killed) goes on where it was with
    the same `state`. `day_s` and `maintain_every`: see the module's docstring (0: off)."""
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
    until = time.monotonic() + minutes * 60 if minutes else None
    with contextlib.ExitStack() as stack:
        root = state or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raypipe-growth-")))
        progress_file = root / "progress.json"
        progress = json.loads(progress_file.read_text()) if progress_file.exists() else None
        properties = _compressed(day_s)
        settings: dict[str, Any] = {"day_s": day_s, "maintain_every": maintain_every, "table_properties": properties}
        if progress is not None and (progress["files"], progress["dailies"]) != (files, dailies):
            raise SystemExit(f"{root} holds a run of --files {progress['files']} --dailies {progress['dailies']}")
        if progress is not None and progress.get("settings", settings) != settings:
            raise SystemExit(f"{root} holds a run with other settings: {progress.get('settings')}")
        # The world's seams, over the kept input and output when resuming (its clock of file
        # modification times goes on from where it was).
        world = World(
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raypipe-growth-world-"))), unit_rows=1000
        )
        world.input, world.output = root / "in", root / "out"
        world.input.mkdir(parents=True, exist_ok=True)
        if progress is not None:
            world._mtime = itertools.count(progress["mtime"], 1_000_000_000)
        stack.callback(world.close)
        stack.callback(setattr, PlanRun, "plan", plan)

        def save(day: int, backfill_s: float, rows: list[dict[str, Any]]) -> None:
            if state is None:
                return
            mtime = next(world._mtime)
            world._mtime = itertools.count(mtime, 1_000_000_000)
            done = {
                "files": files,
                "dailies": dailies,
                "day": day,
                "backfill_s": backfill_s,
                "rows": rows,
                "mtime": mtime,
                "settings": settings,
                "maintenance_s": maintenance_s,
            }
            progress_file.write_text(json.dumps(done))

        if progress is None:
            for k in range(files):
                world.write_file(f"f{k:06d}.parquet", [Row(f"r{k}", f"text {k}", t0)])
            started = time.monotonic()
            out = world.run("backfill", "backfill-0")
            if out.error is not None:
                raise RuntimeError(f"the backfill failed: {out.error!r}")
            backfill_s = time.monotonic() - started
            if properties:
                from deltalake import DeltaTable

                DeltaTable(str(world.output / "outcomes")).alter.set_table_properties(properties)
            rows: list[dict[str, Any]] = []
            maintenance_s: list[float] = []
            first_day = 1
            save(0, backfill_s, rows)
        else:
            backfill_s, rows, first_day = progress["backfill_s"], progress["rows"], progress["day"] + 1
            maintenance_s = progress.get("maintenance_s", [])
        every = max(1, dailies // samples)
        for day in range(first_day, dailies + 1):
            if until is not None and time.monotonic() > until:
                print(f"stopped after daily {day - 1} (--minutes); go on with --state {root}", flush=True)
                break
            stamp = t0 + timedelta(days=day)
            world.write_file(f"new{day:06d}.parquet", [Row(f"n{day}", f"new text {day}", stamp)])
            k = day % files
            world.write_file(f"f{k:06d}.parquet", [Row(f"r{k}", f"text {k} day {day}", stamp)])
            started = time.monotonic()
            out = world.run("daily", f"daily-{day}")
            wall = time.monotonic() - started
            if out.error is not None or out.report is None or out.report.status != "completed":
                raise RuntimeError(f"daily {day} did not complete: {out.error!r}")
            if maintain_every and day % maintain_every == 0:
                started = time.monotonic()
                world.compact()
                world.vacuum()
                maintenance_s.append(round(time.monotonic() - started, 3))
            if day == 1 or day % every == 0 or day == dailies:
                log_bytes, log_files = _tree(world.output / "outcomes" / "_delta_log")
                log_tail, checkpoint_bytes = _log_tail(world.output / "outcomes" / "_delta_log")
                state_bytes, state_files = _tree(world.output / "_raypipe")
                index_bytes, index_files = _tree(world.output / "_raypipe" / "reuse_index")
                index = (out.report.planning or {}).get("reuse_index", {})
                from deltalake import DeltaTable

                table_files = len(DeltaTable(str(world.output / "outcomes")).file_uris())
                rows.append(
                    {
                        "daily": day,
                        "wall_s": round(wall, 3),
                        "planning_s": round(planned[-1], 3),
                        "calls": len(out.calls),
                        "input_files": files + day,
                        "table_files": table_files,
                        "last_maintenance_s": maintenance_s[-1] if maintenance_s else None,
                        "log_bytes": log_bytes,
                        "log_files": log_files,
                        "log_tail": log_tail,
                        "checkpoint_bytes": checkpoint_bytes,
                        "state_bytes": state_bytes,
                        "state_files": state_files,
                        "index_bytes": index_bytes,
                        "index_files": index_files,
                        "index_from_stored": index.get("from_stored"),
                        "index_table_files_read": index.get("table_files_read"),
                        "index_log_entries_read": index.get("log_entries_read"),
                        "index_rows_read": index.get("rows_read"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                if results is not None:  # a run stopped early keeps what it measured
                    results.write_text(json.dumps(_result(files, dailies, backfill_s, rows, settings), indent=1) + "\n")
            save(day, backfill_s, rows)
    return _result(files, dailies, backfill_s, rows, settings)


def _compressed(day_s: float) -> dict[str, str]:
    """The table's retentions with a day of `day_s` seconds (none when 0: Delta's and raypipe's defaults)."""
    if not day_s:
        return {}
    days = {"delta.logRetentionDuration": 30, "delta.setTransactionRetentionDuration": 90}
    days["delta.deletedFileRetentionDuration"] = 7
    return {k: f"interval {max(1, round(n * day_s))} seconds" for k, n in days.items()}


def _result(
    files: int, dailies: int, backfill_s: float, rows: list[dict[str, Any]], settings: dict[str, Any]
) -> dict[str, Any]:
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    keys = (
        "wall_s",
        "planning_s",
        "log_bytes",
        "log_files",
        "log_tail",
        "table_files",
        "input_files",
        "checkpoint_bytes",
        "state_bytes",
        "state_files",
        "index_bytes",
        "index_files",
        "index_table_files_read",
        "index_log_entries_read",
    )

    def ratio(key: str) -> float | None:
        a, b = first.get(key), last.get(key)
        return None if not a or b is None else round(b / a, 3)

    # A single daily's figures are noisy (and the first sample comes before any maintenance):
    # also the median of the first tenth of the samples after the first maintenance against the
    # median of the last tenth.
    kept = [r for r in rows if r.get("last_maintenance_s") is not None]
    tenth = max(1, len(kept) // 10)

    def medians(key: str) -> dict[str, float | None]:
        a = [r[key] for r in kept[:tenth] if r.get(key) is not None]
        b = [r[key] for r in kept[-tenth:] if r.get(key) is not None]
        first_m, last_m = (statistics.median(a) if a else None), (statistics.median(b) if b else None)
        over = None if not first_m or last_m is None else round(last_m / first_m, 3)
        return {"first": first_m, "last": last_m, "last_over_first": over}

    return {
        "files": files,
        "dailies": dailies,
        "dailies_done": last["daily"] if rows else 0,
        "backfill_s": round(backfill_s, 1),
        "time_compressed": (
            f"a day is {settings['day_s']} s of the bench: the table's retentions set to table_properties "
            "(through the table's own properties, as a user would set them); "
            f"compact and vacuum (retention 0, forced) every {settings['maintain_every']} dailies"
            if settings["day_s"]
            else "no: Delta's and raypipe's default retentions, which a bench of minutes never reaches"
        ),
        "settings": settings,
        "samples": rows,
        "last_over_first": {k: ratio(k) for k in keys},
        "medians_maintained": {
            "dailies": [[r["daily"] for r in kept[:tenth]], [r["daily"] for r in kept[-tenth:]]] if kept else [],
            **{k: medians(k) for k in keys},
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--dailies", type=int, default=1_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="keep the output and the progress here; a run given the same --state goes on where it stopped",
    )
    parser.add_argument("--minutes", type=float, default=None, help="stop after the daily running at this many minutes")
    parser.add_argument(
        "--day-s", type=float, default=2.0, help="seconds that stand for a day in the table's retentions (0: defaults)"
    )
    parser.add_argument(
        "--maintain-every", type=int, default=7, help="compact and vacuum every this many dailies (0: never)"
    )
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "bench" / "results" / f"growth-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.state is not None:
        args.state.mkdir(parents=True, exist_ok=True)
    result = run_growth(
        args.files,
        args.dailies,
        samples=args.samples,
        results=out,
        state=args.state,
        minutes=args.minutes,
        day_s=args.day_s,
        maintain_every=args.maintain_every,
    )
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["last_over_first"]))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

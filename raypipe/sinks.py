"""Results, dead letters and the unit commit protocol.

A unit's outcome is committed in three atomic writes, in this order:

1. `results/run=R/<unit>.parquet`: one row per input row that was answered or was bad input
   (`status` says which), or the file is removed if there is none;
2. `dead_letters/run=R/<unit>.parquet`: one row per input row that still failed, with the
   error kind, gRPC status, attempts and last message (and its text, so a replay needs no
   access to the input), or the file is removed if there is none;
3. `_raypipe/runs/R/units/<unit>.json`: the commit marker, the unit's summary.

File names depend only on the unit, so a unit redone after a crash overwrites its own files,
and step 1-2 remove a stale file the earlier attempt may have left. Hence a crash at any point
neither loses nor duplicates a row: without the marker the unit is redone in full; with it,
both files are final. Ray Data's `CheckpointConfig` was not used because it records ids after
the write, and a crash between the two duplicates rows (see README, "Resume").
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from raypipe.store import OutputStore

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "RESULT_STATUS_EMPTY",
    "RESULT_STATUS_OK",
    "commit_unit",
    "committed_units",
    "label_column",
    "results_schema",
]

RESULT_STATUS_OK = "ok"
RESULT_STATUS_EMPTY = "empty_text"

_TS = pa.timestamp("us", tz="UTC")

DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("error_kind", pa.string()),
        pa.field("grpc_status", pa.string()),
        pa.field("attempts", pa.int32()),
        pa.field("message", pa.string()),
        pa.field("failed_at", _TS),
        pa.field("run_id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("updated_at", _TS),
        pa.field("source", pa.string()),
        pa.field("row", pa.int64()),
    ]
)


def label_column(label: str) -> str:
    """The results column of a label's probability: `prob_<label>`, SQL-safe."""
    return "prob_" + re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


def results_schema(labels: tuple[str, ...]) -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("status", pa.string()),
            *[pa.field(label_column(label), pa.float32()) for label in labels],
            pa.field("top_label", pa.string()),
            pa.field("top_score", pa.float32()),
            pa.field("truncated", pa.bool_()),
            pa.field("model_version", pa.string()),
            pa.field("run_id", pa.string()),
            pa.field("inferred_at", _TS),
            pa.field("updated_at", _TS),
            pa.field("source", pa.string()),
            pa.field("row", pa.int64()),
        ]
    )


def mark_started(store: OutputStore, run_id: str, unit: str, attempt: str) -> None:
    store.write_bytes(store.run_state(run_id, "started", unit), attempt.encode())


def commit_unit(
    store: OutputStore,
    run_id: str,
    unit: str,
    results: pa.Table,
    dead_letters: pa.Table,
    summary: dict[str, Any],
    marker_run_id: str | None = None,
) -> None:
    """Commits one unit: results, dead letters, then the marker (see the module docstring)."""
    for table, path in (
        (results, store.results_file(run_id, unit)),
        (dead_letters, store.dead_letter_file(run_id, unit)),
    ):
        if table.num_rows:
            store.write_parquet(path, table)
        else:
            store.delete(path)
    store.write_json(store.run_state(marker_run_id or run_id, "units", f"{unit}.json"), summary)


def committed_units(store: OutputStore, run_id: str) -> dict[str, dict[str, Any]]:
    """Commit markers of a run: unit key -> the unit's summary."""
    folder = store.run_state(run_id, "units")
    markers = store.list_files(folder, ".json")
    return {path.rsplit("/", 1)[-1].removesuffix(".json"): s for path, s in store.read_many_json(markers)}


def started_units(store: OutputStore, run_id: str) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in store.list_files(store.run_state(run_id, "started"))}


def now_utc() -> datetime:
    return datetime.now(UTC)

"""Results, dead letters and the unit commit protocol.

The protocol lives here, in `UnitCommitter`, and nowhere else: the inference actor hands it a
unit's tables and summary. Before any write it checks the run's lease fence
(`raypipe.lease.Fence`), so an attempt fenced off by a newer one stops before its next write.
A unit's outcome is then committed in three atomic writes, in this order:

1. `results/run=R/<unit>.parquet`: one row per input row that was answered or was bad input
   (`status` says which), or the file is removed if there is none;
2. `dead_letters/run=R/<unit>.parquet`: one row per input row that still failed, with the
   error kind, gRPC status, attempts and last message (and its text, so a replay needs no
   access to the input), or the file is removed if there is none;
3. `_raypipe/runs/R/units/<unit>.json`: the commit marker, the unit's summary and the lease
   generation that wrote it.

File names depend only on the unit, so a unit redone after a crash overwrites its own files,
and step 1-2 remove a stale file the earlier attempt may have left. Hence a crash at any point
neither loses nor duplicates a row: without the marker the unit is redone in full; with it,
both files are final. Ray Data's `CheckpointConfig` was not used because it records ids after
the write, and a crash between the two duplicates rows (see README, "Resume").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from raypipe.lease import Fence
from raypipe.report import UnitStats
from raypipe.store import OutputStore

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "RESULT_STATUS_EMPTY",
    "RESULT_STATUS_OK",
    "UnitCommitter",
    "committed_keys",
    "committed_units",
    "iter_committed",
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


class UnitCommitter:
    """Commits units of one run attempt, fenced by its lease (picklable: it travels to actors)."""

    def __init__(
        self, store: OutputStore, run_id: str, *, fence: Fence | None, marker_run_id: str | None = None
    ) -> None:
        self.store = store
        self.run_id = run_id
        """The results partition written to (a replay writes into the run it replays)."""
        self.marker_run_id = marker_run_id or run_id
        """Where commit markers go (a replay keeps its own)."""
        self.fence = fence

    def _check(self) -> None:
        if self.fence is not None:
            self.fence.check(self.store)

    def mark_started(self, unit: str, attempt: str) -> None:
        self._check()
        self.store.write_bytes(self.store.run_state(self.marker_run_id, "started", unit), attempt.encode())

    def commit(
        self,
        unit: str,
        results: pa.Table,
        dead_letters: pa.Table,
        summary: dict[str, Any],
        *,
        replaces: str | None = None,
    ) -> None:
        """Commits one unit: results, dead letters, then the marker (see the module docstring).

        `replaces` names a dead-letter file of the same partition that this unit re-inferred
        (a replay): it is rewritten to the rows that still fail, after the results are written,
        so an id is never in neither set, and the moment it is in both is bounded by one write.
        """
        self._check()
        dead_path = self.store.dead_letter_file(self.run_id, replaces or unit)
        for table, path in ((results, self.store.results_file(self.run_id, unit)), (dead_letters, dead_path)):
            if table.num_rows:
                self.store.write_parquet(path, table)
            else:
                self.store.delete(path)
        generation = None if self.fence is None else self.fence.generation
        self.store.write_json(
            self.store.run_state(self.marker_run_id, "units", f"{unit}.json"), {**summary, "generation": generation}
        )


def committed_keys(store: OutputStore, run_id: str) -> set[str]:
    """Keys of a run's committed units (one listing, no reads)."""
    return {
        p.rsplit("/", 1)[-1].removesuffix(".json") for p in store.list_files(store.run_state(run_id, "units"), ".json")
    }


def iter_committed(store: OutputStore, run_id: str, keys: Iterable[str], chunk: int = 256) -> Iterator[UnitStats]:
    """Streams the summaries of committed units, reading their markers `chunk` at a time."""
    paths = [store.run_state(run_id, "units", f"{k}.json") for k in sorted(keys)]
    for i in range(0, len(paths), chunk):
        for _, summary in store.read_many_json(paths[i : i + chunk]):
            yield UnitStats.from_dict(summary)


def committed_units(store: OutputStore, run_id: str) -> dict[str, dict[str, Any]]:
    """Commit markers of a run: unit key -> the unit's summary (tests and small runs)."""
    folder = store.run_state(run_id, "units")
    markers = store.list_files(folder, ".json")
    return {path.rsplit("/", 1)[-1].removesuffix(".json"): s for path, s in store.read_many_json(markers)}


def started_units(store: OutputStore, run_id: str) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in store.list_files(store.run_state(run_id, "started"))}


def now_utc() -> datetime:
    return datetime.now(UTC)

"""A run's plan: its units, fixed at its first start and stored, and what planning saw.

`Plan` is what `raypipe.run.state.RunState.plan` stores (fenced) and reads back on every
later start, so a restart does the same units; `PlanObservations` is what planning learnt
from footers and paths without reading a row (the report's `planning`, the files seen's
latest `updated_at` per shard, the watermark).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from raypipe.plan.units import DeltaWindow, WorkUnit

__all__ = ["Plan", "PlanObservations"]


@dataclass
class PlanObservations:
    """What planning learnt from footers and paths, without reading any row."""

    limit: datetime | None = None
    """updated_at beyond this (now + the allowed clock skew) is in the future: counted, never a watermark."""
    max_updated_at: datetime | None = None
    """Latest updated_at in the input up to `limit` (row-group statistics): what it was read as of."""
    future_row_groups: int = 0
    """Row groups whose updated_at reaches beyond `limit` (a 9999-12-31 sentinel, a clock ahead)."""
    shard_max: dict[str, str] = dataclasses.field(default_factory=dict)
    """Shard -> its latest updated_at up to `limit` (ISO): recorded with the files seen, so a
    file rewritten later is read for its rows updated after it."""
    null_updated_at_rows: int = 0
    """Rows with a null updated_at in the shards planned (statistics); read when their file is
    new, never by a window over a file read before."""
    row_groups_total: int = 0
    row_groups_pruned: int = 0
    """Row groups a daily skipped because their updated_at statistics lie outside its window."""
    shards_pruned: int = 0
    """Shards a daily skipped by their Hive partition value (`input.updated_at_partition`)."""
    footers_read: int = 0
    """Parquet footers read at planning."""
    whole_files: int = 0
    """Parquet shards planned as one unit from their listed size (`plan_listing`): their footers
    are read by the task that reads their rows, and the statistics above do not count them."""

    def add(self, other: PlanObservations) -> None:
        """Folds in what planning other shards learnt (`plan_units` plans each shard on its own)."""
        if other.max_updated_at is not None and (
            self.max_updated_at is None or other.max_updated_at > self.max_updated_at
        ):
            self.max_updated_at = other.max_updated_at
        self.future_row_groups += other.future_row_groups
        for shard, hi in other.shard_max.items():
            if shard not in self.shard_max or hi > self.shard_max[shard]:
                self.shard_max[shard] = hi
        self.null_updated_at_rows += other.null_updated_at_rows
        self.row_groups_total += other.row_groups_total
        self.row_groups_pruned += other.row_groups_pruned
        self.shards_pruned += other.shards_pruned
        self.footers_read += other.footers_read
        self.whole_files += other.whole_files

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_updated_at": None if self.max_updated_at is None else self.max_updated_at.isoformat(),
            "future_row_groups": self.future_row_groups,
            "null_updated_at_rows": self.null_updated_at_rows,
            "row_groups_total": self.row_groups_total,
            "row_groups_pruned": self.row_groups_pruned,
            "shards_pruned": self.shards_pruned,
            "footers_read": self.footers_read,
            "whole_files": self.whole_files,
            "shard_max": self.shard_max,
        }


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


@dataclass
class Plan:
    mode: str
    input: str | None
    units: list[WorkUnit]
    bad_shards: list[dict[str, str]]
    window: DeltaWindow | None = None
    replay_of: str | None = None
    observations: dict[str, Any] | None = None
    """What planning saw in the footers (`PlanObservations`), and a backfill's `read_as_of`."""
    model_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "input": self.input,
            "units": [u.to_dict() for u in self.units],
            "bad_shards": self.bad_shards,
            "window": None
            if self.window is None
            else {"after": _iso(self.window.after), "until": _iso(self.window.until)},
            "replay_of": self.replay_of,
            "observations": self.observations,
            "model_version": self.model_version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        w = d.get("window")
        window = None if w is None else DeltaWindow(_parse(w["after"]), _parse(w["until"]))  # type: ignore[arg-type]
        return cls(
            d["mode"],
            d["input"],
            [WorkUnit.from_dict(u) for u in d["units"]],
            d["bad_shards"],
            window,
            d.get("replay_of"),
            d.get("observations"),
            d.get("model_version"),
        )

"""A run's `Plan`: its units, fixed at its first start, and its stored form (JSON, stored
fenced by `raypipe.commit.protocol`), so a restart does the same units."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit

__all__ = ["Plan"]


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


@dataclass
class Plan:
    """A run's units, fixed at its first start and stored (fenced, `raypipe.commit.protocol`), so
    a restart does the same units; with what planning saw, and how this attempt reads them."""

    mode: str
    input: str | None
    units: list[WorkUnit]
    bad_shards: list[dict[str, str]]
    window: DeltaWindow | None = None
    replay_of: str | None = None
    observations: dict[str, Any] | None = None
    """What planning saw in the footers (`PlanObservations`), and a backfill's `read_as_of`."""
    model_version: str | None = None
    # How this attempt reads the units, from its input settings (`plan_input`, `resume`); not
    # stored: every attempt reads with its own settings. A replay's are the defaults.
    columns: ColumnNames = dataclasses.field(default=ColumnNames(), compare=False)
    """The input's id, text and updated_at column names."""
    on_bad_shard: Literal["fail", "record"] = dataclasses.field(default="fail", compare=False)
    """A shard that cannot be read: stop the run, or record it and go on (`input.on_bad_shard`)."""
    max_future_skew_s: float = dataclasses.field(default=3600.0, compare=False)
    """An updated_at later than now plus this is in the future (`input.max_future_skew_s`)."""

    @property
    def read_as_of(self) -> datetime | None:
        """What a backfill's or daily's input was read as of: the watermark its completion moves
        to (None for a replay, which reads no input)."""
        return _parse((self.observations or {}).get("read_as_of"))

    def rows_run_id(self, run_id: str) -> str:
        """The run whose rows run `run_id` writes: its own, or for a replay the run it replays."""
        return self.replay_of or run_id

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

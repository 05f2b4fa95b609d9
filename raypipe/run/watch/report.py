"""A watcher's report: what it did so far, and how fresh its output is.

Freshness is, per committed unit, the time from its file's arrival (S3 `LastModified`, the
local mtime, or the S3 event's time) to the unit's commit; `Freshness` keeps those of the
current report window and gives their p50 and p95. Every `watch.report_every_s` (and when the
watcher stops) the report is written to `OUTPUT/_raypipe/watch/<watch id>.json`, and the two
percentiles go out as the gauges `watch.freshness_p50_s` and `watch.freshness_p95_s`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = ["Freshness", "WatchReport", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, nearest rank (0.0 for none): a value seen."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class Freshness:
    """Arrival-to-commit times of the units committed in the current report window."""

    def __init__(self) -> None:
        self._window: list[float] = []

    def add(self, arrived_at: datetime, committed_at: datetime) -> None:
        self._window.append(max(0.0, (committed_at - arrived_at).total_seconds()))

    def __len__(self) -> int:
        return len(self._window)

    def close_window(self) -> tuple[float, float, int]:
        """(p50, p95, units) of the window, which starts again empty."""
        window, self._window = self._window, []
        return percentile(window, 50), percentile(window, 95), len(window)


@dataclass
class WatchReport:
    """What a watcher did since it started (`raypipe.watch` returns it; written as JSON)."""

    watch_id: str
    output: str
    input: str
    started_at: str
    model_version: str = ""
    lease_holder: str = ""
    """The run id and attempt holding the output's lease (this watcher: `<watch id>/<attempt>`)."""
    status: str = "running"
    """running; stopped (SIGTERM, SIGINT or the caller's stop); failed (see `error`)."""
    error: str | None = None
    ticks: int = 0
    listings: int = 0
    cuts: int = 0
    units: int = 0
    rows: int = 0
    files: int = 0
    resumed_units: int = 0
    """Units of a batch an earlier watcher left unfinished, committed by this one at its start."""
    bad_files: list[dict[str, str]] = field(default_factory=list)
    freshness_p50_s: float = 0.0
    """Over the last report window."""
    freshness_p95_s: float = 0.0
    freshness_units: int = 0
    """Units the last window's percentiles are over."""
    backlog_rows: int = 0
    backlog_files: int = 0
    oldest_waiting_s: float = 0.0
    updated_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WatchReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

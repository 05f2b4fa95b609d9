"""Coalescing: arrivals wait together until they are worth a commit.

A watcher plans each file as it arrives (its units, cut as a daily cuts them) and holds it
here until the pending files reach `input.unit_rows` rows or `input.unit_bytes` bytes, or the
oldest of them has waited `watch.max_wait_s`: then they are cut, all together, into one batch
whose units are committed one by one (`raypipe.run.watch.watcher`). Small files are never
merged into one unit: a unit is a row range of one file, the grain every commit and resume
keys on, so a cut gathers files, not rows across files.

The clock is the caller's (`due(now)`), so tests drive it without waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from raypipe.plan.units import WorkUnit

__all__ = ["Coalescer", "Pending"]


@dataclass(frozen=True)
class Pending:
    """One arrived file, planned, not committed yet."""

    uri: str
    fingerprint: str
    arrived_at: datetime
    """When it arrived, UTC: S3 `LastModified`, the local mtime, or the S3 event's time."""
    size: int | None
    units: tuple[WorkUnit, ...]

    @property
    def rows(self) -> int | None:
        """Its rows, where planning read them (a file planned whole from its size has none)."""
        if any(u.expected_rows is None for u in self.units):
            return None
        return sum(u.expected_rows or 0 for u in self.units)


class Coalescer:
    """The arrivals waiting for a cut, and when the cut is due."""

    def __init__(self, *, unit_rows: int, unit_bytes: int, max_wait_s: float) -> None:
        self.unit_rows = unit_rows
        self.unit_bytes = unit_bytes
        self.max_wait_s = max_wait_s
        self._pending: dict[str, Pending] = {}

    def add(self, arrival: Pending) -> None:
        """Holds `arrival` (a file arriving again, rewritten, replaces its earlier version)."""
        self._pending[arrival.uri] = arrival

    def __contains__(self, uri: str) -> bool:
        return uri in self._pending

    def fingerprint(self, uri: str) -> str | None:
        p = self._pending.get(uri)
        return None if p is None else p.fingerprint

    @property
    def files(self) -> int:
        return len(self._pending)

    @property
    def rows(self) -> int:
        """Rows pending, counting a file of unknown rows as none (its bytes still count)."""
        return sum(p.rows or 0 for p in self._pending.values())

    @property
    def bytes(self) -> int:
        return sum(p.size or 0 for p in self._pending.values())

    def oldest(self) -> datetime | None:
        return min((p.arrived_at for p in self._pending.values()), default=None)

    def oldest_waiting_s(self, now: datetime) -> float:
        oldest = self.oldest()
        return 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())

    def deadline(self) -> datetime | None:
        """When the oldest arrival will have waited `max_wait_s` (None with nothing pending)."""
        oldest = self.oldest()
        return None if oldest is None else oldest + timedelta(seconds=self.max_wait_s)

    def due(self, now: datetime) -> str | None:
        """Why a cut is due now ("rows", "bytes" or "age"), or None."""
        if not self._pending:
            return None
        if self.rows >= self.unit_rows:
            return "rows"
        if self.bytes >= self.unit_bytes:
            return "bytes"
        if self.oldest_waiting_s(now) >= self.max_wait_s:
            return "age"
        return None

    def cut(self) -> list[Pending]:
        """Every pending arrival, oldest first; none is pending afterwards."""
        cut = sorted(self._pending.values(), key=lambda p: (p.arrived_at, p.uri))
        self._pending.clear()
        return cut

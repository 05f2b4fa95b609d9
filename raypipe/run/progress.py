"""Progress of a run as the driver sees it: one update per finished unit.

In a terminal it is a progress bar (rows, rows/s, ETA, dead letters, units); elsewhere (a
log file, a notebook, a Ray job's log) a log line every `interval_s` seconds and at the end.
Each committed unit's counts, and the units and time left, also go to the run's metrics
(`raypipe.call.metrics.emit_unit`, `emit_progress`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from raypipe.call.metrics import Metrics, NullMetrics, emit_progress, emit_unit
from raypipe.report import UnitStats

__all__ = ["Progress"]

logger = logging.getLogger("raypipe")


class Progress:
    """Counts units, rows and dead letters; shows them as a bar or as log lines."""

    def __init__(
        self,
        total_units: int,
        total_rows: int | None,
        interval_s: float,
        *,
        metrics: Metrics | None = None,
        bar: bool | None = None,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`bar`: a progress bar (True), log lines (False), or a bar only when `stream`
        (default stderr) is a terminal (None)."""
        self.total_units = total_units
        self.total_rows = total_rows
        self.interval_s = interval_s
        self._metrics = metrics or NullMetrics()
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self.units = 0
        self.rows = 0
        self.dead = 0
        emit_progress(self._metrics, total_units, None)
        stream = stream or sys.stderr
        if bar is None:
            bar = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_rows,
                unit=" rows",
                unit_scale=True,
                dynamic_ncols=True,
                file=stream,
                desc="raypipe",
                smoothing=0.1,
            )

    def update(self, stats: UnitStats | None) -> None:
        """One unit finished: committed (`stats`) or left out as unreadable (None)."""
        now = self._clock()
        self.units += 1
        if stats is not None:
            self.rows += stats.rows
            self.dead += stats.dead_letters
            emit_unit(self._metrics, stats)
        emit_progress(self._metrics, max(0, self.total_units - self.units), self.eta_s(now))
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"dead letters {self.dead:,}, units {self.units}/{self.total_units}", refresh=False
            )
            self._bar.update(stats.rows if stats is not None else 0)
            if self.units >= self.total_units:
                self.close()
            return
        if now - self._last >= self.interval_s or self.units == self.total_units:
            self._last = now
            logger.info("progress: %s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """The progress as one line: units, rows, rate, dead letters and the ETA."""
        now = self._clock() if now is None else now
        rate = self.rows / max(now - self._start, 1e-9)
        eta_s = self.eta_s(now)
        eta = "" if eta_s is None else f", ETA {eta_s:,.0f} s"
        return (
            f"{self.units}/{self.total_units} units, {self.rows:,} rows ({rate:.1f} rows/s), "
            f"{self.dead} dead letters{eta}"
        )

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds left at the rate so far: of rows when the plan knows every unit's rows, else
        of units (JSON lines, Parquet files planned whole); None until there is a rate."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        if not self.total_rows:
            return (self.total_units - self.units) * elapsed / self.units if self.units else None
        rate = self.rows / elapsed
        if rate <= 0:
            return None
        return max(0.0, (self.total_rows - self.rows) / rate)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

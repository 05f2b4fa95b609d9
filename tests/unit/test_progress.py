"""A run's progress as the driver shows it (`raypipe.run.progress`): log lines or a bar, the ETA,
and the units and rows it counts into the run's metrics. An injected clock; no Ray."""

from __future__ import annotations

import io
import logging

import pytest

from raypipe.call.metrics import (
    CLIENT_RETRIES,
    RUN_DEAD_LETTERS,
    RUN_ETA_S,
    RUN_ROWS,
    RUN_UNITS,
    RUN_UNITS_LEFT,
)
from raypipe.report import UnitStats
from raypipe.run.progress import Progress
from tests.unit.test_metrics import Recorder


def _unit(i: int, *, ok: int, empty: int = 0, dead: int = 0, retries: int = 0) -> UnitStats:
    s = UnitStats(unit=f"u{i}", shard="s", attempt="a", actor="x", rows=ok + empty + dead)
    s.ok, s.empty_text, s.dead_letters, s.retries = ok, empty, dead, retries
    if dead:
        s.dead_letter_kinds["invalid_text"] = dead
    return s


def test_progress_logs_lines_and_counts_units_into_metrics(caplog):
    caplog.set_level(logging.INFO, logger="raypipe")
    rec = Recorder()
    now = [0.0]
    p = Progress(3, 60, 10.0, metrics=rec, bar=False, clock=lambda: now[0])
    now[0] = 2.0
    p.update(_unit(0, ok=18, empty=2, retries=1))
    now[0] = 11.0
    p.update(_unit(1, ok=19, dead=1))
    p.update(None)  # an unreadable shard: no stats
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert lines == [
        "progress: 2/3 units, 40 rows (3.6 rows/s), 1 dead letters, ETA 6 s",
        "progress: 3/3 units, 40 rows (3.6 rows/s), 1 dead letters, ETA 6 s",
    ]
    assert rec.total(RUN_UNITS) == 2
    assert rec.total(RUN_ROWS, outcome="ok") == 37
    assert rec.total(RUN_ROWS, outcome="empty_text") == 2
    assert rec.total(RUN_ROWS, outcome="dead_letter") == 1
    assert rec.total(CLIENT_RETRIES) == 1
    assert rec.total(RUN_DEAD_LETTERS) == 1 and rec.total(RUN_DEAD_LETTERS, kind="invalid_text") == 1
    left = [v for _, n, v, _ in rec.records if n == RUN_UNITS_LEFT.name]
    assert left == [3, 2, 1, 0], "the total when it starts, then one less per finished unit"
    etas = [v for _, n, v, _ in rec.records if n == RUN_ETA_S.name]
    assert etas == [pytest.approx((60 - 20) / 10), pytest.approx((60 - 40) / (40 / 11)), pytest.approx(20 / (40 / 11))]


def test_progress_bar_in_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(2, 40, 10.0, stream=out)
    p.update(_unit(0, ok=20))
    p.update(_unit(1, ok=19, dead=1))
    text = out.getvalue()
    assert "40.0/40.0" in text and "dead letters 1" in text and "units 2/2" in text
    assert Progress(1, 1, 10.0, stream=io.StringIO())._bar is None, "not a terminal: log lines"


def test_progress_eta_goes_by_units_when_the_plan_does_not_know_every_units_rows():
    """Files planned whole from their size (and JSON lines) have no row count before they are read."""
    now = [0.0]
    p = Progress(4, None, 10.0, bar=False, stream=io.StringIO(), clock=lambda: now[0])
    assert p.eta_s() is None, "no rate before the first unit"
    now[0] = 3.0
    p.update(_unit(0, ok=50))
    assert p.eta_s() == 9.0, "3 units left at 3 s each"
    now[0] = 4.0
    p.update(_unit(1, ok=500))
    assert p.eta_s() == 4.0

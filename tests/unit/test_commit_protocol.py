"""The unit commit protocol under crashes, the retention rule, and the driver's memory for many units.

A crash is simulated by a store that raises right after a chosen write has completed; the
unit is then redone from scratch, as a resumed run would, and must end with every row exactly
once across results and dead letters.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections import Counter
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest

from raypipe import modes
from raypipe.actor import ActorSettings, InferenceActor
from raypipe.config import BreakerConfig, ClientConfig, RetryConfig, ServiceConfig
from raypipe.errors import LeaseLostError
from raypipe.lease import Lease
from raypipe.report import RunReport, UnitStats
from raypipe.sinks import committed_keys
from raypipe.store import OutputStore
from tests.fakes import LABELS, ScriptedClient
from tests.unit.test_actor import make_unit


class Crash(Exception):
    """The process died right here."""


def _settings(tmp_path, fence=None) -> ActorSettings:
    client = ClientConfig(
        micro_batch_size=4,
        retry=RetryConfig(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.002),
        breaker=BreakerConfig(failure_threshold=50),
    )
    return ActorSettings(
        output_uri=str(tmp_path / "out"),
        run_id="r1",
        attempt="a1",
        service=ServiceConfig(),
        client=client,
        labels=LABELS,
        fence=fence,
    )


TEXTS = ["one", "two", "POISON", "four", "five", "six"]  # five results, one dead letter


def _ids_everywhere(store: OutputStore, unit: str) -> Counter[str]:
    seen: Counter[str] = Counter()
    for path in (store.results_file("r1", unit), store.dead_letter_file("r1", unit)):
        if store.exists(path):
            seen.update(pq.read_table(path).column("id").to_pylist())
    return seen


@pytest.mark.parametrize("crash_after", ["results", "dead_letters", "units"])
def test_a_crash_after_each_commit_step_neither_loses_nor_duplicates_rows(tmp_path, monkeypatch, crash_after):
    unit, block = make_unit(tmp_path, TEXTS)
    store = OutputStore(str(tmp_path / "out"))
    real = OutputStore.write_bytes

    def crashing(self, path, data):
        real(self, path, data)
        if f"/{crash_after}/" in path:
            raise Crash(path)

    monkeypatch.setattr(OutputStore, "write_bytes", crashing)
    with pytest.raises(Crash):
        asyncio.run(InferenceActor(_settings(tmp_path), client_factory=ScriptedClient)(block))
    monkeypatch.setattr(OutputStore, "write_bytes", real)
    # A resumed run redoes every unit without a marker, and skips the committed ones.
    if unit.key not in committed_keys(store, "r1"):
        asyncio.run(InferenceActor(_settings(tmp_path), client_factory=ScriptedClient)(block))
    seen = _ids_everywhere(store, unit.key)
    assert sorted(seen) == sorted(f"id{i}" for i in range(len(TEXTS)))
    assert set(seen.values()) == {1}, seen
    assert unit.key in committed_keys(store, "r1")


def test_a_fenced_off_attempt_stops_before_its_next_write(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    old = Lease(store, "r1", duration_s=600)
    old.acquire()
    old._stop.set()
    new = Lease(store, "r1", duration_s=600)
    new.acquire(force=True)
    unit, block = make_unit(tmp_path, TEXTS)
    with pytest.raises(LeaseLostError):
        asyncio.run(InferenceActor(_settings(tmp_path, fence=old.fence), client_factory=ScriptedClient)(block))
    assert _ids_everywhere(store, unit.key) == Counter()
    assert committed_keys(store, "r1") == set()
    asyncio.run(InferenceActor(_settings(tmp_path, fence=new.fence), client_factory=ScriptedClient)(block))
    marker = json.loads((tmp_path / "out" / "_raypipe" / "runs" / "r1" / "units" / f"{unit.key}.json").read_text())
    assert marker["generation"] == 2
    new.release()


def test_gc_removes_old_committed_runs_state_and_keeps_reports(tmp_path):
    store = OutputStore(str(tmp_path))
    now = datetime(2026, 6, 1, tzinfo=UTC)
    for run_id, committed_at in (
        ("old", now - timedelta(days=30)),
        ("recent", now - timedelta(days=1)),
        ("open", None),
    ):
        store.write_json(store.run_state(run_id, "plan.json"), {"units": []})
        for i in range(3):
            store.write_json(store.run_state(run_id, "units", f"u{i}.json"), {"rows": 1})
            store.write_bytes(store.run_state(run_id, "started", f"u{i}"), b"a")
        store.write_json(store.report_file(run_id), {"run_id": run_id, "mode": "backfill", "status": "completed"})
        if committed_at is not None:
            store.write_json(store.run_state(run_id, "COMMITTED.json"), {"at": committed_at.isoformat()})
    removed = modes.gc(str(tmp_path), older_than_days=7, now=now)
    assert removed == {"runs": 1, "files": 7}
    assert committed_keys(store, "old") == set() and not store.exists(store.run_state("old", "plan.json"))
    assert store.exists(store.report_file("old")) and store.exists(store.run_state("old", "COMMITTED.json"))
    assert committed_keys(store, "recent") == {"u0", "u1", "u2"}
    assert committed_keys(store, "open") == {"u0", "u1", "u2"}
    # A rerun of a collected run id does nothing: it is committed, and says so.
    again = modes._committed(store, "old")
    assert again is not None and again.run_id == "old"


def summaries(n: int):
    """n unit summaries as read back from their markers, made one at a time."""
    u = UnitStats(unit="u", shard="s", attempt="a", actor="actor", rows=2000, ok=2000, calls=63)
    u.status_counts["OK"] = 63
    for ms in (40, 55, 80):
        u.latency.add(ms / 1000)
    marker = u.to_dict()
    for i in range(n):
        marker["actor_stats"] = {"seq": i, "breaker": {"openings": 0, "time_open_s": 0.0, "probes": 0},
                                 "limiter": {"min": 2, "max": 8, "final": 6}}  # fmt: skip
        marker["actor"] = f"actor{i % 4}"
        yield UnitStats.from_dict(marker)


def test_the_report_folds_unit_summaries_in_bounded_memory():
    """Summaries are streamed from markers into the report: memory does not grow with the units."""
    peaks = {}
    for n in (2_000, 20_000):
        report = RunReport(run_id="r", mode="backfill")
        tracemalloc.start()
        report.merge_units(summaries(n))
        _, peaks[n] = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert report.units_committed == n and report.rows_in == 2000 * n
    print(f"report fold peak: 2k units {peaks[2_000] / 1e6:.2f} MB, 20k units {peaks[20_000] / 1e6:.2f} MB")
    assert peaks[20_000] < 1.5 * peaks[2_000] + 1_000_000

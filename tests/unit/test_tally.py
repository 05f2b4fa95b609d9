"""The actors' call tallies: kept over units in flight, and folded into an attempt's figures once."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from raypipe.call.actor import InferenceActor
from raypipe.config import BreakerConfig
from raypipe.errors import ServiceUnavailable
from raypipe.report import AttemptStats, RunReport, UnitStats
from raypipe.store import OutputStore
from raypipe.tally import CallTally, fold_tallies, read_tallies, tally_path
from tests.fakes import ScriptedClient
from tests.unit.test_actor import make_unit, settings


def unit(actor: str, calls: int, *, unavailable: int = 0, seq: int, tally_calls: int | None = None) -> UnitStats:
    """A unit summary whose actor snapshot carries the actor's tally (all its calls so far)."""
    u = UnitStats(unit=f"u{seq}", shard="s", attempt="a1", actor=actor, rows=10, ok=10, calls=calls)
    u.status_counts = Counter({"OK": calls - unavailable, "UNAVAILABLE": unavailable})
    for _ in range(calls):
        u.latency.add(0.01)
    tally = CallTally(units=seq, calls=calls if tally_calls is None else tally_calls)
    tally.status_counts = Counter({"OK": tally.calls})
    u.actor_stats = {"seq": seq, "breaker": {"openings": 0, "time_open_s": 0.0, "probes": 0}, "tally": tally.to_dict()}
    return u


def record(actor: str, seq: int, calls: dict[str, int], *, openings: int = 0) -> dict:
    """An actor's tally as written to the output."""
    tally = CallTally(units=seq, calls=sum(calls.values()), status_counts=Counter(calls), retries=3)
    for _ in range(tally.calls):
        tally.latency.add(0.02)
    return {
        "actor": actor,
        "attempt": "a1",
        "seq": seq,
        "breaker": {"openings": openings, "time_open_s": 5.0, "probes": 2},
        "limiter": {"min": 1, "max": 4, "final": 2},
        "tally": tally.to_dict(),
    }


def test_actor_tallies_supersede_the_unit_summaries_without_double_counting():
    attempt = AttemptStats(attempt="a1")
    attempt.add(unit("A", 10, seq=1))  # A finished one unit of 10 calls, then kept calling
    # B finished nothing: it has only its tally in the output.
    records = [
        record("A", 1, {"OK": 10}),  # older than A's latest below: ignored
        record("A", 4, {"OK": 10, "UNAVAILABLE": 15}, openings=1),
        record("B", 2, {"UNAVAILABLE": 7}, openings=1),
    ]

    folded = fold_tallies(attempt, records)

    assert folded.calls == 32  # A's 25 (its unit's 10 among them) + B's 7; not 10 + 32
    assert folded.status_counts == {"OK": 10, "UNAVAILABLE": 22}
    assert folded.retries == 6 and folded.latency.count == 32
    assert (folded.ok, folded.rows, folded.units) == (10, 10, 1)  # rows stay the committed units'
    report = RunReport(run_id="r", mode="backfill")
    report.fold_attempts([folded])
    assert (report.calls, report.breaker_openings, report.breaker_probes) == (32, 2, 4)
    assert attempt.calls == 10  # the input is left as it was
    assert fold_tallies(folded, records).to_dict() == folded.to_dict()  # folding twice changes nothing


def test_unit_summaries_stay_when_the_tallies_count_no_more():
    attempt = AttemptStats(attempt="a1")
    attempt.add(unit("A", 12, unavailable=2, seq=3))
    attempt.add(unit("A", 8, seq=5, tally_calls=20))
    assert fold_tallies(attempt, [record("A", 2, {"OK": 5})]) is attempt  # a stale record
    assert fold_tallies(attempt, []) is attempt
    legacy = AttemptStats(attempt="a0", calls=9)  # saved before actors kept tallies
    assert fold_tallies(legacy, []) is legacy


def test_tallies_are_read_back_by_attempt(tmp_path):
    store = OutputStore(str(tmp_path))
    store.write_json(store.run_state("r", "attempts", "a1.json"), AttemptStats(attempt="a1").to_dict())
    for attempt, actor in (("a1", "host:1:ab"), ("a1", "host:2:cd"), ("a2", "host:3:ef")):
        store.write_json(tally_path(store, "r", attempt, actor), {**record(actor, 1, {"OK": 1}), "attempt": attempt})
    found = read_tallies(store, "r")
    assert sorted(found) == ["a1", "a2"]
    assert sorted(r["actor"] for r in found["a1"]) == ["host:1:ab", "host:2:cd"]
    assert read_tallies(OutputStore(str(tmp_path / "none")), "r") == {}


def test_the_actor_tally_counts_calls_of_a_unit_still_in_flight(tmp_path):
    """The service answers UNAVAILABLE to every call and the breaker waits long: the unit never
    ends, and the actor's snapshot still holds every call made so far."""

    class Down(ScriptedClient):
        async def classify(self, ids, texts):
            self.calls += 1
            await asyncio.sleep(0)
            self.answered += 1
            raise ServiceUnavailable("down", status_code="UNAVAILABLE")

    client = Down()
    never_again = BreakerConfig(failure_threshold=3, reset_timeout_s=600, max_reset_timeout_s=600, max_wait_s=3600)
    cfg = settings(tmp_path, breaker=never_again)
    _, block = make_unit(tmp_path, [f"text {i}" for i in range(40)])
    actor = InferenceActor(cfg, client_factory=lambda: client)

    async def scenario() -> tuple[dict, int]:
        task = asyncio.create_task(actor(block))
        for _ in range(10_000):
            await asyncio.sleep(0)
            if client.answered >= 3:
                break
        assert not task.done()
        # Both read in one step of the loop: a call answered while the task is being cancelled
        # (it can be, once) is after the snapshot, not missing from it.
        snapshot, answered = actor._actor_snapshot(), client.answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return snapshot, answered

    snapshot, answered = asyncio.run(scenario())
    assert answered >= 3
    assert snapshot["tally"]["calls"] == answered
    assert snapshot["tally"]["status_counts"] == {"UNAVAILABLE": answered}


def test_a_unit_summary_carries_the_actor_tally_including_its_own_calls(tmp_path):
    _, block = make_unit(tmp_path, [f"text {i}" for i in range(30)])
    client = ScriptedClient()
    summary = json.loads(asyncio.run(InferenceActor(settings(tmp_path), client_factory=lambda: client)(block))
                         .column("summary")[0].as_py())  # fmt: skip
    assert summary["calls"] == client.calls > 0
    assert summary["actor_stats"]["tally"]["calls"] == summary["calls"]


def test_vacuum_drops_the_tallies_of_old_finished_runs(tmp_path):
    from datetime import UTC, datetime, timedelta

    from raypipe.commit.fence import mark_committed, take_over
    from raypipe.commit.output import Output
    from raypipe.commit.table import OutcomeTable
    from raypipe.commit.upkeep import drop_finished_state
    from tests.fakes import LABELS

    store = OutputStore(str(tmp_path))
    table = OutcomeTable(str(tmp_path))
    table.ensure(LABELS)
    mark_committed(table, take_over(table, "old"), "old", {})
    finished = (datetime.now(UTC) - timedelta(days=30)).isoformat()
    store.write_json(store.report_file("old"), {"run_id": "old", "status": "completed", "finished_at": finished})
    store.write_json(store.run_state("old", "attempts", "a1.json"), AttemptStats(attempt="a1").to_dict())
    tally = tally_path(store, "old", "a1", "host:1:ab")
    store.write_json(tally, record("host:1:ab", 1, {"OK": 1}))

    assert drop_finished_state(Output.at(str(tmp_path)), before=datetime.now(UTC) - timedelta(days=7)) == 1
    assert not store.exists(tally) and not store.exists(store.run_state("old", "attempts", "a1.json"))
    assert store.exists(store.report_file("old"))

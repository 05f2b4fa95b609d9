"""The commit protocol on a real (local) Delta table: fencing by the table's own concurrency
control, one commit per unit, crashes, retention, the report's memory; and the protocol object's
steps, with the plan and the files seen fenced like unit commits and "committed" one truth, the
table (no Ray).

The interleavings below are the ones that broke the earlier check-then-write protocol: an
attempt passes its check, stalls, and writes after a newer attempt took over.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import threading
import tracemalloc
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import deltalake
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raypipe
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.protocol import CommitProtocol
from raypipe.commit.table import OutcomeTable, UnitCommitter
from raypipe.commit.upkeep import drop_finished_state, finished_runs, vacuum
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError, LeaseLostError
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from raypipe.report import AttemptStats, UnitStats
from raypipe.store import OutputStore
from tests.fakes import LABELS

UNIT = "shard-0-abc"


def rows(outcomes: dict[str, str], *, version: str) -> pa.Table:
    """A unit's rows: id -> "result" or "dead_letter", answered by model `version`."""
    ids = sorted(outcomes)
    return pa.table(
        {
            "id": ids,
            "outcome": [outcomes[i] for i in ids],
            "unit": [UNIT] * len(ids),
            "run_id": ["r1"] * len(ids),
            "status": ["ok" if outcomes[i] == "result" else None for i in ids],
            "error_kind": [None if outcomes[i] == "result" else "internal" for i in ids],
            "model_version": [version] * len(ids),
            "source": ["in.parquet"] * len(ids),
            "row": list(range(len(ids))),
        }
    )


def visible(out) -> Counter[tuple[str, str, str]]:
    t = read_outcomes(str(out), "r1")
    return Counter(
        zip(
            t.column("id").to_pylist(),
            t.column("outcome").to_pylist(),
            t.column("model_version").to_pylist(),
            strict=True,
        )
    )


def table_for(tmp_path) -> OutcomeTable:
    table = OutcomeTable(str(tmp_path / "out"))
    table.ensure(LABELS)
    return table


@pytest.mark.parametrize(
    "old, new",
    [
        ({"A": "result", "B": "dead_letter"}, {"A": "result", "B": "result"}),  # B would be lost
        ({"A": "result", "B": "result"}, {"A": "result", "B": "dead_letter"}),  # B would be twice
    ],
    ids=["old-dead-lettered", "new-dead-lettered"],
)
def test_a_stalled_commit_of_a_fenced_off_attempt_never_becomes_visible(tmp_path, monkeypatch, old, new):
    """Attempt 1 passes every check, stalls right before its write, attempt 2 takes over and
    commits the unit, then attempt 1's write goes on: the table rejects it, and every id is
    there once, as attempt 2 answered it."""
    table = table_for(tmp_path)
    first = UnitCommitter(table.take_over("r1"))
    real = deltalake.write_deltalake
    entered, release = threading.Event(), threading.Event()

    def stalled(*args, **kwargs):
        if threading.current_thread().name == "attempt-1":
            entered.set()
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(deltalake, "write_deltalake", stalled)
    outcome: list[BaseException | bool] = []

    def attempt_1() -> None:
        try:
            outcome.append(first.commit(UNIT, rows(old, version="model-A")))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=attempt_1, name="attempt-1")
    thread.start()
    assert entered.wait(30), "attempt 1 never reached its write"
    second = UnitCommitter(table.take_over("r1"))  # --force, or the lease expired
    assert second.fence.generation == first.fence.generation + 1
    assert second.commit(UNIT, rows(new, version="model-B")) is True
    release.set()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLostError), outcome
    assert visible(tmp_path / "out") == Counter({(i, o, "model-B"): 1 for i, o in new.items()})
    assert table.committed_units("r1") == {UNIT}


def test_results_and_dead_letters_become_visible_in_the_same_commit(tmp_path):
    table = table_for(tmp_path)
    committer = UnitCommitter(table.take_over("r1"))
    before = table.load().version()
    committer.commit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))
    dt = table.load()
    assert dt.version() == before + 1
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "dead_letter", "m"): 1})
    dt.load_as_version(before)
    assert dt.to_pyarrow_table().num_rows == 0


def test_a_commit_retried_in_the_same_generation_writes_nothing_twice(tmp_path):
    table = table_for(tmp_path)
    fence = table.take_over("r1")
    assert UnitCommitter(fence).commit(UNIT, rows({"A": "result"}, version="m")) is True
    assert UnitCommitter(fence).commit(UNIT, rows({"A": "result"}, version="m")) is False
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1})


def test_files_a_crashed_writer_left_are_invisible_and_vacuumed(tmp_path):
    """A writer that died after writing its data file but before its commit: no reader sees the
    file, a redo commits the unit once, and `vacuum` deletes the orphan."""
    table = table_for(tmp_path)
    orphan = tmp_path / "out" / "outcomes" / "run_id=r1" / "part-crashed.parquet"
    orphan.parent.mkdir(parents=True)
    pq.write_table(rows({"A": "result", "B": "result"}, version="crashed").drop(["run_id"]), orphan)
    assert read_outcomes(str(tmp_path / "out")).num_rows == 0
    UnitCommitter(table.take_over("r1")).commit(UNIT, rows({"A": "result", "B": "result"}, version="m"))
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "result", "m"): 1})
    done = vacuum(str(tmp_path / "out"), retention_hours=0, force=True)
    assert done["files"] >= 1 and not orphan.exists()
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "result", "m"): 1})


def _take_over(out: str, barrier, results) -> None:
    table = OutcomeTable(out)
    barrier.wait(30)
    try:
        results.put(("won", table.take_over("r1").generation))
    except LeaseLostError:
        results.put(("lost", 0))


def test_two_processes_taking_over_at_once_never_share_a_generation(tmp_path):
    table = table_for(tmp_path)
    table.take_over("r1")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_take_over, args=(table.output_uri, barrier, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    got = [results.get(timeout=5) for _ in procs]
    generations = [g for kind, g in got if kind == "won"]
    assert generations and len(set(generations)) == len(generations), got
    assert table.generation("r1") == max(generations)


def test_vacuum_drops_old_finished_runs_state_and_keeps_reports(tmp_path):
    """Finished means committed in the table; when, from the report (or an earlier release's
    COMMITTED.json)."""
    store = OutputStore(str(tmp_path))
    table = OutcomeTable(str(tmp_path))
    table.ensure(LABELS)
    now = datetime.now(UTC)
    for run_id, committed_at in (
        ("old", now - timedelta(days=30)),
        ("legacy", now - timedelta(days=30)),
        ("recent", now - timedelta(hours=1)),
        ("open", None),
    ):
        store.write_json(store.run_state(run_id, "plan.json"), {"units": []})
        store.write_json(store.run_state(run_id, "attempts", "a1.json"), {"calls": 1})
        report = {"run_id": run_id, "mode": "backfill", "status": "completed"}
        if committed_at is not None:
            table.mark_committed(table.take_over(run_id), {})
            if run_id == "legacy":
                store.write_json(store.run_state(run_id, "COMMITTED.json"), {"at": committed_at.isoformat()})
            else:
                report["finished_at"] = committed_at.isoformat()
        store.write_json(store.report_file(run_id), report)
    store.write_json(store.run_state("stale", "COMMITTED.json"), {"at": now.isoformat()})  # no run commit
    assert finished_runs(str(tmp_path)) == ["legacy", "old", "recent"]
    assert drop_finished_state(str(tmp_path), before=now - timedelta(days=7)) == 2
    assert not store.exists(store.run_state("old", "plan.json"))
    assert not store.exists(store.run_state("legacy", "plan.json"))
    assert store.exists(store.report_file("old"))
    assert store.exists(store.run_state("recent", "plan.json")) and store.exists(store.run_state("open", "plan.json"))


def summaries(n: int):
    """n unit summaries as the actors stream them back, made one at a time."""
    u = UnitStats(unit="u", shard="s", attempt="a", actor="actor", rows=2000, ok=2000, calls=63)
    u.status_counts["OK"] = 63
    for ms in (40, 55, 80):
        u.latency.add(ms / 1000)
    marker = u.to_dict()
    for i in range(n):
        marker["actor_stats"] = {"seq": i, "breaker": {"openings": 0, "time_open_s": 0.0, "probes": 0},
                                 "limiter": {"min": 2, "max": 8, "final": 6}}  # fmt: skip
        marker["actor"] = f"actor{i % 4}"
        yield UnitStats.from_dict(json.loads(json.dumps(marker)))


RAYPIPE_FILES = str(Path(raypipe.__file__).parent / "*")  # the package, not a checkout that happens to be named raypipe


def test_an_attempts_statistics_fold_in_bounded_memory():
    """Summaries are folded as they stream in: what the fold holds does not grow with the units.

    Counted from raypipe's own allocations that are still alive after a collection, so other
    threads of the test process and the collector's schedule (which earlier tests may change)
    do not enter the figure."""
    held = {}
    for n in (1_000, 10_000):
        attempt = AttemptStats()
        tracemalloc.start(4)
        for u in summaries(n):
            attempt.add(u)
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, RAYPIPE_FILES, all_frames=True)])
        tracemalloc.stop()
        held[n] = sum(stat.size for stat in snapshot.statistics("filename"))
        assert attempt.units == n and attempt.rows == 2000 * n and len(attempt.actors) == 4
        del attempt
    print(f"attempt fold holds: 1k units {held[1_000] / 1e3:.1f} kB, 10k units {held[10_000] / 1e3:.1f} kB")
    assert held[10_000] < 1.5 * held[1_000] + 50_000


def test_each_units_latest_updated_at_comes_from_the_logs_statistics_never_rounded_up(tmp_path):
    """What a shard planned whole from its size was read up to (`raypipe.plan.planning.with_whole_file_maxima`):
    Delta keeps timestamps to the millisecond, truncated, so a later rewrite is re-read from
    at most that millisecond and no row is skipped."""
    table = table_for(tmp_path)
    committer = UnitCommitter(table.take_over("r1"))
    stamps = {
        "u-a": [datetime(2026, 1, 1, 0, 0, 0, 999_999, tzinfo=UTC), datetime(2025, 1, 1, tzinfo=UTC)],
        "u-b": [datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC), None],
        "u-c": [None, None],
    }
    for unit, ts in stamps.items():
        t = rows({"A": "result", "B": "dead_letter"}, version="m")
        t = t.set_column(t.schema.get_field_index("unit"), "unit", pa.array([unit, unit]))
        committer.commit(unit, t.append_column("updated_at", pa.array(ts, pa.timestamp("us", tz="UTC"))))
    latest = table.max_updated_at_by_unit("r1")
    assert latest == {
        "u-a": datetime(2026, 1, 1, 0, 0, 0, 999_000, tzinfo=UTC),
        "u-b": datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC),
    }
    assert table.max_updated_at_by_unit("other-run") == {}


def test_unit_transactions_carry_last_updated_so_the_table_retention_prunes_them(tmp_path):
    """A unit's own transaction is kept for the table's transaction retention (90 days), not
    forever; the run's fencing slots carry no time and stay."""
    table = table_for(tmp_path)
    fence = table.take_over("r1")
    long_ago = (datetime.now(UTC) - timedelta(days=100)).timestamp()
    assert UnitCommitter(fence, clock=lambda: long_ago).commit(UNIT, rows({"A": "result"}, version="m"))
    recent = "shard-1-def"
    assert UnitCommitter(fence).commit(
        recent, rows({"B": "result"}, version="m").set_column(2, "unit", pa.array([recent]))
    )
    dt = table.load()
    assert dt.transaction_version(f"raypipe/r1/unit/{UNIT}") is None  # expired: pruned
    assert dt.transaction_version(f"raypipe/r1/unit/{recent}") == fence.generation
    assert table.generation("r1") == fence.generation


# -- the commit protocol object: set up a run, commit units, commit the run, abort ---------------


IN = "/data/in"


@pytest.fixture
def attempts():
    """The protocols a test sets up, released at its end (each holds the output lease)."""
    made: list[CommitProtocol] = []
    yield made
    for p in made:
        p.release()


def protocol(tmp_path, attempts, attempt: str, **kwargs) -> CommitProtocol:
    """An attempt of run r1; a later one takes the lease over at once (`--force`)."""
    output = OutputConfig(uri=str(tmp_path / "out"), take_over_lease=True, require_conditional_writes=False)
    p = CommitProtocol(output, "backfill", "r1", attempt=attempt, **kwargs)
    attempts.append(p)
    return p


def plan(*shards: str) -> Plan:
    return Plan("backfill", IN, [WorkUnit(f"{IN}/{s}", "parquet", 0, None, fingerprint=f"fp-{s}") for s in shards], [])


def zombie(p: CommitProtocol) -> CommitProtocol:
    """An attempt whose lease check passed just before it stalled: its writes come later."""
    p.check_lease = lambda: None  # type: ignore[method-assign]
    return p


def test_protocol_steps_set_up_commit_units_commit_the_run(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    assert not p.is_committed() and p.committed_report() is None
    fence = p.setup_run(LABELS)
    assert fence.generation == 1
    assert p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))
    assert not p.commit_unit(UNIT, rows({"A": "result", "B": "dead_letter"}, version="m"))  # once
    assert p.committed([UNIT, "other"]) == {UNIT}
    p.commit_run({"why": "every unit"})
    assert protocol(tmp_path, attempts, "a2").is_committed()
    assert visible(tmp_path / "out") == Counter({("A", "result", "m"): 1, ("B", "dead_letter", "m"): 1})


def test_protocol_setup_fences_the_earlier_attempt_off_at_every_step(tmp_path, attempts):
    old, new = protocol(tmp_path, attempts, "a1"), protocol(tmp_path, attempts, "a2")
    old.setup_run(LABELS)
    new.setup_run(LABELS)
    zombie(old)
    with pytest.raises(LeaseLostError):
        old.commit_unit(UNIT, rows({"A": "result"}, version="old"))
    with pytest.raises(LeaseLostError):
        old.save_plan(plan("zombie.parquet"))
    stale = plan("a.parquet")
    with pytest.raises(LeaseLostError):
        old.record_files_seen(stale, {u.key for u in stale.units})
    with pytest.raises(LeaseLostError):
        old.commit_run()
    assert not new.is_committed() and new.stored_plan() is None and new.files_seen() == {}
    assert new.commit_unit(UNIT, rows({"A": "result"}, version="new"))
    assert visible(tmp_path / "out") == Counter({("A", "result", "new"): 1})


def test_protocol_abort_fences_its_own_writers_but_never_a_newer_attempt(tmp_path, attempts):
    first = protocol(tmp_path, attempts, "a1")
    first.setup_run(LABELS)
    assert first.commit_unit(UNIT, rows({"A": "result"}, version="m"))
    stalled = first.unit_committer()  # an actor still working when the driver gives up
    assert first.abort()
    with pytest.raises(LeaseLostError):
        stalled.commit("shard-1-def", rows({"B": "result"}, version="m"))
    second = protocol(tmp_path, attempts, "a2")
    assert second.setup_run(LABELS).generation == 3
    assert second.committed([UNIT, "shard-1-def"]) == {UNIT}  # what committed before stays
    third = protocol(tmp_path, attempts, "a3")
    third.setup_run(LABELS)
    assert not second.abort()  # the run is the third's now: left alone
    assert third.commit_unit("shard-1-def", rows({"B": "result"}, version="m"))


def test_protocol_plan_and_files_seen_read_back_through_the_table(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    first, _ = p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    p.save_plan(plan("a.parquet", "b.parquet"))  # a resumed run's refreshed plan
    assert p.record_files_seen(first, {u.key for u in first.units}) == 1
    assert p.record_files_seen(first, {u.key for u in first.units}) == 0
    reader = protocol(tmp_path, attempts, "reader")
    assert [u.shard for u in reader.stored_plan().units] == [f"{IN}/a.parquet", f"{IN}/b.parquet"]
    assert reader.files_seen() == {f"{IN}/a.parquet": ("fp-a.parquet", None)}


def test_protocol_unit_transactions_use_the_injected_clock(tmp_path, attempts):
    long_ago = (datetime.now(UTC) - timedelta(days=100)).timestamp()
    p = protocol(tmp_path, attempts, "a1", clock=lambda: long_ago)
    p.setup_run(LABELS)
    assert p.commit_unit(UNIT, rows({"A": "result"}, version="m"))
    assert p.table.load().transaction_version(f"raypipe/r1/unit/{UNIT}") is None  # past the retention
    assert p.committed([UNIT]) == {UNIT}  # still found committed by its file


def test_a_fenced_off_attempt_cannot_replace_the_plan(tmp_path, attempts):
    old = protocol(tmp_path, attempts, "a1")
    old.setup_run(LABELS)
    old.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    protocol(tmp_path, attempts, "a2").setup_run(LABELS)
    zombie(old)
    with pytest.raises(LeaseLostError):
        old.save_plan(plan("zombie.parquet"))
    reader = protocol(tmp_path, attempts, "a3")
    stored, resumed = reader.plan(lambda: plan("never.parquet"), input_uri=IN, model_version="m")
    assert resumed and [u.shard for u in stored.units] == [f"{IN}/a.parquet"]


def test_a_fenced_off_attempt_cannot_rewrite_the_files_seen(tmp_path, attempts):
    old = protocol(tmp_path, attempts, "a1")
    old.setup_run(LABELS)
    new = protocol(tmp_path, attempts, "a2")
    new.setup_run(LABELS)
    done = plan("a.parquet")
    new.record_files_seen(done, {u.key for u in done.units})
    zombie(old)
    stale = plan("b.parquet")
    with pytest.raises(LeaseLostError):
        old.record_files_seen(stale, {u.key for u in stale.units})
    assert set(protocol(tmp_path, attempts, "a3").files_seen()) == {f"{IN}/a.parquet"}


def test_a_run_id_resumes_only_as_the_mode_and_input_it_started_as(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    with pytest.raises(ConfigError, match="cannot be resumed as a backfill of /data/other"):
        p.plan(lambda: plan("a.parquet"), input_uri="/data/other", model_version="m")


def test_committed_has_one_truth_the_table(tmp_path, attempts):
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    p.plan(lambda: plan("a.parquet"), input_uri=IN, model_version="m")
    p.commit_run()
    p.release()
    assert not list((tmp_path / "out").rglob("COMMITTED.json"))
    assert finished_runs(str(tmp_path / "out")) == ["r1"]
    assert protocol(tmp_path, attempts, "a2").committed_report() is not None

"""Replays on a real (local) Delta table: what a resumed replay skips, what it counts, and
replays of different units committing side by side (no Ray)."""

from __future__ import annotations

import pyarrow as pa

from raypipe.commit.fence import UnitCommitter, take_over
from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable, unit_slot
from tests.fakes import LABELS

RUN = "r1"
REPLAY = "r1.replay-1"


def unit_names(n: int) -> list[str]:
    """n unit keys in n different fencing slots (commits in one slot conflict by design)."""
    names: dict[int, str] = {}
    k = 0
    while len(names) < n:
        names.setdefault(unit_slot(f"shard-{k}"), f"shard-{k}")
        k += 1
    return list(names.values())


def unit_rows(unit: str, outcomes: dict[str, str], *, kind: str = "internal") -> pa.Table:
    ids = sorted(outcomes)
    n = len(ids)
    return pa.table(
        {
            "id": ids,
            "outcome": [outcomes[i] for i in ids],
            "unit": [unit] * n,
            "run_id": [RUN] * n,
            "status": ["ok" if outcomes[i] == "result" else None for i in ids],
            "error_kind": [None if outcomes[i] == "result" else kind for i in ids],
            "text": [f"text {i}" for i in ids],
            "source": ["in.parquet"] * n,
            "row": list(range(n)),
        }
    )


def original_run(out, units: list[str]) -> OutcomeTable:
    """Run r1: each unit with one result and two dead letters."""
    table = OutcomeTable(str(out))
    table.ensure(LABELS)
    committer = UnitCommitter(take_over(table, RUN))
    for u in units:
        committer.commit(u, unit_rows(u, {f"{u}-ok": "result", f"{u}-d1": "dead_letter", f"{u}-d2": "dead_letter"}))
    return table


def test_replays_of_different_units_do_not_conflict(tmp_path):
    """Two replay commits built on the same snapshot, on different units (different slots):
    both land at the first try (the MERGE reads its unit's file only, not the run's partition)."""
    a, b = unit_names(2)
    table = original_run(tmp_path, [a, b])
    fence = take_over(table, REPLAY)
    first, second = UnitCommitter(fence), UnitCommitter(fence)
    stale = table.load()
    second._fresh = lambda: stale  # type: ignore[method-assign]  # its snapshot predates the first commit
    replayed = {f"{a}-d1": "result", f"{a}-d2": "result"}
    assert first.commit(a, unit_rows(a, replayed), replace_dead_letters=True, max_tries=1)
    replayed = {f"{b}-d1": "result", f"{b}-d2": "dead_letter"}
    assert second.commit(b, unit_rows(b, replayed), replace_dead_letters=True, max_tries=1)
    rows = read_outcomes(str(tmp_path), RUN)
    outcome = dict(zip(rows.column("id").to_pylist(), rows.column("outcome").to_pylist(), strict=True))
    assert sorted(outcome.values()).count("dead_letter") == 1 and len(outcome) == 6


def replay_protocol(out):
    from raypipe.api import build_config
    from raypipe.commit.output import Output
    from raypipe.commit.protocol import CommitProtocol

    cfg = build_config(output=str(out), service="127.0.0.1:1", run_id=REPLAY)
    return CommitProtocol(Output.at(cfg.output), "replay", REPLAY)


def replay_plan(out, units: list[str]):
    """The replay's plan as the run makes it: from the dead letters the table holds by unit."""
    from raypipe.plan.planning import plan_replay

    found = replay_protocol(out).dead_letters_of(RUN)
    assert found is not None
    version, dead_letters = found
    assert set(dead_letters) == set(units)
    return plan_replay(str(out), RUN, dead_letters, table_version=version)


def test_a_resumed_replay_does_not_infer_units_an_earlier_attempt_committed(tmp_path):
    """Attempt 1 committed unit a (its rows stayed dead letters) and was killed; attempt 2's
    pending units are b only: a's dead letters are not inferred again to be thrown away."""
    a, b = unit_names(2)
    original_run(tmp_path, [a, b])
    plan = replay_plan(tmp_path, [a, b])
    killed = UnitCommitter(take_over(OutcomeTable(str(tmp_path)), REPLAY))
    again = {f"{a}-d1": "dead_letter", f"{a}-d2": "dead_letter"}
    assert killed.commit(a, unit_rows(a, again, kind="rejected"), replace_dead_letters=True)
    protocol = replay_protocol(tmp_path)
    assert protocol.committed_units(plan) == {a}


def test_a_replay_report_counts_rows_an_attempt_converted_before_it_was_killed(tmp_path):
    """The killed attempt saved no statistics; the report's rows come from the table: what the
    dead letters of the replayed units became."""
    from raypipe.report import AttemptStats, RunReport
    from raypipe.run.steps import fold_report as _fold_report

    a, b = unit_names(2)
    original_run(tmp_path, [a, b])
    plan = replay_plan(tmp_path, [a, b])
    killed = UnitCommitter(take_over(OutcomeTable(str(tmp_path)), REPLAY))
    assert killed.commit(a, unit_rows(a, {f"{a}-d1": "result", f"{a}-d2": "dead_letter"}), replace_dead_letters=True)
    protocol = replay_protocol(tmp_path)
    report = RunReport(run_id=REPLAY, mode="replay")
    _fold_report(protocol, report, AttemptStats(attempt=protocol.attempt), plan=plan)
    assert (report.rows_ok, report.rows_dead_letters) == (1, 1)


def test_a_replay_unit_reads_its_own_dead_letters_only(tmp_path):
    from raypipe.plan.units import ColumnNames, WorkUnit
    from raypipe.run.read import read_unit

    a, b = unit_names(2)
    original_run(tmp_path, [a, b])
    block = read_unit(WorkUnit(str(tmp_path), "dead_letters", 0, 2, name=b, source_run=RUN), ColumnNames())
    assert sorted(block.column("id").to_pylist()) == [f"{b}-d1", f"{b}-d2"]
    assert set(block.column("_unit").to_pylist()) == {b} and sorted(block.column("_row").to_pylist()) == [0, 1]


def test_a_replay_keeps_the_dead_letters_whose_reason_is_the_row_itself(tmp_path):
    """A text that is not UTF-8, a line that is not a JSON object, a missing id: a replay sends
    none of them, and each keeps its dead letter and its reason (their text is stored null:
    taken for an empty text, they became `empty_text` results)."""
    import asyncio

    from raypipe.call.actor import ActorSettings, InferenceActor
    from raypipe.config import ClientConfig, ServiceConfig
    from raypipe.plan.planning import list_shards, plan_units
    from raypipe.plan.units import ColumnNames, WorkUnit
    from raypipe.run.read import read_unit
    from tests.fakes import ScriptedClient

    (tmp_path / "in.jsonl").write_bytes(
        b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "bad \xff text"}\n"not an object"\n'
        b'{"id": "", "text": "no id"}\n'
    )
    out = tmp_path / "out"
    units, _ = plan_units(list_shards(str(tmp_path / "in.jsonl")), unit_rows=1000, columns=ColumnNames())
    table = OutcomeTable(str(out))
    table.ensure(LABELS)

    def run(run_id: str, block: pa.Table, *, replay: bool) -> ScriptedClient:
        client = ScriptedClient()
        committer = UnitCommitter(take_over(table, run_id))
        settings = ActorSettings(
            committer=committer,
            run_id=RUN,
            attempt=run_id,
            service=ServiceConfig(),
            client=ClientConfig(),
            labels=LABELS,
            replay=replay,
        )
        asyncio.run(InferenceActor(settings, client_factory=lambda: client)(block))
        return client

    def fates() -> dict[int, tuple[str, str | None, str | None]]:
        rows = read_outcomes(str(out), RUN).to_pylist()
        return {r["row"]: (r["outcome"], r["status"] or r["error_kind"], r["message"]) for r in rows}

    run(RUN, read_unit(units[0], ColumnNames()), replay=False)
    before = fates()
    assert {row: f[1] for row, f in before.items()} == {
        0: "ok",
        1: "invalid_text",
        2: "invalid_row",
        3: "missing_id",
    }
    dead = WorkUnit(str(out), "dead_letters", 0, 3, name=units[0].key, source_run=RUN)
    client = run(REPLAY, read_unit(dead, ColumnNames()), replay=True)
    assert client.calls == 0
    assert read_outcomes(str(out), RUN).num_rows == 4  # each row once: replaced, not added
    after = fates()
    assert {row: f[:2] for row, f in after.items()} == {row: f[:2] for row, f in before.items()}
    assert [after[row][2] for row in (1, 2, 3)] == [before[row][2] for row in (1, 2, 3)]


def test_replay_numbering_comes_from_the_table_not_from_state_folders(tmp_path):
    """`vacuum` drops a finished replay's state: the next replay still gets a new number, never
    the committed one (which would do nothing, saying completed)."""
    import shutil

    from raypipe.commit.fence import mark_committed
    from raypipe.commit.output import Output
    from raypipe.run.modes import replay_run_id

    table = original_run(tmp_path / "out", unit_names(1))
    place = Output.at(str(tmp_path / "out"))
    store = place.store
    assert replay_run_id(place, RUN) == REPLAY
    fence = take_over(table, REPLAY)  # the replay starts: its plan stored, then it is committed
    store.write_json(store.run_state(REPLAY, "plan", "1.json"), {})
    assert replay_run_id(place, RUN) == REPLAY  # started, not committed: resumed
    mark_committed(table, fence, REPLAY, {})
    shutil.rmtree(store.run_state(REPLAY))  # what vacuum does to a finished run's state
    place.table.refresh()  # past the replay's run commit, made from another object
    assert replay_run_id(place, RUN) == "r1.replay-2"
    assert replay_run_id(place, "r1.replay-2") == "r1.replay-2.replay-1"  # a replay of a replay


def test_replays_after_compact_rewrite_only_their_own_units_files(tmp_path):
    """`compact` merges the small files of units without dead letters and leaves the units a
    replay rewrites apart: two replays built on one snapshot both land at the first try, and
    each replaces its own unit's file only."""
    from raypipe.commit.fence import mark_committed
    from raypipe.commit.upkeep import compact

    a, b, *clean = unit_names(5)
    table = original_run(tmp_path, [a, b])
    committer = UnitCommitter(take_over(table, RUN))
    for u in clean:
        assert committer.commit(u, unit_rows(u, {f"{u}-1": "result", f"{u}-2": "result"}))
    mark_committed(table, committer.fence, RUN, {})

    def files_by_unit() -> dict[str, set[str]]:
        actions = pa.table(table.refresh().get_add_actions(flatten=True)).to_pylist()
        out: dict[str, set[str]] = {}
        for f in actions:
            key = f["min.unit"] if f["min.unit"] == f["max.unit"] else "several"
            out.setdefault(key, set()).add(f["path"])
        return out

    before = files_by_unit()
    done = compact(str(tmp_path))
    compacted = files_by_unit()
    assert compacted.get(a) == before[a] and compacted.get(b) == before[b]  # the replay's units stay apart
    assert len(compacted["several"]) == 1 and not set(clean) & set(compacted)
    assert done["units"] == 3 and done["files_after"] == done["files_before"] - 2
    assert len(read_outcomes(str(tmp_path), RUN)) == 12  # the same rows

    fence = take_over(table, REPLAY)
    first, second = UnitCommitter(fence), UnitCommitter(fence)
    stale = table.load()
    second._fresh = lambda: stale  # type: ignore[method-assign]  # its snapshot predates the first commit
    assert first.commit(a, unit_rows(a, {f"{a}-d1": "result", f"{a}-d2": "result"}), replace_dead_letters=True,
                        max_tries=1)  # fmt: skip
    assert second.commit(b, unit_rows(b, {f"{b}-d1": "result", f"{b}-d2": "result"}), replace_dead_letters=True,
                         max_tries=1)  # fmt: skip
    after = files_by_unit()
    assert after["several"] == compacted["several"]  # neither replay rewrote the compacted file
    assert not after[a] & compacted[a] and not after[b] & compacted[b]
    assert read_outcomes(str(tmp_path), RUN).column("outcome").to_pylist().count("dead_letter") == 0

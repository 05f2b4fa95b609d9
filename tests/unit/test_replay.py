"""Replays on a real (local) Delta table: what a resumed replay skips, what it counts, and
replays of different units committing side by side (no Ray)."""

from __future__ import annotations

import pyarrow as pa

from raypipe.outcomes import read_outcomes
from raypipe.sinks import OutcomeTable, UnitCommitter, unit_slot
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
    committer = UnitCommitter(table.take_over(RUN))
    for u in units:
        committer.commit(u, unit_rows(u, {f"{u}-ok": "result", f"{u}-d1": "dead_letter", f"{u}-d2": "dead_letter"}))
    return table


def test_replays_of_different_units_do_not_conflict(tmp_path):
    """Two replay commits built on the same snapshot, on different units (different slots):
    both land at the first try (the MERGE reads its unit's file only, not the run's partition)."""
    a, b = unit_names(2)
    table = original_run(tmp_path, [a, b])
    fence = table.take_over(REPLAY)
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

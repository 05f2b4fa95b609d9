"""The files seen grow with the delta, not with the history: each daily writes the entries it
adds or updates over the file before it, every `FILES_SEEN_CHAIN` writes a full copy replaces
the chain, and the replaced files are deleted. On a real local Delta table, no Ray."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from raypipe.commit.state import FILES_SEEN_DIR, read_files_seen
from raypipe.commit.table import FILES_SEEN_APP
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from tests.fakes import LABELS
from tests.unit.test_commit_protocol import IN, attempts, plan, protocol  # noqa: F401 (a fixture)


def test_forty_dailies_keep_a_bounded_files_seen_state_and_lose_no_entry(tmp_path, attempts):  # noqa: F811
    p = protocol(tmp_path, attempts, "a1")
    p.setup_run(LABELS)
    folder = tmp_path / "out" / "_raypipe" / FILES_SEEN_DIR
    written = 0
    for day in range(40):
        added = plan(f"day-{day}.parquet")
        assert p.record_files_seen(added, {u.key for u in added.units}) == 1
        named = folder / f"{p.table.pointer(FILES_SEEN_APP)}.parquet"
        written += pq.read_table(named).num_rows
        assert len(os.listdir(folder)) <= 17  # a full copy and the deltas over it (FILES_SEEN_CHAIN)
    # Entries written: one per file read, and a full copy every FILES_SEEN_CHAIN dailies (here 1 + 17 + 34),
    # not the whole history every day (1 + 2 + ... + 40 = 820).
    assert written <= 40 + 1 + 17 + 34
    rewritten = Plan("backfill", IN, [WorkUnit(f"{IN}/day-3.parquet", "parquet", 0, None, fingerprint="new")], [])
    assert p.record_files_seen(rewritten, {u.key for u in rewritten.units}) == 1
    seen = p.files_seen()
    assert len(seen) == 40 and seen[f"{IN}/day-3.parquet"] == ("new", None)
    assert seen[f"{IN}/day-39.parquet"] == ("fp-day-39.parquet", None)
    assert read_files_seen(p.store, p.table.pointer(FILES_SEEN_APP)) == seen

"""Unit keys (`WorkUnit.key`): ASCII of at most 64 bytes, so delta-rs's string statistics (cut
at 64 bytes) hold a unit's key whole and a resume can list what is committed; a stored plan
keeps the keys it was stored with. Local files, a real local Delta table, no Ray."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest

from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.config import OutputConfig
from raypipe.plan.planning import Plan
from raypipe.plan.units import WorkUnit
from tests.fakes import LABELS
from tests.unit.test_table import rows

CJK = "東京都の天気予報と週間天気予報の詳細な情報を毎日お届けする地域気象観測所の記録簿"[:40]
FRENCH = "données_prévisions_météorologiques_été_hiver_région_Île-de-France_détaillées"
NAMES = [CJK, FRENCH, "x" * 200, "part-00000"]


@pytest.mark.parametrize("name", NAMES)
def test_a_key_is_ascii_of_at_most_64_bytes_with_a_readable_prefix(name):
    assert len(CJK) == 40
    for start, stop in [(0, None), (0, 2000), (9_223_372_036_854_775_000, 9_223_372_036_854_775_807)]:
        unit = WorkUnit(f"s3://bucket/in/{name}.parquet", "parquet", start, stop, fingerprint="123:abc")
        assert unit.key.isascii() and len(unit.key.encode()) <= 64, unit.key
        assert unit.key == WorkUnit.from_dict(unit.to_dict()).key
    assert WorkUnit("/in/part-00000.parquet", "parquet", 0, 10).key.startswith("part-00000-0-")
    assert WorkUnit(f"/in/{FRENCH}.parquet", "parquet", 0, 10).key.startswith("donnees_previsions")


def test_keys_tell_units_apart():
    units = [
        WorkUnit(f"/in/{CJK}.parquet", "parquet", 0, 10),
        WorkUnit(f"/in/{CJK[:-1]}x.parquet", "parquet", 0, 10),
        WorkUnit(f"/in/{CJK}.parquet", "parquet", 10, 20),
        WorkUnit(f"/in/{CJK}.parquet", "parquet", 0, 20),
        WorkUnit(f"/in/{CJK}.parquet", "parquet", 0, 10, fingerprint="another version"),
    ]
    assert len({u.key for u in units}) == len(units)


def test_a_stored_plan_keeps_the_keys_it_was_stored_with():
    """A plan an earlier release stored has no keys in it: its units keep the keys that release
    derived, so a resume finds the units it committed."""
    stored = {"shard": "/in/part-7.parquet", "format": "parquet", "row_start": 0, "row_stop": 10, "name": None}
    stored |= {"source_run": None, "fingerprint": "1:2", "since": None}
    legacy = "part-7-0-" + hashlib.sha1(b"/in/part-7.parquet|0|10").hexdigest()[:12]
    assert WorkUnit.from_dict(stored).key == legacy
    new = WorkUnit("/in/part-7.parquet", "parquet", 0, 10, fingerprint="1:2")
    assert WorkUnit.from_dict(new.to_dict()) == new


@pytest.mark.parametrize("name", [CJK, FRENCH])
def test_a_resume_lists_the_committed_units_of_a_non_ascii_shard(tmp_path, name):
    output = OutputConfig(uri=str(tmp_path / "out"), take_over_lease=True, require_conditional_writes=False)
    units = [WorkUnit(f"/in/{name}.parquet", "parquet", start, start + 10, fingerprint="1:2") for start in (0, 10)]
    plan = Plan("backfill", "/in", units, [])
    first = CommitProtocol(Output.at(output), "backfill", "r1", attempt="a1")
    try:
        first.setup_run(LABELS)
        for unit in units:
            block = rows({"A": "result"}, version="m")
            block = block.set_column(
                block.schema.get_field_index("unit"), "unit", pa.array([unit.key] * block.num_rows)
            )
            assert first.commit_unit(unit.key, block)
    finally:
        first.release()
    again = CommitProtocol(Output.at(output), "backfill", "r1", attempt="a2")
    try:
        again.setup_run(LABELS)
        assert again.committed_units(plan) == {u.key for u in units}
    finally:
        again.release()

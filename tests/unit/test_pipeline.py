"""The pipeline's read side (`raypipe.run.pipeline`) without a cluster: one read task per unit, in
plan order, and what a unit's read task gives for a good, an empty, an unreadable and a
rewritten shard under each bad-shard policy. The actors' side is `test_actor`'s."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.errors import InputError
from raypipe.plan.planning import list_input, plan_units
from raypipe.plan.units import ColumnNames, WorkUnit
from raypipe.run.pipeline import UnitDatasource, _read_block

COLS = ColumnNames()


def shard(path, ids: list[str]) -> WorkUnit:
    texts = [f"text {i}" for i in ids]
    pq.write_table(pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())}), path)
    listing = list_input(str(path))
    units, _ = plan_units(listing.shards, unit_rows=100, columns=COLS, fingerprints=listing.fingerprints, threads=1)
    (unit,) = units
    return unit


def test_one_read_task_per_unit_in_plan_order_with_its_rows(tmp_path):
    a, b = shard(tmp_path / "a.parquet", ["1", "2"]), shard(tmp_path / "b.parquet", ["3"])
    tasks = UnitDatasource([b, a], COLS).get_read_tasks(parallelism=1)
    assert [list(t.metadata.input_files) for t in tasks] == [[b.shard], [a.shard]]
    assert [t.metadata.num_rows for t in tasks] == [1, 2]
    (block,) = list(tasks[1]())
    assert block.column("id").to_pylist() == ["1", "2"] and set(block.column("_unit").to_pylist()) == {a.key}


def test_an_empty_unit_is_one_marker_row_without_an_error(tmp_path):
    unit = shard(tmp_path / "a.parquet", [])
    (block,) = _read_block(unit, COLS, "fail")
    assert block.num_rows == 1 and block.column("_unit_error").to_pylist() == [None]
    assert block.column("_unit_rows").to_pylist() == [0] and block.column("id").to_pylist() == [None]


def test_an_unreadable_shard_stops_the_run_or_is_recorded_by_policy(tmp_path):
    unit = shard(tmp_path / "a.parquet", ["1"])
    (tmp_path / "a.parquet").write_bytes(b"not parquet at all")
    unit = WorkUnit(unit.shard, unit.format, unit.row_start, unit.row_stop)  # no fingerprint: read as it is
    with pytest.raises(InputError) as raised:
        _read_block(unit, COLS, "fail")
    assert raised.value.shard == unit.shard
    (marker,) = _read_block(unit, COLS, "record")
    assert marker.column("_unit_error").to_pylist()[0] and marker.column("_unit").to_pylist() == [unit.key]


def test_a_shard_rewritten_since_planning_is_recorded_even_where_bad_shards_stop_the_run(tmp_path):
    """A rewrite is no corruption: the unit is left out and re-planned, never a failed run."""
    unit = shard(tmp_path / "a.parquet", ["1"])
    pq.write_table(pa.table({"id": ["1", "2"], "text": ["x", "y"]}), tmp_path / "a.parquet")
    (marker,) = _read_block(unit, COLS, "fail")
    assert "ShardChangedError" in marker.column("_unit_error").to_pylist()[0]

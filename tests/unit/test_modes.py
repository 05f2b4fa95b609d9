"""Run modes' planning and reading on local files and a real Delta table (no Ray cluster)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.api import build_config
from raypipe.commit.protocol import CommitProtocol
from raypipe.plan.planning import plan_input
from raypipe.plan.units import ColumnNames
from raypipe.run.pipeline import _read_block

T = datetime(2026, 3, 1, tzinfo=UTC)


def config(tmp_path, **settings):
    return build_config(
        input=str(tmp_path / "in"), output=str(tmp_path / "out"), service="127.0.0.1:1", settings=settings
    )


def write(path, ids, stamps):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {"id": ids, "text": [f"text {i}" for i in ids], "updated_at": pa.array(stamps, pa.timestamp("us", tz="UTC"))}
    )
    pq.write_table(table, path)


def read_plan(plan):
    rows = []
    for unit in plan.units:
        for block in _read_block(unit, ColumnNames(), "fail"):
            rows += [r for r in block.column("id").to_pylist() if r is not None]
    return sorted(rows)


def test_daily_since_reads_a_new_file_whole_whatever_its_rows_updated_at(tmp_path):
    """A late file whose rows are stamped before --since, some with no updated_at: all read."""
    write(tmp_path / "in" / "late.parquet", ["a", "b", "c"], [T - timedelta(days=3), None, T + timedelta(hours=1)])
    cfg = config(tmp_path)
    assert cfg.input is not None
    plan = plan_input(cfg.input, "daily", CommitProtocol(cfg.output, "daily", "d1"), since=T)
    assert read_plan(plan) == ["a", "b", "c"]


class _History:
    """What planning asks of the output (`OutputHistory`), as a test sets it."""

    def __init__(self, seen):
        self.seen = seen

    def quarantined(self):
        return frozenset()

    def files_seen(self):
        return self.seen


def test_daily_since_rereads_a_rewritten_file_after_the_earlier_time_then_the_unchanged_ones(tmp_path):
    """A rewritten file is re-read after what was read of it or `since`, whichever is earlier;
    an unchanged one after `since`; in that order, after the new files."""
    from raypipe.plan.planning import list_input

    write(tmp_path / "in" / "a_new.parquet", ["n"], [T])
    write(tmp_path / "in" / "b_rewritten.parquet", ["r"], [T])
    write(tmp_path / "in" / "c_unchanged.parquet", ["u"], [T])
    cfg = config(tmp_path)
    assert cfg.input is not None
    listing = list_input(cfg.input.uri)
    shard = {s.rsplit("/", 1)[-1]: s for s, _ in listing.shards}
    upto = T - timedelta(days=1)
    history = _History(
        {
            shard["b_rewritten.parquet"]: ("an older version", upto.isoformat()),
            shard["c_unchanged.parquet"]: (listing.fingerprints[shard["c_unchanged.parquet"]], None),
        }
    )
    since = T - timedelta(hours=1)
    plan = plan_input(cfg.input, "daily", history, since=since)
    assert [(u.shard.rsplit("/", 1)[-1], u.since) for u in plan.units] == [
        ("a_new.parquet", None),
        ("b_rewritten.parquet", upto.isoformat()),
        ("c_unchanged.parquet", since.isoformat()),
    ]

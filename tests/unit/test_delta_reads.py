"""What a daily reads: every row of a new or changed file, whatever its `updated_at`; an
unchanged file only under `--since`, for its rows updated at or after it (local files, no Ray).

Each test plans with `plan_input` against a files-seen history and reads the plan back through
the pipeline's read tasks, so what is checked is what a run would send."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.api import build_config
from raypipe.plan.planning import list_input, plan_input
from raypipe.run.pipeline import UnitDatasource

T0 = datetime(2026, 3, 1, tzinfo=UTC)
SENTINEL = datetime(9999, 12, 31, tzinfo=UTC)


def config(tmp_path, **settings):
    cfg = build_config(
        input=str(tmp_path / "in"), output=str(tmp_path / "out"), service="127.0.0.1:1", settings=settings
    )
    assert cfg.input is not None
    return cfg.input


def write(path, ids, stamps, unit=None, *, mtime=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = pa.timestamp(unit or "us", tz="UTC")
    table = pa.table({"id": ids, "text": [f"text {i}" for i in ids], "updated_at": pa.array(stamps, kind)})
    pq.write_table(table, path)
    if mtime is not None:  # the same size and mtime would be the same fingerprint locally
        os.utime(path, (mtime, mtime))


def read_plan(plan):
    """The ids the run's pipeline reads of `plan`: its read tasks, as `run_units` builds them."""
    rows = []
    for task in UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1):
        for block in task():
            rows += [r for r in block.column("id").to_pylist() if r is not None]
    return sorted(rows)


class History:
    """What planning asks of the output (`OutputHistory`): the files read before, as a run left them."""

    def __init__(self, seen):
        self.seen = seen

    def quarantined(self):
        return frozenset()

    def files_seen(self):
        return self.seen


def read_before(input, name, up_to):
    """History where `name` was read as it is now (fingerprint), up to `up_to` (what older runs recorded)."""
    listing = list_input(input.uri)
    (shard,) = [s for s, _ in listing.shards if s.endswith(name)]
    return shard, {shard: (listing.fingerprints[shard], up_to.isoformat())}


def test_a_row_appended_with_an_older_stamp_to_a_rewritten_file_is_read(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "a.parquet", ["a", "b"], [T0, T0], mtime=1_000)
    _, seen = read_before(input, "a.parquet", T0)
    # CDC lag: the producer appends a row stamped a day before what was read of the file.
    write(tmp_path / "in" / "a.parquet", ["a", "b", "late"], [T0, T0, T0 - timedelta(days=1)], mtime=2_000)
    plan = plan_input(input, "daily", History(seen))
    assert read_plan(plan) == ["a", "b", "late"]
    assert all(u.since is None for u in plan.units)


def test_a_sentinel_stamp_beside_a_genuinely_updated_row_both_read(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "s.parquet", ["old", "mid"], [T0 - timedelta(days=2), T0 - timedelta(days=1)], mtime=1_000)
    _, seen = read_before(input, "s.parquet", T0 - timedelta(days=1))
    write(
        tmp_path / "in" / "s.parquet",
        ["old", "mid", "sentinel", "updated"],
        [T0 - timedelta(days=2), T0 - timedelta(days=1), SENTINEL, T0],
        mtime=2_000,
    )
    assert read_plan(plan_input(input, "daily", History(seen))) == ["mid", "old", "sentinel", "updated"]


def test_under_since_a_sentinel_does_not_hide_an_updated_row_of_an_unchanged_file(tmp_path):
    """`--since` only adds reads: an unchanged file is re-read for its rows updated at or after
    it, and a group holding a sentinel is not pruned by a clipped maximum."""
    input = config(tmp_path)
    write(tmp_path / "in" / "u.parquet", ["old", "sentinel", "updated"], [T0 - timedelta(days=2), SENTINEL, T0])
    _, seen = read_before(input, "u.parquet", T0)
    plan = plan_input(input, "daily", History(seen), since=T0 - timedelta(hours=1))
    assert read_plan(plan) == ["sentinel", "updated"]


def test_an_overwrite_of_a_fixed_key_with_an_earlier_batch_is_read_whole(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "latest.parquet", ["x1", "x2"], [T0, T0], mtime=1_000)
    _, seen = read_before(input, "latest.parquet", T0)
    batch = [f"y{i}" for i in range(5)]
    write(tmp_path / "in" / "latest.parquet", batch, [T0 - timedelta(days=3)] * 4 + [None], mtime=2_000)
    assert read_plan(plan_input(input, "daily", History(seen))) == batch


def test_a_rewrite_with_one_row_stamped_in_the_future_reads_the_rows_appended_later(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "f.parquet", ["a", "ahead"], [T0, datetime.now(UTC) + timedelta(minutes=30)], mtime=1_000)
    _, seen = read_before(input, "f.parquet", datetime.now(UTC) + timedelta(minutes=30))
    write(tmp_path / "in" / "f.parquet", ["a", "ahead", "b"], [T0, T0, T0], mtime=2_000)
    assert read_plan(plan_input(input, "daily", History(seen))) == ["a", "ahead", "b"]


def test_an_unchanged_file_is_never_read_without_since(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "u.parquet", ["u"], [T0])
    write(tmp_path / "in" / "n.parquet", ["n"], [T0 - timedelta(days=9)])
    _, seen = read_before(input, "u.parquet", T0)
    plan = plan_input(input, "daily", History(seen))
    assert read_plan(plan) == ["n"] and plan.observations["files"] == {"new": 1, "unchanged": 1}


def test_planning_records_no_clock_per_file(tmp_path):
    """`updated_at` never decides what is read: the plan keeps no per-file maximum for a later daily."""
    input = config(tmp_path)
    write(tmp_path / "in" / "a.parquet", ["a"], [T0])
    plan = plan_input(input, "backfill", History({}))
    assert "shard_max" not in plan.observations
    assert plan.observations["max_updated_at"] == T0.isoformat()


def test_a_sentinel_is_counted_and_never_the_watermark(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "a.parquet", ["a", "s"], [T0, SENTINEL])
    write(tmp_path / "in" / "b.parquet", ["b"], [T0 - timedelta(days=1)])
    plan = plan_input(input, "backfill", History({}))
    assert plan.observations["future_row_groups"] == 1
    assert plan.read_as_of == T0 - timedelta(days=1)


# -- updated_at in nanoseconds -------------------------------------------------------------------
NS = 1_772_323_200_123_456_789  # 2026-03-01T00:00:00.123456789Z: Go, Java `Instant`, pandas


def test_nanosecond_stamps_with_sub_microsecond_digits_are_read_truncated_to_microseconds(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "ns.parquet", ["a", "b", "n"], [NS, NS + 1_000, None], unit="ns")
    plan = plan_input(input, "backfill", History({}))
    assert read_plan(plan) == ["a", "b", "n"]
    (task,) = UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1)
    (block,) = task()
    stamps = block.column("updated_at").cast(pa.int64()).to_pylist()
    assert stamps == [NS // 1_000, NS // 1_000 + 1, None]
    assert plan.read_as_of is not None and plan.read_as_of.microsecond in (123_456, 123_457)


def test_nanosecond_stamps_are_read_by_a_since_window_over_an_unchanged_file(tmp_path):
    input = config(tmp_path)
    write(tmp_path / "in" / "ns.parquet", ["before", "after"], [NS - 10**12, NS], unit="ns")
    _, seen = read_before(input, "ns.parquet", T0)
    plan = plan_input(input, "daily", History(seen), since=datetime(2026, 3, 1, tzinfo=UTC))
    assert read_plan(plan) == ["after"]


def test_json_lines_stamps_with_nanosecond_digits_are_read(tmp_path):
    path = tmp_path / "in" / "ns.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"id": "a", "text": "x", "updated_at": "2026-03-01T00:00:00.123456789Z"}\n')
    input = config(tmp_path)
    plan = plan_input(input, "backfill", History({}))
    (task,) = UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1)
    (block,) = task()
    assert block.column("updated_at").to_pylist() == [datetime(2026, 3, 1, 0, 0, 0, 123456, tzinfo=UTC)]

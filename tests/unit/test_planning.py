"""Planning (`raypipe.plan.planning`): listing shards, cutting units, a daily's selection by the
files seen, reading the units back, and bad input (local files, no Ray)."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.api import build_config
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol
from raypipe.errors import InputError, NoShardsError, SchemaError, ShardChangedError
from raypipe.plan import footers, planning
from raypipe.plan.planning import PlanObservations, list_input, list_shards, plan_input, plan_units
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit
from raypipe.run.pipeline import UnitDatasource
from raypipe.run.read import read_unit

COLS = ColumnNames()


def write_parquet(path, ids, texts, row_group_size=10, **extra):
    pq.write_table(pa.table({"id": ids, "text": texts, **extra}), path, row_group_size=row_group_size)


def test_list_shards_skips_hidden_and_unknown_files(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["1"], ["x"])
    (tmp_path / "b.jsonl").write_text('{"id": "2", "text": "y"}\n')
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".a.parquet.crc").write_text("")
    (tmp_path / "notes.txt").write_text("hi")
    shards = list_shards(str(tmp_path))
    assert [(p.rsplit("/", 1)[-1], f) for p, f in shards] == [("a.parquet", "parquet"), ("b.jsonl", "jsonl")]


def test_every_skipped_file_is_listed_with_its_reason_and_upper_case_extensions_are_read(tmp_path):
    write_parquet(tmp_path / "A.PARQUET", ["1"], ["x"])
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "old.jsonl.gz").write_bytes(b"gz")
    (tmp_path / "README").write_text("hi")
    (tmp_path / "_tmp").mkdir()
    write_parquet(tmp_path / "_tmp" / "part.parquet", ["2"], ["y"])
    listing = list_input(str(tmp_path), quarantined=frozenset())
    assert [p.rsplit("/", 1)[-1] for p, _ in listing.shards] == ["A.PARQUET"]
    reasons = {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in listing.skipped}
    assert reasons["old.jsonl.gz"] == "unknown extension .gz" and reasons["README"] == "unknown extension (none)"
    assert reasons["_SUCCESS"].startswith("hidden") and reasons["part.parquet"].startswith("hidden ('_tmp'")
    with pytest.raises(NoShardsError, match="quarantined"):
        list_input(str(tmp_path), quarantined=frozenset(p for p, _ in listing.shards))


def test_a_shard_rewritten_after_planning_is_not_read(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["1", "2"], ["x", "y"])
    listing = list_input(str(tmp_path))
    units, _ = plan_units(listing.shards, unit_rows=10, columns=COLS, fingerprints=listing.fingerprints)
    assert read_unit(units[0], COLS).num_rows == 2
    write_parquet(tmp_path / "a.parquet", ["1", "2", "3"], ["x", "y", "z"])  # rewritten in place
    with pytest.raises(ShardChangedError, match="rewritten since it was planned"):
        read_unit(units[0], COLS)


def test_no_shards_is_an_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(NoShardsError, match="matches no shards"):
        list_shards(str(tmp_path))
    with pytest.raises(NoShardsError, match="does not exist"):
        list_shards(str(tmp_path / "nope"))


def test_units_follow_row_groups_and_cover_every_row_once(tmp_path):
    n = 95
    write_parquet(tmp_path / "a.parquet", [str(i) for i in range(n)], ["t"] * n, row_group_size=10)
    units, bad = plan_units(list_shards(str(tmp_path)), unit_rows=25, columns=COLS)
    assert bad == []
    assert [(u.row_start, u.row_stop) for u in units] == [(0, 20), (20, 40), (40, 60), (60, 80), (80, 95)]
    rows = [r for u in units for r in read_unit(u, COLS).column("_row").to_pylist()]
    assert rows == list(range(n))
    assert len({u.key for u in units}) == len(units)


def test_a_large_row_group_of_small_rows_stays_one_unit(tmp_path):
    """Cutting it would make every piece re-read the whole group."""
    write_parquet(tmp_path / "a.parquet", [str(i) for i in range(100)], ["t"] * 100, row_group_size=100)
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=30, columns=COLS)
    assert [(u.row_start, u.row_stop) for u in units] == [(0, 100)]


def test_huge_row_group_is_cut_by_rows(tmp_path):
    write_parquet(tmp_path / "a.parquet", [str(i) for i in range(100)], ["t"] * 100, row_group_size=100)
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=30, unit_bytes=1, columns=COLS)  # as if over 64 MiB
    assert [(u.row_start, u.row_stop) for u in units] == [(i, i + 1) for i in range(100)]
    group = pq.read_metadata(tmp_path / "a.parquet").row_group(0)
    size = sum(group.column(i).total_uncompressed_size for i in range(group.num_columns))
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=30, unit_bytes=size - 1, columns=COLS)
    assert [(u.row_start, u.row_stop) for u in units] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    ids = [i for u in units for i in read_unit(u, COLS).column("id").to_pylist()]
    assert ids == [str(i) for i in range(100)]


def test_missing_column_fails_at_plan_time_naming_shard_and_column(tmp_path):
    pq.write_table(pa.table({"id": ["1"], "body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(SchemaError, match=r"column 'text' is missing.*a\.parquet") as info:
        plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS)
    assert info.value.column == "text"


def test_record_mode_lists_bad_shards_and_keeps_good_ones(tmp_path):
    write_parquet(tmp_path / "good.parquet", ["1"], ["x"])
    (tmp_path / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"id": ["1"], "body": ["x"]}), tmp_path / "other.parquet")
    units, bad = plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS, on_bad_shard="record")
    assert [u.shard.rsplit("/", 1)[-1] for u in units] == ["good.parquet"]
    assert [b["shard"].rsplit("/", 1)[-1] for b in bad] == ["corrupt.parquet", "other.parquet"]
    assert "'text' is missing" in bad[1]["error"]
    with pytest.raises(InputError, match=r"corrupt\.parquet"):
        plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS, on_bad_shard="fail")


def test_integer_ids_become_strings_and_other_types_are_rejected(tmp_path):
    write_parquet(tmp_path / "a.parquet", pa.array([7, 8], pa.int64()), ["x", "y"])
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS)
    assert read_unit(units[0], COLS).column("id").to_pylist() == ["7", "8"]
    write_parquet(tmp_path / "b.parquet", pa.array([1.5], pa.float64()), ["x"])
    with pytest.raises(SchemaError, match="ids must be strings or integers"):
        plan_units(list_shards(str(tmp_path / "b.parquet")), unit_rows=10, columns=COLS)


def test_a_jsonl_shard_is_checked_on_its_first_object_and_refused_with_none(tmp_path):
    # A malformed first line is its row's dead letter when read, not the shard's failure.
    (tmp_path / "a.jsonl").write_text('{"id": "1", "text": "cut\n\n{"id": "2", "text": "x"}\n')
    units, _ = plan_units(list_shards(str(tmp_path / "a.jsonl")), unit_rows=10, columns=COLS)
    assert [u.format for u in units] == ["jsonl"]
    (tmp_path / "b.jsonl").write_text('{"id": "1", "body": "x"}\n')
    with pytest.raises(SchemaError, match="column 'text' is missing"):
        plan_units(list_shards(str(tmp_path / "b.jsonl")), unit_rows=10, columns=COLS)
    (tmp_path / "c.jsonl").write_text("id,text\n1,a csv file named .jsonl\n")
    with pytest.raises(InputError, match=r"no JSON object in its first 2 non-blank lines \(line 1 is not JSON"):
        plan_units(list_shards(str(tmp_path / "c.jsonl")), unit_rows=10, columns=COLS)


def test_jsonl_units_and_custom_column_names(tmp_path):
    lines = [{"pid": i, "body": f"text {i}", "ts": "2026-01-02T00:00:00Z"} for i in range(5)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cols = ColumnNames(id="pid", text="body", updated_at="ts")
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=2, columns=cols)
    assert units == [WorkUnit(units[0].shard, "jsonl", 0, None)]
    table = read_unit(units[0], cols)
    assert table.column("id").to_pylist() == ["0", "1", "2", "3", "4"]
    assert table.column("_unit_rows").to_pylist() == [5] * 5


def test_delta_window_selects_new_and_changed_rows(tmp_path):
    ts = [datetime(2026, 1, d, tzinfo=UTC) for d in (1, 2, 3, 4)]
    write_parquet(
        tmp_path / "a.parquet",
        ["a", "b", "c", "d"],
        ["w", "x", "y", "z"],
        updated_at=pa.array(ts, pa.timestamp("us", tz="UTC")),
    )
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS, need_updated_at=True)
    window = DeltaWindow(after=ts[1], until=ts[2])  # both ends inclusive
    table = read_unit(units[0], COLS, window)
    assert table.column("id").to_pylist() == ["b", "c"]
    assert table.column("_row").to_pylist() == [1, 2]
    assert table.column("_unit_rows").to_pylist() == [2, 2]


def test_delta_needs_updated_at(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["a"], ["x"])
    with pytest.raises(SchemaError, match="'updated_at' is missing"):
        plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS, need_updated_at=True)


def test_unit_round_trips_through_its_dict():
    u = WorkUnit("s3://b/k.parquet", "parquet", 10, 20)
    assert WorkUnit.from_dict(u.to_dict()) == u
    assert WorkUnit.from_dict(u.to_dict()).key == u.key


def _mixed_corpus(root):
    """Shards of every kind planning meets: row groups with updated_at statistics (one in the
    future, some nulls), JSON lines, a corrupt file, a missing column, an empty Parquet file."""
    stamps = pa.timestamp("us", tz="UTC")
    for k in range(8):
        ts = [datetime(2026, 1, 1 + k, tzinfo=UTC), None, datetime(2026, 2, 1 + k, tzinfo=UTC)] * 10
        if k == 5:
            ts[-1] = datetime(9999, 12, 31, tzinfo=UTC)  # a sentinel: in the future
        n = len(ts)
        write_parquet(
            root / f"s{k}.parquet",
            [f"{k}-{i}" for i in range(n)],
            ["t"] * n,
            row_group_size=7,
            updated_at=pa.array(ts, stamps),
        )
    (root / "s2.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"id": ["1"], "body": ["x"]}), root / "s4.parquet")
    (root / "s6.parquet").write_bytes(b"")
    (root / "s8.jsonl").write_text('{"id": "j", "text": "x", "updated_at": "2026-01-01T00:00:00Z"}\n')


@pytest.mark.parametrize(
    "window", [None, DeltaWindow(datetime(2026, 1, 5, tzinfo=UTC), datetime(2026, 2, 3, tzinfo=UTC))]
)
def test_parallel_planning_gives_the_sequential_plan(tmp_path, window):
    _mixed_corpus(tmp_path)
    listing = list_input(str(tmp_path))
    limit = datetime(2026, 6, 1, tzinfo=UTC)
    plans = {}
    for threads in (1, 3, 16):
        seen = PlanObservations(limit=limit)
        units, bad = plan_units(
            listing.shards,
            unit_rows=10,
            columns=COLS,
            on_bad_shard="record",
            window=window,
            observations=seen,
            fingerprints=listing.fingerprints,
            threads=threads,
        )
        plans[threads] = (units, bad, seen.to_dict())
    assert plans[1] == plans[3] == plans[16]
    units, bad, seen = plans[1]
    assert [b["shard"].rsplit("/", 1)[-1] for b in bad] == ["s2.parquet", "s4.parquet", "s6.parquet"]
    assert seen["future_row_groups"] == 1 and seen["null_updated_at_rows"] > 0
    assert all(u.fingerprint for u in units)
    if window is None:
        assert sum(u.expected_rows or 0 for u in units if u.format == "parquet") == 5 * 30


def test_parallel_planning_fails_with_the_first_bad_shard_in_shard_order(tmp_path, monkeypatch):
    """The later bad shard fails first; the error is still the earlier one's."""
    _mixed_corpus(tmp_path)
    read = footers._read_footer
    later_failed = threading.Event()

    def footer(fs, path):
        if path.endswith("s2.parquet"):
            assert later_failed.wait(10), "s4 and s2 were not planned at the same time"
        try:
            return read(fs, path)
        finally:
            if path.endswith("s4.parquet"):
                later_failed.set()

    monkeypatch.setattr(footers, "_read_footer", footer)
    shards = list_shards(str(tmp_path))
    with pytest.raises(InputError, match=r"s2\.parquet") as info:
        plan_units(shards, unit_rows=10, columns=COLS, on_bad_shard="fail", threads=4)
    assert isinstance(info.value.__cause__, pa.ArrowInvalid)
    with pytest.raises(SchemaError, match=r"'text' is missing.*s4\.parquet"):
        plan_units(shards[3:], unit_rows=10, columns=COLS, threads=4)


class _CountingFs:
    """A filesystem that counts the reads planning makes."""

    def __init__(self):
        self.fs = fsspec.filesystem("file")
        self.reads = []

    def cat_file(self, path, start=None, end=None):
        self.reads.append(start)
        return self.fs.cat_file(path, start=start, end=end)


def test_a_footer_is_one_read_of_the_tail_and_a_larger_one_two(tmp_path):
    small, large = tmp_path / "small.parquet", tmp_path / "large.parquet"
    write_parquet(small, [str(i) for i in range(100)], ["t"] * 100, row_group_size=10)
    n = 3000  # a row group per row: a footer over 64 KiB
    write_parquet(large, [str(i) for i in range(n)], ["t"] * n, row_group_size=1)
    assert pq.read_metadata(large).serialized_size > footers.FOOTER_TAIL_BYTES > small.stat().st_size
    for path, reads in ((small, [-footers.FOOTER_TAIL_BYTES]), (large, None)):
        fs = _CountingFs()
        meta = footers._read_footer(fs, str(path))
        assert meta.equals(pq.read_metadata(path))
        if reads is not None:
            assert fs.reads == reads
        else:
            assert len(fs.reads) == 2 and -fs.reads[1] == pq.read_metadata(path).serialized_size + 8
    units, _ = plan_units(list_shards(str(large)), unit_rows=1000, columns=COLS)
    assert [(u.row_start, u.row_stop) for u in units] == [(0, 1000), (1000, 2000), (2000, 3000)]


def test_a_footer_exactly_the_tail_read_long_or_longer_than_its_file(tmp_path, monkeypatch):
    path = tmp_path / "a.parquet"
    write_parquet(path, [str(i) for i in range(50)], ["t"] * 50, row_group_size=5)
    size = path.stat().st_size
    footer = pq.read_metadata(path).serialized_size + 8
    for tail in (footer, footer - 1, 12, size, size + 1):
        monkeypatch.setattr(footers, "FOOTER_TAIL_BYTES", tail)
        fs = _CountingFs()
        assert footers._read_footer(fs, str(path)).equals(pq.read_metadata(path))
        assert len(fs.reads) == (1 if tail >= footer else 2)
    path.write_bytes(path.read_bytes()[:-20] + path.read_bytes()[-8:])  # the footer cut short
    _, bad = plan_units(list_shards(str(path)), unit_rows=10, columns=COLS, on_bad_shard="record")
    assert bad[0]["error"].startswith("cannot read parquet shard")


# -- plan_listing: many small shards planned from their listed sizes ------------------------------


def _small_shards(tmp_path, n, rows=8):
    for k in range(n):
        ids_, texts = [f"s{k}-{i}" for i in range(rows)], [f"text {k} {i}" for i in range(rows)]
        write_parquet(tmp_path / f"part-{k:03d}.parquet", ids_, texts)
    return list_input(str(tmp_path))


def test_up_to_footer_sample_shards_every_footer_is_read_as_before(tmp_path):
    listing = _small_shards(tmp_path, 6)
    seen = PlanObservations()
    units, bad = planning.plan_listing(
        listing.shards, sizes=listing.sizes, footer_sample=6, unit_rows=100, columns=COLS, observations=seen
    )
    assert (units, bad) == plan_units(listing.shards, unit_rows=100, columns=COLS)
    assert seen.footers_read == 6 and seen.whole_files == 0
    assert all(u.row_stop == 8 for u in units)


def test_beyond_the_sample_small_shards_are_whole_file_units_read_in_full(tmp_path):
    listing = _small_shards(tmp_path, 30)
    big = tmp_path / "part-015.parquet"  # 400 rows: more than 2 x unit_rows at the sample's bytes per row
    noise = [os.urandom(60).hex() for _ in range(400)]  # incompressible: its size says its rows
    write_parquet(big, [f"big{i}" for i in range(400)], noise, 50)
    listing = list_input(str(tmp_path))
    seen = PlanObservations()
    units, bad = planning.plan_listing(
        listing.shards,
        sizes=listing.sizes,
        footer_sample=5,
        unit_rows=100,
        columns=COLS,
        observations=seen,
        fingerprints=listing.fingerprints,
    )
    assert bad == [] and seen.footers_read == 6 and seen.whole_files == 24  # 5 sampled + the big one
    assert [u.shard for u in units] == sorted(u.shard for u in units), "units stay in listing order"
    whole = [u for u in units if u.row_stop is None]
    assert len(whole) == 24 and all(u.fingerprint == listing.fingerprints[u.shard] for u in whole)
    cut = [u for u in units if u.shard.endswith("part-015.parquet")]
    assert [(u.row_start, u.row_stop) for u in cut] == [(0, 100), (100, 200), (200, 300), (300, 400)]
    table = read_unit(whole[0], COLS)
    assert table.num_rows == 8 and table.column("_unit_rows").to_pylist() == [8] * 8
    assert table.column("_row").to_pylist() == list(range(8))
    assert len({u.key for u in units}) == len(units)
    ids_ = [i for u in units for i in read_unit(u, COLS).column("id").to_pylist()]
    assert len(ids_) == len(set(ids_)) == 29 * 8 + 400


def test_a_bad_shard_planned_whole_is_found_when_read_naming_it_and_the_column(tmp_path):
    listing = _small_shards(tmp_path, 12)
    bad_path = tmp_path / "part-007.parquet"
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(8)], "body": ["x"] * 8}), bad_path)
    listing = list_input(str(tmp_path))
    units, bad = planning.plan_listing(
        listing.shards, sizes=listing.sizes, footer_sample=3, unit_rows=100, columns=COLS
    )
    assert bad == [], "not in the sample: not opened at planning"
    unit = next(u for u in units if u.shard.endswith("part-007.parquet"))
    assert unit.row_stop is None
    with pytest.raises(SchemaError, match="'text' is missing") as info:
        read_unit(unit, COLS)
    assert info.value.shard == unit.shard
    # In the sample, it fails planning before any inference, as every footer planning reads does.
    with pytest.raises(SchemaError, match="'text' is missing"):
        planning.plan_listing(listing.shards, sizes=listing.sizes, footer_sample=12 - 1, unit_rows=100, columns=COLS)


def test_a_sample_with_no_rows_to_measure_plans_every_shard_from_its_footer(tmp_path):
    for k in range(10):
        write_parquet(tmp_path / f"e{k}.parquet", pa.array([], pa.string()), pa.array([], pa.string()))
    listing = list_input(str(tmp_path))
    seen = PlanObservations()
    units, _ = planning.plan_listing(
        listing.shards, sizes=listing.sizes, footer_sample=2, unit_rows=100, columns=COLS, observations=seen
    )
    assert seen.whole_files == 0 and seen.footers_read == 10 and all(u.row_stop == 0 for u in units)


def test_a_window_keeps_rows_stamped_at_its_start(tmp_path):
    """A batch export stamps every row with one time: a `--since` at exactly that instant
    plans and reads every one of them."""
    stamp = datetime(2026, 1, 1, tzinfo=UTC)
    ts = pa.array([stamp] * 4, pa.timestamp("us", tz="UTC"))
    write_parquet(tmp_path / "a.parquet", ["a", "b", "c", "d"], ["w", "x", "y", "z"], updated_at=ts)
    window = DeltaWindow.since(stamp)
    units, _ = plan_units(list_shards(str(tmp_path)), unit_rows=10, columns=COLS, need_updated_at=True, window=window)
    assert len(units) == 1
    assert read_unit(units[0], COLS, window).column("id").to_pylist() == ["a", "b", "c", "d"]


# -- a daily's selection, read back ------------------------------------------------------------
T0 = datetime(2026, 3, 1, tzinfo=UTC)


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
    """The ids the run's pipeline reads of `plan`: its read tasks, as `run_units` builds them."""
    rows = []
    for task in UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1):
        for block in task():
            rows += [r for r in block.column("id").to_pylist() if r is not None]
    return sorted(rows)


class _History:
    """What planning asks of the output (`OutputHistory`), as a test sets it."""

    def __init__(self, seen):
        self.seen = seen

    def quarantined(self):
        return frozenset()

    def files_seen(self):
        return self.seen


def test_daily_since_reads_a_new_file_whole_and_a_file_read_before_from_since(tmp_path):
    """`--since T`: a late file (rows stamped before T, one without updated_at) is new, so it is
    read whole; a file read before is read for its rows updated at or after T only."""
    write(tmp_path / "in" / "late.parquet", ["a", "b", "c"], [T0 - timedelta(days=3), None, T0 + timedelta(hours=1)])
    write(tmp_path / "in" / "read.parquet", ["r1", "r2"], [T0 - timedelta(days=1), T0 + timedelta(hours=1)])
    cfg = config(tmp_path)
    assert cfg.input is not None
    listing = list_input(cfg.input.uri)
    (read,) = [s for s, _ in listing.shards if s.endswith("read.parquet")]
    history = _History({read: (listing.fingerprints[read], (T0 - timedelta(days=1)).isoformat())})
    plan = plan_input(cfg.input, "daily", history, since=T0)
    assert read_plan(plan) == ["a", "b", "c", "r2"]


def test_a_daily_asks_the_output_what_it_read_through_the_commit_protocol(tmp_path):
    write(tmp_path / "in" / "late.parquet", ["a"], [T0])
    cfg = config(tmp_path)
    assert cfg.input is not None
    plan = plan_input(cfg.input, "daily", CommitProtocol(Output.at(cfg.output), "daily", "d1"), since=T0)
    assert read_plan(plan) == ["a"] and plan.observations["files"] == {"new": 1}


def test_daily_since_reads_a_rewritten_file_whole_then_the_unchanged_ones_from_since(tmp_path):
    """`--since` only adds reads: a rewritten file is read whole as without it; an unchanged
    one after `since`; in that order, after the new files."""
    from raypipe.plan.planning import list_input

    write(tmp_path / "in" / "a_new.parquet", ["n"], [T0])
    write(tmp_path / "in" / "b_rewritten.parquet", ["r"], [T0])
    write(tmp_path / "in" / "c_unchanged.parquet", ["u"], [T0])
    cfg = config(tmp_path)
    assert cfg.input is not None
    listing = list_input(cfg.input.uri)
    shard = {s.rsplit("/", 1)[-1]: s for s, _ in listing.shards}
    upto = T0 - timedelta(days=1)
    history = _History(
        {
            shard["b_rewritten.parquet"]: ("an older version", upto.isoformat()),
            shard["c_unchanged.parquet"]: (listing.fingerprints[shard["c_unchanged.parquet"]], None),
        }
    )
    since = T0 - timedelta(hours=1)
    plan = plan_input(cfg.input, "daily", history, since=since)
    assert [(u.shard.rsplit("/", 1)[-1], u.since) for u in plan.units] == [
        ("a_new.parquet", None),
        ("b_rewritten.parquet", None),
        ("c_unchanged.parquet", since.isoformat()),
    ]


def test_a_plan_says_what_its_input_was_read_as_of_and_whose_rows_it_writes():
    from raypipe.plan.planning import Plan, plan_replay

    plan = Plan("backfill", "/in", [], [], observations={"read_as_of": T0.isoformat()})
    assert plan.read_as_of == T0 and plan.rows_run_id("b1") == "b1"
    replay = plan_replay("/out", "b1", {"u2": 1, "u1": 3}, table_version=7)
    assert replay.read_as_of is None and replay.rows_run_id("b1.replay-1") == "b1"
    assert [(u.key, u.row_stop, u.source_run) for u in replay.units] == [("u1", 3, "b1"), ("u2", 1, "b1")]
    assert Plan.from_dict(replay.to_dict()) == replay and replay.observations == {"table_version": 7}

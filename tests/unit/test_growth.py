"""A daily's cost does not grow with the output's history: what one run reads of the table's
log, the transactions it leaves there, and the state it leaves beside it.

Counts, never times: snapshots of the table opened per run, app transactions and state files
after N dailies. The runs go through the real run path with the model-based test's seams
(`tests.modelcheck.world`: no Ray, a fake model client, a real local Delta table)."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import deltalake
import pytest

from raypipe.commit.table import TABLE_DIR
from tests.modelcheck.reference import Row
from tests.modelcheck.world import World

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, unit_rows=1000)
    try:
        for k in range(4):
            w.write_file(f"f{k}.parquet", [Row(f"r{k}", f"text {k}", T0)])
        assert w.run("backfill", "backfill-0").error is None
        yield w
    finally:
        w.close()


def _daily(world: World, day: int) -> None:
    stamp = T0 + timedelta(days=day)
    world.write_file(f"new{day}.parquet", [Row(f"n{day}", f"new text {day}", stamp)])
    world.write_file(f"f{day % 4}.parquet", [Row(f"r{day % 4}", f"text {day % 4} day {day}", stamp)])
    out = world.run("daily", f"daily-{day}")
    assert out.error is None and out.report is not None and out.report.status == "completed", out.error


@contextlib.contextmanager
def _snapshots_opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every `DeltaTable` of the outcomes table built meanwhile: each one reads the log from its
    last checkpoint."""
    opened: list[object] = []
    init = deltalake.DeltaTable.__init__

    def counting(self: deltalake.DeltaTable, *args: object, **kwargs: object) -> None:
        if str(args[0] if args else kwargs.get("table_uri")).endswith(f"/{TABLE_DIR}"):
            opened.append(kwargs.get("version"))
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(deltalake.DeltaTable, "__init__", counting)
        yield opened


def test_a_daily_opens_the_table_once_for_the_driver_and_once_per_committer(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _daily(world, 1)
    with _snapshots_opened(monkeypatch) as opened:
        _daily(world, 2)
    # The driver's one `OutcomeTable` is brought up to date from the log's new entries; the
    # in-process actor's committer has its own (as an actor in a process of its own would).
    assert len(opened) == 2, opened


@contextlib.contextmanager
def _log_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often the outcomes table's log is read meanwhile: snapshots opened (from the last
    checkpoint) and snapshots brought up to date (the log entries after them), and datasets of
    its files built."""
    reads: Counter[str] = Counter()
    methods = {"open": "__init__", "refresh": "update_incremental", "dataset": "to_pyarrow_dataset"}

    def counting(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: deltalake.DeltaTable, *args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():  # a deprecation raypipe's call site allows would point here
                warnings.simplefilter("ignore", DeprecationWarning)
                out = method(self, *args, **kwargs)
            if self.table_uri.rstrip("/").endswith(f"/{TABLE_DIR}"):
                reads[kind] += 1
            return out

        return wrapped

    with monkeypatch.context() as m:
        for kind, name in methods.items():
            m.setattr(deltalake.DeltaTable, name, counting(kind, getattr(deltalake.DeltaTable, name)))
        yield reads


def test_a_daily_reads_the_table_log_a_bounded_number_of_times(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's snapshot is opened once and moved only where the table changed under it:
    to take the output over (1), after each of its own five commits (take-over, plan, files
    seen, run commit, watermark), past its actors' units before the files seen and again as the
    run commit checks every unit (2), and once to read the run's committed rows for the report
    (ledger and model versions in one read): 9. The committer (in process here) opens its own
    and brings it up to date before each unit commit but its first: two units, 1. Before,
    every question to the table moved the snapshot (17)."""
    _daily(world, 1)
    with _log_reads(monkeypatch) as reads:
        _daily(world, 2)
    assert reads["open"] <= 2, reads  # the driver's and the committer's
    assert reads["refresh"] <= 10, reads
    assert reads["dataset"] <= 2, reads  # the report's committed rows, the reuse index's new files


def test_the_state_beside_the_table_does_not_grow_with_the_dailies(world: World) -> None:
    """A completed run's plans and attempt statistics go once its report is written (the report
    stays); files seen are a chain of deltas that a full copy replaces every `FILES_SEEN_CHAIN`
    (the stored reuse index has a test of its own, below)."""
    from raypipe.call.reuse import INDEX_DIR
    from raypipe.commit.state import FILES_SEEN_CHAIN

    for day in range(1, 6):
        _daily(world, day)
    state = world.output / "_raypipe"
    left = sorted(
        str(p.relative_to(state)) for p in state.rglob("*") if p.is_file() and not p.is_relative_to(state / INDEX_DIR)
    )
    assert not [p for p in left if p.startswith("runs/")], left
    assert len(left) <= FILES_SEEN_CHAIN + 2, left  # files seen, the lease (and its lock file)
    assert len(list((world.output / "runs").glob("*.json"))) == 6  # every run's report stays


def test_a_daily_reads_the_stored_reuse_index_and_what_was_committed_since(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each daily's reuse index reads the table's files committed since the run before (not the
    history's) and the log entries since; the stored index stays a bounded number of files (`STORED_FILES_MAX`, here 2,
    then compacted into one, its replaced files and log entries deleted)."""
    from raypipe.call import reuse
    from raypipe.call.reuse import stored as stored_index

    monkeypatch.setattr(stored_index, "STORED_FILES_MAX", 2)
    built: list[reuse.IndexStats] = []
    build = reuse.build_index

    def recording(*args: object, **kwargs: object) -> object:
        out = build(*args, **kwargs)  # type: ignore[arg-type]
        built.append(out[1])
        return out

    monkeypatch.setattr("raypipe.run.steps.build_index", recording)
    for day in range(1, 8):
        _daily(world, day)
    assert len(built) == 7
    assert all(s.from_stored for s in built), built  # the backfill stored it
    # The first daily reads the backfill's four units; each next one, the daily before's two.
    assert [s.table_files_read for s in built] == [4] + [2] * 6, built
    assert len({s.log_entries_read for s in built[1:]}) == 1, [s.log_entries_read for s in built]  # flat
    (stored,) = (world.output / "_raypipe" / reuse.INDEX_DIR).iterdir()
    assert len(list(stored.glob("*.parquet"))) <= 3
    assert len(list((stored / "_delta_log").glob("*.json"))) <= 4


def _log_tail(world: World) -> int:
    """Log entries after the table's last checkpoint: what opening a snapshot replays."""
    import json

    log = world.output / TABLE_DIR / "_delta_log"
    marker = log / "_last_checkpoint"
    version = json.loads(marker.read_text())["version"] if marker.exists() else -1
    return sum(1 for p in log.glob("*.json") if int(p.stem) > version)


def test_opening_the_table_replays_at_most_a_checkpoint_interval_of_log_entries(world: World) -> None:
    """The table is created with a checkpoint every `CHECKPOINT_INTERVAL` commits, so a snapshot
    opened after any number of dailies replays the last checkpoint and at most that many entries
    (delta-rs's default of 100 let the tail reach 100: ~14 dailies of ~7 commits each)."""
    from raypipe.commit.table import CHECKPOINT_INTERVAL

    tails = []
    for day in range(1, 7):
        _daily(world, day)
        tails.append(_log_tail(world))
    dt = deltalake.DeltaTable(str(world.output / TABLE_DIR))
    assert dt.version() > 2 * CHECKPOINT_INTERVAL  # the dailies made more commits than two intervals
    assert max(tails) <= CHECKPOINT_INTERVAL, tails


def test_maintenance_gives_an_earlier_releases_table_the_bounding_properties_and_keeps_a_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table created before the properties (only the transaction retention) gets the missing
    ones from `raypipe compact` and `raypipe vacuum`, in one fenced commit; a value its owner set
    stays; runs go on over it."""
    from raypipe.commit import table as table_module

    earlier = {"delta.setTransactionRetentionDuration": table_module.TRANSACTION_RETENTION}
    w = World(tmp_path, unit_rows=1000)
    try:
        with monkeypatch.context() as m:
            m.setattr(table_module, "TABLE_PROPERTIES", earlier)
            for k in range(2):
                w.write_file(f"f{k}.parquet", [Row(f"r{k}", f"text {k}", T0)])
            assert w.run("backfill", "backfill-0").error is None
        uri = str(w.output / TABLE_DIR)
        deltalake.DeltaTable(uri).alter.set_table_properties({"delta.logRetentionDuration": "interval 7 days"})
        assert table_module.missing_properties(deltalake.DeltaTable(uri))  # as an earlier release left it
        w.compact()
        have = deltalake.DeltaTable(uri).metadata().configuration
        assert {k: have.get(k) for k in table_module.TABLE_PROPERTIES} == {
            **table_module.TABLE_PROPERTIES,
            "delta.logRetentionDuration": "interval 7 days",  # the owner's
        }
        w.vacuum()
        history = deltalake.DeltaTable(uri).history()
        changes = [c for c in history if c.get("raypipe.operation") == "table-properties"]
        assert len(changes) == 1, history  # the compact's; the vacuum found nothing missing
        _daily(w, 1)
    finally:
        w.close()


def test_compact_reads_the_logs_file_statistics_a_bounded_number_of_times_whatever_the_runs(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weekly compact goes over every finished run: the table's add actions are read once for
    all of them (and once to list the runs), not once per run (its time grew with runs x files)."""
    for day in range(1, 5):
        _daily(world, day)
    reads: list[str] = []
    get = deltalake.DeltaTable.get_add_actions

    def counting(self: deltalake.DeltaTable, *args: Any, **kwargs: Any) -> Any:
        reads.append(self.table_uri)
        return get(self, *args, **kwargs)

    monkeypatch.setattr(deltalake.DeltaTable, "get_add_actions", counting)
    world.compact()
    assert 0 < len(reads) <= 2, reads  # five finished runs


def test_compact_reads_each_runs_partition_not_the_whole_table(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group `compact` rewrites is read from its run's files: a dataset of the whole table
    costs every file the history holds (3.5 s at 267 runs' files, against 0.06 s for one run's)."""
    for day in range(1, 5):
        _daily(world, day)
    sizes: list[int] = []
    dataset = deltalake.DeltaTable.to_pyarrow_dataset

    def counting(self: deltalake.DeltaTable, *args: Any, **kwargs: Any) -> Any:
        out = dataset(self, *args, **kwargs)
        sizes.append(len(out.files))
        return out

    monkeypatch.setattr(deltalake.DeltaTable, "to_pyarrow_dataset", counting)
    world.compact()
    # The backfill's four units and each daily's two (the table holds twelve files).
    assert sorted(sizes) == [2, 2, 2, 2, 4], sizes

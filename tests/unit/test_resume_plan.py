"""A resumed run's stored plan brought up to date with its input (`raypipe.plan.planning.resume`):
a shard gone since planning is dropped and listed as skipped, with why; a quarantined one too;
an uncommitted unit of a file rewritten since is planned again from the file as it is now.
Local files, no Ray."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.config import InputConfig
from raypipe.plan.planning import Plan, plan_input, resume
from raypipe.run.pipeline import UnitDatasource


class NoHistory:
    def quarantined(self):
        return frozenset()

    def files_seen(self):
        return {}


def write(path, ids, *, row_group_size=10, mtime=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ids, "text": [f"t{i}" for i in ids]}), path, row_group_size=row_group_size)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def stored(input, mode="backfill"):
    """A new run's plan as a resumed attempt reads it back (stored as JSON)."""
    return Plan.from_dict(plan_input(input, mode, NoHistory()).to_dict())


def read(plan):
    rows = []
    for task in UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1):
        for block in task():
            rows += [r for r in block.column("id").to_pylist() if r is not None]
    return sorted(rows)


def skipped(plan):
    return {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in plan.observations.get("skipped_files", [])}


def test_a_shard_deleted_since_planning_is_dropped_and_listed_as_skipped(tmp_path):
    write(tmp_path / "in" / "a.parquet", ["a"])
    write(tmp_path / "in" / "b.parquet", ["b"])
    input = InputConfig(uri=str(tmp_path / "in"))
    plan = stored(input)
    (tmp_path / "in" / "b.parquet").unlink()
    again, changed = resume(input, plan, set())
    assert changed and read(again) == ["a"]
    assert "gone" in skipped(again)["b.parquet"]
    assert resume(input, again, set()) == (again, False)  # nothing new: not stored again


def test_a_shard_quarantined_since_planning_is_dropped_and_listed_as_skipped(tmp_path):
    write(tmp_path / "in" / "a.parquet", ["a"])
    write(tmp_path / "in" / "b.parquet", ["b"])
    input = InputConfig(uri=str(tmp_path / "in"))
    plan = stored(input)
    b = str(tmp_path / "in" / "b.parquet")
    again, changed = resume(input, plan, set(), quarantined=frozenset({b}))
    assert changed and read(again) == ["a"] and "quarantined" in skipped(again)["b.parquet"]


def test_a_bad_shard_quarantined_since_is_no_longer_bad(tmp_path):
    write(tmp_path / "in" / "a.parquet", ["a"])
    (tmp_path / "in" / "broken.parquet").write_bytes(b"not parquet")
    input = InputConfig(uri=str(tmp_path / "in"), on_bad_shard="record")
    plan = stored(input)
    assert [b["shard"].rsplit("/", 1)[-1] for b in plan.bad_shards] == ["broken.parquet"]
    broken = str(tmp_path / "in" / "broken.parquet")
    again, _ = resume(input, plan, set(), quarantined=frozenset({broken}))
    assert again.bad_shards == [] and "quarantined" in skipped(again)["broken.parquet"]
    os.remove(broken)
    again, _ = resume(input, plan, set())
    assert again.bad_shards == [] and "gone" in skipped(again)["broken.parquet"]


def test_a_file_rewritten_since_planning_has_its_uncommitted_units_planned_again(tmp_path):
    write(tmp_path / "in" / "a.parquet", [f"a{i}" for i in range(20)], mtime=1_000)
    input = InputConfig(uri=str(tmp_path / "in"), unit_rows=10)
    plan = stored(input)
    assert len(plan.units) == 2
    first = plan.units[0].key
    write(tmp_path / "in" / "a.parquet", [f"b{i}" for i in range(25)], mtime=2_000)
    again, changed = resume(input, plan, {first})
    assert changed and first not in {u.key for u in again.units}
    assert read(again) == sorted(f"b{i}" for i in range(25))  # the new version whole, no row skipped


def test_committed_units_of_a_shard_gone_since_stay_as_they_are(tmp_path):
    write(tmp_path / "in" / "a.parquet", ["a"])
    write(tmp_path / "in" / "b.parquet", ["b"])
    input = InputConfig(uri=str(tmp_path / "in"))
    plan = stored(input)
    (tmp_path / "in" / "b.parquet").unlink()
    done = {u.key for u in plan.units if u.shard.endswith("b.parquet")}
    again, changed = resume(input, plan, done)
    assert not changed and again.units == plan.units


def test_a_resumed_run_asks_its_output_for_the_quarantine(tmp_path):
    """`PlanRun` hands the output's quarantine to `resume`, and the report lists the shard skipped."""
    from raypipe.report import RunReport
    from raypipe.run.steps import PlanRun
    from tests.unit.test_steps import FakeProtocol

    write(tmp_path / "in" / "a.parquet", ["a"])
    write(tmp_path / "in" / "b.parquet", ["b"])
    input = InputConfig(uri=str(tmp_path / "in"))
    b = str(tmp_path / "in" / "b.parquet")

    class Quarantining(FakeProtocol):
        def quarantined(self):
            return frozenset({b})

    protocol = Quarantining(stored=stored(input))
    report = RunReport("r1", "backfill")
    plan, todo = PlanRun(protocol, input, lambda p: None).plan("m1", report)  # type: ignore[arg-type]
    assert [u.shard for u in todo] == [str(tmp_path / "in" / "a.parquet")] and protocol.saved == [plan]
    assert [s["path"] for s in report.skipped_files] == [b]

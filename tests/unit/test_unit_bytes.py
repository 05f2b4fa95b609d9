"""Units cut by bytes as well as rows (`input.unit_bytes`): a unit is one block in memory, so
its size is bounded whatever the length of its texts. Parquet row groups are joined up to it
and a group over it is cut; a JSON-lines file over it is cut at line boundaries; a stored plan
from before (or cut for a larger size) has its uncommitted units cut again on resume.
Local files, no Ray."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from raypipe.config import InputConfig
from raypipe.plan.planning import Plan, plan_input, resume
from raypipe.plan.units import ColumnNames
from raypipe.run.pipeline import UnitDatasource
from raypipe.run.read import read_unit


def text(i):
    """A text of 1,000 bytes, each its own (a column of one text repeated is dictionary-encoded:
    its footer states a fraction of what it holds when read)."""
    return f"{i:04d}" + "x" * 996


class NoHistory:
    def quarantined(self):
        return frozenset()

    def files_seen(self):
        return {}


def blocks(plan):
    """Each read task's rows as (ids, source rows, bytes of text)."""
    out = []
    for task in UnitDatasource(plan.units, plan.columns, plan.on_bad_shard).get_read_tasks(parallelism=1):
        for block in task():
            ids = [i for i in block.column("id").to_pylist() if i is not None]
            rows = block.column("_row").to_pylist()[: len(ids)]
            out.append((ids, rows, sum(len(t or "") for t in block.column("text").to_pylist())))
    return out


def write_parquet(path, n, *, row_group_size):
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [f"r{i:04d}" for i in range(n)]
    pq.write_table(pa.table({"id": ids, "text": [text(i) for i in range(n)]}), path, row_group_size=row_group_size)
    return ids


def test_the_default_is_64_mib_and_a_unit_holds_at_least_one_kib():
    assert InputConfig().unit_bytes == 64 * 2**20
    with pytest.raises(ValidationError):
        InputConfig(unit_bytes=10)


def test_a_row_group_over_unit_bytes_is_cut_and_every_row_read_once(tmp_path):
    ids = write_parquet(tmp_path / "in" / "a.parquet", 100, row_group_size=100)
    input = InputConfig(uri=str(tmp_path / "in"), unit_rows=2000, unit_bytes=20_000)
    got = blocks(plan_input(input, "backfill", NoHistory()))
    assert len(got) > 1 and all(size <= 20_000 for *_, size in got)
    assert [i for b, _, _ in got for i in b] == ids
    assert [r for _, rows, _ in got for r in rows] == list(range(100))


def test_row_groups_are_joined_up_to_unit_bytes(tmp_path):
    ids = write_parquet(tmp_path / "in" / "a.parquet", 100, row_group_size=10)  # ~10 KB a group
    input = InputConfig(uri=str(tmp_path / "in"), unit_rows=2000, unit_bytes=25_000)
    plan = plan_input(input, "backfill", NoHistory())
    assert [(u.row_start, u.row_stop) for u in plan.units] == [(s, s + 20) for s in range(0, 100, 20)]
    assert [i for b, _, _ in blocks(plan) for i in b] == ids


def write_jsonl(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'{{"id": "j{i:04d}", "text": "{text(i)}"}}' for i in range(n)]
    # A byte-order mark, blank lines and CRLF endings: rows are counted as the reader counts them.
    body = "\ufeff" + lines[0] + "\n\n" + "\r\n".join(lines[1:50]) + "\r\n  \n" + "\n".join(lines[50:])
    path.write_text(body, encoding="utf-8")
    return [f"j{i:04d}" for i in range(n)]


def test_a_json_lines_file_over_unit_bytes_is_cut_at_line_boundaries(tmp_path):
    ids = write_jsonl(tmp_path / "in" / "a.jsonl", 100)
    whole = read_unit(
        plan_input(InputConfig(uri=str(tmp_path / "in")), "backfill", NoHistory()).units[0], ColumnNames()
    )
    input = InputConfig(uri=str(tmp_path / "in"), unit_bytes=30_000)
    plan = plan_input(input, "backfill", NoHistory())
    got = blocks(plan)
    assert len(plan.units) > 3 and all(size <= 30_000 for *_, size in got)
    assert [i for b, _, _ in got for i in b] == ids
    assert [r for _, rows, _ in got for r in rows] == whole.column("_row").to_pylist()
    assert sum(u.expected_rows or 0 for u in plan.units) == 100


def test_a_json_lines_file_is_cut_by_rows_too_once_it_is_scanned(tmp_path):
    ids = write_jsonl(tmp_path / "in" / "a.jsonl", 100)
    input = InputConfig(uri=str(tmp_path / "in"), unit_rows=30, unit_bytes=60_000)
    plan = plan_input(input, "backfill", NoHistory())
    assert [u.expected_rows for u in plan.units] == [30, 30, 30, 10]
    assert [i for b, _, _ in blocks(plan) for i in b] == ids


def test_a_stored_oversized_json_lines_unit_is_cut_again_on_resume(tmp_path):
    ids = write_jsonl(tmp_path / "in" / "a.jsonl", 100)
    stored = plan_input(InputConfig(uri=str(tmp_path / "in")), "backfill", NoHistory()).to_dict()
    stored["observations"].pop("unit_bytes", None)  # as an earlier release stored it
    plan = Plan.from_dict(stored)
    assert len(plan.units) == 1
    again, changed = resume(InputConfig(uri=str(tmp_path / "in"), unit_bytes=30_000), plan, set())
    assert changed and len(again.units) > 3
    assert [i for b, _, _ in blocks(again) for i in b] == ids


def test_a_stored_oversized_parquet_unit_is_cut_again_within_its_rows_on_resume(tmp_path):
    ids = write_parquet(tmp_path / "in" / "a.parquet", 100, row_group_size=10)
    input = InputConfig(uri=str(tmp_path / "in"), unit_rows=50)
    plan = plan_input(input, "backfill", NoHistory())
    assert [(u.row_start, u.row_stop) for u in plan.units] == [(0, 50), (50, 100)]
    done = plan.units[0]
    stored = plan.to_dict()
    stored["observations"]["unit_bytes"] = 2**40  # cut for a larger size than this attempt's
    smaller = InputConfig(uri=str(tmp_path / "in"), unit_rows=50, unit_bytes=25_000)
    again, changed = resume(smaller, Plan.from_dict(stored), {done.key})
    assert changed and again.units[0] == done
    assert [(u.row_start, u.row_stop) for u in again.units[1:]] == [(50, 70), (70, 90), (90, 100)]
    todo = Plan.from_dict({**again.to_dict(), "units": [u.to_dict() for u in again.units[1:]]})
    assert [i for b, _, _ in blocks(todo) for i in b] == ids[50:]


def test_small_shards_are_planned_whole_only_while_they_fit_unit_bytes(tmp_path):
    """Beyond the footer sample, a shard is planned whole from its listed size only where its
    columns read at the sample's rate fit `unit_bytes`; the others are cut from their footers."""
    for k in range(6):
        write_parquet(tmp_path / "in" / f"s{k}.parquet", 20, row_group_size=5)  # ~20 KB read each
    input = InputConfig(uri=str(tmp_path / "in"), footer_sample=2, unit_rows=2000)
    plan = plan_input(input, "backfill", NoHistory())
    assert plan.observations["whole_files"] == 4
    small = InputConfig(uri=str(tmp_path / "in"), footer_sample=2, unit_rows=2000, unit_bytes=12_000)
    plan = plan_input(small, "backfill", NoHistory())
    assert plan.observations["whole_files"] == 0 and all(u.row_stop is not None for u in plan.units)
    assert all(size <= 12_000 for *_, size in blocks(plan))

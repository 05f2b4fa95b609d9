"""JSON-lines shards at planning: the columns of the first JSON object checked, and a large
file cut into units at line boundaries."""

from __future__ import annotations

import json

from raypipe.errors import InputError
from raypipe.plan.listing import filesystem
from raypipe.plan.schema import check_columns
from raypipe.plan.units import ColumnNames, WorkUnit

__all__ = ["HEAD_LINES", "check_jsonl_head", "cut_lines", "plan_jsonl"]


#: Lines of a JSON-lines shard planning reads to find a JSON object whose columns it checks.
HEAD_LINES = 100


def check_jsonl_head(shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    """The columns of the shard's first JSON object, among its first `HEAD_LINES` non-blank
    lines: a malformed line before it is that row's dead letter when the unit is read
    (`raypipe.run.read`), but a file with no object there is not JSON lines at all."""
    fs, path = filesystem(shard)
    seen = 0
    first_error = ""
    with fs.open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            seen += 1
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                first_error = first_error or f"line {number} is not JSON: {e}"
            else:
                if isinstance(row, dict):
                    check_columns(row.keys(), shard, columns, need_updated_at)
                    return
                first_error = first_error or f"line {number} is not a JSON object"
            if seen >= HEAD_LINES:
                break
    if seen:  # an empty file is a unit of no rows
        raise InputError(f"no JSON object in its first {seen} non-blank lines ({first_error})", shard=shard)


def plan_jsonl(
    shard: str, unit_rows: int, unit_bytes: int, columns: ColumnNames, need_updated_at: bool, size: int | None
) -> list[WorkUnit]:
    """A JSON-lines shard's units: the whole file where it holds at most `unit_bytes` (its
    listed `size`, else asked), else `cut_lines`."""
    check_jsonl_head(shard, columns, need_updated_at)
    fs, path = filesystem(shard)
    if (size if size is not None else fs.size(path)) <= unit_bytes:
        return [WorkUnit(shard, "jsonl", 0, None)]
    return cut_lines(shard, unit_rows, unit_bytes)


def cut_lines(shard: str, unit_rows: int, unit_bytes: int) -> list[WorkUnit]:
    """A large JSON-lines file cut at line boundaries into units of at most `unit_rows` rows and
    `unit_bytes` bytes (a single longer line is a unit of its own), from one pass over its
    lines: each unit names its byte range and its rows, counted as the reader counts them
    (non-blank lines), so its rows keep the numbers a read of the whole file gives them."""
    fs, path = filesystem(shard)
    units: list[WorkUnit] = []
    first_row = row = 0  # the pending unit's first row; the next row's number
    first_byte = at = 0  # the pending unit's first byte; the current line's
    with fs.open(path, "rb") as f:
        for line in f:
            if line.strip():
                if row > first_row and (row - first_row >= unit_rows or at + len(line) - first_byte > unit_bytes):
                    units.append(WorkUnit(shard, "jsonl", first_row, row, byte_start=first_byte, byte_stop=at))
                    first_row, first_byte = row, at
                row += 1
            at += len(line)
    units.append(WorkUnit(shard, "jsonl", first_row, row, byte_start=first_byte, byte_stop=at))
    return units

"""JSON-lines shards at planning: the columns of the first JSON object checked, and a large
file cut into units at line boundaries."""

from __future__ import annotations

import json

from raypipe.errors import InputError
from raypipe.plan.listing import filesystem
from raypipe.plan.schema import check_columns
from raypipe.plan.units import ColumnNames

__all__ = ["HEAD_LINES", "check_jsonl_head"]


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

"""JSON-lines input read row by row: a malformed line is its row's dead letter, never the file's.

`read_jsonl` is Arrow's reader where it can be (valid UTF-8, one JSON type per field) and a line
by line parse otherwise, whose `BAD_JSON_FIELD` column carries each line's reason. Planning's
side of JSON lines (the head checked, a large file cut at line boundaries) is `raypipe.plan.jsonl`;
this is the unit reader's (`raypipe.run.read`).
"""

from __future__ import annotations

import functools
import io
import json
import re
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from raypipe.errors import InvalidRowError
from raypipe.plan.schema import usable_id_type, usable_text_type
from raypipe.plan.units import ColumnNames

__all__ = ["BAD_JSON_FIELD", "SUB_MICROSECONDS", "read_jsonl"]


BAD_JSON_FIELD = "__raypipe_bad"

#: Fractional seconds beyond microseconds in an ISO string, dropped before it is parsed.
SUB_MICROSECONDS = r"(\.\d{6})\d+"


def read_jsonl(data: bytes, columns: ColumnNames) -> pa.Table:
    """A JSON-lines file as a table: by Arrow's reader where the file is valid UTF-8 and every
    line a JSON object of one type per field; otherwise line by line (`_jsonl_lines`), so that a
    malformed line is that row's dead letter and the rest of the file is inferred. (Arrow's
    reader fails the whole file on one bad line, and silently turns bad bytes into U+FFFD.)"""
    try:
        data.decode("utf-8")
        table = pajson.read_json(io.BytesIO(data))
    except (UnicodeDecodeError, pa.ArrowInvalid):
        return _jsonl_lines(data, columns)
    # A field of one unusable type on every line (float ids, object texts) is each line's
    # reason too: in JSON lines a type belongs to a line, not to a column as in Parquet.
    schema, names = table.schema, table.column_names
    if columns.id in names and not usable_id_type(schema.field(columns.id).type):
        return _jsonl_lines(data, columns)
    if columns.text in names and not usable_text_type(schema.field(columns.text).type):
        return _jsonl_lines(data, columns)
    return table


def _jsonl_lines(data: bytes, columns: ColumnNames) -> pa.Table:
    """One row per non-blank line (JSON Lines: lines end in \\n, \\r\\n allowed), in the
    columns the file's objects have (so a file whose objects lack the id column is still a
    `SchemaError`) plus `BAD_JSON_FIELD`: the reason a line cannot be sent, or null. A line
    that is not valid UTF-8 or not a JSON object, or whose id or text has an unusable JSON
    type, has a null text and its reason; its id and time are kept where the line names them."""
    wanted = (columns.id, columns.text, columns.updated_at)
    values: dict[str, list[Any]] = {name: [] for name in wanted}
    seen: set[str] = set()
    reasons: list[str | None] = []
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as Arrow's reader skips it
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.removesuffix(b"\r")
        if not line.strip():
            continue
        row, reason = _jsonl_line(line, number, columns)
        seen.update(k for k in wanted if k in row)
        for name in wanted:
            values[name].append(row.get(name))
        reasons.append(reason)
    present = [name for name in wanted if name in seen]
    table = {name: pa.array(values[name], pa.string()) for name in present}
    return pa.table({**table, BAD_JSON_FIELD: pa.array(reasons, pa.string())})


def _jsonl_line(line: bytes, number: int, columns: ColumnNames) -> tuple[dict[str, str | None], str | None]:
    """One line's {column: string or None} and the reason it cannot be sent (None if it can)."""
    try:
        decoded = line.decode("utf-8")
        reason = None
    except UnicodeDecodeError as e:
        start = max(0, e.start - 8)
        decoded = line.decode("utf-8", errors="replace")
        where = f"invalid at byte {e.start}: {line[start : e.start + 8].hex()}"
        reason = f"invalid_text: line of {len(line)} bytes, {where}"
    try:
        value = json.loads(decoded)
    except json.JSONDecodeError as e:
        # Not JSON, whatever its bytes: an `invalid_row`, with the id and time it names, if any.
        why = f"{InvalidRowError.kind}: line {number} is not JSON: {e.msg}: character {e.pos}"
        named = {columns.id: _named(decoded, columns.id), columns.updated_at: _named_time(decoded, columns.updated_at)}
        return {k: v for k, v in named.items() if v is not None}, why + (f" ({reason})" if reason else "")
    if not isinstance(value, dict):
        why = f"{InvalidRowError.kind}: line {number} is a JSON {_json_kind(value)}, not an object"
        return {}, why + (f" ({reason})" if reason else "")
    row: dict[str, str | None] = {}
    row_id = value.get(columns.id)
    if columns.id in value:
        if isinstance(row_id, str) or row_id is None:
            row[columns.id] = row_id
        elif isinstance(row_id, int) and not isinstance(row_id, bool):
            row[columns.id] = str(row_id)  # integer ids become their decimal strings, as in Parquet
        else:
            row[columns.id] = None
            shown = json.dumps(row_id)[:40]
            reason = reason or f"invalid_id: a JSON {_json_kind(row_id)} ({shown}), not a string or integer"
    if columns.text in value:
        text = value[columns.text]
        if isinstance(text, str) and reason is None:
            row[columns.text] = text
        else:
            row[columns.text] = None
            if text is not None and not isinstance(text, str):
                reason = reason or f"invalid_text: a JSON {_json_kind(text)}, not a string"
    if columns.updated_at in value:
        stamp = value[columns.updated_at]
        # Not a string: kept as its JSON, which the column's timestamp check then names.
        row[columns.updated_at] = stamp if isinstance(stamp, str) or stamp is None else json.dumps(stamp)
    return row, reason


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _named(line: str, name: str) -> str | None:
    """The value a line that is not JSON as a whole (a truncated line, a stray quote) names
    for `name` before the damage: `"name": "value"` or `"name": 123`, else None."""
    match = _value_pattern(name).search(line)
    try:
        return None if match is None else str(json.loads(match.group(1)))
    except json.JSONDecodeError:  # a string with an escape JSON does not have
        return None


def _named_time(line: str, name: str) -> str | None:
    """`_named` where it is a string that reads as a timestamp, else None."""
    value = _named(line, name)
    try:
        pc.cast(
            pc.replace_substring_regex(pa.array([value], pa.string()), SUB_MICROSECONDS, r"\1"),
            pa.timestamp("us", tz="UTC"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return value


@functools.cache
def _value_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(json.dumps(name)) + r'\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)(?=\s*(?:[,}]|$))')

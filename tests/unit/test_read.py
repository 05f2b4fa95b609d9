"""A unit's rows as the pipeline reads them (`raypipe.run.read`): one block schema for every
unit, a fate for every row (bad bytes become the row's reason, never a failed unit), times in
UTC, and a window that keeps its start and never a row without `updated_at`. Local files, no Ray."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe.errors import SchemaError
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit
from raypipe.run.read import marker_block, read_unit, unit_block_schema

COLS = ColumnNames()
T = datetime(2026, 3, 1, tzinfo=UTC)


def test_bad_bytes_in_a_parquet_text_are_that_rows_reason_and_rows_keep_their_numbers(tmp_path):
    texts = pa.array([b"fine", b"bad \xff\xfe bytes", b"fine too"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": texts}), tmp_path / "in.parquet")
    unit = WorkUnit(str(tmp_path / "in.parquet"), "parquet", 1, 3)
    block = read_unit(unit, COLS)
    assert block.schema == unit_block_schema()
    assert block.column("id").to_pylist() == ["b", "c"] and block.column("_row").to_pylist() == [1, 2]
    assert block.column("text").to_pylist() == [None, "fine too"]
    bad = block.column("_bad").to_pylist()
    assert bad[0].startswith("invalid_text: 12 bytes, invalid at byte 4") and bad[1] is None
    assert set(block.column("_unit").to_pylist()) == {unit.key} and block.column("_unit_rows").to_pylist() == [2, 2]


def test_strings_in_every_arrow_layout_are_read_and_byte_strings_checked_row_by_row(tmp_path):
    # Dictionaries (pandas categoricals), views (Polars), large strings, and byte arrays written
    # without a UTF-8 annotation (Hive, older Spark): strings all, each value's bytes checked.
    layouts = {
        "dictionary": (pa.array(["a", "b"]).dictionary_encode(), pa.array(["x", "y"]).dictionary_encode()),
        "view": (pa.array(["a", "b"], pa.string_view()), pa.array(["x", "y"], pa.string_view())),
        "large": (pa.array(["a", "b"], pa.large_string()), pa.array(["x", "y"], pa.large_string())),
        "bytes": (pa.array([b"a", b"\xffb"], pa.binary()), pa.array([b"x", b"bad \xfe"], pa.large_binary())),
    }
    for name, (ids, texts) in layouts.items():
        pq.write_table(pa.table({"id": ids, "text": texts}), tmp_path / f"{name}.parquet")
        block = read_unit(WorkUnit(str(tmp_path / f"{name}.parquet"), "parquet", 0, 2), COLS)
        assert block.schema == unit_block_schema(), name
        if name != "bytes":
            assert block.column("id").to_pylist() == ["a", "b"] and block.column("text").to_pylist() == ["x", "y"]
            assert block.column("_bad").to_pylist() == [None, None], name
    assert block.column("id").to_pylist() == ["a", None] and block.column("text").to_pylist() == ["x", None]
    assert block.column("_bad").to_pylist()[1].startswith("invalid_id: 2 bytes, invalid at byte 0: ff")
    pq.write_table(pa.table({"id": pa.nulls(2), "text": ["x", "y"]}), tmp_path / "null-ids.parquet")
    block = read_unit(WorkUnit(str(tmp_path / "null-ids.parquet"), "parquet", 0, 2), COLS)
    assert block.column("id").to_pylist() == [None, None] and block.column("_bad").to_pylist() == [None, None]


def test_a_json_line_of_bad_bytes_keeps_its_id_and_says_why(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "bad \xff text"}\n')
    block = read_unit(WorkUnit(str(tmp_path / "in.jsonl"), "jsonl", 0, None), COLS)
    assert block.column("id").to_pylist() == ["a", "b"] and block.column("text").to_pylist() == ["ok", None]
    reason = block.column("_bad").to_pylist()[1]
    assert reason.startswith("invalid_text: line of") and "ff" in reason


def test_a_malformed_json_line_is_that_rows_reason_and_the_rest_of_the_file_is_read(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(
        b'\xef\xbb\xbf{"id": "a", "text": "first"}\n'
        b'{"id": "b", "text": "cut off mid-stri\n'  # Arrow's reader would refuse the whole file
        b"\n"
        b"[1, 2]\n"
        b'{"id": 7, "text": "an integer id"}\n'
        b'{"id": 1.5, "text": "a float id"}\n'
        b'{"id": "c", "text": 5}\n'
        b'{"id": "d", "text": "bad \xff bytes"}\n'
        b'{"id": "e", "text": "last"}\r\n'
    )
    block = read_unit(WorkUnit(str(tmp_path / "in.jsonl"), "jsonl", 0, None), COLS)
    rows = block.select(["id", "text", "_row", "_bad"]).to_pylist()
    assert [(r["id"], r["text"], r["_row"]) for r in rows] == [
        ("a", "first", 0),
        ("b", None, 1),  # the id the broken line names
        (None, None, 2),
        ("7", "an integer id", 3),
        (None, None, 4),
        ("c", None, 5),
        ("d", None, 6),
        ("e", "last", 7),
    ]
    reasons = [r["_bad"] for r in rows]
    assert reasons[0] is None and reasons[3] is None and reasons[7] is None
    assert reasons[1].startswith("invalid_row: line 2 is not JSON: Unterminated string")
    assert reasons[2] == "invalid_row: line 4 is a JSON array, not an object"
    assert reasons[4] == "invalid_id: a JSON number (1.5), not a string or integer"
    assert reasons[5] == "invalid_text: a JSON number, not a string"
    assert reasons[6].startswith("invalid_text: line of") and "ff" in reasons[6]


def test_a_window_keeps_a_malformed_line_unless_the_time_it_names_is_outside(tmp_path):
    # A daily re-reading a rewritten file: a line that names no time is recorded, never skipped.
    (tmp_path / "in.jsonl").write_text(
        '{"id": "old", "text": "x", "updated_at": "2026-02-01T00:00:00Z"}\n'
        '{"id": "cut-new", "updated_at": "2026-03-02T00:00:00Z", "text": "cut\n'
        '{"id": "cut-old", "updated_at": "2026-02-02T00:00:00Z", "text": "cut\n'
        '["no", "time"]\n'
        '{"id": "new", "text": "y", "updated_at": "2026-03-03T00:00:00Z"}\n'
    )
    block = read_unit(WorkUnit(str(tmp_path / "in.jsonl"), "jsonl", 0, None), COLS, DeltaWindow.since(T))
    assert block.column("id").to_pylist() == ["cut-new", None, "new"] and block.column("_row").to_pylist() == [1, 3, 4]
    assert [(r or "").split(":")[0] for r in block.column("_bad").to_pylist()] == ["invalid_row", "invalid_row", ""]
    assert block.column("updated_at").to_pylist() == [T + timedelta(days=1), None, T + timedelta(days=2)]


def test_json_lines_with_integer_and_string_ids_are_read_whole(tmp_path):
    # Arrow's reader refuses a field whose JSON type changes between lines.
    lines = ['{"id": 1, "text": "x"}', '{"id": "b2", "text": "y", "updated_at": "2026-03-01T00:00:00Z"}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    block = read_unit(WorkUnit(str(tmp_path / "in.jsonl"), "jsonl", 0, None), COLS)
    assert block.column("id").to_pylist() == ["1", "b2"] and block.column("text").to_pylist() == ["x", "y"]
    assert block.column("updated_at").to_pylist() == [None, T] and block.column("_bad").to_pylist() == [None, None]


def test_json_lines_of_one_unusable_type_throughout_are_each_lines_reason(tmp_path):
    # Arrow reads these whole (a double id column, a struct text column): each line says why.
    (tmp_path / "ids.jsonl").write_text('{"id": 1.5, "text": "x"}\n{"id": 2.5, "text": "y"}\n')
    block = read_unit(WorkUnit(str(tmp_path / "ids.jsonl"), "jsonl", 0, None), COLS)
    assert block.column("id").to_pylist() == [None, None]
    assert [r.split(" (")[0] for r in block.column("_bad").to_pylist()] == ["invalid_id: a JSON number"] * 2
    (tmp_path / "null-ids.jsonl").write_text('{"id": null, "text": "x"}\n')
    block = read_unit(WorkUnit(str(tmp_path / "null-ids.jsonl"), "jsonl", 0, None), COLS)
    assert block.column("id").to_pylist() == [None] and block.column("_bad").to_pylist() == [None]  # missing_id
    (tmp_path / "texts.jsonl").write_text('{"id": "a", "text": {"k": 1}}\n')
    block = read_unit(WorkUnit(str(tmp_path / "texts.jsonl"), "jsonl", 0, None), COLS)
    assert block.column("_bad").to_pylist() == ["invalid_text: a JSON object, not a string"]


def test_json_lines_without_the_text_column_are_still_a_schema_error(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "body": "x"}\n{"id": "b", "body": "y\n')
    with pytest.raises(SchemaError, match="column 'text' is missing"):
        read_unit(WorkUnit(str(tmp_path / "in.jsonl"), "jsonl", 0, None), COLS)


def test_times_are_read_as_utc_and_a_window_keeps_its_start_but_no_row_without_a_time(tmp_path):
    stamps = pa.array(["2026-03-01T00:00:00Z", None, "2026-02-28T23:59:59Z", "2026-03-01T01:00:00+0100"])
    table = pa.table({"id": ["at", "none", "before", "same instant"], "text": ["t"] * 4, "updated_at": stamps})
    pq.write_table(table, tmp_path / "in.parquet")
    unit = WorkUnit(str(tmp_path / "in.parquet"), "parquet", 0, 4)
    everything = read_unit(unit, COLS)
    assert everything.column("updated_at").to_pylist() == [T, None, T - timedelta(seconds=1), T]
    since = read_unit(unit, COLS, DeltaWindow.since(T))
    assert since.column("id").to_pylist() == ["at", "same instant"] and since.column("_row").to_pylist() == [0, 3]
    naive = pa.array([datetime(2026, 3, 1)], pa.timestamp("us"))  # no zone: taken as UTC
    pq.write_table(pa.table({"id": ["n"], "text": ["t"], "updated_at": naive}), tmp_path / "naive.parquet")
    read = read_unit(WorkUnit(str(tmp_path / "naive.parquet"), "parquet", 0, 1), COLS)
    assert read.column("updated_at").to_pylist() == [T]


def test_a_unit_with_nothing_to_send_is_one_marker_row(tmp_path):
    unit = WorkUnit(str(tmp_path / "gone.parquet"), "parquet", 0, 10)
    marker = marker_block(unit, error="FileNotFoundError: gone")
    assert marker.schema == unit_block_schema() and marker.num_rows == 1
    assert marker.to_pylist()[0] | {"id": None} == {
        **{name: None for name in unit_block_schema().names},
        "_source": unit.shard,
        "_unit": unit.key,
        "_unit_rows": 0,
        "_unit_error": "FileNotFoundError: gone",
    }

"""Reading a work unit's rows: one block per unit, in one schema.

Rows leave `read_unit` with raypipe's column names (`id`, `text`, optional `updated_at`) plus
where they came from (`_source`, `_row`) and which unit they belong to (`_unit`, `_unit_rows`);
a row whose id or text is not valid UTF-8 carries its reason in `_bad` (it becomes a dead
letter, never a call). A unit that cannot be read under `on_bad_shard="record"` becomes one
marker row carrying `_unit_error` (`marker_block`), so the failure is recorded rather than
lost. A replay's unit is read from the outcomes table: the dead letters it re-infers.
"""

from __future__ import annotations

from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raypipe.errors import (
    BadRowError,
    InvalidIdError,
    InvalidRowError,
    InvalidTextError,
    SchemaError,
    ShardChangedError,
)
from raypipe.plan.planning import filesystem, fingerprint
from raypipe.plan.schema import check_columns, check_types
from raypipe.plan.units import ColumnNames, DeltaWindow, WorkUnit
from raypipe.run.jsonl import BAD_JSON_FIELD, SUB_MICROSECONDS, read_jsonl

__all__ = ["marker_block", "read_unit", "unit_block_schema"]


def _open_parquet(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A Parquet file opened for random access. On object stores without read-ahead: fsspec's
    default cache fetches 5 MB blocks around every column chunk Arrow asks for, which made a
    daily over 1M rows download 5x the input instead of its footers and delta."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return fs.open(path, "rb")
    return fs.open(path, "rb", cache_type="none")


def unit_block_schema() -> pa.Schema:
    """The columns of every block a unit becomes (one schema, so blocks concatenate).

    `updated_at` is the input's, in every mode (null where the input has no such column), so
    "the newest source version" can be told for backfill rows too.
    """
    return pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("text", pa.string()),
            pa.field("updated_at", pa.timestamp("us", tz="UTC")),
            pa.field("_source", pa.string()),
            pa.field("_row", pa.int64()),
            pa.field("_unit", pa.string()),
            pa.field("_unit_rows", pa.int64()),
            pa.field("_unit_error", pa.string()),
            pa.field("_bad", pa.string()),
        ]
    )


def _read_raw(unit: WorkUnit, columns: ColumnNames, wanted: list[str], window: DeltaWindow | None = None) -> pa.Table:
    fs, path = filesystem(unit.shard)
    if unit.fingerprint is not None:
        fs.invalidate_cache(path)
        now = fingerprint(fs.info(path))
        if now != unit.fingerprint:
            raise ShardChangedError(
                f"rewritten since it was planned ({unit.fingerprint} -> {now}): not read, so rows of two versions "
                "never mix; it is planned again",
                shard=unit.shard,
            )
    if unit.format == "jsonl":
        if unit.byte_start is not None:  # a large file cut at line boundaries (`raypipe.plan.jsonl`)
            data = fs.cat_file(path, start=unit.byte_start, end=unit.byte_stop)
        else:
            with fs.open(path, "rb") as f:
                data = f.read()
        if not data.strip():
            return pa.table({c: pa.array([], pa.string()) for c in wanted})
        table = read_jsonl(data, columns)
        check_columns(table.column_names, unit.shard, columns, window is not None)
        table = table.select([c for c in [*wanted, BAD_JSON_FIELD] if c in table.column_names])
    else:
        with _open_parquet(fs, path) as f:
            pf = pq.ParquetFile(f)
            # Planning checked the columns of the shards whose footers it read; a shard planned
            # whole from its listed size (`plan_listing`) is checked here, where it is first opened.
            check_columns(pf.schema_arrow.names, unit.shard, columns, window is not None)
            wanted = [c for c in wanted if c in pf.schema_arrow.names]
            groups: list[int] = []
            first_row = offset = 0
            for i in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(i).num_rows
                if offset + n > unit.row_start and (unit.row_stop is None or offset < unit.row_stop):
                    if not groups:
                        first_row = offset
                    groups.append(i)
                offset += n
            if window is not None and groups:
                # Two steps: the small updated_at column first, the text only where the window has rows.
                stamps = pf.read_row_groups(groups, columns=[columns.updated_at]).column(0)
                stamps = stamps.slice(unit.row_start - first_row, _unit_len(unit, first_row, len(stamps)))
                if not pc.any(_in_window(_as_utc_timestamps(stamps, unit.shard, columns.updated_at), window)).as_py():
                    groups = []
            table = (
                pf.read_row_groups(groups, columns=wanted) if groups else pf.schema_arrow.empty_table().select(wanted)
            )
            if not groups:
                return table
        stop = unit.row_stop if unit.row_stop is not None else first_row + table.num_rows
        table = table.slice(unit.row_start - first_row, stop - unit.row_start)
    check_types(table.schema, unit.shard, columns)
    return table


_STRING_OF = {pa.binary(): pa.string(), pa.large_binary(): pa.large_string(), pa.binary_view(): pa.string_view()}


def _as_strings(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """The column as `pa.string()`, its bytes not checked yet (`_utf8_checked` does): dictionary
    values decoded, byte strings taken as strings, integers as their decimal strings."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.type in _STRING_OF:
        string = _STRING_OF[column.type]
        column = pa.chunked_array([chunk.view(string) for chunk in column.chunks], type=string)
    return column if column.type == pa.string() else pc.cast(column, pa.string())


def _utf8_checked(column: pa.ChunkedArray, what: str) -> tuple[pa.Array, list[str | None]]:
    """The strings (`_as_strings`) with invalid UTF-8 replaced by null, and each row's reason (or None).

    Readers do not validate UTF-8 (a Parquet string column can hold any bytes), and one bad
    value would fail the whole unit where Python decodes it; so each invalid value becomes its
    row's reason, `invalid_<what>: <first bytes in hex>`, and the row a dead letter."""
    reasons: list[str | None] = [None] * len(column)
    try:
        column.validate(full=True)
        return column.combine_chunks() if column.num_chunks else pa.array([], pa.string()), reasons
    except pa.ArrowInvalid:
        pass
    raw = column.cast(pa.binary()).to_pylist()
    clean: list[str | None] = []
    for i, value in enumerate(raw):
        if value is None:
            clean.append(None)
            continue
        try:
            clean.append(value.decode("utf-8"))
        except UnicodeDecodeError as e:
            clean.append(None)
            start = max(0, e.start - 8)
            reasons[i] = (
                f"invalid_{what}: {len(value)} bytes, invalid at byte {e.start}: {value[start : e.start + 8].hex()}"
            )
    return pa.array(clean, pa.string()), reasons


def _as_utc_timestamps(column: pa.ChunkedArray, shard: str, name: str) -> pa.ChunkedArray:
    """The column as UTC instants in microseconds (the outcomes table's unit). Finer stamps
    (nanoseconds from Go, Java's `Instant`, pandas) are truncated toward the past, never refused:
    a safe cast would fail every row of such a shard."""
    t = column.type
    if pa.types.is_timestamp(t):
        if t.unit == "ns":
            column = pc.floor_temporal(column, unit="microsecond")
        return column.cast(pa.timestamp("us", tz=t.tz or "UTC")).cast(pa.timestamp("us", tz="UTC"))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            return pc.cast(pc.replace_substring_regex(column, SUB_MICROSECONDS, r"\1"), pa.timestamp("us", tz="UTC"))
        except pa.ArrowInvalid as e:
            raise SchemaError(
                f"column {name!r} holds strings that are not ISO timestamps: {e}", shard=shard, column=name
            ) from e
    raise SchemaError(f"column {name!r} has type {t}; expected a timestamp", shard=shard, column=name)


def _unit_len(unit: WorkUnit, first_row: int, available: int) -> int:
    stop = unit.row_stop if unit.row_stop is not None else first_row + available
    return stop - unit.row_start


def _in_window(updated: pa.ChunkedArray | pa.Array, window: DeltaWindow) -> Any:
    """Boolean mask of `after <= updated <= until`; null timestamps are outside every window."""
    keep = pc.less_equal(updated, pa.scalar(window.until, pa.timestamp("us", tz="UTC")))
    if window.after is not None:
        keep = pc.and_(keep, pc.greater_equal(updated, pa.scalar(window.after, pa.timestamp("us", tz="UTC"))))
    return pc.fill_null(keep, False)


#: Dead-letter kinds that are properties of the row itself: a replay cannot change them. (A
#: missing id needs no reason carried: the actor refuses a row without an id on its own.)
BAD_ROW_KINDS = frozenset(e.kind for e in (BadRowError, InvalidIdError, InvalidRowError, InvalidTextError))


def _read_dead_letters(unit: WorkUnit) -> pa.Table:
    """A unit's committed dead letters of run `unit.source_run`, read from the outcomes table
    (`unit.shard` is the output URI); the rows keep their original source and row."""
    from raypipe.commit.schema import OUTCOME_DEAD_LETTER
    from raypipe.commit.table import OutcomeTable, scan_where

    dataset = OutcomeTable(unit.shard).load().to_pyarrow_dataset()
    dead = scan_where(
        dataset,
        {"run_id": unit.source_run or "", "unit": unit.key, "outcome": OUTCOME_DEAD_LETTER},
        ["id", "text", "updated_at", "source", "row", "error_kind", "message"],
    )
    n = dead.num_rows
    # A reason that is the row's own (its text is not UTF-8, its line is not an object...) holds
    # on every replay: such a row goes back as refused, so it keeps its dead letter and reason
    # (`raypipe.call.actor` refuses a row with `_bad`), never a null text taken for an empty one.
    bad = [
        f"{kind}: {(message or '').removeprefix(kind.replace('_', ' ') + ': ')}" if kind in BAD_ROW_KINDS else None
        for kind, message in zip(dead.column("error_kind").to_pylist(), dead.column("message").to_pylist(), strict=True)
    ]
    return pa.table(
        {
            "id": dead.column("id").cast(pa.string()),
            "text": dead.column("text").cast(pa.string()),
            "updated_at": dead.column("updated_at").cast(pa.timestamp("us", tz="UTC")),
            "_source": dead.column("source").cast(pa.string()),
            "_row": dead.column("row").cast(pa.int64()),
            "_unit": pa.array([unit.key] * n, pa.string()),
            "_unit_rows": pa.array([n] * n, pa.int64()),
            "_unit_error": pa.nulls(n, pa.string()),
            "_bad": pa.array(bad, pa.string()),
        },
        schema=unit_block_schema(),
    )


def read_unit(unit: WorkUnit, columns: ColumnNames, window: DeltaWindow | None = None) -> pa.Table:
    """Reads one unit as one table in `unit_block_schema` (rows outside `window` dropped)."""
    if unit.format == "dead_letters":
        return _read_dead_letters(unit)
    wanted = [columns.id, columns.text, columns.updated_at]
    raw = _read_raw(unit, columns, wanted, window)
    id_values, bad_ids = _utf8_checked(_as_strings(raw.column(columns.id)), "id")
    texts, bad_texts = _utf8_checked(_as_strings(raw.column(columns.text)), "text")
    out: dict[str, Any] = {
        "id": id_values,
        "text": texts,
    }
    rows = pa.array(range(unit.row_start, unit.row_start + raw.num_rows), pa.int64())
    if columns.updated_at in raw.column_names:
        out["updated_at"] = _as_utc_timestamps(raw.column(columns.updated_at), unit.shard, columns.updated_at)
    else:
        out["updated_at"] = pa.nulls(raw.num_rows, pa.timestamp("us", tz="UTC"))
    line_bad = raw.column(BAD_JSON_FIELD).to_pylist() if BAD_JSON_FIELD in raw.column_names else bad_texts
    out["_bad"] = pa.array([i or t or j for i, t, j in zip(bad_ids, bad_texts, line_bad, strict=True)], pa.string())
    if window is not None:
        # A JSON-lines line that is not an object and names no time is in every window: it is
        # recorded (a dead letter) each time its file is read, never skipped unseen.
        unknown = pc.and_(pc.is_null(out["updated_at"]), pc.starts_with(out["_bad"], f"{InvalidRowError.kind}:"))
        keep = pc.or_(_in_window(out["updated_at"], window), pc.fill_null(unknown, False))
        out = {k: pc.filter(v, keep) for k, v in out.items()}
        rows = pc.filter(rows, keep)
    n = len(rows)
    out["_source"] = pa.array([unit.shard] * n, pa.string())
    out["_row"] = rows
    out["_unit"] = pa.array([unit.key] * n, pa.string())
    out["_unit_rows"] = pa.array([n] * n, pa.int64())
    out["_unit_error"] = pa.nulls(n, pa.string())
    return pa.table({f.name: out[f.name] for f in unit_block_schema()}, schema=unit_block_schema())


def marker_block(unit: WorkUnit, *, error: str | None) -> pa.Table:
    """One row standing for a unit with no rows to send (empty, filtered out, or unreadable)."""
    schema = unit_block_schema()
    values: dict[str, Any] = {name: [None] for name in schema.names}
    values.update({"_source": [unit.shard], "_unit": [unit.key], "_unit_rows": [0], "_unit_error": [error]})
    return pa.table(values, schema=schema)

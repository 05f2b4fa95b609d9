"""Input shards: listing them, cutting them into work units, and reading a unit.

A **work unit** is a contiguous row range of one shard (whole Parquet row groups where they
are small enough; a whole file for JSON lines). It is the grain of everything that must be
exact: a unit is read as one block, inferred, and committed with its results and dead letters
in one step (see `raypipe.sinks`), so a resumed run skips committed units and redoes only the
ones that were in flight.

Planning reads only Parquet footers and the first line of JSON-lines files, so a missing
column fails the run before any inference, naming the shard and the column.

Rows leave `read_unit` with raypipe's column names (`id`, `text`, optional `updated_at`) plus
where they came from (`_source`, `_row`) and which unit they belong to (`_unit`, `_unit_rows`);
a unit that cannot be read under `on_bad_shard="record"` becomes one marker row carrying
`_unit_error`, so the failure is recorded rather than lost.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from raypipe.errors import InputError, NoShardsError, SchemaError

__all__ = [
    "ColumnNames",
    "DeltaWindow",
    "PlanObservations",
    "ShardFormat",
    "WorkUnit",
    "list_shards",
    "plan_units",
    "prune_partitions",
    "read_unit",
    "unit_block_schema",
]

ShardFormat = Literal["parquet", "jsonl", "dead_letters"]
_EXTENSIONS: dict[str, ShardFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


@dataclass(frozen=True)
class ColumnNames:
    id: str = "id"
    text: str = "text"
    updated_at: str = "updated_at"


@dataclass(frozen=True)
class DeltaWindow:
    """Selects rows with `after < updated_at <= until` (daily runs).

    Rows whose `updated_at` is null are never in a window: a backfill infers them, dailies
    skip them (the plan counts them from the Parquet statistics, `PlanObservations`).
    """

    after: datetime | None
    until: datetime

    def may_hold(self, lo: datetime | None, hi: datetime | None) -> bool:
        """Can a row group whose updated_at spans [lo, hi] hold rows of the window?"""
        if lo is None or hi is None:
            return True  # no statistics: read it
        if lo > self.until:
            return False
        return self.after is None or hi > self.after


@dataclass
class PlanObservations:
    """What planning learnt from footers and paths, without reading any row."""

    max_updated_at: datetime | None = None
    """Latest updated_at in the input (from row-group statistics), the point a backfill read it as of."""
    null_updated_at_rows: int = 0
    """Rows with a null updated_at in the shards planned (statistics); dailies skip them."""
    row_groups_total: int = 0
    row_groups_pruned: int = 0
    """Row groups a daily skipped because their updated_at statistics lie outside its window."""
    shards_pruned: int = 0
    """Shards a daily skipped by their Hive partition value (`input.updated_at_partition`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_updated_at": None if self.max_updated_at is None else self.max_updated_at.isoformat(),
            "null_updated_at_rows": self.null_updated_at_rows,
            "row_groups_total": self.row_groups_total,
            "row_groups_pruned": self.row_groups_pruned,
            "shards_pruned": self.shards_pruned,
        }


@dataclass(frozen=True, order=True)
class WorkUnit:
    shard: str
    """Full URI of the shard (s3://bucket/key or a local path)."""
    format: ShardFormat
    row_start: int
    row_stop: int | None
    """Exclusive end; None for 'to the end of the file' (JSON lines)."""
    name: str | None = None
    """Overrides the derived key (replays name units after the dead-letter file they redo)."""

    @property
    def key(self) -> str:
        """Stable, file-name-safe identity: the same unit always gets the same output names."""
        if self.name:
            return self.name
        digest = hashlib.sha1(f"{self.shard}|{self.row_start}|{self.row_stop}".encode()).hexdigest()[:12]
        stem = posixpath.basename(self.shard).split(".")[0][:40] or "shard"
        return f"{stem}-{self.row_start}-{digest}"

    @property
    def expected_rows(self) -> int | None:
        return None if self.row_stop is None else self.row_stop - self.row_start

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "format": self.format,
            "row_start": self.row_start,
            "row_stop": self.row_stop,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkUnit:
        stop = None if d["row_stop"] is None else int(d["row_stop"])
        return cls(d["shard"], d["format"], int(d["row_start"]), stop, d.get("name"))


def _filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = url_to_fs(uri)
    return fs, path


def _open_parquet(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A Parquet file opened for random access. On object stores without read-ahead: fsspec's
    default cache fetches 5 MB blocks around every column chunk Arrow asks for, which made a
    daily over 1M rows download 5x the input instead of its footers and delta."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return fs.open(path, "rb")
    return fs.open(path, "rb", cache_type="none")


def _full_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _shard_format(path: str, forced: str) -> ShardFormat | None:
    if forced != "auto":
        return forced  # type: ignore[return-value]
    for ext, fmt in _EXTENSIONS.items():
        if path.endswith(ext):
            return fmt
    return None


def list_shards(uri: str, *, format: str = "auto") -> list[tuple[str, ShardFormat]]:
    """Shards under uri (a file, a folder searched recursively, or a glob), sorted by path.

    Hidden files and folders (`.x`, `_x`, e.g. `_SUCCESS`, `.crc`) are skipped, as Spark and
    Hive writers leave them. An input that matches no shard is an error, never an empty run.
    """
    fs, path = _filesystem(uri)
    if any(ch in path for ch in "*?["):
        candidates = sorted(fs.glob(path))
    elif fs.isdir(path):
        candidates = sorted(fs.find(path))
    elif fs.exists(path):
        candidates = [path]
    else:
        raise NoShardsError(f"input {uri} does not exist")
    shards: list[tuple[str, ShardFormat]] = []
    for candidate in candidates:
        rel = candidate[len(path) :] if candidate.startswith(path) else candidate
        if any(part.startswith((".", "_")) for part in rel.split("/") if part):
            continue
        fmt = _shard_format(candidate, format)
        if fmt is not None and not fs.isdir(candidate):
            shards.append((_full_uri(fs, candidate), fmt))
    if not shards:
        raise NoShardsError(
            f"input {uri} matches no shards (looked for {', '.join(sorted(_EXTENSIONS))} files"
            + ("" if format == "auto" else f" read as {format}")
            + ")"
        )
    return shards


def _check_columns(names: Iterable[str], shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    present = set(names)
    required = [columns.id, columns.text] + ([columns.updated_at] if need_updated_at else [])
    for col in required:
        if col not in present:
            raise SchemaError(f"column {col!r} is missing; the shard has {sorted(present)}", shard=shard, column=col)


def _check_types(schema: pa.Schema, shard: str, columns: ColumnNames) -> None:
    id_type = schema.field(columns.id).type
    if not (pa.types.is_string(id_type) or pa.types.is_large_string(id_type) or pa.types.is_integer(id_type)):
        raise SchemaError(
            f"id column {columns.id!r} has type {id_type}; ids must be strings or integers",
            shard=shard,
            column=columns.id,
        )
    text_type = schema.field(columns.text).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type) or pa.types.is_null(text_type)):
        raise SchemaError(
            f"text column {columns.text!r} has type {text_type}; it must hold strings", shard=shard, column=columns.text
        )


def plan_units(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool = False,
    on_bad_shard: Literal["fail", "record"] = "fail",
    window: DeltaWindow | None = None,
    observations: PlanObservations | None = None,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """Cuts shards into work units; returns (units, bad shards as {shard, error}).

    With on_bad_shard="fail" a shard that cannot be opened or lacks a column raises here,
    before any inference; with "record" it is returned in the second list instead. With a
    `window`, Parquet row groups whose updated_at statistics lie outside it get no unit, so
    a daily's cost follows its delta. `observations`, if given, collects what the footers say.
    """
    units: list[WorkUnit] = []
    bad: list[dict[str, str]] = []
    seen = observations if observations is not None else PlanObservations()
    for shard, fmt in shards:
        try:
            if fmt == "parquet":
                units += _plan_parquet(shard, unit_rows, columns, need_updated_at, window, seen)
            else:
                _check_jsonl_head(shard, columns, need_updated_at)
                units.append(WorkUnit(shard, "jsonl", 0, None))
        except (OSError, pa.ArrowException, ValueError, InputError) as e:
            if isinstance(e, InputError):
                err: InputError = e
            else:
                err = InputError(f"cannot read {fmt} shard: {type(e).__name__}: {e}", shard=shard)
            if on_bad_shard == "fail":
                raise err from e
            bad.append({"shard": shard, "format": fmt, "error": str(err)})
    return units, bad


#: Uncompressed size above which a row group of more than 2 x unit_rows rows is cut into units.
CUT_GROUP_BYTES = 64 * 2**20


def _updated_at_stats(rg: Any, index: int | None) -> tuple[datetime | None, datetime | None, int]:
    """(min, max, null count) of a row group's updated_at, where the footer has them as timestamps."""
    if index is None:
        return None, None, 0
    stats = rg.column(index).statistics
    if stats is None:
        return None, None, 0
    nulls = int(stats.null_count or 0) if stats.has_null_count else 0
    if not stats.has_min_max or not isinstance(stats.min, datetime):
        return None, None, nulls
    lo, hi = stats.min, stats.max
    if lo.tzinfo is None:  # Parquet timestamps without a zone are UTC instants here
        lo, hi = lo.replace(tzinfo=UTC), hi.replace(tzinfo=UTC)
    return lo, hi, nulls


def _plan_parquet(
    shard: str,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    seen: PlanObservations,
) -> list[WorkUnit]:
    fs, path = _filesystem(shard)
    with _open_parquet(fs, path) as f:
        meta = pq.ParquetFile(f).metadata
    schema = meta.schema.to_arrow_schema()
    _check_columns(schema.names, shard, columns, need_updated_at)
    _check_types(schema, shard, columns)
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    ts_index = names.index(columns.updated_at) if columns.updated_at in names else None
    units: list[WorkUnit] = []
    start = 0  # first row of the pending unit
    pending = 0  # rows in the pending unit
    offset = 0  # first row of the current row group
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        n = rg.num_rows
        lo, hi, nulls = _updated_at_stats(rg, ts_index)
        seen.row_groups_total += 1
        seen.null_updated_at_rows += nulls
        if hi is not None and (seen.max_updated_at is None or hi > seen.max_updated_at):
            seen.max_updated_at = hi
        skip = window is not None and (not window.may_hold(lo, hi) or (n > 0 and nulls == n))
        if skip:
            seen.row_groups_pruned += 1
        if pending and (skip or pending + n > unit_rows):
            units.append(WorkUnit(shard, "parquet", start, start + pending))
            pending = 0
        if skip:
            offset += n
            start = offset
            continue
        if not pending:
            start = offset
        if n > 2 * unit_rows and rg.total_byte_size > CUT_GROUP_BYTES:
            # A huge row group: cut it by rows (each unit re-reads the group, so only when it is
            # too big to hold as one unit; a group of many small rows stays whole).
            for lo_row in range(0, n, unit_rows):
                hi_row = min(n, lo_row + unit_rows)
                units.append(WorkUnit(shard, "parquet", offset + lo_row, offset + hi_row))
            start = offset + n
        else:
            pending += n
        offset += n
    if pending or (not units and window is None):
        units.append(WorkUnit(shard, "parquet", start, start + pending))
    return units


def _check_jsonl_head(shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
    fs, path = _filesystem(shard)
    with fs.open(path, "rb") as f:
        first = f.readline()
    if not first.strip():
        return  # an empty file is a unit of no rows
    try:
        row = json.loads(first)
    except json.JSONDecodeError as e:
        raise InputError(f"first line is not JSON: {e}", shard=shard) from e
    if not isinstance(row, dict):
        raise InputError("first line is not a JSON object", shard=shard)
    _check_columns(row.keys(), shard, columns, need_updated_at)


def unit_block_schema(with_updated_at: bool) -> pa.Schema:
    """The columns of every block a unit becomes (one schema, so blocks concatenate)."""
    fields = [
        pa.field("id", pa.string()),
        pa.field("text", pa.string()),
        pa.field("_source", pa.string()),
        pa.field("_row", pa.int64()),
        pa.field("_unit", pa.string()),
        pa.field("_unit_rows", pa.int64()),
        pa.field("_unit_error", pa.string()),
    ]
    if with_updated_at:
        fields.insert(2, pa.field("updated_at", pa.timestamp("us", tz="UTC")))
    return pa.schema(fields)


def _read_raw(unit: WorkUnit, columns: ColumnNames, wanted: list[str], window: DeltaWindow | None = None) -> pa.Table:
    fs, path = _filesystem(unit.shard)
    if unit.format == "jsonl":
        with fs.open(path, "rb") as f:
            data = f.read()
        if not data.strip():
            return pa.table({c: pa.array([], pa.string()) for c in wanted})
        table = pajson.read_json(io.BytesIO(data))
        _check_columns(table.column_names, unit.shard, columns, columns.updated_at in wanted)
        table = table.select(wanted)
    else:
        with _open_parquet(fs, path) as f:
            pf = pq.ParquetFile(f)
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
    _check_types(table.schema, unit.shard, columns)
    return table


def _as_utc_timestamps(column: pa.ChunkedArray, shard: str, name: str) -> pa.ChunkedArray:
    t = column.type
    if pa.types.is_timestamp(t):
        return column.cast(pa.timestamp("us", tz=t.tz or "UTC")).cast(pa.timestamp("us", tz="UTC"))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            return pc.cast(column, pa.timestamp("us", tz="UTC"))
        except pa.ArrowInvalid as e:
            raise SchemaError(
                f"column {name!r} holds strings that are not ISO timestamps: {e}", shard=shard, column=name
            ) from e
    raise SchemaError(f"column {name!r} has type {t}; expected a timestamp", shard=shard, column=name)


def _unit_len(unit: WorkUnit, first_row: int, available: int) -> int:
    stop = unit.row_stop if unit.row_stop is not None else first_row + available
    return stop - unit.row_start


def _in_window(updated: pa.ChunkedArray | pa.Array, window: DeltaWindow) -> Any:
    """Boolean mask of `after < updated <= until`; null timestamps are outside every window."""
    keep = pc.less_equal(updated, pa.scalar(window.until, pa.timestamp("us", tz="UTC")))
    if window.after is not None:
        keep = pc.and_(keep, pc.greater(updated, pa.scalar(window.after, pa.timestamp("us", tz="UTC"))))
    return pc.fill_null(keep, False)


def prune_partitions(
    shards: Sequence[tuple[str, ShardFormat]], key: str, window: DeltaWindow, seen: PlanObservations
) -> list[tuple[str, ShardFormat]]:
    """Drops shards whose Hive partition `key=YYYY-MM-DD` (the date of their rows' updated_at)
    lies outside the window's days, without opening them. Shards without the key are kept."""
    lo = None if window.after is None else window.after.astimezone(UTC).date()
    hi = window.until.astimezone(UTC).date()
    kept = []
    for shard, fmt in shards:
        day = None
        for part in shard.split("/"):
            if part.startswith(f"{key}="):
                try:
                    day = date.fromisoformat(part.split("=", 1)[1][:10])
                except ValueError:
                    day = None
        if day is not None and (day > hi or (lo is not None and day < lo)):
            seen.shards_pruned += 1
            continue
        kept.append((shard, fmt))
    return kept


def _read_dead_letters(unit: WorkUnit) -> pa.Table:
    """A dead-letter file as a unit block: the rows keep their original source and row."""
    fs, path = _filesystem(unit.shard)
    with fs.open(path, "rb") as f:
        dead = pq.read_table(f, columns=["id", "text", "updated_at", "source", "row"])
    n = dead.num_rows
    return pa.table(
        {
            "id": dead.column("id"),
            "text": dead.column("text"),
            "updated_at": dead.column("updated_at"),
            "_source": dead.column("source"),
            "_row": dead.column("row"),
            "_unit": pa.array([unit.key] * n, pa.string()),
            "_unit_rows": pa.array([n] * n, pa.int64()),
            "_unit_error": pa.nulls(n, pa.string()),
        },
        schema=unit_block_schema(True),
    )


def read_unit(unit: WorkUnit, columns: ColumnNames, window: DeltaWindow | None = None) -> pa.Table:
    """Reads one unit as one table in `unit_block_schema` (rows outside `window` dropped)."""
    if unit.format == "dead_letters":
        return _read_dead_letters(unit)
    wanted = [columns.id, columns.text] + ([columns.updated_at] if window is not None else [])
    raw = _read_raw(unit, columns, wanted, window)
    ids = raw.column(columns.id)
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        ids = pc.cast(ids, pa.string())  # integer ids become their decimal strings
    out: dict[str, Any] = {
        "id": ids.cast(pa.string()),
        "text": raw.column(columns.text).cast(pa.string()),
    }
    rows = pa.array(range(unit.row_start, unit.row_start + raw.num_rows), pa.int64())
    if window is not None:
        updated = _as_utc_timestamps(raw.column(columns.updated_at), unit.shard, columns.updated_at)
        keep = _in_window(updated, window)
        out = {k: pc.filter(v, keep) for k, v in out.items()}
        out["updated_at"] = pc.filter(updated, keep)
        rows = pc.filter(rows, keep)
    n = len(rows)
    out["_source"] = pa.array([unit.shard] * n, pa.string())
    out["_row"] = rows
    out["_unit"] = pa.array([unit.key] * n, pa.string())
    out["_unit_rows"] = pa.array([n] * n, pa.int64())
    out["_unit_error"] = pa.nulls(n, pa.string())
    return pa.table(out, schema=unit_block_schema(window is not None))


def marker_block(unit: WorkUnit, *, with_updated_at: bool, error: str | None) -> pa.Table:
    """One row standing for a unit with no rows to send (empty, filtered out, or unreadable)."""
    schema = unit_block_schema(with_updated_at)
    values: dict[str, Any] = {name: [None] for name in schema.names}
    values.update({"_source": [unit.shard], "_unit": [unit.key], "_unit_rows": [0], "_unit_error": [error]})
    return pa.table(values, schema=schema)

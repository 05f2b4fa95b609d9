"""Input shards: listing them, cutting them into work units, and reading a unit.

A **work unit** is a contiguous row range of one shard (whole Parquet row groups where they
are small enough; a whole file for JSON lines). It is the grain of everything that must be
exact: a unit is read as one block, inferred, and committed with its results and dead letters
in one step (see `raypipe.commit.table`), so a resumed run skips committed units and redoes only the
ones that were in flight.

Planning reads only Parquet footers (one ranged GET of a shard's tail each on S3) and the
first line of JSON-lines files, so a missing column fails the run before any inference, naming
the shard and the column. Shards are planned several at once (`plan_units`'s `threads`). An
input of many small Parquet shards (more than `FOOTER_SAMPLE`) has a sample of its footers read
and its other small shards planned whole from their listed sizes (`plan_listing`): a 50k-shard
backfill waited on one request per shard before its first unit; such a shard's columns are
checked when its unit is read.

Rows leave `read_unit` with raypipe's column names (`id`, `text`, optional `updated_at`) plus
where they came from (`_source`, `_row`) and which unit they belong to (`_unit`, `_unit_rows`);
a unit that cannot be read under `on_bad_shard="record"` becomes one marker row carrying
`_unit_error`, so the failure is recorded rather than lost.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import posixpath
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, date, datetime
from itertools import islice
from typing import Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from raypipe.errors import InputError, NoShardsError, SchemaError, ShardChangedError

__all__ = [
    "ColumnNames",
    "DeltaWindow",
    "InputListing",
    "PlanObservations",
    "ShardFormat",
    "WorkUnit",
    "fingerprint",
    "list_input",
    "list_shards",
    "plan_listing",
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
    """Selects rows with `after <= updated_at <= until` (daily runs).

    `after` is inclusive: a file rewritten in place is read from the latest `updated_at` read
    of it before, so rows appended at exactly that instant (a batch export stamps every row
    with one time) are read; the rows re-read at that instant are answered from the table by
    reuse.

    A window applies only to a file a run has read before (a unit with its own `since`: a
    daily's `--since`, a rewrite's newer rows); new files are read whole. Rows whose
    `updated_at` is null are never in a window: they are read with the file that holds them,
    when it is new.
    """

    after: datetime | None
    until: datetime

    @classmethod
    def since(cls, after: datetime) -> DeltaWindow:
        """Every row updated at or after `after` (a daily's `--since`; a rewritten file's newer rows)."""
        return cls(after, datetime(9999, 12, 31, tzinfo=UTC))

    def may_hold(self, lo: datetime | None, hi: datetime | None) -> bool:
        """Can a row group whose updated_at spans [lo, hi] hold rows of the window?"""
        if lo is None or hi is None:
            return True  # no statistics: read it
        if lo > self.until:
            return False
        return self.after is None or hi >= self.after


@dataclass
class PlanObservations:
    """What planning learnt from footers and paths, without reading any row."""

    limit: datetime | None = None
    """updated_at beyond this (now + the allowed clock skew) is in the future: counted, never a watermark."""
    max_updated_at: datetime | None = None
    """Latest updated_at in the input up to `limit` (row-group statistics): what it was read as of."""
    future_row_groups: int = 0
    """Row groups whose updated_at reaches beyond `limit` (a 9999-12-31 sentinel, a clock ahead)."""
    shard_max: dict[str, str] = dataclasses.field(default_factory=dict)
    """Shard -> its latest updated_at up to `limit` (ISO): recorded with the files seen, so a
    file rewritten later is read for its rows updated after it."""
    null_updated_at_rows: int = 0
    """Rows with a null updated_at in the shards planned (statistics); read when their file is
    new, never by a window over a file read before."""
    row_groups_total: int = 0
    row_groups_pruned: int = 0
    """Row groups a daily skipped because their updated_at statistics lie outside its window."""
    shards_pruned: int = 0
    """Shards a daily skipped by their Hive partition value (`input.updated_at_partition`)."""
    footers_read: int = 0
    """Parquet footers read at planning."""
    whole_files: int = 0
    """Parquet shards planned as one unit from their listed size (`plan_listing`): their footers
    are read by the task that reads their rows, and the statistics above do not count them."""

    def add(self, other: PlanObservations) -> None:
        """Folds in what planning other shards learnt (`plan_units` plans each shard on its own)."""
        if other.max_updated_at is not None and (
            self.max_updated_at is None or other.max_updated_at > self.max_updated_at
        ):
            self.max_updated_at = other.max_updated_at
        self.future_row_groups += other.future_row_groups
        for shard, hi in other.shard_max.items():
            if shard not in self.shard_max or hi > self.shard_max[shard]:
                self.shard_max[shard] = hi
        self.null_updated_at_rows += other.null_updated_at_rows
        self.row_groups_total += other.row_groups_total
        self.row_groups_pruned += other.row_groups_pruned
        self.shards_pruned += other.shards_pruned
        self.footers_read += other.footers_read
        self.whole_files += other.whole_files

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_updated_at": None if self.max_updated_at is None else self.max_updated_at.isoformat(),
            "future_row_groups": self.future_row_groups,
            "null_updated_at_rows": self.null_updated_at_rows,
            "row_groups_total": self.row_groups_total,
            "row_groups_pruned": self.row_groups_pruned,
            "shards_pruned": self.shards_pruned,
            "footers_read": self.footers_read,
            "whole_files": self.whole_files,
            "shard_max": self.shard_max,
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
    """Overrides the derived key (a replay's unit is the unit of the dead letters it redoes)."""
    source_run: str | None = None
    """Replays: the run whose dead letters the unit re-infers (`shard` is then the output URI)."""
    fingerprint: str | None = None
    """The shard's `fingerprint` at planning: a shard rewritten since is not read (re-planned)."""
    since: str | None = None
    """Only rows updated after this instant (ISO; a daily's `--since` over files read before)."""

    @property
    def key(self) -> str:
        """Stable, file-name-safe identity: the same unit always gets the same output names."""
        if self.name:
            return self.name
        digest = hashlib.sha1(f"{self.shard}|{self.row_start}|{self.row_stop}".encode()).hexdigest()[:12]
        stem = posixpath.basename(self.shard).split(".")[0][:40] or "shard"
        return f"{stem}-{self.row_start}-{digest}"

    @property
    def planned_whole(self) -> bool:
        """A Parquet shard planned as one unit from its listed size (`plan_listing`): no footer
        read at planning, the whole file read as it is when read."""
        return self.format == "parquet" and self.row_stop is None

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
            "source_run": self.source_run,
            "fingerprint": self.fingerprint,
            "since": self.since,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkUnit:
        stop = None if d["row_stop"] is None else int(d["row_stop"])
        return cls(
            d["shard"],
            d["format"],
            int(d["row_start"]),
            stop,
            d.get("name"),
            d.get("source_run"),
            d.get("fingerprint"),
            d.get("since"),
        )


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
    lower = path.lower()  # PART-0.PARQUET is Parquet too
    for ext, fmt in _EXTENSIONS.items():
        if lower.endswith(ext):
            return fmt
    return None


def fingerprint(info: dict[str, Any]) -> str:
    """A file's identity for "has it changed?": size and ETag on S3, size and mtime locally."""
    tag = info.get("ETag") or info.get("etag") or info.get("VersionId") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')}:{str(tag).strip(chr(34))}"


@dataclass
class InputListing:
    """What an input URI holds: the shards raypipe reads, and every file it skips, with why."""

    shards: list[tuple[str, ShardFormat]]
    fingerprints: dict[str, str]
    """Shard URI -> `fingerprint` when listed (a shard that differs when read is re-planned)."""
    sizes: dict[str, int]
    """Shard URI -> its size in bytes when listed."""
    skipped: list[dict[str, str]]
    """{path, reason} of each file not read: hidden (`_x`, `.x`), unknown extension, quarantined."""


def list_input(uri: str, *, format: str = "auto", quarantined: frozenset[str] = frozenset()) -> InputListing:
    """Shards under uri (a file, a folder searched recursively, or a glob), sorted by path.

    Hidden files and folders (`.x`, `_x`, e.g. `_SUCCESS`, `.crc`) and files of unknown
    extensions are skipped, each listed with its reason. An input that matches no shard is an
    error, never an empty run.
    """
    fs, path = _filesystem(uri)
    if any(ch in path for ch in "*?["):
        found = fs.glob(path, detail=True)
    else:
        # `find` first, not `isdir`: on S3, `isdir` of a cold folder lists it whole (another 50
        # pages of 1,000 keys for 50k shards, 25 s on moto). `find` of a file finds the file.
        found = fs.find(path, detail=True)
        if list(found) == [path]:
            found = {path: fs.info(path)}  # local `find` gives no details for a file
        elif not found and not fs.exists(path):
            raise NoShardsError(f"input {uri} does not exist")
    listing = InputListing([], {}, {}, [])
    for candidate in sorted(found):
        info = found[candidate]
        if info.get("type") == "directory":
            continue
        full = _full_uri(fs, candidate)
        rel = candidate[len(path) :] if candidate.startswith(path) else candidate
        hidden = [part for part in rel.split("/") if part.startswith((".", "_"))]
        fmt = _shard_format(candidate, format)
        if hidden:
            listing.skipped.append({"path": full, "reason": f"hidden ({hidden[0]!r} starts with '.' or '_')"})
        elif fmt is None:
            ext = posixpath.splitext(candidate)[1] or "(none)"
            listing.skipped.append({"path": full, "reason": f"unknown extension {ext}"})
        elif full in quarantined:
            listing.skipped.append({"path": full, "reason": "quarantined (raypipe shards quarantine)"})
        else:
            listing.shards.append((full, fmt))
            listing.fingerprints[full] = fingerprint(info)
            if isinstance(info.get("size"), int):
                listing.sizes[full] = info["size"]
    if not listing.shards:
        skipped = "; ".join(f"{s['path']}: {s['reason']}" for s in listing.skipped[:5])
        raise NoShardsError(
            f"input {uri} matches no shards (looked for {', '.join(sorted(_EXTENSIONS))} files"
            + ("" if format == "auto" else f" read as {format}")
            + ")"
            + (f"; skipped {len(listing.skipped)}: {skipped}" if skipped else "")
        )
    return listing


def list_shards(uri: str, *, format: str = "auto") -> list[tuple[str, ShardFormat]]:
    """The shards of `list_input`, as (uri, format) pairs."""
    return list_input(uri, format=format).shards


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


#: Shards planned at once when the caller does not say (`InputConfig.planning_threads`).
PLANNING_THREADS = 16


def plan_units(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool = False,
    on_bad_shard: Literal["fail", "record"] = "fail",
    window: DeltaWindow | None = None,
    observations: PlanObservations | None = None,
    fingerprints: dict[str, str] | None = None,
    threads: int = PLANNING_THREADS,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """Cuts shards into work units; returns (units, bad shards as {shard, error}).

    With on_bad_shard="fail" a shard that cannot be opened or lacks a column raises here,
    before any inference; with "record" it is returned in the second list instead. With a
    `window`, Parquet row groups whose updated_at statistics lie outside it get no unit, so
    a daily's cost follows its delta. `observations`, if given, collects what the footers say.

    Up to `threads` shards are planned at once, each on its own; their results are taken in
    shard order, so the plan is the one planning them one by one gives: the same units and
    observations, the same bad shards, and with "fail" the error of the first bad shard in
    shard order. At most 2 x `threads` shards are in flight: memory does not grow with the input.
    """
    units: list[WorkUnit] = []
    bad: list[dict[str, str]] = []
    seen = observations if observations is not None else PlanObservations()
    plan = functools.partial(
        _plan_shard,
        unit_rows=unit_rows,
        columns=columns,
        need_updated_at=need_updated_at,
        window=window,
        limit=seen.limit,
        fingerprints=fingerprints or {},
    )
    for done in _in_order(plan, shards, threads):
        seen.add(done.seen)  # a shard that failed half way counts what it saw, as before
        if done.error is None:
            units += done.units
        elif on_bad_shard == "fail":
            raise done.error from done.cause
        else:
            bad.append({"shard": done.shard, "format": done.format, "error": str(done.error)})
    return units, bad


#: Parquet shards whose footers planning reads before it plans the others from their listed
#: sizes (`InputConfig.footer_sample`).
FOOTER_SAMPLE = 1000
#: The largest shard `plan_listing` makes one unit from its listed size (its rows are one block).
WHOLE_FILE_MAX_BYTES = 64 * 2**20


def plan_listing(
    shards: Sequence[tuple[str, ShardFormat]],
    *,
    sizes: dict[str, int],
    footer_sample: int | None = FOOTER_SAMPLE,
    unit_rows: int,
    columns: ColumnNames,
    on_bad_shard: Literal["fail", "record"] = "fail",
    observations: PlanObservations | None = None,
    fingerprints: dict[str, str] | None = None,
    threads: int = PLANNING_THREADS,
) -> tuple[list[WorkUnit], list[dict[str, str]]]:
    """`plan_units` for shards read whole (a backfill's, a daily's new files), without reading
    every footer when there are many.

    With at most `footer_sample` Parquet shards (or `footer_sample` None) every footer is read,
    as `plan_units` does. With more, the footers of `footer_sample` of them, spread evenly over
    the listing, are read first: they are checked (a wrong schema fails the run before any
    inference, as it fails in any shard planning reads) and they give the input's bytes per row.
    Each other Parquet shard whose listed size holds at most about 2 x `unit_rows` rows at that
    rate (and at most `WHOLE_FILE_MAX_BYTES`) becomes one whole-file unit (`row_stop` None)
    without a request; its footer is read by the task that reads its rows, which checks its
    columns then (a bad one fails the run there under "fail", or is recorded under "record").
    The rest are planned from their footers.

    Why: a footer costs one request, and an input of 50k small shards waited ~4 min on them
    before its first unit (moto, `bench.planning`); the listing already holds what a unit of a
    small file needs. What it costs: row-group pruning and the footers' `updated_at`
    statistics (the latest per shard, which a daily re-reads a rewritten file after) for the
    shards planned whole; the run takes the latter from its committed rows instead
    (`raypipe.run.modes`), and a daily's windowed re-reads read footers as before.
    """
    seen = observations if observations is not None else PlanObservations()
    common: dict[str, Any] = {
        "unit_rows": unit_rows,
        "columns": columns,
        "on_bad_shard": on_bad_shard,
        "observations": seen,
        "fingerprints": fingerprints,
        "threads": threads,
    }
    parquet = [i for i, (shard, fmt) in enumerate(shards) if fmt == "parquet" and shard in sizes]
    if footer_sample is None or len(parquet) <= max(footer_sample, 1):
        return plan_units(shards, **common)
    step = len(parquet) / footer_sample
    sampled = {parquet[int(k * step)] for k in range(footer_sample)}
    sample = [shards[i] for i in sorted(sampled)]
    sample_units, sample_bad = plan_units(sample, **common)
    bad_shards = {b["shard"] for b in sample_bad}
    rows = sum(u.expected_rows or 0 for u in sample_units if u.shard not in bad_shards)
    size = sum(sizes[shard] for shard, _ in sample if shard not in bad_shards)
    limit = min(WHOLE_FILE_MAX_BYTES, 2 * unit_rows * size / rows) if rows else 0.0
    whole: list[WorkUnit] = []
    rest: list[tuple[str, ShardFormat]] = []
    for i, (shard, fmt) in enumerate(shards):
        if i in sampled:
            continue
        if fmt == "parquet" and shard in sizes and sizes[shard] <= limit:
            mark = (fingerprints or {}).get(shard)
            whole.append(WorkUnit(shard, "parquet", 0, None, fingerprint=mark))
        else:
            rest.append((shard, fmt))
    seen.whole_files += len(whole)
    rest_units, rest_bad = plan_units(rest, **common)
    order = {shard: i for i, (shard, _) in enumerate(shards)}
    units = sorted([*sample_units, *whole, *rest_units], key=lambda u: (order[u.shard], u.row_start))
    bad = sorted([*sample_bad, *rest_bad], key=lambda b: order[b["shard"]])
    return units, bad


@dataclass
class _ShardPlan:
    """One shard's part of a plan: its units and observations, or why it cannot be read."""

    shard: str
    format: ShardFormat
    units: list[WorkUnit]
    seen: PlanObservations
    error: InputError | None = None
    cause: BaseException | None = None


def _plan_shard(
    item: tuple[str, ShardFormat],
    *,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    limit: datetime | None,
    fingerprints: dict[str, str],
) -> _ShardPlan:
    shard, fmt = item
    seen = PlanObservations(limit=limit)
    try:
        if fmt == "parquet":
            planned = _plan_parquet(shard, unit_rows, columns, need_updated_at, window, seen)
        else:
            _check_jsonl_head(shard, columns, need_updated_at)
            planned = [WorkUnit(shard, "jsonl", 0, None)]
    except (OSError, pa.ArrowException, ValueError, InputError) as e:
        if isinstance(e, InputError):
            err: InputError = e
        else:
            err = InputError(f"cannot read {fmt} shard: {type(e).__name__}: {e}", shard=shard)
        return _ShardPlan(shard, fmt, [], seen, err, None if err is e else e)
    mark = fingerprints.get(shard)
    return _ShardPlan(
        shard, fmt, [dataclasses.replace(u, fingerprint=mark) for u in planned] if mark else planned, seen
    )


def _in_order(
    plan: Callable[[tuple[str, ShardFormat]], _ShardPlan], items: Sequence[tuple[str, ShardFormat]], threads: int
) -> Iterator[_ShardPlan]:
    """`plan(item)` for each item, run by up to `threads` threads, yielded in the items' order.

    A window of 2 x `threads` items runs ahead of the one yielded: enough to keep every thread
    busy while the caller takes results in order, and nothing more is held. When the caller
    stops (a failed shard under "fail"), the items not started are dropped."""
    if threads <= 1 or len(items) <= 1:
        yield from map(plan, items)
        return
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="raypipe-plan") as pool:
        todo = iter(items)
        running: deque[Future[_ShardPlan]] = deque(pool.submit(plan, item) for item in islice(todo, 2 * threads))
        try:
            while running:
                done = running.popleft().result()
                running.extend(pool.submit(plan, item) for item in islice(todo, 1))
                yield done
        finally:
            for future in running:
                future.cancel()


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


#: Bytes of a Parquet shard's end read by planning's one request: the footer, its length and
#: the magic. 64 KiB is what Arrow itself reads first; a larger footer costs a second request.
FOOTER_TAIL_BYTES = 64 * 2**10


def _read_footer(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """A Parquet file's metadata from a ranged read of its tail: on S3 one GET of a suffix
    range (`bytes=-N`), which needs neither the size nor a HEAD, and holds no file object.

    Per shard, 1,000 of 50k shards on moto read one at a time (`bench.planning`, results in
    bench/results/bench-20261124T055216Z.md): before, `fs.open(..., cache_type="none")` +
    `pq.ParquetFile` made 1 GET and spent 9.0 ms of driver CPU after `list_input` (s3fs looks
    the size up in its listing cache by scanning the folder's 50k entries: quadratic in the
    shards), 1 HEAD + 1 GET and 4.7 ms without a listing; now 1 GET and 2.4 ms either way
    (s3fs/botocore's own cost of a request).
    """
    tail = fs.cat_file(path, start=-FOOTER_TAIL_BYTES)
    if len(tail) == FOOTER_TAIL_BYTES and tail[-4:] == b"PAR1":
        need = int.from_bytes(tail[-8:-4], "little") + 8
        if need > len(tail):  # a footer larger than the tail read: read it whole
            tail = fs.cat_file(path, start=-need)
    # Arrow parses the footer at the buffer's end; errors (no magic, a truncated file) are Arrow's.
    return pq.read_metadata(pa.BufferReader(tail))


def _plan_parquet(
    shard: str,
    unit_rows: int,
    columns: ColumnNames,
    need_updated_at: bool,
    window: DeltaWindow | None,
    seen: PlanObservations,
) -> list[WorkUnit]:
    fs, path = _filesystem(shard)
    meta = _read_footer(fs, path)
    seen.footers_read += 1
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
        if hi is not None and seen.limit is not None and hi > seen.limit:
            seen.future_row_groups += 1
            hi = lo if lo is not None and lo <= seen.limit else None
        if hi is not None and (seen.max_updated_at is None or hi > seen.max_updated_at):
            seen.max_updated_at = hi
        if hi is not None and (shard not in seen.shard_max or hi.isoformat() > seen.shard_max[shard]):
            seen.shard_max[shard] = hi.isoformat()
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
    fs, path = _filesystem(unit.shard)
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
        with fs.open(path, "rb") as f:
            data = f.read()
        if not data.strip():
            return pa.table({c: pa.array([], pa.string()) for c in wanted})
        table = pajson.read_json(io.BytesIO(_jsonl_valid_utf8(data, columns)))
        _check_columns(table.column_names, unit.shard, columns, window is not None)
        table = table.select([c for c in [*wanted, _BAD_JSON_FIELD] if c in table.column_names])
    else:
        with _open_parquet(fs, path) as f:
            pf = pq.ParquetFile(f)
            # Planning checked the columns of the shards whose footers it read; a shard planned
            # whole from its listed size (`plan_listing`) is checked here, where it is first opened.
            _check_columns(pf.schema_arrow.names, unit.shard, columns, window is not None)
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
    _check_types(table.schema, unit.shard, columns)
    return table


_BAD_JSON_FIELD = "__raypipe_bad"


def _jsonl_valid_utf8(data: bytes, columns: ColumnNames) -> bytes:
    """JSON lines with each line that is not valid UTF-8 replaced by one holding its id, a null
    text and the reason (Arrow's JSON reader would silently turn the bad bytes into U+FFFD)."""
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError:
        pass
    lines = []
    for line in data.splitlines():
        try:
            line.decode("utf-8")
            lines.append(line)
            continue
        except UnicodeDecodeError as e:
            start = max(0, e.start - 8)
            reason = (
                f"invalid_text: line of {len(line)} bytes, invalid at byte {e.start}: {line[start : e.start + 8].hex()}"
            )
        try:
            row = json.loads(line.decode("utf-8", errors="replace"))
            row_id = row.get(columns.id) if isinstance(row, dict) else None
        except json.JSONDecodeError:
            row_id = None
        fixed = {columns.id: row_id, columns.text: None, _BAD_JSON_FIELD: reason}
        lines.append(json.dumps(fixed).encode())
    return b"\n".join(lines) + b"\n"


def _utf8_checked(column: pa.ChunkedArray | pa.Array, what: str) -> tuple[pa.Array, list[str | None]]:
    """The strings with invalid UTF-8 replaced by null, and each row's reason (or None).

    Readers do not validate UTF-8 (a Parquet string column can hold any bytes), and one bad
    value would fail the whole unit where Python decodes it; so each invalid value becomes its
    row's reason, `invalid_<what>: <first bytes in hex>`, and the row a dead letter."""
    column = pa.chunked_array([column]) if isinstance(column, pa.Array) else column
    column = column.cast(pa.string())
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
    """Boolean mask of `after <= updated <= until`; null timestamps are outside every window."""
    keep = pc.less_equal(updated, pa.scalar(window.until, pa.timestamp("us", tz="UTC")))
    if window.after is not None:
        keep = pc.and_(keep, pc.greater_equal(updated, pa.scalar(window.after, pa.timestamp("us", tz="UTC"))))
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
    """A unit's committed dead letters of run `unit.source_run`, read from the outcomes table
    (`unit.shard` is the output URI); the rows keep their original source and row."""
    from raypipe.commit.table import OutcomeTable

    # The unit and outcome in the scan's filter: the log's file statistics skip the run's other
    # units' files, so a replay reads each unit's file once, not the run's partition per unit.
    flt = (
        (pc.field("run_id") == (unit.source_run or ""))
        & (pc.field("unit") == unit.key)
        & (pc.field("outcome") == "dead_letter")
    )
    dataset = OutcomeTable(unit.shard).load().to_pyarrow_dataset()
    dead = dataset.to_table(filter=flt, columns=["id", "text", "updated_at", "source", "row"])
    n = dead.num_rows
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
            "_bad": pa.nulls(n, pa.string()),
        },
        schema=unit_block_schema(),
    )


def read_unit(unit: WorkUnit, columns: ColumnNames, window: DeltaWindow | None = None) -> pa.Table:
    """Reads one unit as one table in `unit_block_schema` (rows outside `window` dropped)."""
    if unit.format == "dead_letters":
        return _read_dead_letters(unit)
    wanted = [columns.id, columns.text, columns.updated_at]
    raw = _read_raw(unit, columns, wanted, window)
    ids = raw.column(columns.id)
    if not (pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        ids = pc.cast(ids, pa.string())  # integer ids become their decimal strings
    id_values, bad_ids = _utf8_checked(ids, "id")
    texts, bad_texts = _utf8_checked(raw.column(columns.text), "text")
    out: dict[str, Any] = {
        "id": id_values,
        "text": texts,
    }
    rows = pa.array(range(unit.row_start, unit.row_start + raw.num_rows), pa.int64())
    if columns.updated_at in raw.column_names:
        out["updated_at"] = _as_utc_timestamps(raw.column(columns.updated_at), unit.shard, columns.updated_at)
    else:
        out["updated_at"] = pa.nulls(raw.num_rows, pa.timestamp("us", tz="UTC"))
    line_bad = raw.column(_BAD_JSON_FIELD).to_pylist() if _BAD_JSON_FIELD in raw.column_names else bad_texts
    out["_bad"] = pa.array([i or t or j for i, t, j in zip(bad_ids, bad_texts, line_bad, strict=True)], pa.string())
    if window is not None:
        keep = _in_window(out["updated_at"], window)
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

"""Planning: what a run reads, cut into work units before anything is sent, in one module.

    plan_input(input, mode, history)    a new run's `Plan`, in these steps:
      list_input                          the shards under the input URI (quarantined ones and
                                          hidden files skipped, each listed with why)
      daily selection                     a daily keeps the files no run has read whole yet, by
                                          the files seen (`OutputHistory.files_seen`)
      plan_listing                        small Parquet shards of a large input planned whole
                                          from their listed sizes, the others from their footers
      plan_units                          shards cut into units from their Parquet footers (or a
                                          JSON-lines file's first line); a daily `--since` prunes
                                          the row groups of unchanged files by their statistics
    plan_replay(output, of_run, ...)    a replay's `Plan`: the units of a run holding dead letters
    resume(input, plan, committed)      a resumed run's stored plan, brought up to date
    check_input(input, mode, ...)       the input as preflight checks it: listed, first shard planned

A backfill plans every shard whole. A daily plans the files no run has read whole yet (new
ones, and those whose size or ETag changed), whole, whatever their rows' `updated_at`: it
selects by the files seen, not by a watermark, and never re-reads an unchanged file. A file
rewritten in place is read whole: its unchanged texts are answered by reuse without a call, so
it costs I/O, not inference. `updated_at` orders versions for `latest`; it never decides what
is read, except that `since` adds reads: the unchanged files too, for their rows updated at
or after it (never fewer rows than without it). Shards an operator quarantined
(`raypipe.store.OutputStore.quarantine`) are skipped and listed.

Planning reads only listings, Parquet footers (one ranged GET of a shard's tail each on S3)
and the first line of JSON-lines files, so a missing column fails the run before any
inference, naming the shard and the column. The `Plan` carries what the later steps need of
the input (its columns, the bad-shard policy, the allowed clock skew), so no step after
planning reads the input's settings again. The vocabulary (`WorkUnit`, `ColumnNames`,
`DeltaWindow`) is `raypipe.plan.units`; the column checks `raypipe.plan.schema`. Planning
imports only the floor (`raypipe.config`, `raypipe.errors`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import posixpath
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from itertools import islice
from typing import Any, Literal, Protocol

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from raypipe.config import InputConfig
from raypipe.errors import InputError, NoShardsError, SchemaError
from raypipe.plan.schema import check_columns, check_types
from raypipe.plan.units import ColumnNames, DeltaWindow, ShardFormat, WorkUnit

__all__ = [
    "CUT_GROUP_BYTES",
    "FOOTER_SAMPLE",
    "FOOTER_TAIL_BYTES",
    "PLANNING_THREADS",
    "WHOLE_FILE_MAX_BYTES",
    "InputListing",
    "OutputHistory",
    "Plan",
    "PlanObservations",
    "check_input",
    "filesystem",
    "fingerprint",
    "list_input",
    "list_shards",
    "plan_input",
    "plan_listing",
    "plan_replay",
    "plan_units",
    "prune_partitions",
    "resume",
]

logger = logging.getLogger("raypipe")


# -- the plan ----------------------------------------------------------------------------------
# What planning learnt without reading a row (the report's `planning`, the files seen's latest
# updated_at per shard, the watermark), and the stored `Plan`.
@dataclass
class PlanObservations:
    """What planning learnt from footers and paths, without reading any row."""

    limit: datetime | None = None
    """updated_at beyond this (now + the allowed clock skew) is in the future: counted, never a watermark."""
    max_updated_at: datetime | None = None
    """Latest updated_at of the row groups wholly up to `limit` (statistics): what the input was
    read as of, informational (the watermark); it never decides what is read."""
    future_row_groups: int = 0
    """Row groups whose updated_at reaches beyond `limit` (a 9999-12-31 sentinel, a clock ahead):
    read like any other, left out of `max_updated_at`."""
    null_updated_at_rows: int = 0
    """Rows with a null updated_at in the shards planned (statistics); read with their file
    whenever it is new or changed, never by a `--since` window over an unchanged file."""
    row_groups_total: int = 0
    row_groups_pruned: int = 0
    """Row groups of unchanged files a daily `--since` did not re-read: their updated_at
    statistics lie wholly before it."""
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
        }


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()


def _parse(ts: str | None) -> datetime | None:
    return None if ts is None else datetime.fromisoformat(ts)


@dataclass
class Plan:
    """A run's units, fixed at its first start and stored (fenced, `raypipe.commit.protocol`), so
    a restart does the same units; with what planning saw, and how this attempt reads them."""

    mode: str
    input: str | None
    units: list[WorkUnit]
    bad_shards: list[dict[str, str]]
    window: DeltaWindow | None = None
    replay_of: str | None = None
    observations: dict[str, Any] | None = None
    """What planning saw in the footers (`PlanObservations`), and a backfill's `read_as_of`."""
    model_version: str | None = None
    # How this attempt reads the units, from its input settings (`plan_input`, `resume`); not
    # stored: every attempt reads with its own settings. A replay's are the defaults.
    columns: ColumnNames = dataclasses.field(default=ColumnNames(), compare=False)
    """The input's id, text and updated_at column names."""
    on_bad_shard: Literal["fail", "record"] = dataclasses.field(default="fail", compare=False)
    """A shard that cannot be read: stop the run, or record it and go on (`input.on_bad_shard`)."""
    max_future_skew_s: float = dataclasses.field(default=3600.0, compare=False)
    """An updated_at later than now plus this is in the future (`input.max_future_skew_s`)."""

    @property
    def read_as_of(self) -> datetime | None:
        """What a backfill's or daily's input was read as of: the watermark its completion moves
        to (None for a replay, which reads no input)."""
        return _parse((self.observations or {}).get("read_as_of"))

    def rows_run_id(self, run_id: str) -> str:
        """The run whose rows run `run_id` writes: its own, or for a replay the run it replays."""
        return self.replay_of or run_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "input": self.input,
            "units": [u.to_dict() for u in self.units],
            "bad_shards": self.bad_shards,
            "window": None
            if self.window is None
            else {"after": _iso(self.window.after), "until": _iso(self.window.until)},
            "replay_of": self.replay_of,
            "observations": self.observations,
            "model_version": self.model_version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        w = d.get("window")
        window = None if w is None else DeltaWindow(_parse(w["after"]), _parse(w["until"]))  # type: ignore[arg-type]
        return cls(
            d["mode"],
            d["input"],
            [WorkUnit.from_dict(u) for u in d["units"]],
            d["bad_shards"],
            window,
            d.get("replay_of"),
            d.get("observations"),
            d.get("model_version"),
        )


# -- listing -----------------------------------------------------------------------------------
# The shards under an input URI, and every file skipped, with why. A shard's `fingerprint` says
# whether it changed since it was listed; a daily's Hive partitions are pruned by date unopened.
_EXTENSIONS: dict[str, ShardFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = url_to_fs(uri)
    return fs, path


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
    fs, path = filesystem(uri)
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


# -- footers -----------------------------------------------------------------------------------
# Shards cut into work units from their Parquet footers (or a JSON-lines file's first line),
# several shards at once; a daily's window prunes row groups by their updated_at statistics.
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
    fs, path = filesystem(shard)
    meta = _read_footer(fs, path)
    seen.footers_read += 1
    schema = meta.schema.to_arrow_schema()
    check_columns(schema.names, shard, columns, need_updated_at)
    check_types(schema, shard, columns)
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
        future = hi is not None and seen.limit is not None and hi > seen.limit
        seen.future_row_groups += future
        if hi is not None and not future and (seen.max_updated_at is None or hi > seen.max_updated_at):
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


#: Lines of a JSON-lines shard planning reads to find a JSON object whose columns it checks.
HEAD_LINES = 100


def _check_jsonl_head(shard: str, columns: ColumnNames, need_updated_at: bool) -> None:
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


# -- whole files -------------------------------------------------------------------------------
# An input of more than `FOOTER_SAMPLE` Parquet shards has a sample of its footers read and its
# other small shards planned whole from their listed sizes: no request per shard. Such a shard's
# columns are checked when its unit is read (`raypipe.run.read`).
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
    small file needs. What it costs: the footers' `updated_at` statistics of the shards
    planned whole (the informational watermark does not count them).
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


# -- a run's plan ------------------------------------------------------------------------------
class OutputHistory(Protocol):
    """What planning asks of the output (`raypipe.commit.protocol.CommitProtocol` answers)."""

    def quarantined(self) -> frozenset[str]:
        """The shards an operator set aside."""
        ...

    def files_seen(self) -> dict[str, tuple[str, str | None]]:
        """Input file URI -> (fingerprint, the latest `updated_at` read in it, ISO, if known)."""
        ...


def _columns(input: InputConfig) -> ColumnNames:
    return ColumnNames(input.id_column, input.text_column, input.updated_at_column)


def _on_bad_shard(input: InputConfig, mode: str) -> Literal["fail", "record"]:
    """A daily records bad shards by default (a bad shard must not hold the others back)."""
    return input.on_bad_shard or ("record" if mode == "daily" else "fail")


def _reading(input: InputConfig, mode: str) -> dict[str, Any]:
    """The `Plan` fields of how this attempt reads its units."""
    return {
        "columns": _columns(input),
        "on_bad_shard": _on_bad_shard(input, mode),
        "max_future_skew_s": input.max_future_skew_s,
    }


def plan_input(input: InputConfig, mode: str, output: OutputHistory, *, since: datetime | None = None) -> Plan:
    """A backfill plans every shard whole. A daily plans the files no run has read whole yet
    (new ones, and those whose size or ETag changed), whole, whatever their rows' updated_at;
    an unchanged file is not read again. `since` only adds reads: the unchanged files too, for
    their rows updated at or after it."""
    listing = list_input(input.uri, format=input.format, quarantined=output.quarantined())
    seen = PlanObservations(limit=datetime.now(UTC) + timedelta(seconds=input.max_future_skew_s))
    whole, unchanged = listing.shards, list[tuple[str, ShardFormat]]()
    files: Counter[str] = Counter()
    if mode == "daily":
        read_before = output.files_seen()
        whole = []
        for shard, fmt in listing.shards:
            before = read_before.get(shard)
            kind = "new" if before is None else "unchanged" if before[0] == listing.fingerprints[shard] else "changed"
            files[kind] += 1
            (unchanged if kind == "unchanged" else whole).append((shard, fmt))
        if since is not None and input.updated_at_partition:
            unchanged = prune_partitions(unchanged, input.updated_at_partition, DeltaWindow.since(since), seen)
    else:
        files["new"] = len(whole)
    common: dict[str, Any] = {
        "unit_rows": input.unit_rows,
        "columns": _columns(input),
        "on_bad_shard": _on_bad_shard(input, mode),
        "observations": seen,
        "fingerprints": listing.fingerprints,
        "threads": input.planning_threads,
    }
    units, bad = plan_listing(whole, sizes=listing.sizes, footer_sample=input.footer_sample, **common)
    if since is not None and unchanged:
        window = DeltaWindow.since(since)
        more, more_bad = plan_units(unchanged, need_updated_at=True, window=window, **common)
        units += [dataclasses.replace(u, since=since.isoformat()) for u in more]
        bad += more_bad
    logger.info(
        "planned %d units: %d files new, %d changed, %d read before%s; %d skipped, %d bad",
        len(units),
        files["new"],
        files["changed"],
        files["unchanged"],
        f" (rows updated at or after {since.isoformat()} re-read)" if since is not None else " (not read)",
        len(listing.skipped),
        len(bad),
    )
    if seen.whole_files:
        logger.info(
            "%d footers read at planning; %d small Parquet files planned whole from their listed size "
            "(each footer is read with its rows)",
            seen.footers_read,
            seen.whole_files,
        )
    if seen.future_row_groups:
        logger.warning(
            "%d row group(s) hold updated_at beyond now + %s s (e.g. a 9999-12-31 sentinel): inferred, but "
            "they do not move the watermark",
            seen.future_row_groups,
            input.max_future_skew_s,
        )
    observations = {**seen.to_dict(), "files": dict(files), "skipped_files": listing.skipped}
    # What the input was read as of (the latest updated_at not in the future, else now): the watermark.
    observations["read_as_of"] = observations["max_updated_at"] or datetime.now(UTC).isoformat()
    window = None if since is None else DeltaWindow.since(since)
    return Plan(mode, input.uri, units, bad, window, observations=observations, **_reading(input, mode))


def plan_replay(output_uri: str, of_run: str, dead_letters: Mapping[str, int], *, table_version: int) -> Plan:
    """A replay's plan: a unit per unit of run `of_run` that holds committed dead letters
    (`dead_letters`: unit -> how many, at `table_version` of the outcomes table, which the
    report counts against), read back from the table by that unit's name."""
    units = [
        WorkUnit(output_uri, "dead_letters", 0, n, name=unit, source_run=of_run)
        for unit, n in sorted(dead_letters.items())
    ]
    return Plan("replay", None, units, [], None, replay_of=of_run, observations={"table_version": table_version})


def resume(
    input: InputConfig, plan: Plan, committed: set[str], *, quarantined: frozenset[str] = frozenset()
) -> tuple[Plan, bool]:
    """A resumed run's stored plan, read with this attempt's input settings, and brought up to
    date with its input as it is now, for what is not `committed` yet:

    - a shard gone from the input since planning, or `quarantined` since, has its units not
      committed dropped, and is listed with the plan's skipped files, with why;
    - a shard rewritten since planning (its fingerprint differs) is planned again, whole, from
      the file as it is now: its old units are dropped, committed or not (their rows stay in
      the table; the new units have new keys), so no row of the new version is skipped;
    - the shards an earlier attempt recorded as bad are planned again (a fixed one joins the
      run; a quarantined or gone one leaves the bad shards for the skipped files).

    A shard planned again that cannot be read is recorded as bad, whatever the bad-shard
    policy (the run is then incomplete; a later resume plans it again).

    Returns (plan, changed): a changed plan is to be stored again."""
    plan = dataclasses.replace(plan, **_reading(input, plan.mode))
    listing = list_input(input.uri, format=input.format, quarantined=quarantined)
    now = listing.fingerprints
    observations = dict(plan.observations or {})
    skipped = list(observations.get("skipped_files") or [])
    listed = {s["path"] for s in skipped}

    def skip(shard: str, reason: str) -> None:
        if shard not in listed:
            listed.add(shard)
            skipped.append({"path": shard, "reason": reason})

    open_shards = {u.shard for u in plan.units if u.key not in committed and u.format != "dead_letters"}
    units, replan = [], list[tuple[str, ShardFormat]]()
    for u in plan.units:
        if u.shard not in open_shards:
            units.append(u)
        elif u.shard in quarantined:
            skip(u.shard, "quarantined (raypipe shards quarantine) since the run was planned")
            if u.key in committed:
                units.append(u)
        elif u.shard not in now:
            skip(u.shard, "gone from the input since the run was planned")
            if u.key in committed:
                units.append(u)
        elif u.fingerprint is not None and u.fingerprint != now[u.shard]:
            if (u.shard, u.format) not in replan:
                replan.append((u.shard, u.format))
        else:
            units.append(u)
    bad = []
    for b in plan.bad_shards:
        if b["shard"] in quarantined:
            skip(b["shard"], "quarantined (raypipe shards quarantine) since the run was planned")
        elif b["shard"] not in now:
            skip(b["shard"], "gone from the input since the run was planned")
        else:
            replan.append((b["shard"], b["format"]))  # type: ignore[arg-type]
    if replan:
        more, more_bad = plan_units(
            replan,
            unit_rows=input.unit_rows,
            columns=plan.columns,
            on_bad_shard="record",
            fingerprints=now,
            threads=input.planning_threads,
        )
        units += more
        bad += more_bad
        logger.info(
            "%d shard(s) rewritten since planning or recorded as bad planned again: %d units", len(replan), len(more)
        )
    if skipped:
        observations["skipped_files"] = skipped
    resumed = dataclasses.replace(plan, units=units, bad_shards=bad, observations=observations or plan.observations)
    return resumed, resumed != plan


# -- the input as preflight checks it ----------------------------------------------------------
_INPUT_HINT = "set --input (input.uri) to a Parquet or JSON-lines file, a folder of them, or a glob"


def check_input(input: InputConfig, mode: str, *, quarantined: frozenset[str] = frozenset()) -> None:
    """Raises `InputError` (or `NoShardsError`, `SchemaError`) with the setting to fix, if a run
    could not plan `input`: it exists, lists at least one shard (the `quarantined` ones left
    out), and its first shard has the id and text columns with usable types (its Parquet
    footer, or its first JSON line; no rows read). A daily records bad shards and goes on
    (`input.on_bad_shard: record`), so it is refused only when its first and its last shard
    both lack the same column: that is a setting (`input.text_column`), not one bad file."""
    try:
        listing = list_input(input.uri, format=input.format, quarantined=quarantined)
    except NoShardsError as e:
        raise NoShardsError(f"{e}: {_INPUT_HINT}") from e
    except (OSError, ValueError) as e:  # a bucket that does not exist, a path we may not list
        raise InputError(f"cannot list input {input.uri}: {type(e).__name__}: {e}: {_INPUT_HINT}") from e
    columns = _columns(input)

    def first_error(shard: tuple[str, ShardFormat]) -> InputError | None:
        try:
            plan_units([shard], unit_rows=input.unit_rows, columns=columns, threads=1)
        except InputError as e:
            return e
        return None

    error = first_error(listing.shards[0])
    if error is None:
        return
    if _on_bad_shard(input, mode) == "record":
        # One bad file is the daily's to record; the same column missing at both ends is a setting.
        if not isinstance(error, SchemaError):
            return
        if len(listing.shards) > 1:
            last = first_error(listing.shards[-1])
            if not (isinstance(last, SchemaError) and last.column == error.column):
                return
    hinted = copy.copy(error)  # keeps its type and fields (shard, column)
    hinted.args = (f"{error}: {_schema_hint(error, input)}",)
    raise hinted from error


def _schema_hint(error: InputError, input: InputConfig) -> str:
    column = getattr(error, "column", None)
    setting = {
        input.id_column: "input.id_column",
        input.text_column: "input.text_column",
        input.updated_at_column: "input.updated_at_column",
    }.get(column or "")
    if setting is None:
        return "fix the shard, or quarantine it (raypipe shards quarantine)"
    return f"name the column with --set {setting}=NAME, or fix the shard"

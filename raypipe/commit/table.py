"""The outcomes table: the names its log keeps, and its readers (its schema: `raypipe.commit.schema`).

Every run's results and dead letters live in one **Delta Lake** table, `OUTPUT/outcomes/`,
written and read through `deltalake` (delta-rs): Parquet files plus a transaction log, so
every reader that goes through the log (DuckDB `delta_scan`, Spark, Athena, Trino,
`raypipe.read_outcomes`) sees only committed data. One row per input row and run, with an
`outcome` column (`result` or `dead_letter`); partitioned by `run_id`.

Nothing here writes rows or fences anything: every commit into the table (take-over, unit,
plan and files-seen pointers, run commit, abort) is the commit protocol's
(`raypipe.commit.protocol`, where the fence is told). What lives here is what those commits
leave in the log and how to read it back:

- the output's fence: `SLOTS` application transactions (Delta `txn` actions, app id
  `raypipe-output/slot-<k>`, `slot_app`) whose version is the output's generation
  (`OutcomeTable.generation`). Tables written before the output-level fence also hold per-run
  slots, `raypipe/<run>/slot-<k>`: nothing reads them any more;
- a unit's own transaction (`raypipe/<run>/unit/<unit>`, `unit_app`), and, because each unit
  writes one data file whose `unit` column holds the unit key, the committed units of a run
  read from the log's file statistics alone (`committed_units`), without reading data;
- a run's commit (`raypipe/<run>/committed`, `done_app`): `is_committed`, the one truth of
  "committed" while it is kept (a run's own transactions expire: `expires`);
- pointers to immutable state files beside the table (`plan_app`, `FILES_SEEN_APP`,
  `QUARANTINE_APP`) and the daily watermark (`WATERMARK_APP`, its version the instant in
  microseconds): `OutcomeTable.pointer`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.schema import outcome_schema
from raypipe.errors import OutputPermissionError, SinkError

__all__ = [
    "CHECKPOINT_INTERVAL",
    "FILES_SEEN_APP",
    "QUARANTINE_APP",
    "REOPEN_AFTER",
    "SLOTS",
    "TABLE_DIR",
    "TABLE_PROPERTIES",
    "TRANSACTION_RETENTION",
    "WATERMARK_APP",
    "OutcomeTable",
    "as_sink_error",
    "done_app",
    "expires",
    "generation_of",
    "missing_properties",
    "plan_app",
    "scan_where",
    "slot_app",
    "storage_options",
    "unit_app",
    "unit_slot",
]

logger = logging.getLogger("raypipe")

TABLE_DIR = "outcomes"
SLOTS = 16
"""Fencing slots of the output: unit commits of one holder conflict only within a slot."""
OUTPUT_APP = "raypipe-output"
"""The output's fence: app ids `raypipe-output/slot-<k>`, each at the output's generation."""


def scan_where(
    dataset: Any, equal: dict[str, str | list[str]], columns: list[str], *, valid: tuple[str, ...] = ()
) -> pa.Table:
    """The rows of a table's dataset whose string columns equal the given values (a list: any of
    them) and whose `valid` columns are not null.

    A file that delta-rs's MERGE rewrote (a replay's) stores its strings as `string_view`, the
    others as `string`, and Arrow has no comparison kernel between a view and a string literal:
    the rows are filtered on the columns cast to string. A cast hides the expression from the
    log's file statistics, so the files are first pruned with the plain expression, which only
    meets the statistics (a replay reads its unit's file, not every file of the run)."""
    import pyarrow.dataset as pds

    def where(cast: bool) -> Any:
        terms = []
        for name, value in equal.items():
            field = pc.field(name).cast(pa.string()) if cast else pc.field(name)
            terms.append(field.isin(value) if isinstance(value, list) else field == value)
        terms += [pc.field(name).is_valid() for name in valid]
        expr = terms[0]
        for term in terms[1:]:
            expr = expr & term
        return expr

    fragments = list(dataset.get_fragments(filter=where(False)))
    if not fragments:
        return dataset.schema.empty_table().select(columns)
    pruned = pds.FileSystemDataset(fragments, dataset.schema, dataset.format, dataset.filesystem)
    return pruned.to_table(filter=where(True), columns=columns)


def storage_options(uri: str) -> dict[str, str] | None:
    """delta-rs options for `uri` from the standard AWS environment (any S3-compatible endpoint)."""
    if not uri.startswith("s3://"):
        return None
    opts = {"AWS_REGION": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            opts["AWS_ALLOW_HTTP"] = "true"
    return opts


def slot_app(slot: int) -> str:
    """One of the output's fencing slots."""
    return f"{OUTPUT_APP}/slot-{slot}"


def unit_app(run_id: str, unit: str) -> str:
    """A unit's own transaction: the unit is committed once per generation."""
    return f"raypipe/{run_id}/unit/{unit}"


def done_app(run_id: str) -> str:
    """A run's commit."""
    return f"raypipe/{run_id}/committed"


def plan_app(run_id: str) -> str:
    """The app transaction naming a run's current plan file (`raypipe.commit.protocol`)."""
    return f"raypipe/{run_id}/plan"


FILES_SEEN_APP = "raypipe/files-seen"
"""The app transaction naming the output's current files-seen file (`raypipe.commit.protocol`)."""
QUARANTINE_APP = "raypipe/quarantine"
"""The app transaction naming the output's current quarantine file (`raypipe.commit.upkeep`)."""
WATERMARK_APP = "raypipe/watermark"
"""The app transaction holding the daily watermark, in microseconds since the epoch (UTC)."""
TRANSACTION_RETENTION = "interval 90 days"
"""The table's `delta.setTransactionRetentionDuration`: how long an expiring transaction is kept."""
CHECKPOINT_INTERVAL = 20
"""The table's `delta.checkpointInterval`: a checkpoint every this many commits (about three
dailies' worth), so opening a snapshot reads the checkpoint and at most this many log entries
after it. delta-rs's default is 100, Delta Lake's Spark writer's 10. The trade: a 90-entry tail
made an open of a 267-file table 40 ms instead of 16 (one read per entry: more on S3), while each
checkpoint is one write of the table's state, ~0.05 ms a file (compaction keeps the files few)."""
REOPEN_AFTER = 5 * CHECKPOINT_INTERVAL
"""Versions `refresh` moves a snapshot incrementally before opening it anew: each write through a
delta-rs snapshot moved by `update_incremental` costs more the more it was moved (`bench/snapshot.py`),
and a run commits every unit through one. Opening anew reads the checkpoint, once per this many."""
TABLE_PROPERTIES = {
    "delta.setTransactionRetentionDuration": TRANSACTION_RETENTION,
    "delta.checkpointInterval": str(CHECKPOINT_INTERVAL),
    "delta.logRetentionDuration": "interval 30 days",
    "delta.enableExpiredLogCleanup": "true",
}
"""What keeps the log bounded, set when the table is created and by maintenance on a table that
lacks them (`missing_properties`): expiring transactions pruned, a checkpoint every
`CHECKPOINT_INTERVAL` commits, and at each checkpoint the log entries older than the log's
retention deleted (delta-rs's post-commit hook; `raypipe vacuum` also runs `cleanup_metadata`).
A value a user set on the table stays: these are only the defaults."""


def missing_properties(dt: Any) -> dict[str, str]:
    """The `TABLE_PROPERTIES` a snapshot (`deltalake.DeltaTable`) does not set (an earlier
    release's table): maintenance sets them (`raypipe.commit.upkeep`)."""
    have = dt.metadata().configuration
    return {k: v for k, v in TABLE_PROPERTIES.items() if k not in have}


def expires(app: str) -> bool:
    """Does `app`'s transaction expire? The rule that keeps the log's transactions from growing
    with the history: a run's own transactions (its units, its plan pointer, its run commit)
    carry `lastUpdated` and are pruned once older than `TRANSACTION_RETENTION`; the output's
    (the fence's `SLOTS`, files seen, quarantine, watermark) are a fixed few, set again by
    every run that moves them, and carry none. Past the retention, a run's commit is
    remembered by its completed report (`raypipe.commit.protocol.committed_runs`)."""
    return app.startswith("raypipe/") and app not in (FILES_SEEN_APP, QUARANTINE_APP, WATERMARK_APP)


def unit_slot(unit: str) -> int:
    """The fencing slot a unit's commit carries."""
    return int(hashlib.blake2b(unit.encode(), digest_size=2).hexdigest(), 16) % SLOTS


def generation_of(dt: Any, slot: int = 0) -> int:
    """The output's generation in a snapshot (`deltalake.DeltaTable`), as slot `slot` holds it."""
    return int(dt.transaction_version(slot_app(slot)) or 0)


def as_sink_error(e: Exception, uri: str) -> Exception:
    """A storage error from delta-rs as raypipe's: a 403 as `OutputPermissionError`."""
    text = str(e)
    if "403" in text or "AccessDenied" in text or "Forbidden" in text:
        return OutputPermissionError(f"the output refuses our credentials: {text}", path=uri)
    return SinkError(f"cannot write the outcomes table: {text}", path=uri)


class OutcomeTable:
    """The Delta table under `OUTPUT/outcomes/`: creation and readers of its rows and log.

    One object holds one snapshot (`load`), opened once and brought up to date from the log's
    new entries only where the commit protocol says the table moved (`refresh`), so a run that
    asks the table a dozen questions reads its log from the last checkpoint once, not a dozen
    times. A run builds one (`raypipe.commit.output.Output`)
    and passes it down; a process of its own (an actor's committer) builds its own."""

    def __init__(self, output_uri: str) -> None:
        self.output_uri = output_uri.rstrip("/")
        self.uri = f"{self.output_uri}/{TABLE_DIR}"
        self._options = storage_options(self.uri)
        self._dt: Any = None
        self._opened_at = -1  # the version `_open` opened the snapshot at
        self._lock = threading.Lock()

    # The snapshot holds delta-rs state and the lock a thread: a copy sent elsewhere opens its own.
    def __getstate__(self) -> dict[str, Any]:
        return {"output_uri": self.output_uri}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["output_uri"])  # type: ignore[misc]

    def exists(self) -> bool:
        from deltalake import DeltaTable

        if self._dt is not None:  # a table once there stays there
            return True
        return bool(DeltaTable.is_deltatable(self.uri, storage_options=self._options))

    def load(self) -> Any:
        """This object's snapshot of the table (`deltalake.DeltaTable`): opened at the latest
        version on first use, and not moved by reading it. Every caller gets the same object (until
        `refresh` opens it anew).

        The commit protocol moves it (`refresh`) where the table changed under it: after this
        run's own commits (a take-over, a pointer, the run commit, its actors' units) and after a
        commit that conflicted. Readers of the snapshot (`pointer`, `committed_units`, ...) so
        answer from one read of the log per step, not one per question."""
        with self._lock:
            if self._dt is None:
                self._open()
            return self._dt

    def refresh(self) -> Any:
        """The snapshot brought up to the table's latest version (`update_incremental` reads only
        the log entries after it; the first call opens it, and so does the first past
        `REOPEN_AFTER` versions since it was opened: then callers get a new object)."""
        with self._lock:
            if self._dt is None:
                self._open()
            else:
                try:
                    self._dt.update_incremental()
                except Exception as e:  # the store's errors, from delta-rs
                    raise as_sink_error(e, self.uri) from e
                if self._dt.version() - self._opened_at >= REOPEN_AFTER:
                    self._open()
            return self._dt

    def _open(self) -> None:
        from deltalake import DeltaTable

        try:
            self._dt = DeltaTable(self.uri, storage_options=self._options)
            self._opened_at = self._dt.version()
        except Exception as e:  # TableNotFoundError and the store's errors, all from delta-rs
            if not self.exists():
                raise SinkError(f"no outcomes table at {self.uri} (no run has written here yet)", path=self.uri) from e
            raise as_sink_error(e, self.uri) from e

    def load_version(self, version: int) -> Any:
        """The table as it was at `version` (time travel; the log keeps it for its retention)."""
        from deltalake import DeltaTable

        return DeltaTable(self.uri, version=version, storage_options=self._options)

    def ensure(self, labels: tuple[str, ...]) -> None:
        """Creates the table, or adds the columns of labels it does not have yet."""
        from deltalake import DeltaTable, write_deltalake

        schema = outcome_schema(labels)
        try:
            if not self.exists():
                try:
                    DeltaTable.create(
                        self.uri,
                        schema=schema,
                        partition_by=["run_id"],
                        mode="ignore",  # a concurrent creator wins: same schema
                        storage_options=self._options,
                        configuration=TABLE_PROPERTIES,
                    )
                except Exception:
                    # A create whose answer was lost (`raypipe.commit.fence.landed`) fails its
                    # retry with "protocol changed": the table is there, as with a concurrent creator.
                    if not self.exists():
                        raise
            dt = self.load()
            have = set(pa.schema(dt.schema().to_arrow()).names)
            if not set(schema.names) <= have:
                write_deltalake(dt, schema.empty_table(), mode="append", schema_mode="merge", partition_by=["run_id"])
        except (SinkError, OutputPermissionError):
            raise
        except Exception as e:
            raise as_sink_error(e, self.uri) from e

    def arrow_schema(self) -> pa.Schema:
        return pa.schema(self.load().schema().to_arrow())

    def generation(self) -> int:
        """The output's generation in the snapshot: how many take-overs (and aborts) its fence
        had seen when the snapshot was last moved (`refresh` first for the latest)."""
        return generation_of(self.load())

    def pointer(self, app: str) -> int | None:
        """The number an app transaction holds (the name of a state file), or None."""
        if not self.exists():
            return None
        version = self.load().transaction_version(app)
        return None if version is None else int(version)

    def committed_runs(self, candidates: set[str]) -> set[str]:
        """The run ids among `candidates` whose run commit is in the table."""
        if not candidates or not self.exists():
            return set()
        dt = self.load()
        return {r for r in candidates if dt.transaction_version(done_app(r)) is not None}

    def run_ids(self) -> set[str]:
        """Run ids with committed rows (the table's `run_id` partitions)."""
        if not self.exists():
            return set()
        actions = pa.table(self.load().get_add_actions(flatten=True))
        if actions.num_rows == 0:
            return set()
        return {r for r in pc.unique(actions.column("partition.run_id")).to_pylist() if r is not None}

    def is_committed(self, run_id: str) -> bool:
        """Is the run committed? Its run commit in the table says so, nothing else."""
        return run_id in self.committed_runs({run_id})

    def committed_units(self, run_id: str) -> set[str]:
        """Units of `run_id` with committed rows, from the log's file statistics (no data read).

        A unit committed with no rows has no file; it is listed again and its commit, finding
        the unit's transaction, does nothing.
        """
        if not self.exists():
            return set()
        actions = pa.table(self.load().get_add_actions(flatten=True))
        if actions.num_rows == 0 or "min.unit" not in actions.column_names:
            return set()
        mine = actions.filter(pc.equal(actions.column("partition.run_id"), run_id))
        lo, hi = mine.column("min.unit").to_pylist(), mine.column("max.unit").to_pylist()
        if any(a != b for a, b in zip(lo, hi, strict=True)):
            raise SinkError(
                f"run {run_id}'s files hold more than one unit each (compacted while it was unfinished?); "
                "its progress cannot be read from the log",
                path=self.uri,
            )
        return {u for u in lo if u is not None}

    def units_with_transaction(self, run_id: str, units: list[str]) -> set[str]:
        """The units of `units` whose own transaction `run_id` committed (with rows or none).

        One lookup per unit (about a millisecond each): for a replay's units, whose rows land
        in the run they replay and so cannot be listed from `run_id`'s files."""
        if not units or not self.exists():
            return set()
        dt = self.load()
        return {u for u in units if dt.transaction_version(unit_app(run_id, u)) is not None}

    def max_updated_at_by_unit(self, run_id: str) -> dict[str, datetime]:
        """The latest `updated_at` (UTC, to the millisecond: Delta's statistics) in each
        committed unit of `run_id` with rows that have one, from the log's file statistics."""
        if not self.exists():
            return {}
        actions = pa.table(self.load().get_add_actions(flatten=True))
        if actions.num_rows == 0 or not {"min.unit", "max.updated_at"} <= set(actions.column_names):
            return {}
        mine = actions.filter(pc.equal(actions.column("partition.run_id"), run_id))
        latest: dict[str, datetime] = {}
        units = mine.column("min.unit").to_pylist()
        stamps = mine.column("max.updated_at").cast(pa.timestamp("us", tz="UTC")).to_pylist()
        for unit, hi in zip(units, stamps, strict=True):
            if unit is not None and hi is not None and (unit not in latest or hi > latest[unit]):
                latest[unit] = hi
        return latest


def now_utc() -> datetime:
    return datetime.now(UTC)

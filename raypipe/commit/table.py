"""The outcomes table and the unit commit protocol.

Every run's results and dead letters live in one **Delta Lake** table, `OUTPUT/outcomes/`,
written and read through `deltalake` (delta-rs): Parquet files plus a transaction log, so
every reader that goes through the log (DuckDB `delta_scan`, Spark, Athena, Trino,
`raypipe.read_outcomes`) sees only committed data. One row per input row and run, with an
`outcome` column (`result` or `dead_letter`); partitioned by `run_id`.

A unit is committed in **one** Delta commit (`UnitCommitter.commit`): its results and dead
letters become visible together, or not at all. Files a failed or fenced-off commit wrote
are in no commit, so no reader sees them (`raypipe vacuum` removes them).

**Fencing is the table's own concurrency control**, not a check before a write, and it is
one fence for the whole output, whatever the run id. The output owns `SLOTS` application
transactions (Delta `txn` actions, app id `raypipe-output/slot-<k>`) whose version is the
output's generation. Whoever takes the output over (a run of any id, a retried attempt,
maintenance) commits the next generation to every slot (`take_over`). A unit commit carries
the slot of its unit with the writer's generation and is built on a snapshot in which that
slot still holds that generation; Delta's conflict checker rejects a commit whose application
transaction was set by any commit after its snapshot. So once a take-over is in the log,
every commit of every older holder fails (`LeaseLostError`), of its own run id or another,
however long it was stalled, and there is no window between a check and a write. Slots
(rather than one app id) let a holder's actors commit side by side: two unit commits conflict
only when their units share a slot, and then the later one retries on a fresh snapshot.

A unit also carries its own transaction (`raypipe/<run>/unit/<unit>`), so a unit committed
twice in one generation (a Ray task retried after its actor died past the commit) is
committed once: the retry sees the unit's transaction and skips. Unit transactions carry
`lastUpdated`, so the table's `delta.setTransactionRetentionDuration` (90 days) prunes them
from snapshots and checkpoints; the slots and the run's own commit (`raypipe/<run>/committed`)
carry none and are kept: they are the fence and the record that the run is committed. (Tables
written before the output-level fence also hold per-run slots, `raypipe/<run>/slot-<k>`:
nothing reads them any more.) Each unit writes one data
file whose `unit` column holds the unit key, so the committed units of a run are read from
the log's file statistics alone (`committed_units`), without reading data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.errors import LeaseLostError, OutputPermissionError, SinkError

__all__ = [
    "FILES_SEEN_APP",
    "OUTCOME_DEAD_LETTER",
    "OUTCOME_RESULT",
    "RESULT_STATUS_EMPTY",
    "RESULT_STATUS_OK",
    "SLOTS",
    "TABLE_DIR",
    "OutcomeTable",
    "TableFence",
    "UnitCommitter",
    "label_column",
    "outcome_schema",
    "plan_app",
    "storage_options",
    "text_hashes",
]

logger = logging.getLogger("raypipe")

TABLE_DIR = "outcomes"
OUTCOME_RESULT = "result"
OUTCOME_DEAD_LETTER = "dead_letter"
RESULT_STATUS_OK = "ok"
RESULT_STATUS_EMPTY = "empty_text"
SLOTS = 16
"""Fencing slots of the output: unit commits of one holder conflict only within a slot."""
OUTPUT_APP = "raypipe-output"
"""The output's fence: app ids `raypipe-output/slot-<k>`, each at the output's generation."""

_TS = pa.timestamp("us", tz="UTC")
# Columns before the labels' probabilities, so Delta's per-file statistics (first 32 columns)
# always cover `unit` (the committed-units listing) and `updated_at` / `inferred_at`.
_HEAD = [
    pa.field("id", pa.string()),
    pa.field("outcome", pa.string()),
    pa.field("unit", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error_kind", pa.string()),
    pa.field("model_version", pa.string()),
    pa.field("updated_at", _TS),
    pa.field("inferred_at", _TS),
    pa.field("text_hash", pa.int64()),
    pa.field("top_label", pa.string()),
    pa.field("top_score", pa.float32()),
    pa.field("truncated", pa.bool_()),
]
_TAIL = [
    pa.field("grpc_status", pa.string()),
    pa.field("attempts", pa.int32()),
    pa.field("message", pa.string()),
    pa.field("text", pa.string()),
    pa.field("source", pa.string()),
    pa.field("row", pa.int64()),
]


def label_column(label: str) -> str:
    """The column of a label's probability: `prob_<label>`, SQL-safe."""
    return "prob_" + re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


def outcome_schema(labels: tuple[str, ...] | list[str]) -> pa.Schema:
    """One row per input row: a result (`status` ok / empty_text, probabilities) or a dead
    letter (`error_kind`, `grpc_status`, `attempts`, `message`, and its `text` for replays)."""
    return pa.schema([*_HEAD, *[pa.field(label_column(x), pa.float32()) for x in labels], *_TAIL])


def text_hashes(texts: pa.Array | pa.ChunkedArray | list[str | None]) -> pa.Array:
    """A 64-bit BLAKE2b of each text's UTF-8 bytes, as a signed int64 (null for a null text):
    the key `raypipe.call.dedup` reuses answers by."""
    values = texts if isinstance(texts, list) else texts.to_pylist()
    return pa.array(
        [
            None
            if t is None
            else int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True)
            for t in values
        ],
        pa.int64(),
    )


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


def _slot_app(slot: int) -> str:
    return f"{OUTPUT_APP}/slot-{slot}"


def _unit_app(run_id: str, unit: str) -> str:
    return f"raypipe/{run_id}/unit/{unit}"


def _done_app(run_id: str) -> str:
    return f"raypipe/{run_id}/committed"


def plan_app(run_id: str) -> str:
    """The app transaction naming a run's current plan file (`raypipe.commit.protocol`)."""
    return f"raypipe/{run_id}/plan"


FILES_SEEN_APP = "raypipe/files-seen"
"""The app transaction naming the output's current files-seen file (`raypipe.commit.protocol`)."""


def unit_slot(unit: str) -> int:
    return int(hashlib.blake2b(unit.encode(), digest_size=2).hexdigest(), 16) % SLOTS


@dataclass(frozen=True)
class TableFence:
    """What a writer needs to commit as the output's holder (picklable: it travels to actors):
    the run id its rows and transactions are of, and the output generation its take-over set."""

    output_uri: str
    run_id: str
    generation: int


def _commit_failed() -> type[Exception]:
    from deltalake.exceptions import CommitFailedError

    return CommitFailedError


def _as_sink_error(e: Exception, uri: str) -> Exception:
    text = str(e)
    if "403" in text or "AccessDenied" in text or "Forbidden" in text:
        return OutputPermissionError(f"the output refuses our credentials: {text}", path=uri)
    return SinkError(f"cannot write the outcomes table: {text}", path=uri)


class OutcomeTable:
    """The Delta table under `OUTPUT/outcomes/`: creation, takeover, run completion, readers."""

    def __init__(self, output_uri: str) -> None:
        self.output_uri = output_uri.rstrip("/")
        self.uri = f"{self.output_uri}/{TABLE_DIR}"
        self._options = storage_options(self.uri)

    def exists(self) -> bool:
        from deltalake import DeltaTable

        return bool(DeltaTable.is_deltatable(self.uri, storage_options=self._options))

    def load(self) -> Any:
        """The table at its latest version (`deltalake.DeltaTable`)."""
        from deltalake import DeltaTable

        try:
            return DeltaTable(self.uri, storage_options=self._options)
        except Exception as e:  # TableNotFoundError and the store's errors, all from delta-rs
            if not self.exists():
                raise SinkError(f"no outcomes table at {self.uri} (no run has written here yet)", path=self.uri) from e
            raise _as_sink_error(e, self.uri) from e

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
                DeltaTable.create(
                    self.uri,
                    schema=schema,
                    partition_by=["run_id"],
                    mode="ignore",  # a concurrent creator wins: same schema
                    storage_options=self._options,
                    configuration={"delta.setTransactionRetentionDuration": "interval 90 days"},
                )
            dt = self.load()
            have = set(pa.schema(dt.schema().to_arrow()).names)
            if not set(schema.names) <= have:
                write_deltalake(dt, schema.empty_table(), mode="append", schema_mode="merge", partition_by=["run_id"])
        except (SinkError, OutputPermissionError):
            raise
        except Exception as e:
            raise _as_sink_error(e, self.uri) from e

    def arrow_schema(self) -> pa.Schema:
        return pa.schema(self.load().schema().to_arrow())

    def generation(self) -> int:
        """The output's generation: how many take-overs (and aborts) its fence has seen."""
        return _generation_of(self.load())

    def take_over(self, run_id: str, *, holder: str = "") -> TableFence:
        """Commits the output's next generation to every slot, for run `run_id`: every older
        holder, of any run id, is fenced off.

        Two takers of the same generation cannot both win: the second commit's transactions
        conflict with the first's, and it raises `LeaseLostError`.
        """
        from deltalake import CommitProperties, Transaction

        failed = _commit_failed()
        for _ in range(20):
            dt = self.load()
            generation = _generation_of(dt) + 1
            try:
                dt.create_write_transaction(
                    [],
                    mode="append",
                    schema=dt.schema(),
                    partition_by=["run_id"],
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(_slot_app(s), generation) for s in range(SLOTS)],
                        custom_metadata={"raypipe.operation": "take-over", "raypipe.run_id": run_id, "holder": holder},
                    ),
                )
                return TableFence(self.output_uri, run_id, generation)
            except failed:
                if self.generation() >= generation:
                    raise LeaseLostError(
                        f"run {run_id}: another holder took over {self.uri} at the same moment (generation "
                        f"{generation}); this one stops",
                        holder=run_id,
                        expires_at="?",
                    ) from None
                # A unit commit of the older holder landed first: our snapshot is stale. Again.
                time.sleep(random.uniform(0.01, 0.1))
        raise SinkError(f"could not take over run {run_id}: the table kept changing under us", path=self.uri)

    def pointer(self, app: str) -> int | None:
        """The number an app transaction holds (the name of a state file), or None."""
        if not self.exists():
            return None
        version = self.load().transaction_version(app)
        return None if version is None else int(version)

    def set_pointer(self, fence: TableFence, app: str, write: Callable[[int | None], int], *, operation: str) -> int:
        """Points `app` at a new state file, fenced like a unit commit.

        `write(current)` gets the number `app` holds on a fresh snapshot, writes a new
        immutable file (under a name no other writer uses) from it and returns that file's
        number; one commit then sets `app` to it, with the output's slots at `fence`'s generation.
        A concurrent pointer change is a conflict: `write` runs again on the new state. Once a
        newer attempt took over, `LeaseLostError`, and the file written stays unreferenced."""

        def mark(dt: Any) -> tuple[str, int]:
            current = dt.transaction_version(app)
            return app, write(None if current is None else int(current))

        return self._fenced_commit(
            fence,
            mark,
            {"raypipe.operation": operation, "raypipe.run_id": fence.run_id},
            failure=f"could not record {operation} for run {fence.run_id}",
        )

    def _fenced_commit(
        self,
        fence: TableFence,
        mark: Callable[[Any], tuple[str, int]],
        metadata: dict[str, str],
        *,
        failure: str,
    ) -> int:
        """One commit of no rows that sets the app transaction `mark(snapshot)` names, with the
        output's slots at `fence`'s generation, on a fresh snapshot where they still hold it.

        A conflicting commit makes it look again (`mark` runs again on the new snapshot); once a
        newer attempt took over, `LeaseLostError`. Returns the version the app was set to."""
        from deltalake import CommitProperties, Transaction

        failed = _commit_failed()
        for _ in range(50):
            dt = self.load()
            _check_generation(dt, fence, 0)
            app, version = mark(dt)
            txns = [Transaction(_slot_app(s), fence.generation) for s in range(SLOTS)]
            try:
                dt.create_write_transaction(
                    [],
                    mode="append",
                    schema=dt.schema(),
                    partition_by=["run_id"],
                    commit_properties=CommitProperties(
                        app_transactions=[*txns, Transaction(app, version)], custom_metadata=metadata
                    ),
                )
                return version
            except failed:
                time.sleep(random.uniform(0.01, 0.2))
        raise SinkError(failure, path=self.uri)

    def committed_runs(self, candidates: set[str]) -> set[str]:
        """The run ids among `candidates` whose run commit is in the table."""
        if not candidates or not self.exists():
            return set()
        dt = self.load()
        return {r for r in candidates if dt.transaction_version(_done_app(r)) is not None}

    def run_ids(self) -> set[str]:
        """Run ids with committed rows (the table's `run_id` partitions)."""
        if not self.exists():
            return set()
        actions = pa.table(self.load().get_add_actions(flatten=True))
        if actions.num_rows == 0:
            return set()
        return {r for r in pc.unique(actions.column("partition.run_id")).to_pylist() if r is not None}

    def retire(self, fence: TableFence) -> bool:
        """Fences off `fence`'s holder itself (the output's slots move to the next generation),
        unless a newer holder took the output already; True if it did (`CommitProtocol.abort`)."""
        from deltalake import CommitProperties, Transaction

        failed = _commit_failed()
        for _ in range(20):
            dt = self.load()
            if _generation_of(dt) != fence.generation:
                return False  # a newer holder took over: the output is its, leave it be
            try:
                dt.create_write_transaction(
                    [],
                    mode="append",
                    schema=dt.schema(),
                    partition_by=["run_id"],
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(_slot_app(s), fence.generation + 1) for s in range(SLOTS)],
                        custom_metadata={"raypipe.operation": "abort", "raypipe.run_id": fence.run_id},
                    ),
                )
                return True
            except failed:
                time.sleep(random.uniform(0.01, 0.1))  # a commit of ours or a take-over: look again
        raise SinkError(f"could not abort run {fence.run_id}: the table kept changing under us", path=self.uri)

    def is_committed(self, run_id: str) -> bool:
        return self.exists() and self.load().transaction_version(_done_app(run_id)) is not None

    def mark_committed(self, fence: TableFence, metadata: dict[str, str]) -> None:
        """Records, fenced, that every unit of the run is committed (a rerun does nothing)."""
        self._fenced_commit(
            fence,
            lambda dt: (_done_app(fence.run_id), fence.generation),
            {"raypipe.operation": "run-committed", "raypipe.run_id": fence.run_id, **metadata},
            failure=f"could not record run {fence.run_id} as committed",
        )

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
        return {u for u in units if dt.transaction_version(_unit_app(run_id, u)) is not None}

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


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _replace_predicate(run_id: str, unit: str) -> str:
    """A replay's MERGE condition. The run and unit as literals let delta-rs prune the scan
    (and the files its conflict check records as read) to the unit's own file; from the source
    columns alone it infers the whole `run_id` partition, and replays of different units of
    one run would conflict with each other."""
    return (
        f"t.run_id = {_sql_string(run_id)} AND t.unit = {_sql_string(unit)} AND t.outcome = 'dead_letter' "
        "AND t.run_id = s.run_id AND t.unit = s.unit AND t.id = s.id AND t.source = s.source AND t.row = s.row"
    )


def _generation_of(dt: Any, slot: int = 0) -> int:
    return int(dt.transaction_version(_slot_app(slot)) or 0)


def _check_generation(dt: Any, fence: TableFence, slot: int) -> None:
    current = _generation_of(dt, slot)
    if current != fence.generation:
        raise LeaseLostError(
            f"run {fence.run_id}: this holder of the output (generation {fence.generation}) was fenced off by "
            f"generation {current}; it stops writing",
            holder=fence.run_id,
            expires_at="?",
        )


class UnitCommitter:
    """Commits units of one run attempt into the outcomes table (picklable: made on actors).

    Commits of one committer are serialised (one `DeltaTable` per actor, kept up to date
    incrementally); commits of several actors run side by side (see the module docstring).
    """

    def __init__(
        self,
        fence: TableFence,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fence = fence
        self._table = OutcomeTable(fence.output_uri)
        self._sleep = sleep
        self._clock = clock
        self._dt: Any = None
        self._schema: pa.Schema | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"fence": self.fence}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fence"])  # type: ignore[misc]

    def _fresh(self) -> Any:
        if self._dt is None:
            self._dt = self._table.load()
        else:
            self._dt.update_incremental()
        return self._dt

    def _conform(self, rows: pa.Table, schema: pa.Schema) -> pa.Table:
        """The rows in the table's full schema (other labels' columns null)."""
        n = rows.num_rows
        columns = [
            rows.column(f.name).cast(f.type) if f.name in rows.column_names else pa.nulls(n, f.type) for f in schema
        ]
        return pa.Table.from_arrays(columns, schema=schema)

    def commit(self, unit: str, rows: pa.Table, *, replace_dead_letters: bool = False, max_tries: int = 50) -> bool:
        """Commits one unit's rows (results and dead letters) in one Delta commit.

        With `replace_dead_letters` (a replay) the rows replace, in the same commit, the
        committed dead letters they re-inferred (same run, unit, id, source and row): each id
        is a result or a dead letter of its run, never both, never neither.

        Returns False if this generation had already committed the unit (nothing is written);
        raises `LeaseLostError` once a newer attempt took over.
        """
        from deltalake import CommitProperties, Transaction, write_deltalake

        failed = _commit_failed()
        slot = unit_slot(unit)
        run_id, generation = self.fence.run_id, self.fence.generation
        with self._lock:
            for attempt in range(max_tries):
                try:
                    dt = self._fresh()
                    _check_generation(dt, self.fence, slot)
                    if dt.transaction_version(_unit_app(run_id, unit)) is not None:
                        return False
                    if self._schema is None or attempt:
                        self._schema = pa.schema(dt.schema().to_arrow())
                    props = CommitProperties(
                        app_transactions=[
                            Transaction(_slot_app(slot), generation),
                            # Stamped, so the table's transaction retention prunes it: ~47k
                            # units per backfill would otherwise sit in every snapshot forever.
                            Transaction(_unit_app(run_id, unit), generation, last_updated=int(self._clock() * 1000)),
                        ],
                        custom_metadata={"raypipe.unit": unit, "raypipe.generation": str(generation)},
                    )
                    if rows.num_rows and replace_dead_letters:
                        conformed = self._conform(rows, self._schema)
                        (
                            dt.merge(
                                conformed,
                                predicate=_replace_predicate(conformed.column("run_id")[0].as_py(), unit),
                                source_alias="s",
                                target_alias="t",
                                commit_properties=props,
                            )
                            .when_matched_update_all()
                            .execute()
                        )
                    elif rows.num_rows:
                        write_deltalake(
                            dt,
                            self._conform(rows, self._schema),
                            mode="append",
                            partition_by=["run_id"],
                            commit_properties=props,
                        )
                    else:
                        dt.create_write_transaction(
                            [], mode="append", schema=dt.schema(), partition_by=["run_id"], commit_properties=props
                        )
                    return True
                except failed:
                    # Another commit of this slot or unit won: look again on a fresh snapshot
                    # (a newer generation there fences us off above).
                    self._sleep(random.uniform(0.005, 0.05) * min(attempt + 1, 10))
                except (LeaseLostError, SinkError):
                    raise
                except Exception as e:
                    raise _as_sink_error(e, self._table.uri) from e
        raise SinkError(f"unit {unit}: gave up after {max_tries} conflicting commits", path=self._table.uri)


def now_utc() -> datetime:
    return datetime.now(UTC)

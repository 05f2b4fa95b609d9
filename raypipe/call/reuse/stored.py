"""The stored index (`StoredIndex`): the reuse index kept beside the table, so that a run reads
it and only the files the table's log committed since, not every committed row.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.call.reuse.index import SHARD_ROWS, IndexShard
from raypipe.commit.schema import label_column
from raypipe.commit.table import OutcomeTable, storage_options
from raypipe.store import STATE_DIR

__all__ = ["INDEX_APP", "INDEX_DIR", "STORED_FILES_MAX", "Fresh", "Since", "Source", "StoredIndex", "committed_rows"]

logger = logging.getLogger("raypipe")

Source = tuple[Any, Any, Any]  # schema, format, filesystem of a dataset
Fresh = tuple[Any, int]  # the rows a shard adds to the stored index (an `IndexShard` or a Ray reference), how many

INDEX_DIR = "reuse_index"
"""The stored indexes' folder under the output's state folder (`raypipe.store.STATE_DIR`)."""

INDEX_APP = "raypipe/reuse-index/covers"
"""The stored index's application transaction: its version is the outcomes table's version the
index covers (every answer committed up to it is held)."""

STORED_FILES_MAX = 16
"""Files the stored index holds before a run compacts it into one (each update appends one)."""

#: No time travel is needed on a cache: its log entries and replaced files go at the next upkeep.
_STORED_CONFIG = {
    "delta.logRetentionDuration": "interval 0 hours",
    "delta.deletedFileRetentionDuration": "interval 0 hours",
}


@dataclass(frozen=True)
class Since:
    """What bringing the stored index up to date reads: its files, and the table's files
    committed after the version it covers."""

    held_source: Source
    held_fragments: list[Any]
    held_rows: int
    paths: list[str]
    """The table's files committed after the stored index's version and still in the table, as
    its dataset names them."""
    rows: int
    """Their rows, by the log's statistics (a bound on the answers among them)."""
    entries: int
    """The log entries read."""


class StoredIndex:
    """The reuse index kept beside the table, so that a run reads only what was committed since.

    A small Delta table under `OUTPUT/_raypipe/reuse_index/<key>/` (the key digests the outcomes
    table's id, the model version and the labels), one row per distinct text: `text_hash`,
    `truncated` and the label columns, named as in the outcomes table, each as a committed
    result of that version holds them. Its application transaction `INDEX_APP` names the
    outcomes table's version it covers. It is a cache of committed rows, never a record: it
    holds only answers read from committed rows of the table's log (a fenced-off commit never
    lands there), so it is written without the output's fence, and whatever goes wrong with it
    (lost, corrupt, behind, written by two runs at once) costs the next run a full read of the
    table or calls, never an answer (docs/guarantees.md)."""

    def __init__(self, uri: str, labels: tuple[str, ...]) -> None:
        self.uri = uri
        self.options = storage_options(uri)
        self.columns = ["text_hash", "truncated", *[label_column(x) for x in labels]]
        self._dt: Any = None  # its snapshot, once opened: one per run

    def _open(self) -> Any:
        from deltalake import DeltaTable

        if self._dt is None:
            self._dt = DeltaTable(self.uri, storage_options=self.options)
        else:
            self._dt.update_incremental()
        return self._dt

    @classmethod
    def of(cls, table: OutcomeTable, dt: Any, model_version: str, labels: tuple[str, ...]) -> StoredIndex:
        key = hashlib.sha256("\0".join([dt.metadata().id, model_version, *labels]).encode()).hexdigest()[:32]
        return cls(f"{table.output_uri}/{STATE_DIR}/{INDEX_DIR}/{key}", tuple(labels))

    def since(self, version: int, ds: Any) -> Since | None:
        """What brings it up to the table's `version` (`ds` its dataset); None when it cannot be used (none
        yet, unreadable, of another shape, ahead of the table, or the table's log since it is
        gone or holds a commit that may have dropped answers): the table is then read whole."""
        from deltalake import DeltaTable

        try:
            if not DeltaTable.is_deltatable(self.uri, storage_options=self.options):
                return None
            idt = self._open()
            covers = idt.transaction_version(INDEX_APP)
            if covers is None or covers > version or pa.schema(idt.schema().to_arrow()).names != self.columns:
                logger.warning("the stored reuse index at %s does not fit the table: reading the table whole", self.uri)
                return None
            log = _log_since(ds.filesystem, covers, version)
            if log is None:
                return None
            held_ds = idt.to_pyarrow_dataset()
            held = list(held_ds.get_fragments())
            paths, rows, entries = log
            return Since(
                held_source=(held_ds.schema, held_ds.format, held_ds.filesystem),
                held_fragments=held,
                held_rows=committed_rows(idt, len(held)),
                paths=paths,
                rows=rows,
                entries=entries,
            )
        except Exception:  # a cache: whatever is wrong with it, the full read answers
            logger.warning(
                "the stored reuse index at %s cannot be read: reading the table whole", self.uri, exc_info=True
            )
            return None

    def save(self, version: int, fresh: Sequence[Fresh], *, full: bool) -> int:
        """Adds `fresh` (or, `full`, replaces what it holds with it) as covering the table's
        `version`; the distinct texts written. A failure is logged, not raised: it costs the
        next run a longer read, not this run its answers."""
        from deltalake import CommitProperties, Transaction

        rows = sum(n for _, n in fresh)
        props = CommitProperties(
            app_transactions=[Transaction(INDEX_APP, version)],
            custom_metadata={"raypipe.operation": "reuse-index", "raypipe.covers": str(version)},
        )
        try:
            self._write(fresh, rows, props, version, full=full)
        except Exception:
            if not full:
                logger.warning(
                    "the reuse index could not be stored at %s (the next run reads more)", self.uri, exc_info=True
                )
                return 0
            # A replacement over an index that cannot be opened at all (its log corrupt): it
            # starts afresh, else every run would read the table whole from now on.
            try:
                from fsspec.core import url_to_fs

                fs, path = url_to_fs(self.uri)
                fs.rm(path, recursive=True)
                self._dt = None
                self._write(fresh, rows, props, version, full=full)
            except Exception:
                logger.warning(
                    "the reuse index could not be stored at %s (the next run reads more)", self.uri, exc_info=True
                )
                return 0
        return rows

    def _write(self, fresh: Sequence[Fresh], rows: int, props: Any, version: int, *, full: bool) -> None:
        from deltalake import DeltaTable, write_deltalake

        exists = DeltaTable.is_deltatable(self.uri, storage_options=self.options)
        if exists and not full and not rows:
            idt = self._open()
            if idt.transaction_version(INDEX_APP) == version:
                return
            idt.create_write_transaction([], mode="append", schema=idt.schema(), commit_properties=props)
        else:
            write_deltalake(
                self.uri,
                pa.RecordBatchReader.from_batches(self._schema(), self._batches(fresh)),
                mode="overwrite" if full or not exists else "append",
                storage_options=self.options,
                configuration=None if exists else _STORED_CONFIG,
                commit_properties=props,
            )
        self._upkeep(full)

    def _schema(self) -> pa.Schema:
        return pa.schema(
            [("text_hash", pa.int64()), ("truncated", pa.bool_()), *[(c, pa.float32()) for c in self.columns[2:]]]
        )

    def _batches(self, fresh: Sequence[Fresh]) -> Iterator[pa.RecordBatch]:
        """The shards' rows in hash order (the shards are in hash order, each sorted), one shard
        at a time: from Ray's object store, a shard is mapped only while it is written."""
        schema = self._schema()
        for shard, n in fresh:
            if not n:
                continue
            s = shard if isinstance(shard, IndexShard) else _get(shard)
            columns = [pa.array(s.hashes, pa.int64()), pa.array(s.truncated, pa.bool_())]
            columns += [pa.array(s.probabilities[:, k], pa.float32()) for k in range(len(self.columns) - 2)]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)

    def _upkeep(self, full: bool) -> None:
        """After a replacement, or once it holds `STORED_FILES_MAX` files: one file, one
        checkpoint, and the replaced files and log entries deleted. A run reading it meanwhile
        may find a file gone; it then reads the table whole."""
        idt = self._open()
        if not full and len(idt.file_uris()) <= STORED_FILES_MAX:
            return
        if not full:
            idt.optimize.compact()
        idt.create_checkpoint()
        idt.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
        idt.cleanup_metadata()


def _get(ref: Any) -> Any:
    import ray

    (got,) = ray.get([ref])
    return got


def _log_since(filesystem: Any, since: int, until: int) -> tuple[list[str], int, int] | None:
    """The files committed after version `since` up to `until` and still in the table (as its
    dataset names them), their rows by the log's statistics, and the entries read; None when an
    entry is gone (the log's retention) or a commit removed rows that may not come back.

    It reads the log's commit entries, Delta's documented format (`_delta_log/<version>.json`,
    one action a line), because delta-rs offers a snapshot's files and the history's commit
    infos but not the actions of one commit. Of raypipe's own commits, a unit's (an append, or a
    replay's MERGE, which rewrites dead letters only) and `compact`'s (the same rows in fewer
    files) keep every answer they remove; any other commit that removes rows (a DELETE, an
    overwrite by another tool) sends the run to the full read."""
    added: dict[str, int] = {}
    for version in range(since + 1, until + 1):
        try:
            with filesystem.open_input_stream(f"_delta_log/{version:020d}.json") as f:
                text = f.read().decode()
        except (FileNotFoundError, OSError):
            logger.info("the table's log before version %d is gone: reading the table whole", version)
            return None
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {}) or {}
        keeps_answers = info.get("raypipe.unit") is not None or info.get("raypipe.operation") == "compact"
        for action in actions:
            if (add := action.get("add")) is not None:
                if "://" in add["path"]:
                    return None  # a file outside the table (a shallow clone's): not ours to name
                stats = json.loads(add.get("stats") or "{}")
                added[unquote(add["path"])] = int(stats.get("numRecords", SHARD_ROWS // 4))
            elif (remove := action.get("remove")) is not None:
                if remove.get("dataChange", True) and not keeps_answers:
                    logger.info("version %d of the table removed rows: reading the table whole", version)
                    return None
                added.pop(unquote(remove["path"]), None)
    return list(added), sum(added.values()), until - since


def committed_rows(dt: Any, files: int) -> int:
    """Rows in the table's files (every outcome and version: a bound on the rows read), from
    the log's file statistics; without them, a guess of a quarter shard a file."""
    import pyarrow as pa

    try:
        counts = pa.chunked_array(dt.get_add_actions(flatten=True).column("num_records"))
        total = pc.sum(counts).as_py()
        if total is not None and counts.null_count == 0:
            return int(total)
    except Exception:  # stats are optional in Delta: size by files then
        logger.debug("no row counts in the table's log", exc_info=True)
    return files * SHARD_ROWS // 4

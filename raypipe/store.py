"""The output location's layout and the atomic file operations everything else uses.

    OUTPUT/
      outcomes/                                   the Delta table: results and dead letters (raypipe.commit.table)
      runs/<run_id>.json                          the run report
      _raypipe/lease.json                         who runs here now (raypipe.commit.lease; liveness only)
      _raypipe/files_seen/<n>.parquet             files read whole: deltas over a full copy; the table names the last
      _raypipe/quarantine/<n>.json                shards set aside (raypipe.commit.upkeep); the table names n
      _raypipe/reuse_index/<key>/                 the reuse index and the table version it covers (call.reuse)
      _raypipe/runs/<run_id>/plan/<n>.json        the run's units; the table names the current n
      _raypipe/runs/<run_id>/attempts/<a>.json    each attempt's call statistics
      _raypipe/runs/<run_id>/attempts/<a>/actors/*.json   its actors' call tallies (raypipe.tally)
                                                  (a run's folder goes once its completed report is written)

Whether a run or a unit is committed is the table's to say, never a file's (`raypipe.commit.protocol`).
The daily watermark (what the input was read as of; informational) is an app transaction of
the table itself. An earlier release's `results/`, `dead_letters/`, `plan.json`,
`files_seen.parquet`, `quarantine.json`, `watermark.json` and `COMMITTED.json` are still read
(`raypipe migrate`, and where the table names nothing).

Every write is atomic: a local file is written beside its target and renamed over it; an S3
object appears whole when its PUT (or multipart upload) completes. Folders starting with `_`
are skipped by Hive, Spark, Athena and DuckDB globs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from raypipe.config.sections import output_uri
from raypipe.errors import SinkError

__all__ = ["OutputStore"]

STATE_DIR = "_raypipe"
QUARANTINE = "quarantine.json"
"""An earlier release's quarantine file under the state folder (read where the table names none)."""


class OutputStore:
    """Paths and atomic reads/writes under one output URI (local or S3)."""

    def __init__(self, uri: str) -> None:
        self.uri = output_uri(uri).rstrip("/")
        fs, root = url_to_fs(self.uri)
        self._fs: fsspec.AbstractFileSystem | None = fs
        self._root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.is_local = protocol in ("file", "local")

    # An fsspec filesystem holds sockets and threads, so it is made where it is used, not
    # pickled into Ray workers with the store.
    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["uri"])  # type: ignore[misc]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            self._fs, _ = url_to_fs(self.uri)
        return self._fs

    def path(self, *parts: str) -> str:
        return posixpath.join(self._root, *parts)

    def full_uri(self, path: str) -> str:
        return path if self.is_local else f"s3://{path}"

    # -- layout ------------------------------------------------------------------------------
    def results_file(self, run_id: str, name: str) -> str:
        return self.path("results", f"run={run_id}", f"{name}.parquet")

    def dead_letter_file(self, run_id: str, name: str) -> str:
        return self.path("dead_letters", f"run={run_id}", f"{name}.parquet")

    def report_file(self, run_id: str) -> str:
        return self.path("runs", f"{run_id}.json")

    def run_state(self, run_id: str, *parts: str) -> str:
        return self.path(STATE_DIR, "runs", run_id, *parts)

    def state(self, *parts: str) -> str:
        return self.path(STATE_DIR, *parts)

    # -- atomic operations -------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except OSError as e:
            raise SinkError(f"cannot write: {e}", path=self.full_uri(path)) from e

    def write_json(self, path: str, data: Any) -> None:
        self.write_bytes(path, json.dumps(data, indent=1, sort_keys=True, default=str).encode())

    def write_parquet(self, path: str, table: pa.Table) -> None:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        self.write_bytes(path, buf.getvalue())

    def read_bytes(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    def read_json_or_none(self, path: str) -> Any:
        try:
            return self.read_json(path)
        except FileNotFoundError:
            return None

    def read_parquet(self, path: str, columns: list[str] | None = None) -> pa.Table:
        with self.fs.open(path, "rb") as f:
            return pq.read_table(f, columns=columns)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def list_files(self, folder: str, suffix: str = "") -> list[str]:
        """Files directly in folder (sorted), or [] if it does not exist."""
        try:
            self.fs.invalidate_cache(folder)
            entries = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e for e in entries if e.endswith(suffix) and ".tmp-" not in posixpath.basename(e))

    def read_many_json(self, paths: list[str]) -> Iterator[tuple[str, Any]]:
        """Reads many small JSON files, concurrently where the filesystem can (S3)."""
        if not paths:
            return
        contents = self.fs.cat(paths, on_error="omit")
        for path in paths:
            key = path if path in contents else self.fs._strip_protocol(path)
            if key in contents:
                yield path, json.loads(contents[key])

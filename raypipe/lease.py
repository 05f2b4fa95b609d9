"""The output lease: at most one run writes to an output location at a time.

`_raypipe/lease.json` names the holder (run id, host, pid, a random token) and when the
lease expires. A run creates it exclusively (S3 `If-None-Match: *`; `O_EXCL` locally),
renews it from a heartbeat thread, and deletes it at the end. Another run id finding a live
lease is refused with `OutputLockedError`, naming the holder; an expired lease (its holder
died without cleaning up) is taken over with a conditional replace (S3 `If-Match` on the
ETag), so two runs racing for it cannot both win. A new attempt of the *same* run id may take
over a live lease at once: that is how a killed run is resumed without waiting out the lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from raypipe.errors import OutputLockedError, SinkError
from raypipe.store import OutputStore

__all__ = ["Lease"]

logger = logging.getLogger("raypipe")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


class Lease:
    def __init__(
        self, store: OutputStore, holder: str, *, duration_s: float = 120.0, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._path = store.state("lease.json")
        self.holder = holder
        self.duration_s = duration_s
        self._clock = clock
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps(
            {
                "holder": self.holder,
                "token": self._token,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "expires_at": self._clock() + self.duration_s,
                "expires_at_iso": _iso(self._clock() + self.duration_s),
            }
        ).encode()

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The current lease and its version tag (ETag on S3, mtime locally)."""
        try:
            info = self._store.fs.info(self._path)
            data = json.loads(self._store.read_bytes(self._path))
        except FileNotFoundError:
            return None, None
        tag = info.get("ETag") or str(info.get("mtime") or info.get("LastModified"))
        return data, tag

    def _create(self) -> bool:
        if self._store.is_local:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            try:
                fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(self._record())
            return True
        try:
            self._store.fs.pipe_file(self._path, self._record(), mode="create")
        except FileExistsError:
            return False
        return True

    def _replace(self, tag: str | None) -> bool:
        """Overwrites the lease only if it is still the version we read."""
        if self._store.is_local:
            _, now_tag = self._read()
            if now_tag != tag:
                return False
            self._store.write_bytes(self._path, self._record())
            return True
        bucket, _, key = self._path.partition("/")
        try:
            self._store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=self._record(), IfMatch=tag)
        except OSError:
            return False
        self._store.fs.invalidate_cache(self._path)
        return True

    def acquire(self) -> None:
        """Takes the lease or raises OutputLockedError; then keeps it alive until `release`."""
        if not self._create():
            current, tag = self._read()
            if current is None:  # released between our two looks
                if not self._create():
                    raise OutputLockedError(
                        "the output lease changed hands while taking it", holder="?", expires_at="?"
                    )
            else:
                expired = float(current.get("expires_at", 0)) < self._clock()
                same_run = current.get("holder") == self.holder
                if not (expired or same_run):
                    raise OutputLockedError(
                        f"output {self._store.uri} is being written by run {current.get('holder')!r} "
                        f"(host {current.get('host')}, pid {current.get('pid')}) until "
                        f"{current.get('expires_at_iso')} unless renewed; wait for it, or use another output",
                        holder=str(current.get("holder")),
                        expires_at=str(current.get("expires_at_iso")),
                    )
                if same_run and not expired:
                    logger.warning("taking over the live lease of an earlier attempt of run %s", self.holder)
                if not self._replace(tag):
                    raise OutputLockedError(
                        "another run took the output lease at the same moment",
                        holder="?",
                        expires_at="?",
                    )
        self._thread = threading.Thread(target=self._heartbeat, name="raypipe-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.duration_s / 3):
            try:
                current, tag = self._read()
                if current is None or current.get("token") != self._token:
                    logger.error("lost the output lease to %s", None if current is None else current.get("holder"))
                    return
                self._replace(tag)
            except (OSError, SinkError) as e:  # a blip: the next beat tries again
                logger.warning("could not renew the output lease: %s", e)

    def held(self) -> bool:
        current, _ = self._read()
        return current is not None and current.get("token") == self._token

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.held():
            self._store.delete(self._path)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

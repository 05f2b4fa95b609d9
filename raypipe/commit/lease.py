"""The output lease: liveness, one run id at a time per output. It fences nothing.

`_raypipe/lease.json` names the holder (run id, host, pid, a random token), its *generation*
and when it expires. A run creates it exclusively (S3 `If-None-Match: *`; locally under an
`flock` of `lease.json.lock`), renews it from a heartbeat thread, and deletes it at the end.

- Another run id finding a live lease is refused with `OutputLockedError`, naming the holder.
- A holder on this machine whose process is gone (a SIGKILLed driver, resumed on the same host)
  is dead whatever its lease says: its lease is taken over at once, as an expired one. The
  record names the holder's process by host, boot, pid namespace, pid and the process's start
  time, so a pid reused by another process, or the same pid in another container, is not
  taken for it.
- An expired lease (its holder died) is taken over with a conditional replace (S3 `If-Match`
  on the ETag; locally a compare-and-swap under `flock`), so two takers racing cannot both
  win. Each takeover increments the generation.
- A new attempt of the *same* run id (a retried RayJob, a re-submit) waits for the live lease
  to expire, then takes it over; `force=True` (CLI `--force`) takes it at once. An earlier
  attempt that keeps renewing is waited for at most `wait_s` (`output.lease_wait_s`), then
  `OutputLockedError` names it (host, pid, last renewal) and the way to take over. The driver
  calls `check()` before its writes of run state, and the heartbeat sets `lost` when the
  lease is gone, so a superseded driver stops at its next step. That is a courtesy, not the
  fence: a check passes and a write lands later. The fence is the table's
  (`raypipe.commit.protocol`).
- Where the lease itself cannot be trusted it refuses to start: an S3 endpoint that ignores
  conditional writes (probed at start: a second create-only PUT of the same key must fail)
  raises `UnsafeOutputError` unless the operator opts out; a 403 raises
  `OutputPermissionError`, never "another run took the lease".
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

from raypipe.commit.conditional import ConditionalFile, check_conditional_writes
from raypipe.commit.holder import holder_is_gone, process_identity
from raypipe.errors import LeaseLostError, OutputLockedError
from raypipe.store import OutputStore

__all__ = ["Lease"]

logger = logging.getLogger("raypipe")

LEASE_FILE = "lease.json"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


class Lease:
    """The output's lease for one attempt of run `holder`: `acquire`, a heartbeat that renews
    it, `check` before the driver's writes of run state, `release` at the end; `expire` for an
    operator who declares the holder dead. Liveness only: the module docstring says why."""

    def __init__(
        self,
        store: OutputStore,
        holder: str,
        *,
        duration_s: float = 120.0,
        wait_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._store = store
        self._file = ConditionalFile(store, store.state(LEASE_FILE), "the output lease")
        self.holder = holder
        self.duration_s = duration_s
        self.wait_s = wait_s
        self._clock = clock
        self._sleep = sleep
        self._token = uuid.uuid4().hex
        self._me = process_identity(os.getpid())
        self.generation = 0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        expires = self._clock() + self.duration_s
        return json.dumps(
            {
                "holder": self.holder,
                "token": self._token,
                "generation": self.generation,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "process": self._me,
                "expires_at": expires,
                "expires_at_iso": _iso(expires),
                "duration_s": self.duration_s,
            }
        ).encode()

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The current lease and its version tag."""
        raw, tag = self._file.read()
        return (None, None) if raw is None else (json.loads(raw), tag)

    def _create(self) -> bool:
        self.generation = 1
        return self._file.create(self._record())

    def _replace(self, tag: str | None, generation: int, body: bytes | None = None) -> bool:
        """Overwrites the lease (with our record, or `body`) only if it is still the version we read."""
        self.generation = generation
        return self._file.replace(tag, body or self._record())

    def check_conditional_writes(self) -> None:
        """Refuses an S3 endpoint that ignores `If-None-Match` (the lease could not exclude anyone)."""
        check_conditional_writes(self._store)

    def acquire(self, *, force: bool = False) -> None:
        """Takes the lease, or raises `OutputLockedError`; then keeps it alive until `release`.

        A live lease of the same run id is waited out (its holder may still be writing) for at
        most `wait_s`, or taken at once with `force`; a live lease of another run id is refused.
        """
        waiting_since: float | None = None
        while not self._create():
            current, tag = self._read()
            if current is None:
                continue  # released between our two looks: try to create it again
            now = self._clock()
            expires = float(current.get("expires_at", 0))
            same_run = current.get("holder") == self.holder
            if expires >= now and holder_is_gone(current):
                logger.warning(
                    "the output lease's holder, run %s (generation %s, pid %s on this host), is no longer running: "
                    "taking its lease over now",
                    current.get("holder"),
                    current.get("generation"),
                    current.get("pid"),
                )
                expires = now - 1
            if expires >= now and not same_run:
                raise OutputLockedError(
                    f"output {self._store.uri} is being written by run {current.get('holder')!r} "
                    f"(host {current.get('host')}, pid {current.get('pid')}) until "
                    f"{current.get('expires_at_iso')} unless renewed; wait for it, or use another output",
                    holder=str(current.get("holder")),
                    expires_at=str(current.get("expires_at_iso")),
                )
            if expires >= now and not force:
                wait = min(expires - now + 0.5, self.duration_s / 4)
                renewed_at = expires - float(current.get("duration_s", self.duration_s))
                renewed_ago = now - renewed_at
                waiting_since = now if waiting_since is None else waiting_since
                waited = now - waiting_since
                if waited >= self.wait_s:
                    raise OutputLockedError(
                        f"output {self._store.uri}: an earlier attempt of run {self.holder} (generation "
                        f"{current.get('generation')}, host {current.get('host')}, pid {current.get('pid')}) still "
                        f"renews its lease, last at {_iso(renewed_at)} ({max(renewed_ago, 0.0):.0f} s ago); gave up "
                        f"after waiting {waited:.0f} s (output.lease_wait_s). Let it finish, or take the run over "
                        "now, fencing that attempt off: rerun with --force",
                        holder=str(current.get("holder")),
                        expires_at=str(current.get("expires_at_iso")),
                    )
                wait = min(wait, self.wait_s - waited)
                logger.warning(
                    "waiting %.0f s for the output lease: an earlier attempt of run %s (generation %s, host %s, "
                    "pid %s) renewed it %.0f s ago and holds it until %s. If that attempt is alive (a driver still "
                    "running, a RayJob retrying) it keeps renewing and this one keeps waiting; if it is dead (a "
                    "killed driver, a deleted pod), the lease lapses by itself, or end the wait now with "
                    "`raypipe lease expire --output %s` (or rerun with --force). Either way the table fences the "
                    "earlier attempt off: nothing it still writes becomes visible.",
                    max(expires - now, 0.0),
                    self.holder,
                    current.get("generation"),
                    current.get("host"),
                    current.get("pid"),
                    max(renewed_ago, 0.0),
                    current.get("expires_at_iso"),
                    self._store.uri,
                )
                self._sleep(wait)
                continue
            if same_run:
                logger.warning(
                    "taking over the lease of run %s from generation %s: that attempt is fenced off",
                    self.holder,
                    current.get("generation"),
                )
            if self._replace(tag, int(current.get("generation", 0)) + 1):
                break
            # Somebody else replaced it first: look again (they hold it now, or it moved on).
        self._thread = threading.Thread(target=self._heartbeat, name="raypipe-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        """Renews the lease every third of its duration (`renew`) until it is released or lost."""
        renewed_at = self._clock()
        while not self._stop.wait(self.duration_s / 3):
            renewed_at = self.renew(renewed_at)
            if self.lost:
                return

    def renew(self, renewed_at: float) -> float:
        """One renewal; returns when the lease was last renewed (now, or `renewed_at` if this
        one failed). Any failure to renew (a store that is down raises whatever its client
        raises: botocore's `EndpointConnectionError` is no `OSError`) counts as a missed
        renewal; once the lease would have expired without one, or another attempt holds it,
        this attempt has lost it (`lost`), and the driver stops at its next step."""
        try:
            current, tag = self._read()
            if current is None or current.get("token") != self._token:
                self.lost = True
                logger.error(
                    "lost the output lease to %s (generation %s): stopping",
                    None if current is None else current.get("holder"),
                    None if current is None else current.get("generation"),
                )
                return renewed_at
            if self._replace(tag, self.generation):
                return self._clock()
            failure = "the lease changed under us"
        except Exception as e:  # any store error is a missed renewal
            failure = f"{type(e).__name__}: {e}"
        if self._clock() >= renewed_at + self.duration_s:
            self.lost = True
            logger.error("could not renew the output lease before it expired (%s): stopping", failure)
        else:
            logger.warning("could not renew the output lease (%s); retrying", failure)
        return renewed_at

    def check(self) -> None:
        """Raises `LeaseLostError` if another attempt took the lease, or it could not be renewed
        in time: a courtesy before the driver's writes of run state (the fence is the table's)."""
        current = None if self.lost else self._read()[0]
        if current is not None and current.get("token") == self._token:
            return
        self.lost = True
        holder = "nobody" if current is None else f"generation {current.get('generation')} ({current.get('host')})"
        raise LeaseLostError(
            f"run {self.holder} (generation {self.generation}) lost the output lease of {self._store.uri} to "
            f"{holder}; it stops writing",
            holder=str(None if current is None else current.get("holder")),
            expires_at=str(None if current is None else current.get("expires_at_iso")),
        )

    def current(self) -> dict[str, Any] | None:
        """The lease record as stored (None: nobody holds the output)."""
        return self._read()[0]

    def expire(self, *, run_id: str | None = None) -> dict[str, Any] | None:
        """Declares the current holder dead: the lease is expired at once, with a token no
        attempt holds, so a waiting attempt takes over now and a holder that was alive after
        all loses it at its next renewal. Returns the record it expired (None: no lease).

        Safe for the data whatever the holder's state: writes are fenced by the outcomes
        table's generation, which the next attempt raises when it takes over.
        """
        while True:
            current, tag = self._read()
            if current is None:
                return None
            if run_id is not None and current.get("holder") != run_id:
                raise OutputLockedError(
                    f"the lease of {self._store.uri} is held by run {current.get('holder')!r}, not {run_id!r}",
                    holder=str(current.get("holder")),
                    expires_at=str(current.get("expires_at_iso")),
                )
            now = self._clock()
            body = {
                **current,
                "token": f"expired-by-operator-{uuid.uuid4().hex[:8]}",
                "expires_at": now - 1,
                "expires_at_iso": _iso(now - 1),
                "expired_by": {"host": socket.gethostname(), "pid": os.getpid(), "at": _iso(now)},
            }
            if self._replace(tag, int(current.get("generation", 0)), json.dumps(body).encode()):
                return dict(current)

    def held(self) -> bool:
        current, _ = self._read()
        return current is not None and current.get("token") == self._token

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._file.local_lock():
            if self.held():
                self._store.delete(self._file.path)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

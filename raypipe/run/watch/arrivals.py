"""Where a watcher learns what arrived: a listing of the input, or S3 event notifications.

    ListingArrivals     lists the input (`raypipe.plan.listing.list_input`) at every look: each
                        shard with its fingerprint, size and when it was last written
    EventArrivals       reads S3 ObjectCreated notifications from an SQS queue
                        (`raypipe.plan.events.SqsArrivals`), so a look costs no listing; each
                        event's file is looked up (`info`) for its fingerprint

Both answer `look()` with every input file they know of now (`Listed`); the watcher keeps those
it has not committed in their present version (`raypipe.run.watch.watcher`), so a file is
picked up whichever way it was seen. `settle(uris)` tells a source which files are committed
(the event source deletes their messages then, so an event is never lost to a crash).

A look of the event source can wait for an arrival (`look(wait_s, stop)`: one long poll of the
queue, up to SQS's 20 s), so the watcher spends its pause between ticks inside the look rather
than asleep: a quiet tick is one blocking call, and an arrival ends the wait at once. A
listing cannot wait (`max_look_wait_s` 0): the watcher sleeps between its looks.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from raypipe.config import InputConfig
from raypipe.errors import NoShardsError
from raypipe.plan.listing import filesystem, fingerprint, list_input, modified_at
from raypipe.plan.units import ShardFormat

__all__ = ["ArrivalSource", "EventArrivals", "Listed", "ListingArrivals"]

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class Listed:
    """An input file as a look found it."""

    uri: str
    format: ShardFormat
    fingerprint: str
    size: int | None
    arrived_at: datetime


_STOP_CHECK_S = 0.25
"""How often a look waiting on the queue checks its stop: a thread's wait cannot be woken by
two events at once, and a stop must not wait for SQS's answer (up to 20 s)."""


class ArrivalSource(Protocol):
    """What a watcher asks of where arrivals come from."""

    max_look_wait_s: float
    """The longest one look can wait for an arrival (0: a look cannot wait, the watcher sleeps)."""

    def look(self, wait_s: float = 0, stop: threading.Event | None = None) -> list[Listed]:
        """The input files this look found (all of them for a listing; the new ones for events),
        waiting up to `wait_s` (at most `max_look_wait_s`) for one when none is there yet; a
        `stop` set meanwhile ends the wait with nothing found."""
        ...

    def settle(self, uris: Sequence[str]) -> None:
        """`uris` are committed (or set aside): their notifications may go."""
        ...


class ListingArrivals:
    """One listing of the input per look; an input with no shard yet is an empty look."""

    max_look_wait_s = 0.0

    def __init__(self, input: InputConfig, quarantined: frozenset[str] = frozenset()) -> None:
        self.input = input
        self.quarantined = quarantined
        self._said_empty = False

    def look(self, wait_s: float = 0, stop: threading.Event | None = None) -> list[Listed]:
        try:
            listing = list_input(self.input.uri, format=self.input.format, quarantined=self.quarantined)
        except NoShardsError as e:
            if not self._said_empty:
                logger.info("watch: %s; waiting for files to arrive", e)
                self._said_empty = True
            return []
        self._said_empty = False
        now = datetime.now(UTC)
        return [
            Listed(
                uri,
                fmt,
                listing.fingerprints[uri],
                listing.sizes.get(uri),
                listing.modified.get(uri, now),
            )
            for uri, fmt in listing.shards
        ]

    def settle(self, uris: Sequence[str]) -> None:
        return None


_FORMATS: dict[str, ShardFormat] = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


class EventArrivals:
    """Arrivals from S3 event notifications (an SQS queue, `watch.events_queue`).

    The first look lists the input once (files that arrived while no watcher ran have had
    their notifications consumed or expired); every later one reads only the queue. An event
    for a key outside the input, hidden (`_x`, `.x`) or of an unknown extension is ignored
    (and deleted); a file's fingerprint comes from one `info` of it, its arrival time from the
    event. Messages are deleted once their file is committed (`settle`), so a watcher killed
    before that sees them again after the queue's visibility timeout.

    A look that may wait long-polls the queue (`SqsArrivals.poll(wait_s=...)`) in a thread of
    its own while the caller watches `stop`: at a stop the look returns at once, and whatever
    that poll still receives is never acked, so it comes back after the visibility timeout."""

    max_look_wait_s = 20.0
    """SQS's longest long poll."""

    def __init__(
        self,
        input: InputConfig,
        queue: Any,
        *,
        quarantined: frozenset[str] = frozenset(),
    ) -> None:
        self.input = input
        self.queue = queue
        """A `raypipe.plan.events.SqsArrivals` (or a fake with its `poll` and `ack`)."""
        self.listing = ListingArrivals(input, quarantined)
        self.quarantined = quarantined
        self._listed = False
        self._unsettled: dict[str, list[Any]] = {}

    def look(self, wait_s: float = 0, stop: threading.Event | None = None) -> list[Listed]:
        found: list[Listed] = []
        if not self._listed:
            found = self.listing.look()
            self._listed = True
        ignored = []
        for arrival in self._poll(min(wait_s, self.max_look_wait_s), stop):
            listed = self._listed_of(arrival)
            if listed is None:
                ignored.append(arrival)
                continue
            self._unsettled.setdefault(listed.uri, []).append(arrival)
            found.append(listed)
        if ignored:
            self.queue.ack(ignored)
        return found

    def _poll(self, wait_s: float, stop: threading.Event | None) -> list[Any]:
        """The queue's arrivals, waiting up to `wait_s` for one; [] at once if `stop` is set meanwhile."""
        if wait_s <= 0 or stop is None:
            return list(self.queue.poll(wait_s=wait_s))
        answer: Future[list[Any]] = Future()

        def poll() -> None:
            try:
                answer.set_result(list(self.queue.poll(wait_s=wait_s)))
            except BaseException as e:
                answer.set_exception(e)

        # a daemon: a poll abandoned at a stop must not hold the process's exit for its answer
        threading.Thread(target=poll, name="raypipe-events-poll", daemon=True).start()
        while not wait_for([answer], timeout=_STOP_CHECK_S).done:
            if stop.is_set():
                return []
        return answer.result()

    def _listed_of(self, arrival: Any) -> Listed | None:
        uri = str(arrival.uri)
        if not _under(uri, self.input.uri) or uri in self.quarantined:
            return None
        name = posixpath.basename(uri)
        if name.startswith((".", "_")):
            return None
        fmt: ShardFormat | None = (
            self.input.format if self.input.format != "auto" else _FORMATS.get(posixpath.splitext(name.lower())[1])
        )
        if fmt is None:
            return None
        fs, path = filesystem(uri)
        # s3fs answers `info` from its cached listing of the folder when it has one (the first
        # look's): a file announced since is not in it, and would be taken for deleted
        fs.invalidate_cache(path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None  # deleted since it was written: nothing to read
        when = arrival.arrived_at or modified_at(info) or datetime.now(UTC)
        size = info.get("size") if isinstance(info.get("size"), int) else arrival.size
        return Listed(uri, fmt, fingerprint(info), size, when)

    def settle(self, uris: Sequence[str]) -> None:
        done = [a for uri in uris for a in self._unsettled.pop(uri, [])]
        if done:
            self.queue.ack(done)


def _under(uri: str, input_uri: str) -> bool:
    """Is `uri` a file of the input `input_uri` (a file, a folder, or a glob)?"""
    if any(ch in input_uri for ch in "*?["):
        return fnmatch.fnmatchcase(uri, input_uri)
    base = input_uri.rstrip("/")
    return uri == base or uri.startswith(base + "/")

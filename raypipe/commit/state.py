"""The state beside the outcomes table: small immutable files, each under a number no other
writer uses, that the table's app transactions name (`raypipe.commit.table`: `FILES_SEEN_APP`,
`QUARANTINE_APP`, `WATERMARK_APP`): a file is current only once a fenced commit names it
(`raypipe.commit.fence.set_pointer`, driven by `raypipe.commit.protocol`). This module is their
formats: how each is written, read back, and, for the files seen, stacked.

- **Files seen**: input file URI -> (fingerprint, the latest `updated_at` read in it). A new
  file holds only the entries a run adds or updates and names the file it builds on, so a daily
  writes what it read, not the history; every `FILES_SEEN_CHAIN` files the new one is a full
  copy instead, and the files it replaces are dropped once the table names it.
- **Quarantine**: shard -> reason and when, a whole copy per change.
- **Watermark**: an instant in microseconds, the app transaction's version itself (no file).

An earlier release's `files_seen.parquet`, `quarantine.json` and `watermark.json` are read where
the table names nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa

from raypipe.errors import SinkError
from raypipe.store import QUARANTINE, OutputStore

__all__ = [
    "FILES_SEEN_CHAIN",
    "FILES_SEEN_DIR",
    "LEGACY_FILES_SEEN",
    "FilesSeen",
    "FilesSeenWrite",
    "changes",
    "drop_files_seen",
    "fresh_number",
    "read_files_seen",
    "read_quarantine",
    "read_watermark",
    "watermark_micros",
    "write_files_seen",
    "write_quarantine",
]

FilesSeen = dict[str, tuple[str, str | None]]
"""Input file URI -> (fingerprint, the latest `updated_at` read in it, ISO, if known)."""

FILES_SEEN_DIR = "files_seen"
FILES_SEEN_CHAIN = 16
"""Files-seen deltas stacked on a full copy before the next write is a full copy again."""
_BASE = b"raypipe.base"
LEGACY_FILES_SEEN = "files_seen.parquet"
WATERMARK = "watermark.json"
"""An earlier release's watermark file (read where the table holds no `WATERMARK_APP`)."""
QUARANTINE_DIR = "quarantine"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def fresh_number() -> int:
    """A state file's number: random, so no two writers (a zombie included) share a file name."""
    return secrets.randbits(62) + 1


@dataclass
class FilesSeenWrite:
    number: int
    """The new file's number (the pointer's next value)."""
    changed: FilesSeen
    """The entries it adds or updates."""
    replaced: list[int]
    """Files it makes unneeded (a full copy replaces its chain): drop them once the table names it."""


def write_files_seen(
    store: OutputStore, current: int | None, done: dict[str, str], latest: dict[str, str]
) -> FilesSeenWrite:
    """Writes the files-seen file over `current` (the number the table names) with the files
    `done` (file -> fingerprint) and their latest `updated_at` read (`latest`): only what
    changes, naming `current` as its base, or a full copy every `FILES_SEEN_CHAIN` files."""
    chain = _files_seen_chain(store, current)
    seen = _merged(chain)
    changed = changes(done, latest, seen)
    seen.update(changed)
    full = current is None or len(chain) >= FILES_SEEN_CHAIN
    entries = seen if full else changed
    files = sorted(entries)
    number = fresh_number()
    table = pa.table(
        {
            "path": files,
            "fingerprint": [entries[f][0] for f in files],
            "max_updated_at": pa.array([entries[f][1] for f in files], pa.string()),
        }
    )
    if not full:
        table = table.replace_schema_metadata({_BASE: str(current).encode()})
    store.write_parquet(store.state(FILES_SEEN_DIR, f"{number}.parquet"), table)
    return FilesSeenWrite(number, changed, [n for n, _ in chain] if full else [])


def drop_files_seen(store: OutputStore, numbers: list[int]) -> None:
    """Deletes files-seen files no pointer names (the run holding the output alone reads them)."""
    for number in numbers:
        store.delete(store.state(FILES_SEEN_DIR, f"{number}.parquet"))


def write_quarantine(
    store: OutputStore, current: int | None, shards: list[str], *, reason: str, release: bool
) -> tuple[int, dict[str, dict[str, str]]]:
    """Writes the quarantine over `current` with `shards` added (or with `release`, removed);
    returns its number and what it holds."""
    state = read_quarantine(store, current)
    for shard in shards:
        if release:
            state.pop(shard, None)
        else:
            state[shard] = {"reason": reason, "at": datetime.now(UTC).isoformat()}
    number = fresh_number()
    store.write_json(store.state(QUARANTINE_DIR, f"{number}.json"), {"shards": state})
    return number, state


def read_watermark(store: OutputStore, micros: int | None) -> datetime | None:
    """The watermark the table's `WATERMARK_APP` holds (`micros`), else an earlier release's file."""
    if micros is not None:
        return _EPOCH + timedelta(microseconds=micros)
    mark = store.read_json_or_none(store.state(WATERMARK))
    return None if not mark else datetime.fromisoformat(mark["updated_at"])


def watermark_micros(at: datetime) -> int:
    """`at` as the watermark's app-transaction version."""
    return (at - _EPOCH) // timedelta(microseconds=1)


def read_quarantine(store: OutputStore, number: int | None) -> dict[str, dict[str, str]]:
    """The quarantine numbered `number` (the table's `QUARANTINE_APP`): shard -> reason and
    when; with None, the `quarantine.json` an earlier release kept, if any."""
    path = store.state(QUARANTINE) if number is None else store.state(QUARANTINE_DIR, f"{number}.json")
    data = store.read_json_or_none(path)
    if data is None and number is not None:
        raise SinkError(f"the quarantine the table names is missing: {path}", path=path)
    return dict((data or {}).get("shards", {}))


def read_files_seen(store: OutputStore, number: int | None) -> FilesSeen:
    """The files-seen state numbered `number` (the table's `FILES_SEEN_APP`): that file's
    entries over those of the file it builds on, and so on down to a full copy (a file naming
    no base); with None, the one an earlier release kept as `_raypipe/files_seen.parquet`."""
    if number is None:
        path = store.state(LEGACY_FILES_SEEN)
        return _entries(store.read_parquet(path)) if store.exists(path) else {}
    return _merged(_files_seen_chain(store, number))


def _files_seen_chain(store: OutputStore, number: int | None) -> list[tuple[int, pa.Table]]:
    """The files-seen files from `number` down to its full copy, newest first ([] for None)."""
    chain: list[tuple[int, pa.Table]] = []
    while number is not None:
        path = store.state(FILES_SEEN_DIR, f"{number}.parquet")
        if not store.exists(path):
            raise SinkError(f"the files-seen state the table names is missing: {path}", path=path)
        t = store.read_parquet(path)
        chain.append((number, t))
        base = (t.schema.metadata or {}).get(_BASE)
        number = None if base is None else int(base)
    return chain


def _merged(chain: list[tuple[int, pa.Table]]) -> FilesSeen:
    seen: FilesSeen = {}
    for _, t in reversed(chain):
        seen.update(_entries(t))
    return seen


def _entries(t: pa.Table) -> FilesSeen:
    latest = t.column("max_updated_at").to_pylist() if "max_updated_at" in t.column_names else [None] * t.num_rows
    return {
        p: (fp, m)
        for p, fp, m in zip(t.column("path").to_pylist(), t.column("fingerprint").to_pylist(), latest, strict=True)
    }


def changes(done: dict[str, str], latest: dict[str, str], seen: FilesSeen) -> FilesSeen:
    """The files-seen entries `done` (file -> fingerprint) adds or updates in `seen`."""
    out: FilesSeen = {}
    for shard, fingerprint in done.items():
        value = (fingerprint, _later(latest.get(shard), seen.get(shard, (None, None))[1]))
        if seen.get(shard) != value:
            out[shard] = value
    return out


def _later(a: str | None, b: str | None) -> str | None:
    return max((x for x in (a, b) if x is not None), default=None)

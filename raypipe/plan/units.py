"""The vocabulary of planning: a shard's format, the input's column names, a daily's window,
and the work unit.

A **work unit** is a contiguous row range of one shard (whole Parquet row groups where they
are small enough; a whole JSON-lines file, or a byte range of its lines where it is large), of
at most `input.unit_rows` rows and about `input.unit_bytes` bytes. It is the grain of everything that must be
exact: a unit is read as one block (`raypipe.run.read`), inferred, and committed with its
results and dead letters in one step (`raypipe.commit.table`), so a resumed run skips
committed units and redoes only the ones that were in flight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import re
import unicodedata
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["ColumnNames", "DeltaWindow", "ShardFormat", "WorkUnit"]


ShardFormat = Literal["parquet", "jsonl", "dead_letters"]


@dataclass(frozen=True)
class ColumnNames:
    id: str = "id"
    text: str = "text"
    updated_at: str = "updated_at"


@dataclass(frozen=True)
class DeltaWindow:
    """Selects rows with `after <= updated_at <= until`: a daily `--since`'s re-read of an
    unchanged file (a unit with its own `since`).

    A window only ever adds reads: new and changed files are read whole, whatever their
    rows' `updated_at`, and a file no run changed was read whole before. `after` is
    inclusive (a batch export stamps every row with one time). Rows whose `updated_at` is
    null are never in a window: they were read with their file. (A JSON-lines line that is
    not an object and names no time is in every window: its dead letter is recorded each
    time its file is read, `raypipe.run.read`.)
    """

    after: datetime | None
    until: datetime

    @classmethod
    def since(cls, after: datetime) -> DeltaWindow:
        """Every row updated at or after `after` (a daily's `--since`)."""
        return cls(after, datetime(9999, 12, 31, tzinfo=UTC))

    def may_hold(self, lo: datetime | None, hi: datetime | None) -> bool:
        """Can a row group whose updated_at spans [lo, hi] hold rows of the window?"""
        if lo is None or hi is None:
            return True  # no statistics: read it
        if lo > self.until:
            return False
        return self.after is None or hi >= self.after


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
    """Only rows updated at or after this instant (ISO; a daily's `--since` over unchanged files)."""
    byte_start: int | None = None
    """JSON lines cut by bytes: the unit's lines start at this byte (None: the whole file)."""
    byte_stop: int | None = None
    """JSON lines cut by bytes: the unit's lines end before this byte."""

    @property
    def key(self) -> str:
        """Stable identity: the same unit always gets the same key, and units of a run never
        share one. ASCII of at most `KEY_MAX_BYTES` (delta-rs cuts string statistics at 64
        bytes, and a resume lists its committed units from them): the shard's name folded to
        ASCII and shortened, the first row, and a digest of the shard, its row range and the
        version it was planned at (a file re-planned after a rewrite gets new keys)."""
        if self.name:
            return self.name
        mark = f"{self.shard}|{self.row_start}|{self.row_stop}|{self.fingerprint}"
        digest = hashlib.sha1(mark.encode(), usedforsecurity=False).hexdigest()[:12]
        return f"{_ascii_stem(self.shard)}-{self.row_start}-{digest}"

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
            "key": self.key,
            "shard": self.shard,
            "format": self.format,
            "row_start": self.row_start,
            "row_stop": self.row_stop,
            "name": self.name,
            "source_run": self.source_run,
            "fingerprint": self.fingerprint,
            "since": self.since,
            "byte_start": self.byte_start,
            "byte_stop": self.byte_stop,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkUnit:
        """The unit stored by `to_dict`, with the key it was stored with: a plan an earlier
        release stored (no "key") keeps the key that release derived, so a resume finds the
        units it committed."""
        stop = None if d["row_stop"] is None else int(d["row_stop"])
        unit = cls(
            d["shard"],
            d["format"],
            int(d["row_start"]),
            stop,
            d.get("name"),
            d.get("source_run"),
            d.get("fingerprint"),
            d.get("since"),
            d.get("byte_start"),
            d.get("byte_stop"),
        )
        stored = d.get("key") or (None if unit.name else _legacy_key(unit))
        return unit if stored in (None, unit.key) else dataclasses.replace(unit, name=stored)


#: The longest unit key (`WorkUnit.key`): delta-rs keeps string statistics up to 64 bytes.
KEY_MAX_BYTES = 64
_STEM_CHARS = 24


def _ascii_stem(shard: str) -> str:
    """The shard's file name without extensions, folded to ASCII (accents dropped, other
    characters left out) and cut to `_STEM_CHARS`: a readable prefix, not an identity."""
    stem = posixpath.basename(shard).split(".")[0]
    folded = unicodedata.normalize("NFKD", stem).encode("ascii", "ignore").decode()
    return re.sub(r"[^A-Za-z0-9_-]", "", folded)[:_STEM_CHARS] or "shard"


def _legacy_key(unit: WorkUnit) -> str:
    """The key an earlier release derived (up to 40 characters of the name, any script)."""
    digest = hashlib.sha1(f"{unit.shard}|{unit.row_start}|{unit.row_stop}".encode(), usedforsecurity=False).hexdigest()[
        :12
    ]
    stem = posixpath.basename(unit.shard).split(".")[0][:40] or "shard"
    return f"{stem}-{unit.row_start}-{digest}"

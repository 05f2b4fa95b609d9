"""The reference model: what the input holds and what a user may expect of `raypipe.latest`.

A page, on purpose: the contract of docs/guarantees.md ("Contracts users rely on" in the
design notes), not the code's mechanism:
- every row of a new or changed file is read, whatever its `updated_at`; so once a backfill
  or daily completes, every row its attempts saw is *covered*;
- `latest` holds, per id, the newest source version: the greatest `updated_at` (a missing one
  is older than any), ties ordered by commit (a row rewritten in place under the same stamp:
  its new text);
- reuse answers a text that has a committed result of the model version without a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

Location = tuple[str, str]
"""(file name, id): where a row lives; rewritten in place, it keeps its location."""


@dataclass(frozen=True)
class Row:
    id: str
    text: str
    stamp: datetime | None  # microsecond precision; None: no `updated_at`


def order(stamp: datetime | None) -> tuple[int, datetime | None]:
    """Sort key of a source version's stamp: a missing one is older than any."""
    return (0, None) if stamp is None else (1, stamp)


Version = tuple[str, Row]  # (file, row)


@dataclass
class Reference:
    files: dict[str, list[Row]] = field(default_factory=dict)
    covered: set[Version] = field(default_factory=set)
    """Versions read by a run that completed (every attempt of it saw them)."""
    deleted: dict[str, list[Row]] = field(default_factory=dict)
    """id -> the last versions of its locations that were removed (a row or file deleted)."""
    quarantined: set[str] = field(default_factory=set)

    def current(self) -> set[Version]:
        return {(name, row) for name, rows in self.files.items() for row in rows}

    def write(self, name: str, rows: list[Row]) -> None:
        """The producer (re)writes a file: locations it no longer holds are deleted rows."""
        kept = {r.id for r in rows}
        for old in self.files.get(name, []):
            if old.id not in kept:
                self.deleted.setdefault(old.id, []).append(old)
        self.files[name] = list(rows)

    def remove(self, name: str) -> None:
        self.write(name, [])
        del self.files[name]

    def newest(self, id: str) -> Row | None:
        """The id's current row with the newest stamp (None: no current row)."""
        rows = [r for rows in self.files.values() for r in rows if r.id == id]
        return max(rows, key=lambda r: order(r.stamp)) if rows else None

    def completed(self, seen_by_attempts: list[set[Version]]) -> None:
        """A backfill or daily completed: what every one of its attempts saw is covered."""
        self.covered |= set.intersection(*seen_by_attempts)

    def expected(self) -> dict[str, set[str]]:
        """id -> the texts its `latest` answer may be for, for the ids the contract decides:
        every current row of the id covered, none in a quarantined file, and no deleted version
        of it as new as its newest current one (what `latest` shows for deleted rows is not
        decided yet)."""
        by_id: dict[str, list[Version]] = {}
        for name, row in self.current():
            by_id.setdefault(row.id, []).append((name, row))
        out: dict[str, set[str]] = {}
        for id, versions in by_id.items():
            if any(v not in self.covered or v[0] in self.quarantined for v in versions):
                continue
            newest = max(order(r.stamp) for _, r in versions)
            if any(order(d.stamp) >= newest for d in self.deleted.get(id, [])):
                continue
            out[id] = {r.text for _, r in versions if order(r.stamp) == newest}
        return out

"""Shards an operator set aside: `raypipe shards quarantine` writes them beside the output,
and planning skips each (`raypipe.plan.listing.list_input`'s `quarantined`), listing it in the
report, so a shard that stays bad stops making every run incomplete."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from raypipe.store import OutputStore

__all__ = ["QUARANTINE", "quarantine", "quarantined"]

QUARANTINE = "quarantine.json"
"""The file under the output's state folder (`_raypipe/quarantine.json`)."""


def quarantined(store: OutputStore) -> frozenset[str]:
    """The shards the output's quarantine holds."""
    return frozenset((store.read_json_or_none(store.state(QUARANTINE)) or {}).get("shards", {}))


def quarantine(output: str, shards: list[str], *, reason: str, release: bool = False) -> dict[str, Any]:
    """Adds shards to (or with `release`, removes them from) the output's quarantine: planning
    skips a quarantined shard and lists it in the report, so a shard that stays bad stops
    making every run incomplete once an operator has decided so."""
    store = OutputStore(output)
    current = (store.read_json_or_none(store.state(QUARANTINE)) or {}).get("shards", {})
    for shard in shards:
        if release:
            current.pop(shard, None)
        else:
            current[shard] = {"reason": reason, "at": datetime.now(UTC).isoformat()}
    store.write_json(store.state(QUARANTINE), {"shards": current})
    return {"quarantined": sorted(current)}

"""An actor's running tally of its calls, kept in the output so a stopped run keeps its figures.

The driver learns a unit's calls from its summary, which an actor returns when the unit ends.
A run stopped while its units are in flight (SIGTERM, a killed driver, the breaker waiting on a
dead service) would report none of the calls made so far. So each actor also keeps a
`CallTally` (`raypipe.report`: the call figures an attempt's statistics count too) over every
unit it worked on in the attempt, finished or not, and writes it, with its breaker and limiter
figures, to

    _raypipe/runs/<run_id>/attempts/<attempt>/actors/<actor>.json

soon after its first calls, at most every `WRITE_INTERVAL_S` while they change, and at each
unit's end (one small atomic put each). The same record rides in every unit summary
(`UnitStats.actor_stats`). An actor's tally covers everything its summaries count, so for an
attempt the driver uses the sum of its actors' latest tallies (highest `seq`) in place of the
sum of its units' summaries when it holds more calls (`fold_tallies`): never both.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from typing import Any

from raypipe.report import AttemptStats, CallTally
from raypipe.store import OutputStore

__all__ = ["WRITE_INTERVAL_S", "CallTally", "fold_tallies", "read_tallies", "tally_files", "tally_path"]

WRITE_INTERVAL_S = 10.0
"""Longest an actor's changed tally waits before it is written again."""


def tally_path(store: OutputStore, run_id: str, attempt: str, actor: str) -> str:
    return store.run_state(run_id, "attempts", attempt, "actors", f"{re.sub(r'[^A-Za-z0-9_.-]', '_', actor)}.json")


def tally_files(store: OutputStore, run_id: str) -> dict[str, list[str]]:
    """The actor records under the run's attempts, by attempt id."""
    found: dict[str, list[str]] = {}
    for folder in store.list_files(store.run_state(run_id, "attempts")):
        attempt = posixpath.basename(folder)
        if attempt.endswith(".json"):
            continue  # an attempt's own statistics (`CommitProtocol.save_attempt`), not a folder
        found[attempt] = store.list_files(posixpath.join(folder, "actors"), ".json")
    return found


def read_tallies(store: OutputStore, run_id: str) -> dict[str, list[dict[str, Any]]]:
    """Every actor record under the run's attempts, by attempt id."""
    return {a: [record for _, record in store.read_many_json(paths)] for a, paths in tally_files(store, run_id).items()}


def fold_tallies(attempt: AttemptStats, records: Iterable[dict[str, Any]]) -> AttemptStats:
    """The attempt's statistics with its calls taken from its actors' tallies when those count
    more calls than its unit summaries (a run stopped with units in flight), else unchanged.

    `records` are actor records read from the output (`read_tallies`); the ones riding in the
    summaries are in `attempt.actors`. Per actor, the record with the highest `seq` wins. Rows
    and outcomes stay the summaries' (only a committed unit has them). Idempotent: folding an
    attempt that was folded already changes nothing.
    """
    latest: dict[str, dict[str, Any]] = {a: s for a, s in attempt.actors.items() if "tally" in s}
    for record in records:
        actor = record.get("actor")
        if not actor or "tally" not in record:
            continue
        prev = latest.get(actor)
        if prev is None or record.get("seq", 0) >= prev.get("seq", 0):
            latest[actor] = {k: v for k, v in record.items() if k not in ("actor", "attempt")}
    total = CallTally()
    for record in latest.values():
        total.add(CallTally.from_dict(record["tally"]))
    if total.calls <= attempt.calls:
        return attempt
    folded = AttemptStats.from_dict(attempt.to_dict())
    folded.take_calls(total)
    folded.actors = {**attempt.actors, **latest}
    return folded

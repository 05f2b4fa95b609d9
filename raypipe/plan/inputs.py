"""Planning a run over its input: which files, cut how, given what the output already holds.

A backfill plans every shard whole. A daily plans the files no run has read whole yet (new
ones, and those whose size or ETag changed), whole, whatever their rows' `updated_at`: it
selects by the files seen (`OutputHistory.files_seen`), not by a watermark. A file rewritten
in place is read for its rows updated at or after the latest `updated_at` read of it before;
`since` also re-reads the files read before, for their rows updated after it. Shards an
operator quarantined are skipped and listed (`raypipe.plan.quarantine`).

A resumed run plans nothing anew: it takes its stored plan (`replan` brings its bad shards
and whole-file units up to date with the input).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from raypipe.config import InputConfig
from raypipe.plan.footers import plan_units
from raypipe.plan.listing import InputListing, list_input, prune_partitions
from raypipe.plan.plan import Plan, PlanObservations
from raypipe.plan.units import ColumnNames, DeltaWindow, ShardFormat, WorkUnit
from raypipe.plan.whole_files import plan_listing

__all__ = ["OutputHistory", "columns_of", "on_bad_shard", "plan_input", "replan", "with_whole_file_maxima"]

logger = logging.getLogger("raypipe")


class OutputHistory(Protocol):
    """What planning asks of the output (`raypipe.run.state.RunState` answers)."""

    def quarantined(self) -> frozenset[str]:
        """The shards an operator set aside."""
        ...

    def files_seen(self) -> dict[str, tuple[str, str | None]]:
        """Input file URI -> (fingerprint, the latest `updated_at` read in it, ISO, if known)."""
        ...


def columns_of(input: InputConfig) -> ColumnNames:
    """The input's column names, as planning and reading take them."""
    return ColumnNames(input.id_column, input.text_column, input.updated_at_column)


def on_bad_shard(input: InputConfig, mode: str) -> Literal["fail", "record"]:
    """A daily records bad shards by default (a bad shard must not hold the others back)."""
    return input.on_bad_shard or ("record" if mode == "daily" else "fail")


def plan_input(input: InputConfig, mode: str, output: OutputHistory, *, since: datetime | None = None) -> Plan:
    """A backfill plans every shard whole. A daily plans the files no run has read whole yet
    (new ones, and those whose size or ETag changed), whole, whatever their rows' updated_at;
    with `since`, also the files already read, for their rows updated after `since`."""
    listing = list_input(input.uri, format=input.format, quarantined=output.quarantined())
    seen = PlanObservations(limit=datetime.now(UTC) + timedelta(seconds=input.max_future_skew_s))
    whole, windowed = listing.shards, list[tuple[str, ShardFormat]]()
    rewritten: dict[datetime, list[tuple[str, ShardFormat]]] = {}
    files: Counter[str] = Counter()
    if mode == "daily":
        read_before = output.files_seen()
        whole = []
        for shard, fmt in listing.shards:
            fingerprint, read_up_to = read_before.get(shard, (None, None))
            kind = (
                "new"
                if fingerprint is None
                else "changed"
                if fingerprint != listing.fingerprints[shard]
                else "unchanged"
            )
            files[kind] += 1
            if kind == "unchanged":
                windowed.append((shard, fmt))
            elif kind == "changed" and read_up_to is not None and fmt == "parquet":
                # Rewritten in place: its rows updated after what was read of it last time.
                rewritten.setdefault(datetime.fromisoformat(read_up_to), []).append((shard, fmt))
            else:
                whole.append((shard, fmt))
        if since is not None and input.updated_at_partition:
            windowed = prune_partitions(windowed, input.updated_at_partition, DeltaWindow.since(since), seen)
    else:
        files["new"] = len(whole)
    common: dict[str, Any] = {
        "unit_rows": input.unit_rows,
        "columns": columns_of(input),
        "on_bad_shard": on_bad_shard(input, mode),
        "observations": seen,
        "fingerprints": listing.fingerprints,
        "threads": input.planning_threads,
    }
    units, bad = plan_listing(whole, sizes=listing.sizes, footer_sample=input.footer_sample, **common)
    # Files read before, re-read for their rows updated after a time: each rewritten file after
    # what was read of it (or `since`, if earlier), then the unchanged ones after `since`.
    reread = [(upto if since is None else min(since, upto), shards) for upto, shards in sorted(rewritten.items())]
    if since is not None and windowed:
        reread.append((since, windowed))
    for after, shards in reread:
        more, more_bad = plan_units(shards, need_updated_at=True, window=DeltaWindow.since(after), **common)
        units += [dataclasses.replace(u, since=after.isoformat()) for u in more]
        bad += more_bad
    logger.info(
        "planned %d units: %d files new, %d changed, %d read before%s; %d skipped, %d bad",
        len(units),
        files["new"],
        files["changed"],
        files["unchanged"],
        f" (rows updated after {since.isoformat()} re-read)" if since is not None else " (not read)",
        len(listing.skipped),
        len(bad),
    )
    if seen.whole_files:
        logger.info(
            "%d footers read at planning; %d small Parquet files planned whole from their listed size "
            "(each footer is read with its rows)",
            seen.footers_read,
            seen.whole_files,
        )
    if seen.future_row_groups:
        logger.warning(
            "%d row group(s) hold updated_at beyond now + %s s (e.g. a 9999-12-31 sentinel): inferred, but "
            "they do not move the watermark",
            seen.future_row_groups,
            input.max_future_skew_s,
        )
    observations = {**seen.to_dict(), "files": dict(files), "skipped_files": listing.skipped}
    # What the input was read as of (the latest updated_at not in the future, else now): the watermark.
    observations["read_as_of"] = observations["max_updated_at"] or datetime.now(UTC).isoformat()
    window = None if since is None else DeltaWindow.since(since)
    return Plan(mode, input.uri, units, bad, window, observations=observations)


def replan(input: InputConfig, plan: Plan, pending: list[WorkUnit]) -> Plan:
    """A resumed run's stored plan, brought up to date with its input as it is now: the shards
    an earlier attempt recorded as bad planned again (a fixed one joins the run), and each
    pending whole-file unit read as its file is now."""
    listing = list_input(input.uri, format=input.format)
    return _refresh_whole_files(_retry_bad_shards(input, plan, listing), listing, pending)


def _refresh_whole_files(plan: Plan, listing: InputListing, pending: list[WorkUnit]) -> Plan:
    """A resumed run reads each of its pending whole-file units (`plan_listing`) as the
    file is now: one mended or rewritten since planning (a bad shard fixed in place) would
    otherwise never read under this run id (`ShardChangedError`). A unit that is the whole file
    has no row range of an older version to keep; a unit cut from a footer keeps its
    fingerprint, and a committed unit keeps the one it was read at."""
    todo = {u.key for u in pending if u.planned_whole}
    units = [
        dataclasses.replace(u, fingerprint=listing.fingerprints[u.shard])
        if u.key in todo and u.shard in listing.fingerprints
        else u
        for u in plan.units
    ]
    return dataclasses.replace(plan, units=units)


def _retry_bad_shards(input: InputConfig, plan: Plan, listing: InputListing) -> Plan:
    """Plans again the shards an earlier attempt recorded as bad: a fixed shard joins the run."""
    if not plan.bad_shards:
        return plan
    shards = [(b["shard"], b["format"]) for b in plan.bad_shards]
    units, bad = plan_units(
        [(shard, fmt) for shard, fmt in shards if shard in listing.fingerprints],  # type: ignore[misc]
        unit_rows=input.unit_rows,
        columns=columns_of(input),
        on_bad_shard="record",
        fingerprints=listing.fingerprints,
        threads=input.planning_threads,
    )
    gone = [b for b in plan.bad_shards if b["shard"] not in listing.fingerprints]
    bad += [{**b, "error": "the shard is gone from the input"} for b in gone]
    if units:
        logger.info("%d shard(s) recorded as bad are readable now: %d units added", len(shards) - len(bad), len(units))
    return Plan(
        plan.mode,
        plan.input,
        plan.units + units,
        bad,
        plan.window,
        plan.replay_of,
        plan.observations,
        plan.model_version,
    )


def with_whole_file_maxima(
    plan: Plan, done: set[str], skew_s: float, maxima: Callable[[], Mapping[str, datetime]]
) -> Plan:
    """The plan with the latest `updated_at` of each committed shard planned whole from its
    listed size (`plan_listing`: no footer read at planning), taken from the statistics of its
    committed rows in the table's log (`maxima`: unit -> its latest `updated_at`; no data read).

    They are recorded with the files seen, so a daily reads a later rewrite of such a file for
    its newer rows only, as it does for a file whose footers planning read. Delta's statistics
    truncate timestamps to the millisecond (never up: checked in the unit tests), so a rewrite
    may re-read rows of that last millisecond and never skips one. A file whose rows reach
    beyond now + `skew_s` (a sentinel) gets none: a rewrite of it is read whole."""
    whole = {u.key: u.shard for u in plan.units if u.planned_whole and u.key in done}
    if not whole:
        return plan
    by_unit = maxima()
    limit = datetime.now(UTC) + timedelta(seconds=skew_s)
    found: dict[str, datetime] = {}
    for key, shard in whole.items():
        hi = by_unit.get(key)
        if hi is not None and hi <= limit:
            found[shard] = hi
    if not found:
        return plan
    observations = dict(plan.observations or {})
    observations["shard_max"] = {
        **(observations.get("shard_max") or {}),
        **{shard: hi.isoformat() for shard, hi in found.items()},
    }
    latest = max(found.values())
    stated = observations.get("max_updated_at")
    footers = None if stated is None else datetime.fromisoformat(stated)
    if footers is not None and latest > footers:  # else read_as_of is "now": the rows had no statistics
        observations["max_updated_at"] = observations["read_as_of"] = latest.isoformat()
    return dataclasses.replace(plan, observations=observations)

"""A run's plan, per mode: a backfill reads every shard whole; a daily the files no run has read
whole yet (`OutputHistory.files_seen`), whole, and under `--since` also the unchanged files for
their rows updated at or after it; a replay the units of a run holding dead letters; a resumed
run its stored plan, brought up to date with its input."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal, Protocol

import pyarrow as pa

from raypipe.config import InputConfig
from raypipe.plan.footers import PlanObservations, recut_parquet
from raypipe.plan.listing import list_input
from raypipe.plan.plan import Plan
from raypipe.plan.shards import plan_listing, plan_units
from raypipe.plan.units import ColumnNames, DeltaWindow, ShardFormat, WorkUnit

__all__ = ["OutputHistory", "bad_shard_policy", "columns_of", "plan_input", "plan_replay", "prune_partitions", "resume"]

logger = logging.getLogger("raypipe")


def prune_partitions(
    shards: Sequence[tuple[str, ShardFormat]], key: str, window: DeltaWindow, seen: PlanObservations
) -> list[tuple[str, ShardFormat]]:
    """Drops shards whose Hive partition `key=YYYY-MM-DD` (the date of their rows' updated_at)
    lies outside the window's days, without opening them. Shards without the key are kept."""
    lo = None if window.after is None else window.after.astimezone(UTC).date()
    hi = window.until.astimezone(UTC).date()
    kept = []
    for shard, fmt in shards:
        day = None
        for part in shard.split("/"):
            if part.startswith(f"{key}="):
                try:
                    day = date.fromisoformat(part.split("=", 1)[1][:10])
                except ValueError:
                    day = None
        if day is not None and (day > hi or (lo is not None and day < lo)):
            seen.shards_pruned += 1
            continue
        kept.append((shard, fmt))
    return kept


# -- a run's plan ------------------------------------------------------------------------------
class OutputHistory(Protocol):
    """What planning asks of the output (`raypipe.commit.protocol.CommitProtocol` answers)."""

    def quarantined(self) -> frozenset[str]:
        """The shards an operator set aside."""
        ...

    def files_seen(self) -> dict[str, tuple[str, str | None]]:
        """Input file URI -> (fingerprint, the latest `updated_at` read in it, ISO, if known)."""
        ...


def columns_of(input: InputConfig) -> ColumnNames:
    return ColumnNames(input.id_column, input.text_column, input.updated_at_column)


def bad_shard_policy(input: InputConfig, mode: str) -> Literal["fail", "record"]:
    """A daily records bad shards by default (a bad shard must not hold the others back)."""
    return input.on_bad_shard or ("record" if mode == "daily" else "fail")


def _reading(input: InputConfig, mode: str) -> dict[str, Any]:
    """The `Plan` fields of how this attempt reads its units."""
    return {
        "columns": columns_of(input),
        "on_bad_shard": bad_shard_policy(input, mode),
        "max_future_skew_s": input.max_future_skew_s,
    }


def plan_input(input: InputConfig, mode: str, output: OutputHistory, *, since: datetime | None = None) -> Plan:
    """A backfill plans every shard whole. A daily plans the files no run has read whole yet
    (new ones, and those whose size or ETag changed), whole, whatever their rows' updated_at;
    an unchanged file is not read again. `since` only adds reads: the unchanged files too, for
    their rows updated at or after it."""
    listing = list_input(input.uri, format=input.format, quarantined=output.quarantined())
    seen = PlanObservations(limit=datetime.now(UTC) + timedelta(seconds=input.max_future_skew_s))
    whole, unchanged = listing.shards, list[tuple[str, ShardFormat]]()
    files: Counter[str] = Counter()
    if mode == "daily":
        read_before = output.files_seen()
        whole = []
        for shard, fmt in listing.shards:
            before = read_before.get(shard)
            kind = "new" if before is None else "unchanged" if before[0] == listing.fingerprints[shard] else "changed"
            files[kind] += 1
            (unchanged if kind == "unchanged" else whole).append((shard, fmt))
        if since is not None and input.updated_at_partition:
            unchanged = prune_partitions(unchanged, input.updated_at_partition, DeltaWindow.since(since), seen)
    else:
        files["new"] = len(whole)
    common: dict[str, Any] = {
        "unit_rows": input.unit_rows,
        "unit_bytes": input.unit_bytes,
        "columns": columns_of(input),
        "on_bad_shard": bad_shard_policy(input, mode),
        "observations": seen,
        "fingerprints": listing.fingerprints,
        "threads": input.planning_threads,
    }
    units, bad = plan_listing(whole, sizes=listing.sizes, footer_sample=input.footer_sample, **common)
    window = None if since is None else DeltaWindow.since(since)
    if window is not None and since is not None and unchanged:
        more, more_bad = plan_units(unchanged, window=window, sizes=listing.sizes, **common)
        units += [dataclasses.replace(u, since=since.isoformat()) for u in more]
        bad += more_bad
    logger.info(
        "planned %d units: %d files new, %d changed, %d read before%s; %d skipped, %d bad",
        len(units),
        files["new"],
        files["changed"],
        files["unchanged"],
        f" (rows updated at or after {since.isoformat()} re-read)" if since is not None else " (not read)",
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
    observations["unit_bytes"] = input.unit_bytes  # what the units were cut for (`resume` cuts again)
    # What the input was read as of (the latest updated_at not in the future, else now): the watermark.
    observations["read_as_of"] = observations["max_updated_at"] or datetime.now(UTC).isoformat()
    return Plan(mode, input.uri, units, bad, window, observations=observations, **_reading(input, mode))


def plan_replay(output_uri: str, of_run: str, dead_letters: Mapping[str, int], *, table_version: int) -> Plan:
    """A replay's plan: a unit per unit of run `of_run` that holds committed dead letters
    (`dead_letters`: unit -> how many, at `table_version` of the outcomes table, which the
    report counts against), read back from the table by that unit's name."""
    units = [
        WorkUnit(output_uri, "dead_letters", 0, n, name=unit, source_run=of_run)
        for unit, n in sorted(dead_letters.items())
    ]
    return Plan("replay", None, units, [], None, replay_of=of_run, observations={"table_version": table_version})


def resume(
    input: InputConfig, plan: Plan, committed: set[str], *, quarantined: frozenset[str] = frozenset()
) -> tuple[Plan, bool]:
    """A resumed run's stored plan, read with this attempt's input settings, and brought up to
    date with its input as it is now, for what is not `committed` yet:

    - a shard gone from the input since planning, or `quarantined` since, has its units not
      committed dropped, and is listed with the plan's skipped files, with why;
    - a shard rewritten since planning (its fingerprint differs) is planned again, whole, from
      the file as it is now: its old units are dropped, committed or not (their rows stay in
      the table; the new units have new keys), so no row of the new version is skipped;
    - the shards an earlier attempt recorded as bad are planned again (a fixed one joins the
      run; a quarantined or gone one leaves the bad shards for the skipped files).

    A shard planned again that cannot be read is recorded as bad, whatever the bad-shard
    policy (the run is then incomplete; a later resume plans it again).

    Returns (plan, changed): a changed plan is to be stored again."""
    plan = dataclasses.replace(plan, **_reading(input, plan.mode))
    listing = list_input(input.uri, format=input.format, quarantined=quarantined)
    now = listing.fingerprints
    observations = dict(plan.observations or {})
    # A plan stored before units were cut by bytes, or cut for a larger size, is cut again.
    recut = (observations.get("unit_bytes") or float("inf")) > input.unit_bytes
    if recut:
        observations["unit_bytes"] = input.unit_bytes
    skipped = list(observations.get("skipped_files") or [])
    listed = {s["path"] for s in skipped}

    def skip(shard: str, reason: str) -> None:
        if shard not in listed:
            listed.add(shard)
            skipped.append({"path": shard, "reason": reason})

    open_shards = {u.shard for u in plan.units if u.key not in committed and u.format != "dead_letters"}
    units, replan, to_cut = [], list[tuple[str, ShardFormat]](), list[WorkUnit]()
    for u in plan.units:
        if u.shard not in open_shards:
            units.append(u)
        elif u.shard in quarantined:
            skip(u.shard, "quarantined (raypipe shards quarantine) since the run was planned")
            if u.key in committed:
                units.append(u)
        elif u.shard not in now:
            skip(u.shard, "gone from the input since the run was planned")
            if u.key in committed:
                units.append(u)
        elif u.fingerprint is not None and u.fingerprint != now[u.shard]:
            if (u.shard, u.format) not in replan:
                replan.append((u.shard, u.format))
        elif recut and u.key not in committed and _oversized_whole(u, listing.sizes, input.unit_bytes):
            replan.append((u.shard, u.format))
        elif recut and u.key not in committed and u.format == "parquet" and u.row_stop is not None:
            units.append(u)
            to_cut.append(u)
        else:
            units.append(u)
    if to_cut:
        pieces = _recut(to_cut, input, plan.columns)
        units = [piece for u in units for piece in pieces.get(u.key, [u])]
    bad = []
    for b in plan.bad_shards:
        if b["shard"] in quarantined:
            skip(b["shard"], "quarantined (raypipe shards quarantine) since the run was planned")
        elif b["shard"] not in now:
            skip(b["shard"], "gone from the input since the run was planned")
        else:
            replan.append((b["shard"], b["format"]))  # type: ignore[arg-type]
    if replan:
        more, more_bad = plan_units(
            replan,
            unit_rows=input.unit_rows,
            unit_bytes=input.unit_bytes,
            columns=plan.columns,
            on_bad_shard="record",
            fingerprints=now,
            sizes=listing.sizes,
            threads=input.planning_threads,
        )
        units += more
        bad += more_bad
        logger.info(
            "%d shard(s) rewritten since planning, recorded as bad or over unit_bytes planned again: %d units",
            len(replan),
            len(more),
        )
    if skipped:
        observations["skipped_files"] = skipped
    resumed = dataclasses.replace(plan, units=units, bad_shards=bad, observations=observations or plan.observations)
    return resumed, resumed != plan


#: How many times its size a Parquet file planned whole may hold when read (text columns
#: decompressed), for a stored whole-file unit: over `unit_bytes` at that rate, it is planned
#: again from its footer on resume.
PARQUET_EXPANSION = 8


def _oversized_whole(unit: WorkUnit, sizes: dict[str, int], unit_bytes: int) -> bool:
    """A stored whole-file unit that may hold more than `unit_bytes` (by its listed size)."""
    size = sizes.get(unit.shard)
    if size is None or unit.row_stop is not None or unit.byte_start is not None:
        return False
    if unit.format == "jsonl":
        return size > unit_bytes
    return unit.format == "parquet" and size * PARQUET_EXPANSION > unit_bytes


def _recut(units: list[WorkUnit], input: InputConfig, columns: ColumnNames) -> dict[str, list[WorkUnit]]:
    """Stored Parquet units cut again within their rows (`recut_parquet`): unit key -> what it
    becomes, a footer read per shard, `input.planning_threads` shards at once. A footer that
    cannot be read leaves its units as they were (their read records why)."""
    by_shard: dict[str, list[WorkUnit]] = {}
    for u in units:
        by_shard.setdefault(u.shard, []).append(u)

    def cut(shard_units: list[WorkUnit]) -> list[list[WorkUnit]]:
        try:
            return recut_parquet(shard_units, input.unit_rows, input.unit_bytes, columns)
        except (OSError, pa.ArrowException, ValueError) as e:
            logger.warning("%s: units not cut again for unit_bytes: %s: %s", shard_units[0].shard, type(e).__name__, e)
            return [[u] for u in shard_units]

    with ThreadPoolExecutor(
        max(1, min(input.planning_threads, len(by_shard))), thread_name_prefix="raypipe-plan"
    ) as pool:
        done = list(pool.map(cut, by_shard.values()))
    return {
        u.key: pieces
        for shard_units, cuts in zip(by_shard.values(), done, strict=True)
        for u, pieces in zip(shard_units, cuts, strict=True)
    }

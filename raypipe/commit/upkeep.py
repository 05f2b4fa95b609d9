"""Keeping an output in shape: compaction, vacuum, and copying an earlier layout in.

- `compact`: finished runs' small files rewritten into fewer, the units a replay rewrites
  (files holding dead letters) left apart.
- `vacuum`: Delta's `vacuum` (files no commit references, such as those of a fenced-off
  attempt, and the log's expired entries), plus removing finished runs' state
  (`drop_finished_state`).
- `migrate`: copies an output written by raypipe ≤ 0.1 (`results/`, `dead_letters/` Parquet
  with commit markers, read through `LegacyLayout`) into the table.
- `finished_runs`: the run ids the table records as committed, which all three go by.
- `quarantine` / `quarantined`: the shards an operator set aside, as immutable numbered files
  the table names (a fenced commit: no read-modify-write of a shared file).

Each that writes holds the output as a run does (`raypipe.commit.protocol.holding`): the lease
(refused while a run is live), then a take-over, so every older holder of any run id is
fenced off first; its own commits carry the fence.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import posixpath
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.fence import UnitCommitter, fence_transactions, mark_committed
from raypipe.commit.output import Output
from raypipe.commit.protocol import CommitProtocol, committed_runs, holding
from raypipe.commit.state import read_quarantine
from raypipe.commit.table import QUARANTINE_APP, missing_properties
from raypipe.config import OutputConfig
from raypipe.errors import ConfigError
from raypipe.store import STATE_DIR, OutputStore
from raypipe.tally import tally_files

__all__ = [
    "VACUUM_FLOOR_HOURS",
    "LegacyLayout",
    "compact",
    "drop_finished_state",
    "finished_runs",
    "keep_bounded",
    "migrate",
    "vacuum",
]

logger = logging.getLogger("raypipe")

COMMITTED = "COMMITTED.json"
"""An earlier release's run commit marker (`_raypipe/runs/<run_id>/COMMITTED.json`)."""


def quarantine(
    output: str | OutputConfig | Output, shards: list[str], *, reason: str, release: bool = False
) -> list[str]:
    """Adds shards to (or with `release`, removes them from) the output's quarantine, holding
    the output (refused while a run is live: it planned without them); returns the shards it
    holds now. A shard that stays bad stops making every run incomplete once an operator has
    decided so."""
    with holding(Output.at(output), "quarantine", labels=()) as protocol:
        return protocol.set_quarantine(shards, reason=reason, release=release)


def quarantined(place: Output) -> frozenset[str]:
    """The shards quarantined on the output `place` (planning skips them and lists them); read,
    not held: the preflight's look before a run takes the output."""
    return frozenset(read_quarantine(place.store, place.table.pointer(QUARANTINE_APP)))


COMPACT_TARGET_BYTES = 128 * 2**20
"""About how many bytes of small files `compact` writes into one."""


def compact(
    output: str | OutputConfig | Output, *, run_ids: list[str] | None = None, target_size: int | None = None
) -> dict[str, Any]:
    """Rewrites finished runs' small files into fewer, keeping the units a replay may rewrite
    apart (all finished runs by default; an unfinished run is refused).

    A replay rewrites each unit's dead letters with a MERGE that reads only the files holding
    them. Delta's `optimize.compact` would put many units' dead letters in one file, and then
    every replay unit's MERGE reads and rewrites that whole file, and replays of different units
    conflict. So only files without dead letters (by the log's statistics) are compacted, and
    only units all of whose files are such; files holding dead letters stay as they are, one
    unit each. Each group of about `target_size` bytes is one commit that replaces its units'
    rows with the same rows in fewer files. It holds the output (its commits carry the fence).
    """
    from deltalake import CommitProperties, write_deltalake

    place = Output.at(output)
    done = finished_runs(place)
    runs = run_ids if run_ids is not None else done
    unfinished = [r for r in runs if r not in set(done)]
    if unfinished:
        raise ValueError(f"runs still unfinished (not compacted): {', '.join(unfinished)}")
    if not runs:
        return {"runs": 0}
    with holding(place, "compact") as protocol:
        dt = keep_bounded(protocol)
        out = {"runs": len(runs), "units": 0, "files_before": len(dt.file_uris())}
        # The log's file statistics, read once: a run's compaction touches its partition only.
        actions = pa.table(dt.get_add_actions(flatten=True))
        for run_id in runs:
            where = pc.field("run_id") == run_id
            # The run's partition only: a dataset of the whole table costs its every file.
            run = dt.to_pyarrow_dataset(file_pruning_predicate=[("run_id", "=", run_id)])
            for units in _compactable(actions, run_id, target_size or COMPACT_TARGET_BYTES):
                rows = run.to_table(filter=where & pc.field("unit").isin(units)).sort_by("unit")
                write_deltalake(
                    dt,
                    rows,
                    mode="overwrite",
                    predicate=f"run_id = {_quoted(run_id)} AND unit IN ({', '.join(map(_quoted, units))})",
                    partition_by=["run_id"],
                    commit_properties=CommitProperties(
                        app_transactions=fence_transactions(protocol.fence),
                        custom_metadata={"raypipe.operation": "compact", "raypipe.run_id": run_id},
                    ),
                )
                dt.update_incremental()
                out["units"] += len(units)
        out["files_after"] = len(dt.file_uris())
    return out


def keep_bounded(protocol: CommitProtocol) -> Any:
    """The table's snapshot, after setting the `TABLE_PROPERTIES` it lacks (a table an earlier
    release created keeps its log's tail, expired entries and transactions bounded from here
    on): one fenced commit, none when nothing is missing. The values a user set are kept."""
    from deltalake import CommitProperties

    dt = protocol.table.load()
    missing = missing_properties(dt)
    if missing:
        dt.alter.set_table_properties(
            missing,
            commit_properties=CommitProperties(
                app_transactions=fence_transactions(protocol.fence),
                custom_metadata={"raypipe.operation": "table-properties"},
            ),
        )
        dt.update_incremental()
        logger.info("table properties set: %s", ", ".join(f"{k}={v}" for k, v in sorted(missing.items())))
    return dt


def _quoted(value: str) -> str:
    """A SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _compactable(actions: pa.Table, run_id: str, target_size: int) -> list[list[str]]:
    """Groups of `run_id`'s units (about `target_size` bytes each, two files at least) that
    `compact` may rewrite together: units whose every file is one unit's and holds no dead
    letter (`outcome` statistics all "result"), from the table's add actions (`actions`, the
    log's file statistics). A file without statistics counts as holding one."""
    if actions.num_rows == 0 or not {"min.unit", "min.outcome"} <= set(actions.column_names):
        return []
    mine = actions.filter(pc.equal(actions.column("partition.run_id"), run_id)).to_pylist()
    kept: set[str] = set()  # units a replay may rewrite: never mixed with others
    spans: list[tuple[str, str]] = []  # files of several units (compacted before): left as they are
    sizes: dict[str, int] = {}
    for f in mine:
        unit = f["min.unit"]
        if unit is None or f["max.unit"] is None:
            return []  # a file whose units the log does not tell: any rewrite might touch it
        if unit != f["max.unit"]:
            spans.append((unit, f["max.unit"]))
        elif f["min.outcome"] == "result" and f["max.outcome"] == "result":
            sizes[unit] = sizes.get(unit, 0) + int(f["size_bytes"])
        else:
            kept.add(unit)
    # A unit that may have rows in a file of several units is left too: rewriting its rows
    # would rewrite that file.
    free = sorted(u for u in sizes if u not in kept and not any(lo <= u <= hi for lo, hi in spans))
    groups: list[list[str]] = [[]]
    total = 0
    for unit in free:
        if groups[-1] and total + sizes[unit] > target_size:
            groups.append([])
            total = 0
        groups[-1].append(unit)
        total += sizes[unit]
    return [g for g in groups if len(g) >= 2]


VACUUM_FLOOR_HOURS = 168.0
"""The shortest retention `vacuum` takes unless forced: Delta's own default
(`delta.deletedFileRetentionDuration`, 7 days), far above the longest a unit may take between
writing its file and committing it (a unit's inference, breaker waits, commit retries)."""


def vacuum(
    output: str | OutputConfig | Output,
    *,
    retention_hours: float = VACUUM_FLOOR_HOURS,
    dry_run: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Delta `vacuum`: deletes data files no commit references and that are older than the
    retention (fenced-off or failed commits, files compacted away), and the commit log's
    expired entries; then the run state of runs committed before the retention.

    A file written by a live attempt is referenced by no commit until its unit commits, so a
    short retention could delete it under that commit. A retention under `VACUUM_FLOOR_HOURS`
    is refused (`ConfigError`) unless `force`; the retention is rounded up to whole hours
    (delta-rs takes an int), never down. It holds the output meanwhile (a live run refuses it,
    and every older holder is fenced off first, so a stalled writer whose files it deletes can
    commit nothing afterwards).
    """
    if not retention_hours >= 0:
        raise ConfigError(f"vacuum: --retention-hours must be >= 0, got {retention_hours}")
    if retention_hours < VACUUM_FLOOR_HOURS and not force:
        raise ConfigError(
            f"vacuum: a retention of {retention_hours:g} h is under {VACUUM_FLOOR_HOURS:g} h and may delete the files "
            "of a unit a live run has written but not committed yet; pass --force if no run writes to this output"
        )
    with holding(Output.at(output), "vacuum") as protocol:
        dt = keep_bounded(protocol) if not dry_run else protocol.table.load()
        files = dt.vacuum(
            retention_hours=math.ceil(retention_hours), dry_run=dry_run, enforce_retention_duration=False, full=True
        )
        if not dry_run:
            dt.cleanup_metadata()
        before = datetime.now(UTC) - timedelta(hours=retention_hours)
        removed = 0 if dry_run else drop_finished_state(protocol.place, before=before)
    return {"files": len(files), "dry_run": dry_run, "runs_state_removed": removed}


def migrate(output: str | OutputConfig | Output) -> dict[str, int]:
    """Copies an output of raypipe's earlier layout (`results/run=R/*.parquet`,
    `dead_letters/run=R/*.parquet`, committed units' markers under `_raypipe/runs/R/units/`)
    into the outcomes table; the old files are left in place.

    Only units with a commit marker are copied (an unfinished attempt's files never were
    committed), each in its own unit commit (so each is one file the table lists as a
    committed unit), and only a run with its `COMMITTED.json` is then recorded as committed in
    the table: a half-done legacy run, resumed under its run id, infers its other units. A
    rerun copies what the table does not hold yet and records what is not recorded yet (a
    migrate killed between its copy and its mark is finished), so the command can be rerun.
    It holds the output (`holding`), and every commit carries the fence.
    """
    place = Output.at(output)
    old = LegacyLayout(place.store)
    runs = old.runs()
    if not runs:
        return {"runs": 0, "rows": 0}
    with holding(place, "migrate", labels=()) as protocol:
        return _migrate(old, runs, protocol)


def _migrate(old: LegacyLayout, runs: list[str], protocol: CommitProtocol) -> dict[str, int]:
    table = protocol.table
    copied = {"runs": 0, "rows": 0}
    for run_id in runs:
        legacy_done = old.has_commit_marker(run_id)
        if table.exists() and table.is_committed(run_id):
            continue
        held = table.committed_units(run_id) if table.exists() else set()
        units = {u: rows for u in sorted(old.committed_units(run_id) - held) if (rows := old.unit_rows(run_id, u))}
        if not units and not (legacy_done and table.exists()):
            continue
        labels = [c.removeprefix("prob_") for t in units.values() for c in t.column_names if c.startswith("prob_")]
        table.ensure(tuple(dict.fromkeys(labels)))
        # The holder's fence, for the legacy run's units: their own transactions name that run.
        fence = dataclasses.replace(protocol.fence, run_id=run_id)
        committer = UnitCommitter(fence)
        rows = sum(t.num_rows for unit, t in units.items() if committer.commit(unit, t))
        if legacy_done:  # else a half-done legacy run: resuming it does its other units
            mark_committed(table, fence, run_id, {"raypipe.migrated": "true"})
        copied["runs"] += 1
        copied["rows"] += rows
        logger.info("migrated run %s: %d rows", run_id, rows)
    return copied


def finished_runs(output: str | Output) -> list[str]:
    """Run ids committed (their fenced run commit, or past its retention their completed
    report: `committed_runs`), among the runs with rows in the table or state under
    `_raypipe/runs/`."""
    place = Output.at(output)
    store, table = place.store, place.table
    runs = store.path(STATE_DIR, "runs")
    try:
        store.fs.invalidate_cache(runs)
        names = {p.rsplit("/", 1)[-1] for p in store.fs.ls(runs, detail=False)}
    except FileNotFoundError:
        names = set()
    return sorted(committed_runs(place, names | table.run_ids()))


def _finished_at(store: OutputStore, run_id: str) -> datetime | None:
    """When a committed run finished: its report's `finished_at`, else the `COMMITTED.json` an
    earlier release wrote."""
    report = store.read_json_or_none(store.report_file(run_id)) or {}
    at = report.get("finished_at") or (store.read_json_or_none(store.run_state(run_id, COMMITTED)) or {}).get("at")
    return datetime.fromisoformat(at) if at else None


def drop_finished_state(output: Output, *, before: datetime) -> int:
    """Removes plans and attempt statistics of runs committed and finished before `before`
    (reports stay)."""
    store = output.store
    removed = 0
    for run_id in finished_runs(output):
        at = _finished_at(store, run_id)
        if at is None or at > before:
            continue
        attempt_folders = tally_files(store, run_id)  # each attempt's actors' call tallies
        doomed = [
            p
            for sub in ("attempts", "units", "started", "inputs", "plan")
            for p in store.list_files(store.run_state(run_id, sub))
            if not (sub == "attempts" and posixpath.basename(p) in attempt_folders)
        ]
        doomed += [p for paths in attempt_folders.values() for p in paths]
        doomed.append(store.run_state(run_id, "plan.json"))
        for path in doomed:
            store.delete(path)
        removed += 1
    return removed


class LegacyLayout:
    """An output written by raypipe's earlier layout (read by `raypipe migrate`)."""

    def __init__(self, store: OutputStore) -> None:
        self.store = store

    def runs(self) -> list[str]:
        runs = self.store.path(STATE_DIR, "runs")
        try:
            self.store.fs.invalidate_cache(runs)
            return sorted(p.rsplit("/", 1)[-1] for p in self.store.fs.ls(runs, detail=False))
        except FileNotFoundError:
            return []

    def has_commit_marker(self, run_id: str) -> bool:
        """Did the run finish in the earlier layout (its `COMMITTED.json`)? Not "committed"
        in the table: that is `OutcomeTable.is_committed`."""
        return self.store.read_json_or_none(self.store.run_state(run_id, COMMITTED)) is not None

    def committed_units(self, run_id: str) -> set[str]:
        folder = self.store.run_state(run_id, "units")
        return {p.rsplit("/", 1)[-1].removesuffix(".json") for p in self.store.list_files(folder, ".json")}

    def unit_rows(self, run_id: str, unit: str) -> pa.Table | None:
        """A committed unit's results and dead letters as the table's rows (None: it has none)."""
        import pyarrow.parquet as pq

        from raypipe.commit.schema import text_hashes

        parts: list[pa.Table] = []
        for kind, path in (("result", self.results_file(run_id, unit)), ("dead_letter", self.dead_file(run_id, unit))):
            if not self.store.exists(path):
                continue
            with self.store.fs.open(path, "rb") as f:
                t = pq.read_table(f)
            n = t.num_rows
            cols: dict[str, Any] = {c: t.column(c) for c in t.column_names if c != "failed_at"}
            cols["outcome"] = pa.array([kind] * n, pa.string())
            cols["unit"] = pa.array([unit] * n, pa.string())
            cols["run_id"] = pa.array([run_id] * n, pa.string())
            if kind == "dead_letter":
                cols["inferred_at"] = t.column("failed_at")
                cols["text_hash"] = text_hashes(t.column("text"))
            parts.append(pa.table(cols))
        return pa.concat_tables(parts, promote_options="permissive") if parts else None

    def results_file(self, run_id: str, unit: str) -> str:
        return self.store.path("results", f"run={run_id}", f"{unit}.parquet")

    def dead_file(self, run_id: str, unit: str) -> str:
        return self.store.path("dead_letters", f"run={run_id}", f"{unit}.parquet")

"""Reading the outcomes table, and keeping it in shape.

- `read_outcomes(output, run_id=None)`: every committed row (results and dead letters).
- `latest(output)`: one row per id: the newest source version (`updated_at`), a result before
  a dead letter of the same version, then the newest inference, then `run_id`, `source`,
  `row`. `LATEST_SQL` states that order once, as plain SQL over a relation named
  `outcomes`; the docs show it for DuckDB, Spark, Athena and Trino, and `latest` runs it.
- `ledger(output, run_id)`: a run's committed rows by outcome, the report's row counts.
- `compact` and `vacuum`: Delta's own `optimize` and `vacuum` (small files; files no commit
  references, such as those of a fenced-off attempt), plus removing finished runs' state.
- `migrate`: copies an output written by raypipe ≤ 0.1 (`results/`, `dead_letters/` Parquet
  with commit markers) into the table.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.errors import ConfigError
from raypipe.sinks import OUTCOME_DEAD_LETTER, OUTCOME_RESULT, OutcomeTable

__all__ = [
    "LATEST_SQL",
    "VACUUM_FLOOR_HOURS",
    "Ledger",
    "compact",
    "latest",
    "ledger",
    "ledger_of",
    "migrate",
    "read_outcomes",
    "vacuum",
]

logger = logging.getLogger("raypipe")

LATEST_SQL = """
SELECT * EXCLUDE (rn) FROM (
  SELECT *, row_number() OVER (
    PARTITION BY id
    ORDER BY updated_at DESC NULLS LAST,
             CASE WHEN outcome = 'result' THEN 0 ELSE 1 END,
             inferred_at DESC NULLS LAST,
             run_id DESC, source DESC NULLS LAST, "row" DESC NULLS LAST
  ) AS rn
  FROM outcomes
) WHERE rn = 1
""".strip()
"""One row per id, the same row for every query (the order is total):
1. the newest source version (`updated_at`; a row without one is older than any with one);
2. within a source version, a result before a dead letter: a dead letter wins only over
   results of an older source version, never over a valid result of its own;
3. then the newest inference (`inferred_at`: a re-backfill with a new model wins);
4. then the greatest `run_id`, `source`, `row`: a tie-breaker, so the answer never depends
   on the order files are scanned in.
`EXCLUDE` is DuckDB's; other engines list the columns."""


def _dataset(output: str) -> Any:
    return OutcomeTable(output).load().to_pyarrow_dataset()


def read_outcomes(output: str, run_id: str | None = None, *, columns: list[str] | None = None) -> pa.Table:
    """Every committed row of the output (of one run if `run_id` is given): results and dead
    letters, told apart by `outcome`. Rows of unfinished or fenced-off commits are never here."""
    ds = _dataset(output)
    flt = None if run_id is None else pc.field("run_id") == run_id
    return ds.to_table(filter=flt, columns=columns)


def latest(output: str) -> pa.Table:
    """One row per id (results and dead letters) in the order `LATEST_SQL` states: the newest
    source version, a result before a dead letter of that version, the newest inference, then
    `run_id`, `source`, `row`. Runs `LATEST_SQL` with DuckDB over the committed files."""
    import duckdb

    con = duckdb.connect()
    try:
        con.register("outcomes", _dataset(output))
        return con.sql(LATEST_SQL).to_arrow_table()
    finally:
        con.close()


class Ledger(dict[str, int]):
    """Row counts of a run's committed rows: `result:ok`, `result:empty_text`, `dead_letter:<kind>`."""

    @property
    def results(self) -> int:
        return sum(v for k, v in self.items() if k.startswith(f"{OUTCOME_RESULT}:"))

    @property
    def dead_letters(self) -> int:
        return sum(v for k, v in self.items() if k.startswith(f"{OUTCOME_DEAD_LETTER}:"))

    def of(self, key: str) -> int:
        return self.get(key, 0)

    def dead_letter_kinds(self) -> dict[str, int]:
        return {k.split(":", 1)[1]: v for k, v in self.items() if k.startswith(f"{OUTCOME_DEAD_LETTER}:")}


def ledger(output: str, run_id: str) -> Ledger:
    table = OutcomeTable(output)
    if not table.exists():
        return Ledger()
    return ledger_of(read_outcomes(output, run_id, columns=["outcome", "status", "error_kind"]))


def ledger_of(rows: pa.Table) -> Ledger:
    """Rows (with `outcome`, `status`, `error_kind`) counted in `Ledger`'s form."""
    counts: Counter[str] = Counter()
    if rows.num_rows:
        grouped = rows.group_by(["outcome", "status", "error_kind"]).aggregate([([], "count_all")])
        for r in grouped.to_pylist():
            detail = r["status"] if r["outcome"] == OUTCOME_RESULT else r["error_kind"]
            counts[f"{r['outcome']}:{detail}"] += int(r["count_all"])
    return Ledger(counts)


def compact(output: str, *, run_ids: list[str] | None = None, target_size: int | None = None) -> dict[str, Any]:
    """Delta `optimize.compact` over finished runs' partitions (all finished runs by default).

    An unfinished run is never compacted: its progress is read from one file per unit.
    """
    from raypipe.runstate import finished_runs

    table = OutcomeTable(output)
    runs = run_ids if run_ids is not None else finished_runs(output)
    done = set(finished_runs(output))
    unfinished = [r for r in runs if r not in done]
    if unfinished:
        raise ValueError(f"runs still unfinished (not compacted): {', '.join(unfinished)}")
    if not runs:
        return {"runs": 0}
    dt = table.load()
    metrics = dt.optimize.compact(partition_filters=[("run_id", "in", runs)], target_size=target_size)
    return {"runs": len(runs), **{k: v for k, v in metrics.items() if isinstance(v, int | float)}}


VACUUM_FLOOR_HOURS = 168.0
"""The shortest retention `vacuum` takes unless forced: Delta's own default
(`delta.deletedFileRetentionDuration`, 7 days), far above the longest a unit may take between
writing its file and committing it (a unit's inference, breaker waits, commit retries)."""


def vacuum(
    output: str, *, retention_hours: float = VACUUM_FLOOR_HOURS, dry_run: bool = False, force: bool = False
) -> dict[str, Any]:
    """Delta `vacuum`: deletes data files no commit references and that are older than the
    retention (fenced-off or failed commits, files compacted away), and the commit log's
    expired entries; then the run state of runs committed before the retention.

    A file written by a live attempt is referenced by no commit until its unit commits, so a
    short retention could delete it under that commit. A retention under `VACUUM_FLOOR_HOURS`
    is refused (`ConfigError`) unless `force`; the retention is rounded up to whole hours
    (delta-rs takes an int), never down.
    """
    from raypipe.runstate import drop_finished_state

    if not retention_hours >= 0:
        raise ConfigError(f"vacuum: --retention-hours must be >= 0, got {retention_hours}")
    if retention_hours < VACUUM_FLOOR_HOURS and not force:
        raise ConfigError(
            f"vacuum: a retention of {retention_hours:g} h is under {VACUUM_FLOOR_HOURS:g} h and may delete the files "
            "of a unit a live run has written but not committed yet; pass --force if no run writes to this output"
        )
    table = OutcomeTable(output)
    dt = table.load()
    files = dt.vacuum(
        retention_hours=math.ceil(retention_hours), dry_run=dry_run, enforce_retention_duration=False, full=True
    )
    if not dry_run:
        dt.cleanup_metadata()
    removed = 0 if dry_run else drop_finished_state(output, before=datetime.now(UTC) - timedelta(hours=retention_hours))
    return {"files": len(files), "dry_run": dry_run, "runs_state_removed": removed}


def migrate(output: str) -> dict[str, int]:
    """Copies an output of raypipe's earlier layout (`results/run=R/*.parquet`,
    `dead_letters/run=R/*.parquet`, committed units' markers under `_raypipe/runs/R/units/`)
    into the outcomes table, one commit per run; the old files are left in place.

    Only units with a commit marker are copied (an unfinished attempt's files never were
    committed), and only a run with its `COMMITTED.json` is recorded as committed in the
    table: a half-done legacy run, resumed under its run id, infers its other units. A run
    already in the table is skipped, so the command can be rerun.
    """
    import pyarrow.parquet as pq

    from raypipe.runstate import LegacyLayout
    from raypipe.sinks import text_hashes

    old = LegacyLayout(output)
    table = OutcomeTable(output)
    copied = {"runs": 0, "rows": 0}
    for run_id in old.runs():
        if table.exists() and run_id in _runs_in_table(table):
            continue
        units = old.committed_units(run_id)
        parts: list[pa.Table] = []
        labels: list[str] = []
        for unit in sorted(units):
            for kind, path in (
                ("result", old.results_file(run_id, unit)),
                ("dead_letter", old.dead_file(run_id, unit)),
            ):
                if not old.store.exists(path):
                    continue
                with old.store.fs.open(path, "rb") as f:
                    t = pq.read_table(f)
                labels = labels or [c.removeprefix("prob_") for c in t.column_names if c.startswith("prob_")]
                n = t.num_rows
                cols: dict[str, Any] = {c: t.column(c) for c in t.column_names if c != "failed_at"}
                cols["outcome"] = pa.array([kind] * n, pa.string())
                cols["unit"] = pa.array([unit] * n, pa.string())
                cols["run_id"] = pa.array([run_id] * n, pa.string())
                if kind == "dead_letter":
                    cols["inferred_at"] = t.column("failed_at")
                    cols["text_hash"] = text_hashes(t.column("text"))
                parts.append(pa.table(cols))
        if not parts:
            continue
        table.ensure(tuple(labels))
        full = table.arrow_schema()
        rows = pa.concat_tables(
            [
                pa.Table.from_arrays(
                    [
                        p.column(f.name).cast(f.type) if f.name in p.column_names else pa.nulls(p.num_rows, f.type)
                        for f in full
                    ],
                    schema=full,
                )
                for p in parts
            ]
        )
        from deltalake import CommitProperties, write_deltalake

        write_deltalake(
            table.load(),
            rows,
            mode="append",
            partition_by=["run_id"],
            commit_properties=CommitProperties(
                custom_metadata={"raypipe.operation": "migrate", "raypipe.run_id": run_id}
            ),
        )
        if old.is_committed(run_id):  # else a half-done legacy run: resuming it does its other units
            fence = table.take_over(run_id, holder="migrate")
            table.mark_committed(fence, {"raypipe.migrated": "true"})
        copied["runs"] += 1
        copied["rows"] += rows.num_rows
        logger.info("migrated run %s: %d rows", run_id, rows.num_rows)
    return copied


def _runs_in_table(table: OutcomeTable) -> set[str]:
    actions = pa.table(table.load().get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return set()
    return set(pc.unique(actions.column("partition.run_id")).to_pylist())

"""Reading the outcomes table.

- `read_outcomes(output, run_id=None)`: every committed row (results and dead letters).
- `latest(output)`: one row per id: the newest source version (`updated_at`), a result before
  a dead letter of the same version, then the newest inference, then `run_id`, `source`,
  `row`. `LATEST_SQL` states that order once, as plain SQL over a relation named
  `outcomes`; the docs show it for DuckDB, Spark, Athena and Trino, and `latest` runs it.
- `ledger(output, run_id)`: a run's committed rows by outcome, the report's row counts.

Keeping the table in shape (`compact`, `vacuum`, `migrate`) is `raypipe.commit.upkeep`'s.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.table import OUTCOME_DEAD_LETTER, OUTCOME_RESULT, OutcomeTable

__all__ = ["LATEST_SQL", "Ledger", "latest", "ledger", "ledger_of", "read_outcomes"]

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

"""Reading the outcomes table.

- `read_outcomes(output, run_id=None)`: every committed row (results and dead letters).
- `latest(output)`: one row per id: the newest source version (`updated_at`, text), a result
  before a dead letter of the same version, then the latest run. `LATEST_SQL` states that
  order once, as plain SQL over a relation named `outcomes`; the docs show it for DuckDB,
  Spark, Athena and Trino, and `latest` runs it.
- `ledger(table, run_id)`: a run's committed rows by outcome, the report's row counts.

Keeping the table in shape (`compact`, `vacuum`, `migrate`) is `raypipe.commit.upkeep`'s.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.schema import OUTCOME_DEAD_LETTER, OUTCOME_RESULT
from raypipe.commit.table import OutcomeTable
from raypipe.config.sections import output_uri  # a reader's URI, checked before delta-rs is asked

__all__ = [
    "LATEST_SQL",
    "Ledger",
    "answered_versions",
    "latest",
    "latest_of",
    "ledger",
    "ledger_of",
    "read_outcomes",
    "versions_of",
]

LATEST_SQL = """
WITH runs AS (
  SELECT *, min(coalesce(first_inferred_at, inferred_at)) OVER (PARTITION BY run_id) AS run_order
  FROM outcomes
), versions AS (
  SELECT *,
    max(coalesce(updated_at, run_order)) OVER (PARTITION BY id, updated_at, text_hash) AS version_at,
    max(run_order) OVER (PARTITION BY id, updated_at, text_hash) AS version_seen
  FROM runs
), ranked AS (
  SELECT *, row_number() OVER (
    PARTITION BY id
    ORDER BY version_at DESC NULLS LAST, version_seen DESC NULLS LAST,
             text_hash DESC NULLS LAST, updated_at DESC NULLS LAST,
             CASE WHEN outcome = 'result' THEN 0 ELSE 1 END,
             run_order DESC NULLS LAST, inferred_at DESC NULLS LAST,
             run_id DESC, source DESC NULLS LAST, "row" DESC NULLS LAST
  ) AS rn
  FROM versions
)
SELECT * EXCLUDE (rn, run_order, version_at, version_seen) FROM ranked WHERE rn = 1
""".strip()
"""One row per id, the same row for every query (the order is total).

A *source version* of an id is its (`updated_at`, text), the text told by `text_hash`. A run's
*place* in commit order is the earliest `inferred_at` of its rows, its first commit: one writer
holds an output at a time, so runs commit one after another; every row of a run has the same
place, so which unit of a run committed first never matters, and a replay (whose rows carry the
run they replay, and keep the `inferred_at` they had first as `first_inferred_at`) leaves its
run where it was.
1. The newest source version wins: by `updated_at`; a version without `updated_at` is placed at
   the latest run that saw it, so a text seen later wins over any version committed before it,
   and a producer that drops the column is not the oldest forever.
2. Versions in the same place: the one the later run saw; then (two texts of one id with one
   `updated_at` in one run: a duplicate id in the input) the greater `text_hash`, an arbitrary
   rule that every engine and every run applies alike.
3. Within the winning version, a result before a dead letter: a dead letter wins only over
   answers of other, older versions (the text changed and its new text failed), never over a
   result of its own text (a replay's result beats the dead letter it replays).
4. Then the later run (a re-backfill with a new model wins), the newest inference, and the
   greatest `run_id`, `source`, `row`, so the answer never depends on the order files are
   scanned in.
An id whose input row was deleted keeps its last answer: the table records answers, not the
input's current rows. Rows without `text_hash` (written by releases before it) are one text
per `updated_at`. `EXCLUDE` is DuckDB's; other engines list the columns."""


def _dataset(output: str | OutcomeTable, run_id: str | None = None) -> Any:
    """The committed files as a pyarrow dataset; of one run's partition only with `run_id`
    (pruned by the log, so a run's reads do not walk every file the table's history holds)."""
    # A table passed in is brought up to date: every committed row, not those of its snapshot.
    dt = output.refresh() if isinstance(output, OutcomeTable) else OutcomeTable(output_uri(output)).load()
    partitions = None if run_id is None else [("run_id", "=", run_id)]
    return dt.to_pyarrow_dataset(partitions=partitions)


def read_outcomes(
    output: str | OutcomeTable, run_id: str | None = None, *, columns: list[str] | None = None
) -> pa.Table:
    """Every committed row of the output (of one run if `run_id` is given): results and dead
    letters, told apart by `outcome`. Rows of unfinished or fenced-off commits are never here.
    A run passes its own table (`OutcomeTable`), a user the output's URI."""
    ds = _dataset(output, run_id)
    flt = None if run_id is None else pc.field("run_id") == run_id
    return ds.to_table(filter=flt, columns=columns)


def latest(output: str) -> pa.Table:
    """One row per id (results and dead letters), chosen as `LATEST_SQL` states: the newest
    source version, where a version is (`updated_at`, text) and a version without `updated_at`
    is placed at the latest run that saw it (runs in the order of their first commit); a result
    before a dead letter of the winning version; then the later run, the newest inference,
    `run_id`, `source`, `row`. Ids
    whose input rows were deleted keep their last answer. Runs `LATEST_SQL` with DuckDB over
    the committed files."""
    return latest_of(_dataset(output))


def latest_of(outcomes: Any) -> pa.Table:
    """`LATEST_SQL` over ``outcomes`` (a pyarrow Table or dataset with the table's columns)."""
    import duckdb

    con = duckdb.connect()
    try:
        if "first_inferred_at" in outcomes.schema.names:
            con.register("outcomes", outcomes)
        else:  # a table written before the column, not yet run on by this release
            con.register("stored", outcomes)
            con.sql("CREATE VIEW outcomes AS SELECT *, NULL::TIMESTAMPTZ AS first_inferred_at FROM stored")
        return con.sql(LATEST_SQL).to_arrow_table()
    finally:
        con.close()


def answered_versions(output: str | OutcomeTable, run_id: str) -> dict[str, int]:
    """The run's committed results by the model version that answered them, over every attempt
    (more than one only when a resume was allowed to change model)."""
    if not (output if isinstance(output, OutcomeTable) else OutcomeTable(output_uri(output))).exists():
        return {}
    return versions_of(read_outcomes(output, run_id, columns=["model_version"]))


def versions_of(rows: pa.Table) -> dict[str, int]:
    """Results (rows with a `model_version`) counted by the model version, most first."""
    counts = rows.group_by("model_version").aggregate([([], "count_all")]).to_pylist()
    return {
        r["model_version"]: int(r["count_all"])
        for r in sorted(counts, key=lambda r: -r["count_all"])
        if r["model_version"]
    }


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


def ledger(table: OutcomeTable, run_id: str) -> Ledger:
    """Run `run_id`'s committed rows by outcome (none if the table does not exist yet)."""
    if not table.exists():
        return Ledger()
    rows = read_outcomes(table, run_id, columns=["outcome", "status", "error_kind"])
    return ledger_of(rows)


def ledger_of(rows: pa.Table) -> Ledger:
    """Rows (with `outcome`, `status`, `error_kind`) counted in `Ledger`'s form."""
    counts: Counter[str] = Counter()
    if rows.num_rows:
        grouped = rows.group_by(["outcome", "status", "error_kind"]).aggregate([([], "count_all")])
        for r in grouped.to_pylist():
            detail = r["status"] if r["outcome"] == OUTCOME_RESULT else r["error_kind"]
            counts[f"{r['outcome']}:{detail}"] += int(r["count_all"])
    return Ledger(counts)

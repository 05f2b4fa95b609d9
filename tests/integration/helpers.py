"""Reading an output location back, for the tests' "nothing lost, nothing twice" checks.

Everything goes through the outcomes table's log (`raypipe.read_outcomes`), as users read it:
files of a failed or fenced-off commit are never counted.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from raypipe.commit.outcomes import read_outcomes
from raypipe.commit.table import OutcomeTable


def _outcome(out: str | Path, outcome: str, run_id: str | None = None) -> pa.Table | None:
    if not OutcomeTable(str(out)).exists():
        return None
    rows = read_outcomes(str(out), run_id)
    rows = rows.filter(pc.equal(rows.column("outcome"), outcome))
    return rows if rows.num_rows else None


def results(out: str | Path, run_id: str | None = None) -> pa.Table | None:
    return _outcome(out, "result", run_id)


def dead_letters(out: str | Path, run_id: str | None = None) -> pa.Table | None:
    return _outcome(out, "dead_letter", run_id)


def committed_units(out: str | Path, run_id: str) -> int:
    """Units of `run_id` with committed rows (from the table's log)."""
    table = OutcomeTable(str(out))
    return len(table.committed_units(run_id)) if table.exists() else 0


def ids(table: pa.Table | None) -> list[str]:
    return [] if table is None else table.column("id").to_pylist()


def assert_nothing_lost(out: str | Path, input_ids: list[str]) -> tuple[list[str], list[str]]:
    """Every input id is in the results or the dead letters, exactly once overall."""
    got_results = ids(results(out))
    got_dead = ids(dead_letters(out))
    counts = Counter(got_results + got_dead)
    twice = [i for i, c in counts.items() if c > 1]
    assert not twice, f"{len(twice)} ids appear more than once, e.g. {twice[:5]}"
    missing = set(input_ids) - set(counts)
    assert not missing, f"{len(missing)} input ids are neither in results nor dead letters, e.g. {sorted(missing)[:5]}"
    extra = set(counts) - set(input_ids)
    assert not extra, f"unknown ids in the output: {sorted(extra)[:5]}"
    return got_results, got_dead

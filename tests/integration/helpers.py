"""Reading an output location back, for the tests' "nothing lost, nothing twice" checks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads


def _table(path: Path, sub: str) -> pa.Table | None:
    folder = path / sub
    files = sorted(str(p) for p in folder.rglob("*.parquet")) if folder.exists() else []
    if not files:
        return None
    return pads.dataset(files, format="parquet", partitioning=pads.partitioning(flavor="hive")).to_table()


def results(out: str | Path) -> pa.Table | None:
    return _table(Path(out), "results")


def dead_letters(out: str | Path) -> pa.Table | None:
    return _table(Path(out), "dead_letters")


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

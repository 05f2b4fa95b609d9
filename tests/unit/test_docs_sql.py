"""The SQL the docs show is the SQL the code runs."""

from __future__ import annotations

import re
from pathlib import Path

from raypipe.commit.outcomes import LATEST_SQL

DOC = Path(__file__).resolve().parents[2] / "docs" / "output-and-sql.md"


def test_the_latest_per_id_view_in_the_docs_is_latest_sql():
    shown = re.search(r"`raypipe\.commit\.outcomes\.LATEST_SQL`[^\n]*\n```sql\n(.*?)\n```", DOC.read_text(), re.S)
    assert shown is not None, "docs/output-and-sql.md no longer shows LATEST_SQL"
    assert shown.group(1).strip() == LATEST_SQL

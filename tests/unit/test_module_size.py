"""No module in `raypipe/` passes ~400 lines without saying why.

A module that long is usually two concepts (docs/development.md, the style guide): split it by
job, or, where it has one job, say so in its docstring with a paragraph that starts "Over ~400
lines" and gives the reason. A new module past the limit without one fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raypipe"

LIMIT = 400
"""Lines a module may have without a reason beside it."""

REASON = re.compile(r"^Over ~?\d+ lines\b", re.MULTILINE)


def over_without_reason(package: Path) -> list[str]:
    """Modules under `package` past `LIMIT` lines whose docstring gives no reason, with their size."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not REASON.search(doc):
            found.append(f"{path.relative_to(package).as_posix()} ({lines} lines)")
    return found


def test_no_module_passes_the_limit_without_a_reason():
    assert over_without_reason(PACKAGE) == []


def test_the_check_sees_a_long_module_and_its_reason(tmp_path):
    body = "x = 1\n" * LIMIT
    (tmp_path / "long.py").write_text('"""A module."""\n' + body, encoding="utf-8")
    (tmp_path / "said.py").write_text('"""A module.\n\nOver ~400 lines on purpose: one job."""\n' + body)
    (tmp_path / "short.py").write_text('"""A module."""\n' + "x = 1\n" * (LIMIT - 1), encoding="utf-8")
    assert over_without_reason(tmp_path) == [f"long.py ({LIMIT + 1} lines)"]

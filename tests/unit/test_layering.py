"""The layers import downwards only: `protos` (the wire contract and the metric emitters) lies
below both `raypipe` (the client side) and `serve_app` (the model service); neither of those
imports the other, except where a user joins them (the CLI, the demo, the public API's lazy
re-exports of the model export)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOINS = {
    "raypipe/cli/model.py",
    "raypipe/cli/parser.py",
    "raypipe/cli/serve.py",
    "raypipe/demo.py",
    "raypipe/samples.py",
    "raypipe/__init__.py",
}
"""The CLI, the demo and its sample corpus (the demo model's paragraphs), and the public API."""


def imports(package: str, *, module_level: bool = False) -> dict[str, set[str]]:
    """Module path -> the top-level packages its import statements name (only the statements
    run at import with `module_level`)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("protos/raypipe/"):
            continue  # generated code
        names: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body if module_level else ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[rel] = names
    return found


def test_serve_app_does_not_import_raypipe():
    assert {m for m, names in imports("serve_app").items() if "raypipe" in names} == set()


def test_raypipe_imports_serve_app_only_where_a_user_joins_them():
    assert {m for m, names in imports("raypipe").items() if "serve_app" in names} <= JOINS


def test_protos_imports_neither_and_not_ray_at_import():
    assert {m for m, names in imports("protos").items() if names & {"raypipe", "serve_app"}} == set()
    assert {m for m, names in imports("protos", module_level=True).items() if "ray" in names} == set()

"""Executes the notebooks in place, so they are committed with their outputs.

    python notebooks/execute.py                      # both notebooks
    python notebooks/execute.py backfill_and_explore.ipynb

Each notebook runs top to bottom in a fresh Jupyter kernel from the repository's root, as a
user runs it: it joins the Ray cluster at `RAY_ADDRESS` (or one `ray start` left running), or
starts a local one that stops with its kernel, and deploys the model service it needs itself
(the offline demo model, built once into `.cache/demo-model`). Nothing is started here.

A reader on GitHub then sees the tables and the plot without running anything; the tests run
the same notebooks again against the test cluster (tests/integration/test_notebooks.py).
Data goes under `notebook-output/` (git-ignored), which is emptied first; each kernel's own
log (Ray's lines as its cluster stops, say) goes to `notebook-output/<notebook>.kernel.log`.
The outputs are written with the machine's paths taken out (`scrub`): the repository's path
becomes relative, the home folder `~`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
WORK = REPO / "notebook-output"
ORDER = ("backfill_and_explore.ipynb", "run_report_and_dead_letters.ipynb")


def scrub(nb: Any, paths: dict[str, str]) -> Any:
    """`nb` with each of `paths`' keys replaced by its value in every output's text and data
    (the longest key first, so the repository's path wins over the home folder holding it)."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for old in sorted(paths, key=len, reverse=True):
                value = value.replace(old, paths[old])
            return value
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return type(value)((k, clean(v)) for k, v in value.items())
        return value

    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [clean(o) for o in cell.get("outputs", [])]
    return nb


def machine_paths(repo: Path = REPO) -> dict[str, str]:
    """The executing machine's paths in a notebook's outputs and what they become: the repository's
    (a run's output folder is `notebook-output/...` in it) and the home folder."""
    return {f"{repo}/": "", str(repo): ".", f"{Path.home()}/": "~/"}


def execute_in_place(name: str, *, timeout_s: int = 600) -> None:
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    # A kernel's start on a fresh venv (IPython and ipykernel without their bytecode) on a busy
    # machine can take over nbclient's default 60 s.
    client = NotebookClient(
        nb, timeout=timeout_s, startup_timeout=240, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    WORK.mkdir(exist_ok=True)
    with open(WORK / f"{path.stem}.kernel.log", "w") as log:  # passed to the kernel's Popen
        client.execute(stdout=log, stderr=log)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    if errors:
        raise SystemExit(f"{name}: a cell failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    nbformat.write(scrub(nb, machine_paths()), path)
    print(f"executed {path.relative_to(REPO)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python notebooks/execute.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(ORDER), help="notebooks to run (default: all, in order)")
    args = parser.parse_args(argv)
    shutil.rmtree(WORK, ignore_errors=True)
    for name in args.names:
        execute_in_place(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

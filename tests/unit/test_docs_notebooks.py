"""The committed notebooks' outputs carry no path of the machine that ran them, and
`notebooks/execute.py` takes them out when it writes the outputs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
_ABSOLUTE = re.compile(r"(?<![\w.~])/(?:home|Users|root|work|tmp|mnt|opt|srv|private|var/folders)/[\w.-]+")


def _execute_module():
    spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks" / "execute.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _output_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(str(o) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_the_committed_notebooks_outputs_name_no_machine_path():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = _output_text(nbformat.read(path, as_version=4))
        assert _ABSOLUTE.findall(text) == [], path.name
        assert str(ROOT) not in text, path.name


def test_execute_scrubs_the_repository_and_home_paths_from_outputs(tmp_path):
    execute = _execute_module()
    repo, home = tmp_path / "home" / "ann" / "raypipe", tmp_path / "home" / "ann"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "report",
            outputs=[
                nbformat.v4.new_output(
                    "execute_result",
                    data={
                        "text/plain": f"RunReport(output='{repo}/notebook-output/explore/output')",
                        "text/html": f"<td>{repo}/notebook-output/x</td><td>{home}/.cache/m</td><td>{repo}</td>",
                    },
                    execution_count=1,
                ),
                nbformat.v4.new_output("stream", name="stderr", text=f"model at {home}/models/demo\n"),
            ],
        )
    ]
    paths = execute.machine_paths(repo)
    paths[f"{home}/"] = "~/"  # what Path.home() gives on that machine
    scrubbed = execute.scrub(nb, paths)
    text = _output_text(scrubbed)
    assert str(tmp_path) not in text
    data = scrubbed.cells[0].outputs[0].data
    assert data["text/plain"] == "RunReport(output='notebook-output/explore/output')"
    assert data["text/html"] == "<td>notebook-output/x</td><td>~/.cache/m</td><td>.</td>"
    assert scrubbed.cells[0].outputs[1].text == "model at ~/models/demo\n"
    nbformat.validate(scrubbed)

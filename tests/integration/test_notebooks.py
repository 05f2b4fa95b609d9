"""The notebooks under notebooks/ run cleanly, top to bottom, against the session's cluster.

Each runs in a fresh Jupyter kernel (nbclient), which joins the test cluster as a second
driver (on a user's machine it starts a local cluster when none runs). The notebooks read
their settings from `RAYPIPE_NB_*` variables; here they point at the session's Serve gRPC
proxy, a temporary folder, and for the dead-letter story an S3 output. That notebook makes its
own story: it deploys the poison application, writes the input, runs the backfill, reads the
report from the output URI, and deletes the application.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, workdir: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel's own start (IPython and ipykernel imported, on a fresh clone without their
    # bytecode, beside the other lanes) took over nbclient's default 60 s on 2 busy cores.
    client = NotebookClient(nb, timeout=240, startup_timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})  # fmt: skip
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    return nb


def test_notebooks_are_committed_with_their_outputs():
    """A reader sees tables and the plot without running anything (`make notebooks` refreshes them)."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), f"{path.name} has cells never run"
        counts = [c.execution_count for c in code]
        assert counts == sorted(counts), f"{path.name} was not run top to bottom"
        outputs = [o for c in code for o in c.outputs]
        assert outputs and not [o for o in outputs if o.output_type == "error"], f"{path.name}: no outputs, or errors"
    assert len(list(NOTEBOOKS.glob("*.ipynb"))) >= 2


@pytest.fixture
def kernel_env(monkeypatch, ray_cluster):
    # The kernel inherits this process's environment: the cluster's address and token settings.
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.gcs_address)
    return monkeypatch


@pytest.mark.timeout(600)
def test_backfill_and_explore_notebook(tmp_path, serve_address, kernel_env):
    kernel_env.setenv("RAYPIPE_NB_SERVICE", serve_address)
    kernel_env.setenv("RAYPIPE_NB_WORKDIR", str(tmp_path / "work"))
    kernel_env.setenv("RAYPIPE_NB_ROWS", "300")
    kernel_env.setenv("RAYPIPE_NB_RUN_ID", "nb-explore")
    nb = execute("backfill_and_explore.ipynb", tmp_path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the label distribution plot"
    assert any("text/html" in o.get("data", {}) and "COMPLETED" in o["data"]["text/html"] for o in outputs)
    assert (tmp_path / "work" / "output" / "runs" / "nb-explore.json").exists()


# The notebook deploys its own application beside the session's: more CPU than the default replica leaves.
@pytest.mark.usefixtures("room_beside_session_app")
@pytest.mark.timeout(600)
def test_report_and_dead_letters_notebook(tmp_path, serve_address, demo_model_dir, s3, kernel_env):
    from ray import serve

    output = f"{s3.bucket('nb-dead-letters')}/out"  # the report is read from the URI, not a local path
    kernel_env.setenv("RAYPIPE_NB_SERVICE", serve_address)
    kernel_env.setenv("RAYPIPE_NB_WORKDIR", str(tmp_path / "work"))
    kernel_env.setenv("RAYPIPE_NB_OUTPUT", output)
    kernel_env.setenv("RAYPIPE_NB_RUN_ID", "nb-dead")
    kernel_env.setenv("RAYPIPE_DEMO_MODEL_DIR", str(demo_model_dir))
    nb = execute("run_report_and_dead_letters.ipynb", tmp_path)
    text = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "completed: 58 results, 2 dead letters" in text
    assert "2 dead letters; the report counts 2" in text
    assert "n007" in text and "n041" in text
    assert s3.fs().exists(f"{output.removeprefix('s3://')}/runs/nb-dead.json")
    assert "nb-poison" not in serve.status().applications  # the notebook cleans up after itself

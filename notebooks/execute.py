"""Executes the notebooks in place, so they are committed with their outputs (`make notebooks`).

A reader on GitHub sees the tables and the plot without running anything; the tests execute
the same notebooks again against the test cluster (tests/integration/test_notebooks.py).

What it runs, on a local 2-CPU Ray cluster with the offline demo model:
- the `raypipe` Serve app on 127.0.0.1:9000, and beside it `nb-poison`, the same model set to
  fail on paragraphs containing "CRASHME" (`serve_app.settings.FaultInjection`);
- backfill_and_explore.ipynb as a user runs it (its defaults: `notebook-output/`, 300 rows);
- a 60-paragraph backfill through `nb-poison` (2 poison paragraphs become dead letters), then
  run_report_and_dead_letters.ipynb on that run.

Data is written under `notebook-output/` (git-ignored); the outputs show this machine's paths.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nbformat
import pyarrow as pa
import pyarrow.parquet as pq
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
WORK = REPO / "notebook-output"
POISON_RUN = "notebook-dead-letters"


def execute_in_place(name: str, env: dict[str, str]) -> None:
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    os.environ.update(env)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    if errors:
        raise SystemExit(f"{name}: a cell failed: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    nbformat.write(nb, path)
    print(f"executed {path.relative_to(REPO)}")


def main() -> None:
    import ray

    import raypipe
    from raypipe.modes import start_local_ray
    from serve_app.demo_model import build_demo_model, default_demo_model_dir
    from serve_app.deploy import DeploymentOptions, deploy
    from serve_app.settings import FaultInjection, ServerSettings

    shutil.rmtree(WORK, ignore_errors=True)
    model = build_demo_model(default_demo_model_dir())
    start_local_ray(num_cpus=2, include_dashboard=False)
    try:
        # The notebook kernels join this cluster as further drivers.
        address = ray.get_runtime_context().gcs_address
        options = DeploymentOptions(num_cpus=0.5)
        service = deploy(model, options=options)
        deploy(
            model,
            app_name="nb-poison",
            settings=ServerSettings(fault=FaultInjection(poison_text="CRASHME", status="INTERNAL")),
            options=options,
        )
        env = {"RAY_ADDRESS": address, "RAYPIPE_NB_SERVICE": service}
        execute_in_place("backfill_and_explore.ipynb", env)

        ids = [f"n{i:03d}" for i in range(60)]
        texts = [f"CRASHME {i}" if i in (7, 41) else f"I am so happy today, number {i}." for i in range(60)]
        (WORK / "poison-input").mkdir(parents=True)
        pq.write_table(pa.table({"id": ids, "text": texts}), WORK / "poison-input" / "part-0.parquet")
        raypipe.backfill(
            str(WORK / "poison-input"),
            str(WORK / "poison-output"),
            service=service,
            run_id=POISON_RUN,
            settings={"service": {"application": "nb-poison"}, "client": {"retry": {"initial_backoff_s": 0.05}}},
        )
        execute_in_place(
            "run_report_and_dead_letters.ipynb",
            {**env, "RAYPIPE_NB_OUTPUT": "notebook-output/poison-output", "RAYPIPE_NB_RUN_ID": POISON_RUN},
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

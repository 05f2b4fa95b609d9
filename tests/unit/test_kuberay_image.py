"""The image recipe and the two scripts it carries (no Docker daemon needed).

- The Dockerfile builds on the Ray CPU image that matches the pinned Ray and Python, which
  is also the `rayVersion` of every Ray cluster in the manifests. It copies only what its
  `.dockerignore` lets through, and it puts the scripts where the manifests call them. It
  runs as a non-root user.
- `fetch_model.py` (the model service's init container) copies a model directory into place
  only when its model card validates.
- `create_rayjob.py` (the legacy daily scheduler) builds its RayJob from the template. It
  skips a tick while an earlier RayJob still runs, waits for the one it created, reports its
  outcome in its exit code, and prunes old RayJobs.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shutil
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kuberay import validate

IMAGE = validate.REPO / "kuberay" / "image"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kuberay_image_{name}", IMAGE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fetch_model = _load("fetch_model")
create_rayjob = _load("create_rayjob")


# --- Dockerfile ---------------------------------------------------------------------------


def _dockerfile() -> str:
    return (IMAGE / "Dockerfile").read_text(encoding="utf-8")


def _ignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    patterns = [
        line.strip()
        for line in (IMAGE / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(p, body) for p in prefixes):
            ignored = not negate
    return ignored


def test_base_image_matches_the_pinned_ray_and_python() -> None:
    pyproject = tomllib.loads((validate.REPO / "pyproject.toml").read_text(encoding="utf-8"))
    ray_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("ray["))
    ray_version = ray_pin.split("==")[1]
    python = re.search(r">=(\d+)\.(\d+)", pyproject["project"]["requires-python"])
    assert python is not None
    base = re.search(r"^ARG RAY_IMAGE=(\S+)$", _dockerfile(), flags=re.M)
    assert base is not None
    assert base.group(1) == f"rayproject/ray:{ray_version}-py{python.group(1)}{python.group(2)}-cpu"


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod-kuberay-1.5"])
def test_every_ray_cluster_declares_the_image_ray_version(overlay: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    resources = validate.render(validate.OVERLAYS / overlay)
    base = re.search(r"rayproject/ray:([\d.]+)-", _dockerfile())
    assert base is not None
    versions = [
        validate.get(r, "spec", "rayClusterConfig", "rayVersion") for r in resources if r["kind"] == "RayService"
    ]
    versions += [j.spec["rayClusterSpec"]["rayVersion"] for j in validate.jobs(resources)]
    assert versions and set(versions) == {base.group(1)}


def test_copied_files_exist_and_pass_the_dockerignore() -> None:
    sources = []
    for line in _dockerfile().splitlines():
        if line.startswith("COPY "):
            words = [w for w in line.split()[1:] if not w.startswith("--")]
            sources += words[:-1]
    assert sources
    for source in sources:
        assert (validate.REPO / source).exists(), source
        assert not _ignored(source), f"{source} is excluded by Dockerfile.dockerignore"
    assert _ignored(".venv") and _ignored(".cache/demo-model") and _ignored("raypipe/__pycache__")


def test_scripts_are_where_the_manifests_call_them() -> None:
    text = _dockerfile()
    assert re.search(r"COPY .*kuberay/image/fetch_model.py kuberay/image/create_rayjob.py /opt/raypipe/bin/", text)
    manifests = "\n".join(p.read_text(encoding="utf-8") for p in (validate.REPO / "kuberay").rglob("*.yaml"))
    assert set(re.findall(r"/opt/raypipe/bin/(\w+\.py)", manifests)) == {"fetch_model.py", "create_rayjob.py"}


def test_image_runs_as_a_non_root_user() -> None:
    users = re.findall(r"^USER (\S+)$", _dockerfile(), flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")


# --- fetch_model.py -----------------------------------------------------------------------


def _model(path: Path, version: str = "v1") -> Path:
    from serve_app.model import MODEL_FORMAT

    (path / "tokenizer").mkdir(parents=True)
    (path / "tokenizer" / "vocab.txt").write_text("[PAD]\n", encoding="utf-8")
    card = {"format": MODEL_FORMAT, "labels": ["joy", "anger"], "version": version, "max_sequence_length": 64}
    (path / "model.json").write_text(json.dumps(card), encoding="utf-8")
    return path


def test_fetch_model_copies_a_valid_model_into_place(tmp_path: Path) -> None:
    target = tmp_path / "models" / "current"
    assert fetch_model.fetch(str(_model(tmp_path / "v1")), target) == "v1"
    assert (target / "tokenizer" / "vocab.txt").is_file()
    assert fetch_model.fetch(str(_model(tmp_path / "v2", "v2")) + "/", target) == "v2"  # replaces it
    assert json.loads((target / "model.json").read_text())["version"] == "v2"
    assert [p.name for p in target.parent.iterdir()] == ["current"]  # no staging left behind


def test_fetch_model_refuses_a_directory_without_a_valid_card(tmp_path: Path) -> None:
    from serve_app.model import ModelDirError

    target = tmp_path / "models" / "current"
    with pytest.raises(ModelDirError, match=r"no model\.json"):
        fetch_model.fetch(str(tmp_path / "nothing"), target)
    broken = _model(tmp_path / "broken")
    (broken / "model.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ModelDirError):
        fetch_model.fetch(str(broken), target)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_fetch_model_main_reports_by_exit_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "out" / "current"))
    monkeypatch.setenv("MODEL_URI", str(tmp_path / "absent"))
    assert fetch_model.main() == 1
    monkeypatch.setenv("MODEL_URI", str(_model(tmp_path / "m")))
    assert fetch_model.main() == 0
    monkeypatch.delenv("MODEL_URI")
    assert fetch_model.main() == 2


# --- create_rayjob.py ---------------------------------------------------------------------


def _template() -> dict[str, Any]:
    path = validate.REPO / "kuberay" / "components" / "daily-cronjob-legacy" / "rayjob-daily-template.yaml"
    doc: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return doc


def test_prepare_sets_every_image_and_the_schedule_label() -> None:
    job = create_rayjob.prepare(_template(), image="reg/raypipe:1.0", scheduled_by="raypipe-daily-legacy")
    assert job["metadata"]["generateName"] == "raypipe-daily-"
    assert job["metadata"]["labels"][create_rayjob.SCHEDULED_BY] == "raypipe-daily-legacy"
    pods = [job["spec"]["submitterPodTemplate"], job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]]
    pods += [g["template"] for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    images = {c["image"] for p in pods for c in p["spec"].get("initContainers", []) + p["spec"]["containers"]}
    assert images == {"reg/raypipe:1.0"}
    assert _template()["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["image"] == "raypipe"  # not mutated


def test_prepare_refuses_a_template_with_a_fixed_name() -> None:
    template = _template()
    template["metadata"]["name"] = "raypipe-daily"
    with pytest.raises(ValueError, match="generateName"):
        create_rayjob.prepare(template, image="i:1", scheduled_by="s")


class FakeApi:
    """RayJobs in memory; each `get` of the created job advances it one status."""

    def __init__(self, existing: list[dict[str, Any]], statuses: list[dict[str, str]]) -> None:
        self.jobs = {j["metadata"]["name"]: j for j in existing}
        self.statuses = statuses
        self.created: list[str] = []
        self.deleted: list[str] = []

    def list(self, scheduled_by: str) -> list[dict[str, Any]]:
        return list(self.jobs.values())

    def create(self, rayjob: dict[str, Any]) -> dict[str, Any]:
        name = rayjob["metadata"]["generateName"] + "abcde"
        self.jobs[name] = {
            **rayjob,
            "metadata": {**rayjob["metadata"], "name": name, "creationTimestamp": "2026-12-31"},
        }
        self.created.append(name)
        return self.jobs[name]

    def get(self, name: str) -> dict[str, Any]:
        self.jobs[name]["status"] = self.statuses.pop(0)
        return self.jobs[name]

    def delete(self, name: str) -> None:
        self.deleted.append(name)
        del self.jobs[name]


def _old(name: str, day: str, status: str = "Complete") -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": day}, "status": {"jobDeploymentStatus": status}}


def test_run_waits_for_its_rayjob_and_prunes_old_ones() -> None:
    api = FakeApi(
        [_old("raypipe-daily-old1", "2026-12-01"), _old("raypipe-daily-old2", "2026-12-02")],
        [{"jobDeploymentStatus": "Running"}, {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}],
    )
    job = create_rayjob.prepare(_template(), image="i:1", scheduled_by="raypipe-daily-legacy")
    sleeps: list[float] = []
    assert create_rayjob.run(api, job, keep=2, poll_s=30, sleep=sleeps.append) == 0
    assert api.created == ["raypipe-daily-abcde"] and sleeps == [30]
    assert api.deleted == ["raypipe-daily-old1"]


def test_run_fails_when_the_ray_job_failed() -> None:
    api = FakeApi([], [{"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}])
    job = create_rayjob.prepare(_template(), image="i:1", scheduled_by="s")
    assert create_rayjob.run(api, job, keep=14, poll_s=1, sleep=lambda s: None) == 1


def test_run_skips_a_tick_while_an_earlier_rayjob_runs(capsys: pytest.CaptureFixture[str]) -> None:
    api = FakeApi([_old("raypipe-daily-slow", "2026-12-30", status="Running")], [])
    job = create_rayjob.prepare(_template(), image="i:1", scheduled_by="s")
    assert create_rayjob.run(api, job, keep=14, poll_s=1, sleep=lambda s: None) == 0
    assert api.created == [] and "raypipe-daily-slow still running" in capsys.readouterr().out


def test_run_keeps_polling_through_api_server_errors() -> None:
    import urllib.error

    class Flaky(FakeApi):
        def __init__(self) -> None:
            super().__init__([], [{"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}])
            self.failures = 2

        def get(self, name: str) -> dict[str, Any]:
            if self.failures:
                self.failures -= 1
                raise urllib.error.URLError("connection refused")
            return super().get(name)

    api = Flaky()
    job = create_rayjob.prepare(_template(), image="i:1", scheduled_by="s")
    sleeps: list[float] = []
    assert create_rayjob.run(api, job, keep=14, poll_s=5, sleep=sleeps.append) == 0
    assert sleeps == [5, 5]

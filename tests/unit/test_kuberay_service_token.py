"""The model service's bearer token on KubeRay: one Secret, in every Ray container that checks or
sends it, in no other pod, and the RayService's builder told to check it.

Offline: `kubectl kustomize` renders the overlays, nothing is applied. Each rule of
`kuberay.identity.service_token_problems` is shown to fail on a copy of a rendered overlay that
breaks it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay import identity, policy, validate
from kuberay.validate import Resource
from protos.credential import TOKEN_ENV

OVERLAYS = sorted(p.name for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "kuberay.md"
FROM_SECRET = {"secretKeyRef": {"name": "raypipe-service-token", "key": "token"}}

Mutation = Callable[[list[Resource]], Any]


def rendered(overlay: str) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def ray_clusters(resources: list[Resource]) -> list[tuple[str, dict[str, Any]]]:
    """(where, cluster spec) of the model service and of every job, embedded ones included."""
    found = [
        (f"{validate.ref(r)}.spec.rayClusterConfig", r["spec"]["rayClusterConfig"])
        for r in resources
        if r["kind"] == "RayService"
    ]
    found += [
        (f"{j.where}.rayClusterSpec", j.spec["rayClusterSpec"])
        for j in validate.jobs(resources)
        if "rayClusterSpec" in j.spec
    ]
    return found


def token_var(container: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in container.get("env") or [] if v["name"] == TOKEN_ENV), None)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_of_the_model_service_and_the_jobs_has_the_token_from_the_secret(overlay: str) -> None:
    resources = rendered(overlay)
    clusters = ray_clusters(resources)
    # the model service, the backfill and the daily (a RayCronJob, or the legacy CronJob's template)
    assert len(clusters) == 3, [w for w, _ in clusters]
    for where, cluster in clusters:
        for at, pod in validate.cluster_pod_templates(where, cluster):
            var = token_var(pod["spec"]["containers"][0])
            assert var is not None and var.get("valueFrom") == FROM_SECRET and "value" not in var, at


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_model_service_checks_the_token_and_no_submitter_or_scheduler_holds_it(overlay: str) -> None:
    resources = rendered(overlay)
    rayservice = next(r for r in resources if r["kind"] == "RayService")
    apps = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert [a["args"].get("token_env") for a in apps] == [TOKEN_ENV]
    callers = {at for where, c in ray_clusters(resources) for at, _ in validate.cluster_pod_templates(where, c)}
    others = [(at, pod) for at, pod in validate.pod_templates(resources) if at not in callers]
    assert any("submitterPodTemplate" in at for at, _ in others)
    for at, pod in others:
        assert all(token_var(c) is None for c in pod["spec"]["containers"]), at


def test_the_guide_creates_the_secret_the_manifests_read() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert re.search(
        r"kubectl -n raypipe create secret generic raypipe-service-token\s*\\?\s*--from-literal=token=", text
    ), "docs/kuberay.md must say how to create raypipe-service-token (key token)"


# --- each rule fails on a copy that breaks it ----------------------------------------------


def _named(rs: list[Resource], kind: str, name: str) -> Resource:
    return next(r for r in rs if r["kind"] == kind and r["metadata"]["name"] == name)


def _ray_container(rs: list[Resource], kind: str, name: str, group: str) -> dict[str, Any]:
    spec = _named(rs, kind, name)["spec"]
    cluster = {"RayService": lambda: spec["rayClusterConfig"], "RayJob": lambda: spec["rayClusterSpec"]}.get(
        kind, lambda: spec["jobTemplate"]["rayClusterSpec"]
    )()
    template = cluster["headGroupSpec"]["template"] if group == "head" else cluster["workerGroupSpecs"][0]["template"]
    container: dict[str, Any] = template["spec"]["containers"][0]
    return container


def _drop_var(container: dict[str, Any]) -> None:
    container["env"] = [v for v in container["env"] if v["name"] != TOKEN_ENV]


def _literal(container: dict[str, Any]) -> None:
    _drop_var(container)
    container["env"].append({"name": TOKEN_ENV, "value": "0123abcd"})


def _from_secret(container: dict[str, Any], secret: str) -> None:
    _drop_var(container)
    container["env"].append({"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}})


def _legacy(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    cm = next(r for r in rs if r["kind"] == "ConfigMap" and "rayjob-template" in r["metadata"]["name"])
    key = next(iter(cm["data"]))
    doc = yaml.safe_load(cm["data"][key])
    edit(doc)
    cm["data"][key] = yaml.safe_dump(doc)


def _serve_args(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    spec = _named(rs, "RayService", "raypipe")["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    edit(config["applications"][0]["args"])
    spec["serveConfigV2"] = yaml.safe_dump(config)


BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "backfill-worker-without-token": (
        "prod",
        lambda rs: _drop_var(_ray_container(rs, "RayJob", "raypipe-backfill", "worker")),
        "RayJob/raypipe-backfill.rayClusterSpec.workerGroupSpecs[0].template.containers[ray-worker]: "
        "RAYPIPE_SERVICE_TOKEN is not set: this Ray container sends",
    ),
    "service-head-without-token": (
        "dev",
        lambda rs: _drop_var(_ray_container(rs, "RayService", "raypipe", "head")),
        "headGroupSpec.template.containers[ray-head]: RAYPIPE_SERVICE_TOKEN is not set: this Ray container checks",
    ),
    "literal-token": (
        "prod",
        lambda rs: _literal(_ray_container(rs, "RayCronJob", "raypipe-daily", "head")),
        "RAYPIPE_SERVICE_TOKEN must come from secretKeyRef raypipe-service-token[token], not literal",
    ),
    "legacy-template-another-secret": (
        "prod-kuberay-1.5",
        lambda rs: _legacy(
            rs,
            lambda d: _from_secret(
                d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0], "raypipe-s3"
            ),
        ),
        "not raypipe-s3[token]",
    ),
    "builder-not-told": (
        "prod-tls",
        lambda rs: _serve_args(rs, lambda a: a.pop("token_env")),
        "application raypipe: args.token_env must be RAYPIPE_SERVICE_TOKEN",
    ),
    "submitter-holds-it": (
        "prod",
        lambda rs: _named(rs, "RayJob", "raypipe-backfill")["spec"]["submitterPodTemplate"]["spec"]["containers"][0][
            "env"
        ].append({"name": TOKEN_ENV, "valueFrom": FROM_SECRET}),
        "RayJob/raypipe-backfill.submitterPodTemplate.containers[ray-job-submitter]: holds RAYPIPE_SERVICE_TOKEN",
    ),
    "scheduler-holds-it": (
        "prod-kuberay-1.5",
        lambda rs: _named(rs, "CronJob", "raypipe-daily-legacy")["spec"]["jobTemplate"]["spec"]["template"]["spec"][
            "containers"
        ][0]["env"].append({"name": TOKEN_ENV, "valueFrom": FROM_SECRET}),
        "CronJob/raypipe-daily-legacy.spec.jobTemplate.spec.template.containers[create-rayjob]: holds",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_service_token_rules_reject_broken_copies(case: str) -> None:
    overlay, mutate, expected = BREAKS[case]
    resources = rendered(overlay)
    assert identity.service_token_problems(resources) == []
    mutate(resources)
    problems = policy.project_problems(resources)
    assert any(expected in p for p in problems), problems

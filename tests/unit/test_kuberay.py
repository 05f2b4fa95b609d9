"""The KubeRay manifests: every overlay renders and passes the checks of `kuberay.validate`.

- the KubeRay 1.7 CRD schemas, made strict (`additionalProperties: false` wherever an object
  declares `properties`), for RayService, RayJob, RayCronJob and the RayJob template the legacy
  CronJob keeps in a ConfigMap, from the copy in kuberay/crds (checked against its README's
  hashes); `python -m kuberay.validate` fails when it cannot read them;
- Kubernetes' own schemas (strict) for the core kinds: NetworkPolicy, CronJob, ConfigMap, RBAC;
- the operator's cross-field rules, which no schema holds;
- raypipe's deployment rules (pool, requests = limits, non-root, ClusterIP...); the network,
  identity, placement and TLS rules have their own file (test_kuberay_network.py).

Each check is also shown to fail on a deliberately broken copy of the manifest it guards.
serveConfigV2 and the entrypoints have their own files (test_kuberay_serve.py,
test_kuberay_entrypoints.py). Offline: `kubectl kustomize` renders, nothing is applied.
"""

from __future__ import annotations

import copy
import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay import policy, validate
from kuberay.validate import Resource

OVERLAYS = sorted(p.name for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def rendered(directory: str | Path) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(directory if isinstance(directory, Path) else validate.OVERLAYS / directory)


@pytest.fixture(scope="module")
def crds() -> Path:
    return validate.DEFAULT_CRDS


def find(resources: list[Resource], kind: str, name: str | None = None) -> Resource:
    for r in resources:
        if r.get("kind") == kind and (name is None or name in r["metadata"].get("name", "")):
            return r
    raise LookupError(f"no {kind} {name or ''} rendered")


def test_overlays_exist() -> None:
    assert {"dev", "prod", "prod-kuberay-1.5", "prod-watch"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_what_the_issue_asks_for(overlay: str) -> None:
    resources = rendered(overlay)
    kinds = [r["kind"] for r in resources]
    watchers = [j for j in validate.jobs(resources) if j.watch]  # components/watch, instead of a schedule
    assert kinds.count("RayService") == 1
    assert kinds.count("RayJob") == 1 + len(watchers)
    assert kinds.count("ServiceAccount") >= 2  # raypipe-serve, raypipe-jobs (and the legacy scheduler's)
    assert kinds.count("NetworkPolicy") == 8 + 3 * len(watchers)  # kuberay/base/networkpolicy.yaml (+ the watcher's)
    schedules = [
        r["kind"] for r in resources if r["kind"] in ("RayCronJob", "CronJob") and not validate.is_maintenance(r)
    ]
    assert len(schedules) + len(watchers) == 1, kinds
    # the output's maintenance (components/maintenance) beside a daily schedule, never beside a watcher
    assert sum(map(validate.is_maintenance, resources)) == (0 if watchers else 1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_crd_schemas_accept_the_overlay(overlay: str, crds: Path) -> None:
    assert validate.schema_problems(rendered(overlay), crds) == []


def test_crd_schemas_accept_the_base(crds: Path) -> None:
    assert validate.schema_problems(rendered(validate.REPO / "kuberay" / "base"), crds) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_schemas_accept_the_core_kinds(overlay: str) -> None:
    pytest.importorskip("kubernetes_validate", reason="the kubernetes-validate package checks the core kinds")
    assert validate.core_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_rules_accept_the_overlay(overlay: str) -> None:
    assert validate.operator_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_project_rules_accept_the_overlay(overlay: str) -> None:
    assert policy.project_problems(rendered(overlay)) == []


def test_every_rayjob_spec_is_found() -> None:
    """The checks see the backfill, the RayCronJob's template and the legacy ConfigMap's template."""
    assert {(j.where, j.scheduled) for j in validate.jobs(rendered("prod"))} == {
        ("RayJob/raypipe-backfill", False),
        ("RayCronJob/raypipe-daily.spec.jobTemplate", True),
    }
    legacy = {(j.where.split("-template-")[0], j.scheduled) for j in validate.jobs(rendered("prod-kuberay-1.5"))}
    assert legacy == {("RayJob/raypipe-backfill", False), ("ConfigMap/raypipe-daily-rayjob", True)}


def test_the_docs_port_forward_only_to_services_kuberay_makes() -> None:
    """A RayJob's cluster (and so its head Service) has a random suffix: the docs find it by label."""
    doc = (validate.REPO / "docs" / "kuberay.md").read_text(encoding="utf-8")
    services = {
        f"{r['metadata']['name']}-{suffix}"
        for r in rendered("prod")
        if r["kind"] == "RayService"
        for suffix in ("head-svc", "serve-svc")
    }
    named = re.findall(r"port-forward\s+svc/([\w-]+)", doc)
    assert named and set(named) <= services, named
    assert "get rayjob raypipe-backfill -o jsonpath='{.status.rayClusterName}'" in doc
    assert "get svc -l ray.io/cluster=$C,ray.io/node-type=head -o name" in doc


def test_strict_closes_objects_that_declare_properties() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}, "m": {"type": "object"}},
    }
    out = validate.strict(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["m"]  # a free-form map stays open
    assert "additionalProperties" not in schema  # the input is not changed


def test_the_crd_schemas_are_kuberay_1_7_0_as_named() -> None:
    """kuberay/crds holds the four CRDs its README names, byte for byte, and nothing else."""
    readme = (validate.DEFAULT_CRDS / "README.md").read_text(encoding="utf-8")
    assert "v1.7.0" in readme
    named = dict(re.findall(r"\| `(ray\.io_\w+\.yaml)` \| `([0-9a-f]{64})` \|", readme))
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in validate.DEFAULT_CRDS.glob("*.yaml")}
    assert files == named
    assert set(validate.crd_schemas(validate.DEFAULT_CRDS)) == set(validate.CRD_KINDS)


def test_missing_crd_folder_is_reported_not_passed(tmp_path: Path) -> None:
    with pytest.raises(validate.SchemasUnavailable):
        validate.crd_schemas(tmp_path)
    results = validate.check([], crd_dir=tmp_path / "absent")
    assert results["schema"] == [
        f"cannot check the KubeRay CRD schemas: no KubeRay CRD folder at {tmp_path / 'absent'}"
    ]
    (tmp_path / "rayjobs.yaml").write_text((validate.DEFAULT_CRDS / "ray.io_rayjobs.yaml").read_text("utf-8"), "utf-8")
    with pytest.raises(validate.SchemasUnavailable, match=r"no ray\.io/v1 CRD for RayCluster, RayService, RayCronJob"):
        validate.crd_schemas(tmp_path)


@pytest.mark.parametrize("crds", ["absent", "empty"])
def test_the_cli_fails_in_one_line_when_it_cannot_check_schemas(
    crds: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert validate.main([str(validate.OVERLAYS / "dev"), "--crds", str(tmp_path / crds)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("FAILED: cannot check the KubeRay CRD schemas:"), out


@pytest.mark.parametrize(
    ("schedule", "ok"),
    [
        ("30 2 * * *", True),
        ("*/15 0-6 1,15 JAN-MAR mon-fri", True),
        ("@daily", True),
        ("TZ=Europe/Berlin 0 3 * * *", True),
        ("30 2 * *", False),
        ("61 2 * * *", False),
        ("0 2 * * 7", False),
        ("0 2 * * MON-SUNDAY", False),
        ("0 */0 * * *", False),
    ],
)
def test_cron_schedules(schedule: str, ok: bool) -> None:
    assert (validate.cron_problem(schedule) is None) == ok


# --- broken copies ------------------------------------------------------------------------

Mutation = Callable[[list[Resource]], None]


def _rayservice(rs: list[Resource]) -> dict[str, Any]:
    return find(rs, "RayService")["spec"]


def _backfill(rs: list[Resource]) -> dict[str, Any]:
    return find(rs, "RayJob", "raypipe-backfill")["spec"]


def _daily(rs: list[Resource]) -> dict[str, Any]:
    return find(rs, "RayCronJob")["spec"]


def _legacy_template(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    cm = find(rs, "ConfigMap", "raypipe-daily-rayjob-template")
    key = next(iter(cm["data"]))
    doc = yaml.safe_load(cm["data"][key])
    edit(doc)
    cm["data"][key] = yaml.safe_dump(doc)


def _head(cluster: dict[str, Any]) -> dict[str, Any]:
    return cluster["headGroupSpec"]["template"]["spec"]["containers"][0]


def _worker_group(cluster: dict[str, Any]) -> dict[str, Any]:
    return cluster["workerGroupSpecs"][0]


SCHEMA_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "rayservice-typo": (
        "prod",
        lambda rs: _rayservice(rs)["rayClusterConfig"]["headGroupSpec"].update(rayStartParam={"num-cpus": "0"}),
        "'rayStartParam' was unexpected",
    ),
    "rayservice-typo-deep": (
        "prod",
        lambda rs: _head(_rayservice(rs)["rayClusterConfig"])["ports"][0].update(containerPorts=6379),
        "'containerPorts' was unexpected",
    ),
    "rayjob-typo": (
        "prod",
        lambda rs: _backfill(rs).update(shutdownAfterJobFinish=True),
        "'shutdownAfterJobFinish' was unexpected",
    ),
    "rayjob-wrong-type": ("prod", lambda rs: _backfill(rs).update(backoffLimit="2"), "'2' is not of type 'integer'"),
    "raycronjob-typo": ("prod", lambda rs: _daily(rs).update(timezone="Etc/UTC"), "'timezone' was unexpected"),
    "raycronjob-rule-enum": (
        "prod",
        lambda rs: _daily(rs)["jobTemplate"]["deletionStrategy"]["deletionRules"][0].update(policy="DeleteAll"),
        "'DeleteAll' is not one of",
    ),
    "legacy-template-typo": (
        "prod-kuberay-1.5",
        lambda rs: _legacy_template(rs, lambda d: d["spec"].update(ttlSecondAfterFinished=60)),
        "'ttlSecondAfterFinished' was unexpected",
    ),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_BREAKS))
def test_crd_schemas_reject_broken_copies(case: str, crds: Path) -> None:
    overlay, mutate, expected = SCHEMA_BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = validate.schema_problems(resources, crds)
    assert any(expected in p for p in problems), problems


CORE_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "networkpolicy-typo": (
        "prod",
        lambda rs: find(rs, "NetworkPolicy")["spec"].update(podSelecter={}),
        "'podSelecter' was unexpected",
    ),
    "cronjob-typo": (
        "prod-kuberay-1.5",
        lambda rs: find(rs, "CronJob")["spec"].update(concurencyPolicy="Forbid"),
        "'concurencyPolicy' was unexpected",
    ),
    "role-typo": (
        "prod-kuberay-1.5",
        lambda rs: find(rs, "Role")["rules"][0].update(verb=["create"]),
        "'verb' was unexpected",
    ),
    "serviceaccount-typo": (
        "prod",
        lambda rs: find(rs, "ServiceAccount", "raypipe-serve").update(automountServiceAccountTokens=False),
        "'automountServiceAccountTokens' was unexpected",
    ),
}


@pytest.mark.parametrize("case", sorted(CORE_BREAKS))
def test_kubernetes_schemas_reject_broken_copies(case: str) -> None:
    pytest.importorskip("kubernetes_validate", reason="the kubernetes-validate package checks the core kinds")
    overlay, mutate, expected = CORE_BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = validate.core_problems(resources)
    assert any(expected in p for p in problems), problems


OPERATOR_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "ttl-without-shutdown": (
        "prod",
        lambda rs: _backfill(rs).update(shutdownAfterJobFinishes=False),
        "ttlSecondsAfterFinished needs shutdownAfterJobFinishes",
    ),
    "cluster-spec-and-selector": (
        "prod",
        lambda rs: _backfill(rs).update(clusterSelector={"ray.io/cluster": "raypipe"}),
        "exactly one of rayClusterSpec and clusterSelector",
    ),
    "neither-cluster-spec-nor-selector": (
        "prod",
        lambda rs: _backfill(rs).pop("rayClusterSpec"),
        "exactly one of rayClusterSpec and clusterSelector",
    ),
    "deletion-rules-with-shutdown": (
        "prod",
        lambda rs: _daily(rs)["jobTemplate"].update(shutdownAfterJobFinishes=True),
        "mutually exclusive",
    ),
    "deletion-rule-ttl-order": (
        "prod",
        lambda rs: _daily(rs)["jobTemplate"]["deletionStrategy"]["deletionRules"][2]["condition"].update(
            ttlSeconds=99999999
        ),
        "DeleteSelf ttlSeconds (1209600) must be >= DeleteCluster's",
    ),
    "deletion-condition-both-statuses": (
        "prod",
        lambda rs: _daily(rs)["jobTemplate"]["deletionStrategy"]["deletionRules"][0]["condition"].update(
            jobDeploymentStatus="Failed"
        ),
        "exactly one of jobStatus and jobDeploymentStatus",
    ),
    "legacy-template-ttl-without-shutdown": (
        "prod-kuberay-1.5",
        lambda rs: _legacy_template(rs, lambda d: d["spec"].pop("shutdownAfterJobFinishes")),
        "ttlSecondsAfterFinished needs shutdownAfterJobFinishes",
    ),
    "token-auth-on-old-ray": (
        "prod",
        lambda rs: _rayservice(rs)["rayClusterConfig"].update(rayVersion="2.46.0"),
        "needs Ray >= 2.52.0",
    ),
    "min-above-max": (
        "prod",
        lambda rs: _worker_group(_rayservice(rs)["rayClusterConfig"]).update(minReplicas=9),
        "minReplicas (9) <= maxReplicas (8)",
    ),
    "bad-cron": ("prod", lambda rs: _daily(rs).update(schedule="30 2 * *"), "invalid cron schedule"),
    "bad-time-zone": ("prod", lambda rs: _daily(rs).update(timeZone="Mars/Olympus"), "is not a time zone"),
    "long-raycronjob-name": (
        "prod",
        lambda rs: find(rs, "RayCronJob")["metadata"].update(name="raypipe-daily-" + "x" * 30),
        "KubeRay allows 41",
    ),
    "bad-upgrade-type": (
        "prod",
        lambda rs: _rayservice(rs)["upgradeStrategy"].update(type="BlueGreen"),
        "upgradeStrategy.type 'BlueGreen'",
    ),
}


@pytest.mark.parametrize("case", sorted(OPERATOR_BREAKS))
def test_operator_rules_reject_broken_copies(case: str) -> None:
    overlay, mutate, expected = OPERATOR_BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = validate.operator_problems(resources)
    assert any(expected in p for p in problems), problems


def _drop_port(rs: list[Resource], name: str) -> None:
    head = _head(_rayservice(rs)["rayClusterConfig"])
    head["ports"] = [p for p in head["ports"] if p["name"] != name]


PROJECT_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "default-port-dropped": ("prod", lambda rs: _drop_port(rs, "gcs-server"), "must declare port gcs-server=6379"),
    "grpc-port-dropped": ("prod", lambda rs: _drop_port(rs, "serve-grpc"), "must declare port serve-grpc=9000"),
    "head-runs-replicas": (
        "prod",
        lambda rs: _rayservice(rs)["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": "2"}),
        'num-cpus "0"',
    ),
    "requests-below-limits": (
        "dev",
        lambda rs: _head(_backfill(rs)["rayClusterSpec"])["resources"]["requests"].update(cpu="1"),
        "requests must equal resources.limits",
    ),
    "off-the-pool": (
        "prod",
        lambda rs: _backfill(rs)["submitterPodTemplate"]["spec"].pop("nodeSelector"),
        "nodeSelector must pick the pool",
    ),
    "taint-not-tolerated": (
        "prod",
        lambda rs: _worker_group(_rayservice(rs)["rayClusterConfig"])["template"]["spec"].pop("tolerations"),
        "tolerations must admit",
    ),
    "root-pod": (
        "prod",
        lambda rs: _rayservice(rs)["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["securityContext"].update(
            runAsNonRoot=False
        ),
        "runAsNonRoot must be true",
    ),
    "literal-credential": (
        "prod",
        lambda rs: (
            _head(_backfill(rs)["rayClusterSpec"])
            .setdefault("env", [])
            .append({"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"})
        ),
        "has a literal value",
    ),
    "secret-in-manifests": (
        "prod",
        lambda rs: rs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "raypipe-s3"}}),
        "Secrets are created out of band",
    ),
    "dashboard-exposed": (
        "prod",
        lambda rs: _rayservice(rs)["rayClusterConfig"]["headGroupSpec"].update(serviceType="LoadBalancer"),
        "must stay ClusterIP",
    ),
    "no-token-auth": (
        "prod",
        lambda rs: _backfill(rs)["rayClusterSpec"].pop("authOptions"),
        "authOptions must be mode token",
    ),
    "job-pods-unlabelled": (
        "prod",
        lambda rs: _worker_group(_backfill(rs)["rayClusterSpec"])["template"]["metadata"]["labels"].pop(
            "raypipe.io/model-client"
        ),
        "raypipe.io/model-client",
    ),
    "job-on-serving-cluster": (
        "prod",
        lambda rs: _backfill(rs).update(clusterSelector={"ray.io/cluster": "raypipe"}),
        "not on the serving cluster",
    ),
    "no-retries": ("prod", lambda rs: _backfill(rs).update(backoffLimit=0), "backoffLimit >= 1"),
    "no-clean-up": ("prod", lambda rs: _daily(rs)["jobTemplate"].pop("deletionStrategy"), "clean up"),
    "two-daily-schedules": (
        "prod",
        lambda rs: rs.append(copy.deepcopy(find(rs, "RayCronJob")) | {"metadata": {"name": "raypipe-daily-2"}}),
        "exactly one daily schedule",
    ),
    "no-upgrade-strategy": ("prod", lambda rs: _rayservice(rs).pop("upgradeStrategy"), "must be NewCluster"),
    "two-images": (
        "prod",
        lambda rs: _head(_backfill(rs)["rayClusterSpec"]).update(image="rayproject/ray:2.60.0-py311-cpu"),
        "more than one image",
    ),
    "legacy-image-not-copied": (
        "prod-kuberay-1.5",
        lambda rs: find(rs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["env"][
            0
        ].update(value="raypipe"),
        "RAYPIPE_IMAGE raypipe is not the container's image",
    ),
    "model-worker-without-agent-host": (
        "prod",
        lambda rs: _worker_group(_rayservice(rs)["rayClusterConfig"])["template"]["spec"]["containers"][0].pop("env"),
        "needs env DD_AGENT_HOST from fieldRef status.hostIP",
    ),
    "daily-head-with-a-fixed-agent-host": (
        "prod",
        lambda rs: _head(_daily(rs)["jobTemplate"]["rayClusterSpec"]).update(
            env=[{"name": "DD_AGENT_HOST", "value": "datadog-agent"}]
        ),
        "RayCronJob/raypipe-daily.spec.jobTemplate.rayClusterSpec.headGroupSpec.template.containers[ray-head]: "
        "needs env DD_AGENT_HOST",
    ),
    "backfill-submitter-without-agent-host": (
        "dev",
        lambda rs: _backfill(rs)["submitterPodTemplate"]["spec"]["containers"][0].update(
            env=[
                v
                for v in _backfill(rs)["submitterPodTemplate"]["spec"]["containers"][0]["env"]
                if v["name"] != "DD_AGENT_HOST"
            ]
        ),
        "submitterPodTemplate.containers[ray-job-submitter]: needs env DD_AGENT_HOST",
    ),
    "backfill-without-step-label": (
        "prod",
        lambda rs: find(rs, "RayJob")["metadata"]["labels"].pop("raypipe.io/job"),
        "the model-service step (no raypipe.io/job label) holds",
    ),
    "placeholder-left": (
        "prod",
        lambda rs: find(rs, "ConfigMap", "raypipe-params")["data"].update(JOB_OUTPUT_URI="s3://CHANGE-ME/x/"),
        "CHANGE-ME",
    ),
}


@pytest.mark.parametrize("case", sorted(PROJECT_BREAKS))
def test_project_rules_reject_broken_copies(case: str) -> None:
    overlay, mutate, expected = PROJECT_BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = policy.project_problems(resources)
    assert any(expected in p for p in problems), problems

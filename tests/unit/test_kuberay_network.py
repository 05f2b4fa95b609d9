"""The locked-down network, the identities and the placement of raypipe's manifests.

Every overlay passes `kuberay.netpol`, `kuberay.identity` and `kuberay.model_service` (through
`policy.project_problems`), and each rule is shown to fail on a copy of a rendered overlay that
breaks it: a rule open to every source, a peer wider than the pods it means, the gRPC port open
to the head or to non-clients, a cluster closed to itself, the operator or a submitter shut
out, a token Secret or ServiceAccount shared, replicas that could land anywhere. Offline:
`kubectl kustomize` renders, nothing is applied.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay import netpol, policy, validate
from kuberay.model_service import advertised_resources
from kuberay.validate import Resource

OVERLAYS = sorted(p.name for p in validate.OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
POLICIES = {
    "raypipe-default-deny",
    "raypipe-kuberay-operator",
    "raypipe-model-service",
    "raypipe-model-service-grpc",
    "raypipe-backfill",
    "raypipe-backfill-submitter",
    "raypipe-daily",
    "raypipe-daily-submitter",
}
WATCH_POLICIES = {"raypipe-watch", "raypipe-watch-submitter", "raypipe-watch-egress"}
"""components/watch adds these beside the base's (tests/unit/test_kuberay_watch.py)."""

Mutation = Callable[[list[Resource]], Any]

SERVICE_HEAD = "RayService/raypipe.spec.rayClusterConfig.headGroupSpec.template"
SERVICE_WORKER = "RayService/raypipe.spec.rayClusterConfig.workerGroupSpecs[0].template"
BACKFILL = "RayJob/raypipe-backfill"
DAILY = "RayCronJob/raypipe-daily.spec.jobTemplate"


def rendered(overlay: str) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def named(rs: list[Resource], kind: str, name: str) -> Resource:
    return next(r for r in rs if r["kind"] == kind and r["metadata"]["name"] == name)


def np(rs: list[Resource], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = named(rs, "NetworkPolicy", name)["spec"]
    return spec


def drop(kind: str, name: str) -> Mutation:
    return lambda rs: rs.remove(named(rs, kind, name))


def service(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = named(rs, "RayService", "raypipe")["spec"]
    return spec


def cluster(rs: list[Resource], which: str) -> dict[str, Any]:
    if which == "service":
        return service(rs)["rayClusterConfig"]
    if which == "backfill":
        return job(rs, "backfill")["rayClusterSpec"]
    return job(rs, "daily")["rayClusterSpec"]


def job(rs: list[Resource], which: str) -> dict[str, Any]:
    if which == "backfill":
        spec: dict[str, Any] = named(rs, "RayJob", "raypipe-backfill")["spec"]
        return spec
    daily: dict[str, Any] = named(rs, "RayCronJob", "raypipe-daily")["spec"]["jobTemplate"]
    return daily


def pod(rs: list[Resource], which: str, group: str) -> dict[str, Any]:
    """The pod spec of a cluster's head ("head") or first worker group ("worker"), or a job's submitter."""
    if group == "submitter":
        spec: dict[str, Any] = job(rs, which)["submitterPodTemplate"]["spec"]
        return spec
    c = cluster(rs, which)
    template = c["headGroupSpec"]["template"] if group == "head" else c["workerGroupSpecs"][0]["template"]
    spec = template["spec"]
    return spec


def legacy_template(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    cm = next(r for r in rs if r["kind"] == "ConfigMap" and "rayjob-template" in r["metadata"]["name"])
    key = next(iter(cm["data"]))
    doc = yaml.safe_load(cm["data"][key])
    edit(doc)
    cm["data"][key] = yaml.safe_dump(doc)


def serve_config(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    config = yaml.safe_load(service(rs)["serveConfigV2"])
    edit(config)
    service(rs)["serveConfigV2"] = yaml.safe_dump(config)


def set_env_secret(env: list[dict[str, Any]], name: str, secret: str) -> None:
    next(v for v in env if v["name"] == name)["valueFrom"]["secretKeyRef"]["name"] = secret


# --- every overlay passes -----------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_policies(overlay: str) -> None:
    resources = rendered(overlay)
    names = {r["metadata"]["name"] for r in resources if r["kind"] == "NetworkPolicy"}
    watcher = any(j.watch for j in validate.jobs(resources))
    assert names == (POLICIES | WATCH_POLICIES if watcher else POLICIES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_passes_the_network_identity_and_placement_rules(overlay: str) -> None:
    assert policy.project_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_cluster_has_its_own_token_and_the_parts_their_own_accounts(overlay: str) -> None:
    resources = rendered(overlay)
    secrets = {
        j.where.split(".")[0]: j.spec["rayClusterSpec"]["authOptions"]["secretName"]
        for j in validate.jobs(resources)
        if "rayClusterSpec" in j.spec
    }
    secrets["RayService"] = service(resources)["rayClusterConfig"]["authOptions"]["secretName"]
    delta = "watch" if any(j.watch for j in validate.jobs(resources)) else "daily"  # the one that commits new files
    assert sorted(secrets.values()) == sorted(
        ["raypipe-backfill-ray-token", f"raypipe-{delta}-ray-token", "raypipe-serve-ray-token"]
    )
    accounts = {r["metadata"]["name"] for r in resources if r["kind"] == "ServiceAccount"}
    assert {"raypipe-serve", "raypipe-jobs"} <= accounts
    assert "raypipe" not in accounts


def test_prod_gives_each_account_its_own_role() -> None:
    resources = rendered("prod")
    roles = {
        r["metadata"]["name"]: r["metadata"].get("annotations", {}).get("eks.amazonaws.com/role-arn")
        for r in resources
        if r["kind"] == "ServiceAccount"
    }
    assert roles == {
        "raypipe-serve": "arn:aws:iam::111122223333:role/raypipe-serve",
        "raypipe-jobs": "arn:aws:iam::111122223333:role/raypipe-jobs",
        "raypipe-submitter": None,  # it only submits: no S3 access
    }


def test_a_submitter_running_as_the_jobs_account_is_a_problem() -> None:
    from kuberay.identity import identity_problems

    resources = rendered("prod")
    assert identity_problems(resources) == []
    for r in resources:
        template = (r.get("spec") or {}).get("submitterPodTemplate")
        if template:
            template["spec"]["serviceAccountName"] = "raypipe-jobs"
    assert any("the submitters run as ServiceAccount raypipe-jobs" in p for p in identity_problems(resources))


def test_the_model_workers_advertise_the_pool_the_replicas_ask_for() -> None:
    from serve_app.deploy import POOL_RESOURCE, POOL_RESOURCE_PER_NODE

    resources = rendered("prod")
    c = cluster(resources, "service")
    assert advertised_resources(c["workerGroupSpecs"][0]["rayStartParams"]) == (
        {POOL_RESOURCE: POOL_RESOURCE_PER_NODE},
        None,
    )
    assert advertised_resources(c["headGroupSpec"]["rayStartParams"]) == ({}, None)
    deployment = yaml.safe_load(service(resources)["serveConfigV2"])["applications"][0]["deployments"][0]
    assert deployment["ray_actor_options"]["resources"] == {POOL_RESOURCE: 1}


# --- the readers of rayStartParams' resources -----------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("'{\"raypipe_pool\": 1000}'", None),  # what KubeRay writes itself (common/pod.go)
        ('"{\\"raypipe_pool\\": 1000}"', "KubeRay's operator (getResourcesMap"),  # KubeRay's samples
        ('{"raypipe_pool": 1000}', "bash splits"),
        ("'{\"raypipe_pool\": 1000.0}'", "not a mapping of names to integer amounts"),
        ("'{\"raypipe_pool\": 1000'", "cannot read"),
    ],
)
def test_resources_must_read_the_same_to_bash_the_autoscaler_and_the_operator(value: str, why: str | None) -> None:
    advertised, problem = advertised_resources({"resources": value})
    if why is None:
        assert (advertised, problem) == ({"raypipe_pool": 1000}, None)
    else:
        assert problem is not None and why in problem, problem


def test_the_autoscaler_reads_resources_as_the_check_says() -> None:
    """The check mirrors Ray's own reader; run the real one on the manifests' value."""
    autoscaling_config = pytest.importorskip("ray.autoscaler._private.kuberay.autoscaling_config")
    params = cluster(rendered("prod"), "service")["workerGroupSpecs"][0]["rayStartParams"]
    assert autoscaling_config._get_custom_resources({}, params, "cpu") == {"raypipe_pool": 1000}


# --- NetworkPolicy semantics ----------------------------------------------------------------


def test_selectors_match_labels_and_expressions() -> None:
    labels = {"a": "1", "b": "2"}
    assert netpol.matches({}, labels)
    assert netpol.matches({"matchLabels": {"a": "1"}}, labels)
    assert not netpol.matches({"matchLabels": {"a": "2"}}, labels)
    assert netpol.matches({"matchExpressions": [{"key": "b", "operator": "In", "values": ["2", "3"]}]}, labels)
    assert not netpol.matches({"matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["2"]}]}, labels)
    assert netpol.matches({"matchExpressions": [{"key": "c", "operator": "DoesNotExist"}]}, labels)
    assert not netpol.matches({"matchExpressions": [{"key": "c", "operator": "Exists"}]}, labels)


def test_rule_ports_resolve_names_ranges_and_protocols() -> None:
    pod_ = netpol.Pod("p", {}, "ns", {"serve-grpc": 9000})
    assert netpol.rule_ports({}, pod_) == [(1, 65535)]
    assert netpol.rule_ports({"ports": [{"port": "serve-grpc"}]}, pod_) == [(9000, 9000)]
    assert netpol.rule_ports({"ports": [{"port": 1, "endPort": 8999}]}, pod_) == [(1, 8999)]
    assert netpol.rule_ports({"ports": [{"protocol": "UDP", "port": 9000}]}, pod_) == []
    assert netpol.rule_ports({"ports": [{"protocol": "TCP"}]}, pod_) == [(1, 65535)]


def test_the_pods_carry_the_labels_kuberay_gives_them() -> None:
    pods = {p.where: p for p in netpol.network(rendered("prod")).pods}
    head = pods["RayService/raypipe.spec.rayClusterConfig.headGroupSpec.template"]
    worker = pods["RayService/raypipe.spec.rayClusterConfig.workerGroupSpecs[0].template"]
    assert (head.labels["ray.io/node-type"], worker.labels["ray.io/node-type"]) == ("head", "worker")
    assert head.labels["app.kubernetes.io/name"] == "raypipe"  # the template's label wins over KubeRay's
    submitter = pods["RayJob/raypipe-backfill.submitterPodTemplate"]
    assert submitter.labels["batch.kubernetes.io/job-name"] == "raypipe-backfill"
    assert submitter.submits == "RayJob/raypipe-backfill"


def test_the_old_single_policy_fails() -> None:
    """main's policy (port 9000 from clients, every other port from everyone, jobs unselected)."""
    resources = rendered("prod")
    resources[:] = [r for r in resources if r["kind"] != "NetworkPolicy"]
    resources.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "raypipe-serve-grpc", "namespace": "raypipe"},
            "spec": {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "raypipe", "app.kubernetes.io/component": "model-service"}
                },
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"raypipe.io/model-client": "true"}}}],
                        "ports": [{"protocol": "TCP", "port": 9000}],
                    },
                    {
                        "ports": [
                            {"protocol": "TCP", "port": 1, "endPort": 8999},
                            {"protocol": "TCP", "port": 9001, "endPort": 65535},
                        ]
                    },
                ],
            },
        }
    )
    problems = netpol.network_problems(resources)
    for expected in (
        "RayJob/raypipe-backfill.rayClusterSpec.headGroupSpec.template: no NetworkPolicy selects it",
        "NetworkPolicy/raypipe-serve-grpc.spec.ingress[1]: no `from`: admits every source",
        f"admits the pods of {BACKFILL} to {SERVICE_HEAD} on 9000",
    ):
        assert any(expected in p for p in problems), (expected, problems)


# --- broken copies ------------------------------------------------------------------------


def _peer(rs: list[Resource], policy_name: str, peer: dict[str, Any]) -> None:
    np(rs, policy_name)["ingress"][0]["from"] = [peer]


NETWORK_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    # Selection: nothing takes every connection by default.
    "no-default-deny": (
        "prod",
        drop("NetworkPolicy", "raypipe-default-deny"),
        f"{BACKFILL}.submitterPodTemplate: no NetworkPolicy selects it",
    ),
    "model-pods-unlabelled": (
        "prod",
        lambda rs: cluster(rs, "service")["workerGroupSpecs"][0]["template"].pop("metadata"),
        f"{SERVICE_WORKER}: no NetworkPolicy selects it",
    ),
    # Shapes: every source, IP blocks, every namespace, every pod.
    "rule-without-from": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service-grpc")["ingress"][0].pop("from"),
        "NetworkPolicy/raypipe-model-service-grpc.spec.ingress[0]: no `from`: admits every source",
    ),
    "every-other-port-open": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service")["ingress"].append(
            {
                "ports": [
                    {"protocol": "TCP", "port": 1, "endPort": 8999},
                    {"protocol": "TCP", "port": 9001, "endPort": 65535},
                ]
            }
        ),
        "NetworkPolicy/raypipe-model-service.spec.ingress[1]: no `from`: admits every source",
    ),
    "ip-block": (
        "prod",
        lambda rs: _peer(rs, "raypipe-model-service-grpc", {"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "admits an IP block (0.0.0.0/0)",
    ),
    "every-namespace": (
        "prod",
        lambda rs: _peer(
            rs,
            "raypipe-kuberay-operator",
            {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}},
        ),
        "admits every namespace",
    ),
    "whole-namespace": (
        "prod",
        lambda rs: _peer(
            rs,
            "raypipe-kuberay-operator",
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}},
        ),
        "every pod of the selected namespaces",
    ),
    "every-pod": (
        "prod",
        lambda rs: _peer(rs, "raypipe-backfill", {"podSelector": {}}),
        "admits every pod of the namespace",
    ),
    # The gRPC port: the job pods, on the workers only.
    "grpc-to-the-head": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service-grpc")["podSelector"]["matchLabels"].pop("ray.io/node-type"),
        f"admits the pods of {BACKFILL} to {SERVICE_HEAD} on 9000",
    ),
    "grpc-from-non-clients": (
        "prod",
        lambda rs: _peer(
            rs, "raypipe-model-service-grpc", {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "raypipe"}}}
        ),
        f"admits the submitter of {BACKFILL} to {SERVICE_WORKER} on 9000",
    ),
    "grpc-range-leak": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service-grpc")["ingress"][0]["ports"][0].update(endPort=9001),
        f"admits the pods of {DAILY} to {SERVICE_WORKER} on 9000-9001",
    ),
    "grpc-by-port-name": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service-grpc")["ingress"].append(
            {
                "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "backfill-submitter"}}}],
                "ports": [{"protocol": "TCP", "port": "serve-grpc"}],
            }
        ),
        f"admits the submitter of {BACKFILL} to {SERVICE_WORKER} on 9000",
    ),
    "grpc-clients-shut-out": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service-grpc")["ingress"][0]["ports"][0].update(port=9001),
        f"no NetworkPolicy admits {BACKFILL}.rayClusterSpec.headGroupSpec.template (a model client) to port 9000",
    ),
    "clients-unlabelled": (
        "prod",
        lambda rs: cluster(rs, "daily")["workerGroupSpecs"][0]["template"]["metadata"]["labels"].pop(
            "raypipe.io/model-client"
        ),
        f"no NetworkPolicy admits {DAILY}.rayClusterSpec.workerGroupSpecs[0].template (a model client)",
    ),
    # Ray's own traffic: within a cluster, every port; beyond it, none.
    "cluster-closed-to-itself": (
        "prod",
        drop("NetworkPolicy", "raypipe-backfill"),
        f"{BACKFILL}: its pods must admit each other on every port",
    ),
    "legacy-daily-closed-to-itself": (
        "prod-kuberay-1.5",
        drop("NetworkPolicy", "raypipe-daily"),
        ": its pods must admit each other on every port",
    ),
    "cluster-open-to-others": (
        "prod",
        lambda rs: _peer(
            rs, "raypipe-backfill", {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "raypipe"}}}
        ),
        f"admits the pods of RayService/raypipe to {BACKFILL}.rayClusterSpec.headGroupSpec.template on every port",
    ),
    "metrics-from-elsewhere": (
        "prod",
        lambda rs: np(rs, "raypipe-model-service")["ingress"].append(
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "datadog"}},
                        "podSelector": {"matchLabels": {"app": "datadog-agent"}},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 8080}],
            }
        ),
        "no pod of this rendering",
    ),
    "unknown-pods": (
        "prod",
        lambda rs: _peer(rs, "raypipe-model-service-grpc", {"podSelector": {"matchLabels": {"app": "curl"}}}),
        "no pod of this rendering",
    ),
    "submitter-takes-connections": (
        "prod",
        lambda rs: np(rs, "raypipe-default-deny").update(
            ingress=[
                {
                    "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "backfill"}}}],
                    "ports": [{"protocol": "TCP", "port": 8080}],
                }
            ]
        ),
        f"admits the pods of {BACKFILL} to {BACKFILL}.submitterPodTemplate on 8080",
    ),
    # The heads: the operator to the dashboard, each submitter to its own head.
    "operator-shut-out": (
        "prod",
        drop("NetworkPolicy", "raypipe-kuberay-operator"),
        f"{SERVICE_HEAD}: no NetworkPolicy admits the KubeRay operator to the dashboard (8265)",
    ),
    "operator-beyond-the-control-ports": (
        "prod",
        lambda rs: np(rs, "raypipe-kuberay-operator")["ingress"][0]["ports"].append({"protocol": "TCP", "port": 9000}),
        f"admits the KubeRay operator to {SERVICE_HEAD} on 8265, 9000",
    ),
    "operator-to-the-workers": (
        "prod",
        lambda rs: np(rs, "raypipe-kuberay-operator")["podSelector"]["matchLabels"].pop("ray.io/node-type"),
        f"admits the KubeRay operator to {SERVICE_WORKER} on 8265",
    ),
    "submitter-shut-out": (
        "prod",
        drop("NetworkPolicy", "raypipe-backfill-submitter"),
        f"{BACKFILL}.rayClusterSpec.headGroupSpec.template: no NetworkPolicy admits its submitter",
    ),
    "submitter-to-another-head": (
        "prod",
        lambda rs: _peer(
            rs,
            "raypipe-backfill-submitter",
            {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "daily-submitter"}}},
        ),
        f"admits the submitter of {DAILY} to {BACKFILL}.rayClusterSpec.headGroupSpec.template on 8265",
    ),
    "submitter-to-the-model-service": (
        "prod",
        lambda rs: np(rs, "raypipe-daily-submitter")["podSelector"]["matchLabels"].pop("app.kubernetes.io/component"),
        f"admits the submitter of {DAILY} to {SERVICE_HEAD} on 8265",
    ),
}


def share_the_service_token(rs: list[Resource]) -> None:
    """The backfill's cluster and submitter use the model service's token (consistently)."""
    cluster(rs, "backfill")["authOptions"].update(secretName="raypipe-serve-ray-token")
    env = pod(rs, "backfill", "submitter")["containers"][0]["env"]
    set_env_secret(env, "RAY_AUTH_TOKEN", "raypipe-serve-ray-token")


IDENTITY_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "shared-token": ("prod", share_the_service_token, "share the Ray token Secret raypipe-serve-ray-token"),
    "submitter-sends-another-token": (
        "prod",
        lambda rs: set_env_secret(
            pod(rs, "daily", "submitter")["containers"][0]["env"], "RAY_AUTH_TOKEN", "raypipe-backfill-ray-token"
        ),
        "RAY_AUTH_TOKEN comes from raypipe-backfill-ray-token[auth_token], not from its cluster's raypipe-daily",
    ),
    "legacy-submitter-sends-another-token": (
        "prod-kuberay-1.5",
        lambda rs: legacy_template(
            rs,
            lambda d: set_env_secret(
                d["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["env"],
                "RAY_AUTH_TOKEN",
                "raypipe-serve-ray-token",
            ),
        ),
        "RAY_AUTH_TOKEN comes from raypipe-serve-ray-token[auth_token]",
    ),
    "shared-account": (
        "prod",
        lambda rs: pod(rs, "backfill", "worker").update(serviceAccountName="raypipe-serve"),
        "the model service and the jobs share ServiceAccount raypipe-serve",
    ),
    "default-account": (
        "prod",
        lambda rs: pod(rs, "backfill", "submitter").pop("serviceAccountName"),
        f"{BACKFILL}.submitterPodTemplate: runs as the namespace's default ServiceAccount",
    ),
    "account-not-rendered": (
        "prod",
        lambda rs: pod(rs, "service", "worker").update(serviceAccountName="raypipe"),
        "ServiceAccount raypipe is not rendered",
    ),
    "same-role": (
        "prod",
        lambda rs: named(rs, "ServiceAccount", "raypipe-jobs")["metadata"]["annotations"].update(
            {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/raypipe-serve"}
        ),
        "assume the same eks.amazonaws.com/role-arn",
    ),
    "account-mounts-tokens": (
        "prod",
        lambda rs: named(rs, "ServiceAccount", "raypipe-jobs").update(automountServiceAccountToken=True),
        "ServiceAccount/raypipe-jobs: set automountServiceAccountToken: false",
    ),
    "legacy-scheduler-account-mounts-tokens": (
        "prod-kuberay-1.5",
        lambda rs: named(rs, "ServiceAccount", "raypipe-daily-scheduler").pop("automountServiceAccountToken"),
        "ServiceAccount/raypipe-daily-scheduler: set automountServiceAccountToken: false",
    ),
    "worker-mounts-a-token": (
        "prod",
        lambda rs: pod(rs, "backfill", "worker").update(automountServiceAccountToken=True),
        f"{BACKFILL}.rayClusterSpec.workerGroupSpecs[0].template: mounts an API token",
    ),
}

PLACEMENT_BREAKS: dict[str, tuple[str, Mutation, str]] = {
    "worker-does-not-advertise": (
        "prod",
        lambda rs: cluster(rs, "service")["workerGroupSpecs"][0]["rayStartParams"].pop("resources"),
        "a model worker must advertise raypipe_pool=1000",
    ),
    "escaped-sample-form": (
        "prod",
        lambda rs: cluster(rs, "service")["workerGroupSpecs"][0]["rayStartParams"].update(
            resources='"{\\"raypipe_pool\\": 1000}"'
        ),
        "KubeRay's operator (getResourcesMap; it logs an error for every pod) cannot read",
    ),
    "head-advertises": (
        "prod",
        lambda rs: cluster(rs, "service")["headGroupSpec"]["rayStartParams"].update(
            resources="'{\"raypipe_pool\": 1000}'"
        ),
        "headGroupSpec.rayStartParams.resources: advertises raypipe_pool",
    ),
    "job-worker-advertises": (
        "prod",
        lambda rs: cluster(rs, "backfill")["workerGroupSpecs"][0]["rayStartParams"].update(
            resources="'{\"raypipe_pool\": 1000}'"
        ),
        f"{BACKFILL}.rayClusterSpec.workerGroupSpecs[0].rayStartParams.resources: advertises raypipe_pool",
    ),
    "replicas-anywhere": (
        "prod",
        lambda rs: serve_config(
            rs, lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].pop("resources")
        ),
        "ray_actor_options.resources must request raypipe_pool",
    ),
}


@pytest.mark.parametrize("case", sorted({**NETWORK_BREAKS, **IDENTITY_BREAKS, **PLACEMENT_BREAKS}))
def test_rules_reject_broken_copies(case: str) -> None:
    overlay, mutate, expected = {**NETWORK_BREAKS, **IDENTITY_BREAKS, **PLACEMENT_BREAKS}[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = policy.project_problems(resources)
    assert any(expected in p for p in problems), problems


def test_the_pool_amount_is_read_from_serve_app(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check follows serve_app.deploy, not a copy of its numbers."""
    import serve_app.deploy

    monkeypatch.setattr(serve_app.deploy, "POOL_RESOURCE_PER_NODE", 500)
    problems = policy.project_problems(rendered("prod"))
    assert any("must advertise raypipe_pool=500" in p for p in problems), problems
    monkeypatch.setattr(serve_app.deploy, "POOL_RESOURCE", "other_pool")
    problems = policy.project_problems(copy.deepcopy(rendered("prod")))
    assert any("must request other_pool" in p for p in problems), problems


# --- the guide ------------------------------------------------------------------------------

GUIDE = validate.REPO / "docs" / "kuberay.md"


def test_the_guides_operator_namespace_patch_moves_the_operator(tmp_path: Path) -> None:
    """docs/kuberay.md's patch, in an overlay over prod, selects the operator in its new namespace."""
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    patch = next(b for b in blocks if "raypipe-kuberay-operator" in b)
    prod = os.path.relpath(validate.OVERLAYS / "prod", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources:\n  - {prod}\n{patch}", encoding="utf-8")
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    resources = validate.render(tmp_path)
    peer = np(resources, "raypipe-kuberay-operator")["ingress"][0]["from"][0]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ray-system"}
    assert netpol.is_operator(peer)
    assert policy.project_problems(resources) == []


def test_the_guide_creates_every_token_secret() -> None:
    loop = re.search(
        r"for cluster in ([\w ]+); do\s+kubectl .* create secret generic raypipe-\$cluster-ray-token",
        GUIDE.read_text(encoding="utf-8"),
    )
    assert loop is not None
    created = {f"raypipe-{name}-ray-token" for name in loop.group(1).split()}
    everywhere: set[str] = set()
    for overlay in OVERLAYS:
        resources = rendered(overlay)
        used = {service(resources)["rayClusterConfig"]["authOptions"]["secretName"]}
        used |= {
            j.spec["rayClusterSpec"]["authOptions"]["secretName"]
            for j in validate.jobs(resources)
            if "rayClusterSpec" in j.spec
        }
        assert used <= created, overlay
        everywhere |= used
    assert everywhere == created

"""The watcher on KubeRay (kuberay/components/watch, as kuberay/overlays/prod-watch renders it).

`raypipe watch` runs as one long-lived RayJob beside the RayService, instead of the daily
RayCronJob: it passes every check the other overlays pass (CRD and Kubernetes schemas, the
operator's rules, raypipe's deployment rules), and its pods are closed for egress to all but
their own cluster, the model service's gRPC port, DNS, S3's public addresses on 443 and the
node's DogStatsD port. Each rule is also shown to fail on a broken copy. The entrypoint's
parse with the real CLI is in test_kuberay_entrypoints.py (every overlay).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest

from kuberay import entrypoints, netpol, policy, validate
from kuberay.validate import Resource

OVERLAY = "prod-watch"
WATCH = "RayJob/raypipe-watch"
HEAD = f"{WATCH}.rayClusterSpec.headGroupSpec.template"

Mutation = Callable[[list[Resource]], Any]


def rendered(overlay: str = OVERLAY) -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def named(rs: list[Resource], kind: str, name: str) -> Resource:
    return next(r for r in rs if r["kind"] == kind and r["metadata"]["name"] == name)


def watcher(rs: list[Resource]) -> Resource:
    return named(rs, "RayJob", "raypipe-watch")


def egress(rs: list[Resource]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = named(rs, "NetworkPolicy", "raypipe-watch-egress")["spec"]["egress"]
    return rules


def test_prod_watch_runs_the_watcher_instead_of_the_daily_schedule() -> None:
    resources = rendered()
    kinds = [r["kind"] for r in resources]
    assert "RayCronJob" not in kinds and "CronJob" not in kinds
    jobs = {j.where: j for j in validate.jobs(resources)}
    assert set(jobs) == {"RayJob/raypipe-backfill", WATCH}
    watch = jobs[WATCH]
    assert watch.watch and not watch.scheduled
    assert watch.spec["entrypoint"].split()[:4] == ["python", "-m", "raypipe", "watch"]
    assert "activeDeadlineSeconds" not in watch.spec  # it runs until it is stopped
    assert watch.spec["backoffLimit"] >= 1  # KubeRay replaces a failed watcher
    # the other overlays keep their daily schedule and no watcher
    assert not any(j.watch for j in validate.jobs(rendered("prod")))


def test_prod_watch_passes_every_check_but_the_cli_parse() -> None:
    resources = rendered()
    assert validate.schema_problems(resources) == []
    assert validate.operator_problems(resources) == []
    assert policy.project_problems(resources) == []
    pytest.importorskip("kubernetes_validate", reason="the kubernetes-validate package checks the core kinds")
    assert validate.core_problems(resources) == []


def test_the_watchers_ray_pods_send_the_service_token_from_its_secret() -> None:
    """The driver (head) and the inference actors (workers) both call the model service."""
    spec = watcher(rendered())["spec"]["rayClusterSpec"]
    for _, pod in validate.cluster_pod_templates("", spec):
        env = {v["name"]: v for v in pod["spec"]["containers"][0]["env"]}
        ref = env["RAYPIPE_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("raypipe-service-token", "token")
    assert spec["authOptions"]["secretName"] == "raypipe-watch-ray-token"


def test_dns_over_udp_alone_is_enough_outside_the_rendering() -> None:
    resources = rendered()
    egress(resources)[2]["ports"] = [{"protocol": "UDP", "port": 53}]
    assert policy.project_problems(resources) == []


def test_the_watchers_egress_reaches_what_it_needs_and_no_other_raypipe_pod() -> None:
    resources = rendered()
    net = netpol.network(resources)
    watch_pods = net.cluster_pods(WATCH)
    assert len(watch_pods) == 2
    service_workers = [p for p in net.cluster_pods("RayService/raypipe") if not p.head]
    others = [p for p in net.pods if p.cluster not in (WATCH, "RayService/raypipe")]
    assert others  # the backfill's pods and submitter
    for pod in watch_pods:
        for worker in service_workers:
            assert netpol.egress_ports(net, pod, worker) == [(9000, 9000)]
        for mate in watch_pods:
            assert netpol.egress_ports(net, pod, mate) == [(1, 65535)]
        for other in others:
            assert netpol.egress_ports(net, pod, other) == [], other.where
    # other parts keep open egress (nothing selects them for it)
    backfill_head = next(p for p in others if p.head)
    assert netpol.egress_ports(net, backfill_head, service_workers[0]) == [(1, 65535)]


@pytest.mark.parametrize(
    ("block", "holds"),
    [
        ({"cidr": "0.0.0.0/0"}, True),
        ({"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"]}, False),
        ({"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]}, True),  # 100.64/10
        ({"cidr": "52.216.0.0/15"}, False),  # an S3 range
        ({"cidr": "10.20.0.0/16"}, True),
        ({"cidr": "10.0.0.0/8", "except": ["10.0.0.0/9"]}, True),
        ({"cidr": "10.20.0.0/16", "except": ["10.0.0.0/8"]}, False),
        ({"cidr": "CHANGE-ME"}, True),
        ({"cidr": "::/0"}, True),
    ],
)
def test_a_block_holds_pods_unless_it_excepts_the_private_ranges(block: dict[str, Any], holds: bool) -> None:
    assert netpol.block_holds_pods(block) is holds


def _add_cron_watcher(rs: list[Resource]) -> None:
    daily = validate.render(validate.OVERLAYS / "prod")
    cron = named(daily, "RayCronJob", "raypipe-daily")
    cron["metadata"]["labels"]["raypipe.io/job"] = "watch"
    rs.append(cron)


BREAKS: dict[str, tuple[Mutation, str]] = {
    "deadline": (
        lambda rs: watcher(rs)["spec"].update(activeDeadlineSeconds=86400),
        f"{WATCH}: activeDeadlineSeconds would end the watcher",
    ),
    "submitter-not-restarted": (
        lambda rs: watcher(rs)["spec"]["submitterConfig"].update(backoffLimit=0),
        "submitterConfig.backoffLimit >= 1",
    ),
    "no-retry": (lambda rs: watcher(rs)["spec"].update(backoffLimit=0), f"{WATCH}: needs backoffLimit >= 1"),
    "daily-beside-watcher": (
        lambda rs: rs.append(named(validate.render(validate.OVERLAYS / "prod"), "RayCronJob", "raypipe-daily")),
        "expected exactly one daily schedule (RayCronJob or legacy CronJob) or one watcher",
    ),
    "no-watcher-no-daily": (
        lambda rs: watcher(rs)["metadata"]["labels"].pop("raypipe.io/job"),
        "expected exactly one daily schedule (RayCronJob or legacy CronJob) or one watcher",
    ),
    "scheduled-watcher": (_add_cron_watcher, "the watcher runs once, as a RayJob"),
    "watch-step-holds-a-policy": (
        lambda rs: (
            named(rs, "NetworkPolicy", "raypipe-watch-egress")["metadata"]
            .setdefault("labels", {})
            .update({"raypipe.io/job": "watch"})
        ),
        "the watch step (raypipe.io/job=watch) holds",
    ),
    "egress-open": (
        lambda rs: rs.remove(named(rs, "NetworkPolicy", "raypipe-watch-egress")),
        f"{HEAD}: no NetworkPolicy closes it for egress",
    ),
    "egress-rule-without-to": (
        lambda rs: egress(rs).append({"ports": [{"protocol": "TCP", "port": 443}]}),
        "a rule without `to`",
    ),
    "egress-block-on-tcp-into-pods": (
        lambda rs: egress(rs)[3]["to"][0]["ipBlock"].pop("except"),
        "may hold pod addresses and is open on TCP",
    ),
    "egress-block-every-port": (
        lambda rs: egress(rs)[4].pop("ports"),
        "is open on every port",
    ),
    "egress-to-the-backfill": (
        lambda rs: egress(rs)[0]["to"][0]["podSelector"]["matchLabels"].pop("app.kubernetes.io/component"),
        "reach RayJob/raypipe-backfill",
    ),
    "egress-to-the-model-head": (
        lambda rs: egress(rs)[1]["to"][0]["podSelector"]["matchLabels"].pop("ray.io/node-type"),
        "reach RayService/raypipe.spec.rayClusterConfig.headGroupSpec.template",
    ),
    "egress-outside-on-another-port": (
        lambda rs: egress(rs)[2]["ports"].append({"protocol": "TCP", "port": 443}),
        "is no pod of this rendering; outside it only DNS",
    ),
    "egress-outside-on-udp": (
        lambda rs: egress(rs)[2]["ports"].append({"protocol": "UDP", "port": 5353}),
        "is no pod of this rendering; outside it only DNS",
    ),
    "egress-closes-the-model": (
        lambda rs: egress(rs).pop(1),
        f"no NetworkPolicy admits {HEAD} (a model client) to port 9000",
    ),
    "egress-closes-its-cluster": (
        lambda rs: egress(rs).pop(0),
        f"{WATCH}: its pods must admit each other on every port",
    ),
    "own-token-shared": (
        lambda rs: watcher(rs)["spec"]["rayClusterSpec"]["authOptions"].update(secretName="raypipe-backfill-ray-token"),
        "share the Ray token Secret raypipe-backfill-ray-token",
    ),
    "submitter-as-jobs-account": (
        lambda rs: watcher(rs)["spec"]["submitterPodTemplate"]["spec"].update(serviceAccountName="raypipe-jobs"),
        "the submitters run as ServiceAccount raypipe-jobs",
    ),
    "no-agent": (
        lambda rs: watcher(rs)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
            "env"
        ].pop(0),
        f"{HEAD}.containers[ray-head]: needs env DD_AGENT_HOST",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_the_rules_reject_broken_copies_of_the_watcher(case: str) -> None:
    mutate, expected = BREAKS[case]
    resources = rendered()
    mutate(resources)
    problems = policy.project_problems(resources)
    assert any(expected in p for p in problems), problems


def test_the_watchers_entrypoint_must_run_watch() -> None:
    resources = rendered()
    spec = watcher(resources)["spec"]
    spec["entrypoint"] = (
        'python -m raypipe daily --input "$JOB_INPUT_URI" --output "$JOB_OUTPUT_URI" '
        "--service raypipe-serve-svc:9000 --run-id watch-1"
    )
    (job,) = [j for j in validate.jobs(resources) if j.watch]
    problems = entrypoints.job_problems(job, resources)
    assert any("runs `raypipe daily`; expected watch" in p for p in problems), problems

"""raypipe's own deployment rules, checked on rendered manifests (`project_problems`).

- Placement: every pod (Ray heads and workers, submitters, the legacy scheduler) selects the
  CPU pool (`raypipe.io/pool: cpu`) and tolerates its taint.
- Resources: every container, init container and autoscaler sidecar requests what it limits
  (cpu and memory), so pods get the Guaranteed QoS class and TensorFlow sees whole cores.
- Security: non-root pods, no privilege escalation, no privileged containers; no Secret
  objects and no credential-like variable with a literal value; no LoadBalancer or NodePort
  Service, no Ingress, Ray head Services ClusterIP; token auth on every Ray cluster from a
  Secret.
- The network (`kuberay.netpol`): every raypipe pod closed by default, each Ray cluster open to
  itself, the gRPC port to the job pods, the heads' dashboards to the operator and submitters.
- Identities (`kuberay.identity`): a token Secret per cluster, separate ServiceAccounts for the
  model service and the jobs, API tokens only where the autoscaler needs them, the model
  service's bearer token from its Secret in every Ray container, and an admission policy on any
  account that may create RayJobs.
- The model service (`kuberay.model_service`): a head that runs no replicas with the ports it
  must declare, autoscaling, the NewCluster upgrade, placement on the pool by custom resource,
  and the model-tls component's consistency (its proxy refusing calls without a bearer header).
- The jobs: their own clusters (no clusterSelector onto the serving cluster), pods labelled
  as model clients, a bounded life (activeDeadlineSeconds), retries, and clean-up (a TTL
  after shutdown, or deletionRules); exactly one way to commit new files: one daily schedule or
  one watcher (`raypipe.io/job: watch`, a RayJob that runs until stopped: no deadline, created
  once, its submitter restarted for as long as it follows the watcher).
- Maintenance (`kuberay/components/maintenance`): at most one schedule of it, a CronJob
  (concurrencyPolicy Forbid, a time zone) in the daily step, never beside a watcher, which
  holds the output's lease while it runs; its commands are checked in `kuberay.entrypoints`.
- Metrics: every container that runs raypipe or Ray in a Ray pod or a submitter (not the
  legacy scheduler, which only creates RayJobs) sends DogStatsD to the Datadog agent on its
  node: `DD_AGENT_HOST` from the downward API's `status.hostIP`.
- One image per rendering (plus the TLS proxy's, pinned), tagged, and no CHANGE-ME placeholder.
- The apply steps of docs/kuberay.md: the label raypipe.io/job splits a rendering into the
  model service (no label), the backfill (`backfill`: the RayJob) and the daily schedule
  (`daily`, with the maintenance schedule) or the watcher (`watch`: its RayJob), so each step
  applies what it says and nothing of the next.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from kuberay.identity import identity_problems
from kuberay.model_service import model_service_problems
from kuberay.netpol import network_problems
from kuberay.validate import (
    Job,
    Resource,
    cluster_pod_templates,
    containers,
    get,
    is_maintenance,
    jobs,
    pod_templates,
    ref,
)

POOL_LABEL, POOL_VALUE = "raypipe.io/pool", "cpu"
MODEL_CLIENT_LABEL = "raypipe.io/model-client"
JOB_LABEL = "raypipe.io/job"
SIDECARS = {"tls-proxy": "the model-tls component's TLS proxy"}
"""Containers that run their own (pinned) image beside raypipe's."""
AGENT_HOST_VAR = "DD_AGENT_HOST"
_SECRETISH = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|ACCESS_KEY|SESSION|CREDENTIAL", re.IGNORECASE)
_AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")


def _placement(where: str, pod: dict[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    problems = []
    if (spec.get("nodeSelector") or {}).get(POOL_LABEL) != POOL_VALUE:
        problems.append(f"{where}: nodeSelector must pick the pool {POOL_LABEL}={POOL_VALUE}")
    tolerated = any(
        t.get("key") == POOL_LABEL
        and t.get("effect") in (None, "NoSchedule")
        and (t.get("operator") == "Exists" or t.get("value") == POOL_VALUE)
        for t in spec.get("tolerations") or []
    )
    if not tolerated:
        problems.append(f"{where}: tolerations must admit the pool's taint {POOL_LABEL}={POOL_VALUE}:NoSchedule")
    return problems


def _guaranteed(where: str, resources: dict[str, Any] | None) -> list[str]:
    requests, limits = (resources or {}).get("requests") or {}, (resources or {}).get("limits") or {}
    if not {"cpu", "memory"} <= set(limits):
        return [f"{where}: resources.limits needs cpu and memory"]
    if any(str(requests.get(k, limits[k])) != str(limits[k]) for k in limits):
        return [f"{where}: resources.requests must equal resources.limits"]
    return []


def _security(where: str, pod: dict[str, Any]) -> list[str]:
    spec = pod.get("spec") or {}
    problems = []
    context = spec.get("securityContext") or {}
    if not context.get("runAsNonRoot") or context.get("runAsUser") == 0:
        problems.append(f"{where}: securityContext.runAsNonRoot must be true (and runAsUser not 0)")
    for c in containers(pod):
        sc = c.get("securityContext") or {}
        at = f"{where}.containers[{c.get('name')}]"
        if sc.get("privileged") or sc.get("allowPrivilegeEscalation", True) or sc.get("runAsUser") == 0:
            problems.append(f"{at}: needs allowPrivilegeEscalation: false, not privileged, not root")
        for var in c.get("env") or []:
            if "value" in var and _SECRETISH.search(str(var.get("name"))):
                problems.append(f"{at}: env {var.get('name')} has a literal value; take it from a Secret")
    return problems


def _pod_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for where, pod in pod_templates(resources):
        problems += _placement(where, pod)
        problems += _security(where, pod)
        for c in containers(pod):
            problems += _guaranteed(f"{where}.containers[{c.get('name')}]", c.get("resources"))
    clusters = [(ref(r), get(r, "spec", "rayClusterConfig")) for r in resources if r.get("kind") == "RayService"]
    clusters += [(j.where, j.spec["rayClusterSpec"]) for j in jobs(resources) if "rayClusterSpec" in j.spec]
    for where, cluster in clusters:
        if cluster.get("enableInTreeAutoscaling"):
            problems += _guaranteed(f"{where}.autoscalerOptions", get(cluster, "autoscalerOptions", "resources"))
        head = cluster.get("headGroupSpec") or {}
        if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
            problems.append(f"{where}.headGroupSpec: the head Service (dashboard) must stay ClusterIP, no ingress")
        auth = cluster.get("authOptions") or {}
        if auth.get("mode") != "token" or not auth.get("secretName"):
            problems.append(f"{where}: authOptions must be mode token with the token from a Secret (secretName)")
    return problems


def _exposure_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for r in resources:
        kind = r.get("kind")
        if kind == "Secret":
            problems.append(f"{ref(r)}: Secrets are created out of band, never rendered from the repository")
        elif kind in ("Ingress", "Route", "Gateway", "HTTPRoute", "GRPCRoute"):
            problems.append(f"{ref(r)}: nothing of raypipe is exposed outside the cluster")
        elif kind == "Service" and get(r, "spec", "type", default="ClusterIP") != "ClusterIP":
            problems.append(f"{ref(r)}: Service type must be ClusterIP")
        elif (
            kind == "RayService" and get(r, "spec", "serveService", "spec", "type", default="ClusterIP") != "ClusterIP"
        ):
            problems.append(f"{ref(r)}: spec.serveService must stay ClusterIP")
        elif kind == "ConfigMap":
            for key, value in (r.get("data") or {}).items():
                if _SECRETISH.search(key) or _AWS_KEY_ID.search(str(value)):
                    problems.append(f"{ref(r)}: data[{key}] looks like a credential; put it in a Secret")
    return problems


def _job_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for job in jobs(resources):
        spec, where = job.spec, job.where
        if "clusterSelector" in spec:
            problems.append(f"{where}: runs in its own cluster, not on the serving cluster (clusterSelector)")
        for _, pod in cluster_pod_templates("", spec.get("rayClusterSpec") or {}):
            if get(pod, "metadata", "labels", MODEL_CLIENT_LABEL) != "true":
                problems.append(
                    f'{where}: every Ray pod needs the label {MODEL_CLIENT_LABEL}="true" to reach the model'
                )
                break
        if job.watch:
            problems += _watch_problems(job)
        elif not spec.get("activeDeadlineSeconds"):
            problems.append(f"{where}: needs activeDeadlineSeconds")
        if spec.get("backoffLimit", 0) < 1:
            problems.append(f"{where}: needs backoffLimit >= 1: a retry resumes the run")
        rules = get(spec, "deletionStrategy", "deletionRules", default=[])
        if rules:
            policies = {(get(r, "condition", "jobStatus"), r.get("policy")) for r in rules}
            for status in ("SUCCEEDED", "FAILED"):
                for policy in ("DeleteCluster", "DeleteSelf"):
                    if (status, policy) not in policies:
                        problems.append(f"{where}: deletionRules need {policy} on {status}")
        elif not (spec.get("shutdownAfterJobFinishes") and spec.get("ttlSecondsAfterFinished", 0) > 0):
            problems.append(
                f"{where}: clean up: shutdownAfterJobFinishes with ttlSecondsAfterFinished, or deletionRules"
            )
        if not get(spec, "submitterPodTemplate", "spec", "containers"):
            problems.append(f"{where}: needs a submitterPodTemplate (to place the submitter on the pool)")
    schedules = [r for r in resources if r.get("kind") in ("RayCronJob", "CronJob") and not is_maintenance(r)]
    watchers = [job.where for job in jobs(resources) if job.watch]
    if len(schedules) + len(watchers) != 1:
        problems.append(
            "expected exactly one daily schedule (RayCronJob or legacy CronJob) or one watcher "
            f"(raypipe.io/job=watch) to commit new files, found {[ref(r) for r in schedules] + watchers}"
        )
    for r in schedules + [r for r in resources if is_maintenance(r)]:
        if r.get("kind") == "RayCronJob" and not get(r, "spec", "timeZone"):
            problems.append(f"{ref(r)}: set timeZone; the operator's clock is not a schedule")
        if r.get("kind") == "CronJob" and get(r, "spec", "concurrencyPolicy") != "Forbid":
            problems.append(f"{ref(r)}: concurrencyPolicy must be Forbid")
    return problems


def _watch_problems(job: Job) -> list[str]:
    """The watcher runs until it is stopped, in a RayJob created once (not per tick)."""
    where, spec = job.where, job.spec
    problems = []
    if job.scheduled:
        problems.append(f"{where}: the watcher runs once, as a RayJob; a schedule would start one per tick")
    if spec.get("activeDeadlineSeconds"):
        problems.append(f"{where}: activeDeadlineSeconds would end the watcher (KubeRay does not retry a deadline)")
    if get(spec, "submitterConfig", "backoffLimit", default=2) < 1:
        problems.append(f"{where}: submitterConfig.backoffLimit >= 1: the submitter follows the watcher for its life")
    return problems


def _metrics_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for where, pod in pod_templates(resources):
        if where.startswith("CronJob/"):
            continue  # the legacy scheduler creates RayJobs and emits nothing
        for c in get(pod, "spec", "containers", default=[]):
            if c.get("name") in SIDECARS:
                continue
            var = next((v for v in c.get("env") or [] if v.get("name") == AGENT_HOST_VAR), None)
            if get(var, "valueFrom", "fieldRef", "fieldPath") != "status.hostIP":
                problems.append(
                    f"{where}.containers[{c.get('name')}]: needs env {AGENT_HOST_VAR} from fieldRef status.hostIP "
                    "(the Datadog agent on the node), or no metric reaches Datadog"
                )
    return problems


def _image_problems(resources: list[Resource]) -> list[str]:
    problems = []
    images = {}
    sidecar_images: set[Any] = set()
    for where, pod in pod_templates(resources):
        if any(where.startswith(j.where) for j in jobs(resources) if j.manifest is not None):
            continue  # an embedded template: create_rayjob.py sets its images
        for c in containers(pod):
            if c.get("name") in SIDECARS:
                sidecar_images.add(c.get("image"))
                continue
            images[f"{where}.containers[{c.get('name')}]"] = c.get("image")
            for var in c.get("env") or []:
                if var.get("name") == "RAYPIPE_IMAGE" and var.get("value") != c.get("image"):
                    problems.append(
                        f"{where}: env RAYPIPE_IMAGE {var.get('value')} is not the container's image {c.get('image')}"
                    )
    distinct = set(images.values())
    if len(distinct) > 1:
        problems.append(f"more than one image: {sorted(map(str, distinct))}")
    for image in distinct | sidecar_images:
        if not image or ":" not in str(image).rsplit("/", 1)[-1] or str(image).endswith(":latest"):
            problems.append(f"image {image!r} needs an explicit tag (not latest)")
    text = yaml.safe_dump_all(resources)
    if "CHANGE-ME" in text:
        problems.append("a CHANGE-ME placeholder is left: set it in the overlay")
    return problems


def _step_problems(resources: list[Resource]) -> list[str]:
    steps: dict[str | None, list[str]] = {None: [], "backfill": [], "daily": [], "watch": []}
    problems = []
    for r in resources:
        step = get(r, "metadata", "labels", JOB_LABEL)
        if is_maintenance(r):
            continue  # beside the daily schedule in its step (_maintenance_problems)
        if step not in steps:
            problems.append(f"{ref(r)}: label {JOB_LABEL}={step} is not a step (backfill, daily or watch)")
            continue
        steps[step].append(str(r.get("kind")))
    jobs_kinds = {"RayJob", "RayCronJob", "CronJob"}
    if jobs_kinds & set(steps[None]) or not {"RayService", "NetworkPolicy"} <= set(steps[None]):
        problems.append(f"the model-service step (no {JOB_LABEL} label) holds {sorted(steps[None])}")
    if steps["backfill"] != ["RayJob"]:
        problems.append(f"the backfill step ({JOB_LABEL}=backfill) holds {steps['backfill']}, not one RayJob")
    if steps["watch"]:
        # The watcher replaces the daily schedule: its step holds the RayJob and its own policies.
        if steps["daily"]:
            problems.append(f"the daily step ({JOB_LABEL}=daily) holds {steps['daily']} beside a watcher")
        if sorted(set(steps["watch"])) != ["RayJob"] or steps["watch"].count("RayJob") != 1:
            problems.append(f"the watch step ({JOB_LABEL}=watch) holds {steps['watch']}, not one RayJob")
    elif len(jobs_kinds & set(steps["daily"])) != 1 or "RayJob" in steps["daily"]:
        problems.append(f"the daily step ({JOB_LABEL}=daily) holds {steps['daily']}, not one schedule")
    return problems


def _maintenance_problems(resources: list[Resource]) -> list[str]:
    """At most one maintenance schedule, in the daily step, with a time zone and never two at once;
    never beside a watcher, which holds the output's lease for as long as it runs."""
    found = [r for r in resources if is_maintenance(r)]
    problems = []
    if len(found) > 1:
        problems.append(f"expected at most one maintenance schedule, found {[ref(r) for r in found]}")
    if found and any(job.watch for job in jobs(resources)):
        problems.append(
            f"{ref(found[0])}: beside a watcher, which holds the output's lease while it runs: every tick is refused"
        )
    for r in found:
        if get(r, "metadata", "labels", JOB_LABEL) != "daily":
            problems.append(f"{ref(r)}: label {JOB_LABEL}=daily: it is applied with the daily schedule")
        if not get(r, "spec", "timeZone"):
            problems.append(f"{ref(r)}: set timeZone; the controller's clock is not a schedule")
    return problems


def project_problems(resources: list[Resource]) -> list[str]:
    return (
        _pod_problems(resources)
        + _exposure_problems(resources)
        + model_service_problems(resources)
        + network_problems(resources)
        + identity_problems(resources)
        + _job_problems(resources)
        + _metrics_problems(resources)
        + _image_problems(resources)
        + _step_problems(resources)
        + _maintenance_problems(resources)
    )

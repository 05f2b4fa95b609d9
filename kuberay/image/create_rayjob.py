"""Creates one RayJob from a template and waits for it: the daily run on KubeRay without RayCronJob.

A plain Kubernetes CronJob (kuberay/components/daily-cronjob-legacy) runs this once per tick:

    python create_rayjob.py --template /etc/raypipe/template/rayjob.yaml --image IMAGE \\
        --scheduled-by raypipe-daily-legacy [--keep 14] [--poll-s 30]

1. If a RayJob created by the same schedule is still running, it says so and exits 0 without
   creating another: a RayJob outlives this pod, so the CronJob's own concurrencyPolicy
   (Forbid) cannot see it. The skipped day's rows go to the next run (the watermark has not
   moved past them).
2. Creates the RayJob (the template's metadata.generateName gives it a fresh name), with every
   container image set to IMAGE and the label raypipe.io/scheduled-by=<schedule>.
3. Polls it until its jobDeploymentStatus is terminal; exits 0 when the Ray job SUCCEEDED,
   1 otherwise, so the CronJob's history shows failed days.
4. Deletes all but the newest --keep finished RayJobs of the schedule (their clusters are
   already gone: the template sets shutdownAfterJobFinishes).

It talks to the API server with the pod's service account token over HTTPS, with the
standard library only, so it runs in the raypipe image without kubectl.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

SCHEDULED_BY = "raypipe.io/scheduled-by"
TERMINAL = frozenset({"Complete", "Failed", "ValidationFailed"})
_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def prepare(template: dict[str, Any], *, image: str, scheduled_by: str) -> dict[str, Any]:
    """The RayJob to create: the template with the image set everywhere and the schedule's label."""
    if template.get("apiVersion") != "ray.io/v1" or template.get("kind") != "RayJob":
        raise ValueError("the template must be a ray.io/v1 RayJob")
    job = json.loads(json.dumps(template))  # a deep copy of plain data
    meta = job.setdefault("metadata", {})
    if not meta.get("generateName") or meta.get("name"):
        raise ValueError("the template must set metadata.generateName (and no name): one RayJob per tick")
    meta.setdefault("labels", {})[SCHEDULED_BY] = scheduled_by
    spec = job["spec"]
    pod_specs = [spec.get("submitterPodTemplate", {}).get("spec", {})]
    cluster = spec.get("rayClusterSpec", {})
    pod_specs.append(cluster.get("headGroupSpec", {}).get("template", {}).get("spec", {}))
    pod_specs += [g.get("template", {}).get("spec", {}) for g in cluster.get("workerGroupSpecs", [])]
    for pod in pod_specs:
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            container["image"] = image
    return job


def is_finished(rayjob: dict[str, Any]) -> bool:
    return rayjob.get("status", {}).get("jobDeploymentStatus") in TERMINAL


def succeeded(rayjob: dict[str, Any]) -> bool:
    status = rayjob.get("status", {})
    return status.get("jobDeploymentStatus") == "Complete" and status.get("jobStatus") == "SUCCEEDED"


def to_prune(rayjobs: list[dict[str, Any]], keep: int) -> list[str]:
    """Names of the finished RayJobs beyond the newest `keep` (by creation time)."""
    finished = [j for j in rayjobs if is_finished(j)]
    finished.sort(key=lambda j: j["metadata"].get("creationTimestamp", ""), reverse=True)
    return [j["metadata"]["name"] for j in finished[keep:]]


class Api:
    """The few RayJob calls this script makes, against the in-cluster API server."""

    def __init__(self, namespace: str) -> None:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self._base = f"https://{host}:{port}/apis/ray.io/v1/namespaces/{namespace}/rayjobs"
        self._token = (_SA_DIR / "token").read_text().strip()
        self._ssl = ssl.create_default_context(cafile=str(_SA_DIR / "ca.crt"))

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        request = urllib.request.Request(  # noqa: S310  always https:// (self._base)
            url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, context=self._ssl, timeout=30) as response:  # noqa: S310  https:// only
            data: dict[str, Any] = json.load(response)
            return data

    def create(self, rayjob: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self._base, rayjob)

    def get(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"{self._base}/{name}")

    def list(self, scheduled_by: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": f"{SCHEDULED_BY}={scheduled_by}"})
        items: list[dict[str, Any]] = self._call("GET", f"{self._base}?{query}")["items"]
        return items

    def delete(self, name: str) -> None:
        self._call("DELETE", f"{self._base}/{name}")


def run(api: Api, job: dict[str, Any], *, keep: int, poll_s: float, sleep: Callable[[float], None] = time.sleep) -> int:
    scheduled_by = job["metadata"]["labels"][SCHEDULED_BY]
    running = [j["metadata"]["name"] for j in api.list(scheduled_by) if not is_finished(j)]
    if running:
        print(f"skipped: {', '.join(running)} still running; the next run picks up this day's rows", flush=True)
        return 0
    name = api.create(job)["metadata"]["name"]
    print(f"created RayJob {name} (run id {name})", flush=True)
    while True:
        try:
            current = api.get(name)
        except urllib.error.URLError as e:  # the API server blinked; the RayJob runs on regardless
            if isinstance(e, urllib.error.HTTPError) and e.code < 500:
                raise
            print(f"polling {name}: {e}; retrying", flush=True)
            sleep(poll_s)
            continue
        if is_finished(current):
            break
        sleep(poll_s)
    status = current.get("status", {})
    print(f"RayJob {name}: {status.get('jobDeploymentStatus')} / {status.get('jobStatus')}", flush=True)
    for old in to_prune(api.list(scheduled_by), keep):
        api.delete(old)
        print(f"deleted finished RayJob {old}", flush=True)
    return 0 if succeeded(current) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", required=True, help="a RayJob manifest with metadata.generateName")
    parser.add_argument("--image", required=True, help="image for every container of the RayJob")
    parser.add_argument("--scheduled-by", required=True, help="value of the raypipe.io/scheduled-by label")
    parser.add_argument("--keep", type=int, default=14, help="finished RayJobs to keep")
    parser.add_argument("--poll-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    template = yaml.safe_load(Path(args.template).read_text())
    job = prepare(template, image=args.image, scheduled_by=args.scheduled_by)
    namespace = (_SA_DIR / "namespace").read_text().strip()
    try:
        return run(Api(namespace), job, keep=args.keep, poll_s=args.poll_s)
    except urllib.error.HTTPError as e:
        print(f"create_rayjob: {e.code} {e.reason}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

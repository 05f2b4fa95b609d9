"""Offline checks of raypipe's KubeRay manifests: what the API server or the operator would reject.

    python -m kuberay.validate                    # every overlay under kuberay/overlays
    python -m kuberay.validate kuberay/overlays/prod [--crds DIR] [--model-dir DIR]

Each check takes rendered resources (dicts, as `kubectl kustomize` prints them) and returns
the problems it found, each naming the resource and the field; an empty list means it passed.

- `schema_problems`: ray.io kinds against the KubeRay 1.7 CRD schemas with
  `additionalProperties: false` added wherever an object declares `properties`, so a
  misspelt field fails as it would under kubeconform's strict mode.
- `core_problems`: the other kinds against Kubernetes' own schemas (`kubernetes-validate`,
  strict).
- `operator_problems`: the operator's cross-field rules, which no schema holds (KubeRay's
  `utils/validation.go`): exactly one of rayClusterSpec and clusterSelector, a TTL needs
  shutdownAfterJobFinishes, deletionRules exclude it, name lengths, cron syntax...
- `serve_problems` (in `kuberay.serve_check`): serveConfigV2 parses with Ray's
  ServeDeploySchema, has no keys that schema silently ignores, and its import paths import.
- `entrypoint_problems` (in `kuberay.entrypoints`): every RayJob entrypoint, expanded as its
  submitter's shell expands it, and the maintenance CronJob's commands parse with raypipe's
  own CLI parser.
- `project_problems` (in `kuberay.policy`): raypipe's deployment contract: the CPU pool,
  requests = limits, non-root, ClusterIP only, the ports, one image; the NetworkPolicies
  (`kuberay.netpol`), the tokens, the ServiceAccounts and the RayJob creators' admission policy
  (`kuberay.identity`), and the model service's placement and TLS (`kuberay.model_service`).

RayJob specs are found wherever they are: RayJob resources, RayCronJob job templates, and
RayJob manifests kept in ConfigMaps (the legacy daily CronJob's template).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import re
import shutil
import subprocess
import sys
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = REPO / "kuberay" / "overlays"
DEFAULT_CRDS = REPO / "kuberay" / "crds"
"""The CRDs of KubeRay v1.7.0, copied unchanged (kuberay/crds/README.md says from where)."""
CRD_KINDS = ("RayCluster", "RayJob", "RayService", "RayCronJob")
K8S_VERSION = "1.32"
"""Kubernetes version whose schemas check the core kinds (kubectl's, here)."""

EXAMPLE_SUFFIX = "x7k2q"
"""Stands in for the random suffix of a generated RayJob name."""

# From KubeRay's utils/constant.go: a cluster name leaves room for "-serve-svc" in 63
# characters, and RayJob/RayService names leave room for the 6 characters of their cluster's.
MAX_CLUSTER_NAME = 53
MAX_RAYJOB_NAME = MAX_RAYSERVICE_NAME = MAX_CLUSTER_NAME - 6
MAX_RAYCRONJOB_NAME = MAX_RAYJOB_NAME - 6  # its RayJobs are named <name>-<5 characters>
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class RenderError(RuntimeError):
    """`kubectl kustomize` is missing or failed."""


def render(directory: Path | str) -> list[Resource]:
    """The resources `kubectl kustomize DIRECTORY` renders (offline); fresh objects on every call."""
    return [doc for doc in yaml.load_all(render_text(directory), Loader=_Loader) if doc]


def render_text(directory: Path | str) -> str:
    """What `kubectl kustomize DIRECTORY` prints (offline)."""
    return _kustomize(str(Path(directory).resolve()))


@functools.cache
def _kustomize(directory: str) -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        raise RenderError("kubectl is not on PATH (it renders the kustomize overlays)")
    proc = subprocess.run([exe, "kustomize", directory], capture_output=True, text=True, timeout=120, check=False)  # noqa: S603  argv, no shell
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed: {proc.stderr.strip()}")
    return proc.stdout


def ref(resource: Resource) -> str:
    meta = resource.get("metadata") or {}
    return f"{resource.get('kind')}/{meta.get('name') or meta.get('generateName', '?')}"


def get(node: Any, *path: str | int, default: Any = None) -> Any:
    """node[path[0]][path[1]]..., or `default` where the path does not exist."""
    for key in path:
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                return default
        elif not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


# --- where RayJob specs and pod templates are -------------------------------------------


@dataclass(frozen=True)
class Job:
    """A RayJob spec found in the rendered resources."""

    where: str
    """Names it: "RayJob/x", "RayCronJob/x.spec.jobTemplate", "ConfigMap/x[key]"."""
    spec: dict[str, Any]
    name: str
    """The RayJob's name as its submitter sees it; a generated name gets EXAMPLE_SUFFIX."""
    namespace: str | None
    scheduled: bool
    """Created once per tick (by a RayCronJob or the legacy CronJob)."""
    manifest: Resource | None = None
    """The whole RayJob manifest when it is embedded in a ConfigMap."""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    """The labels of the RayJob resource or RayCronJob that holds it (none for a ConfigMap's template)."""

    @property
    def watch(self) -> bool:
        """The long-lived watcher (`raypipe.io/job: watch`), which runs until it is stopped."""
        return self.labels.get("raypipe.io/job") == "watch"


def _embedded_rayjobs(resource: Resource) -> Iterator[tuple[str, Resource]]:
    if resource.get("kind") != "ConfigMap":
        return
    for key, text in (resource.get("data") or {}).items():
        try:
            doc = yaml.load(text, Loader=_Loader)  # noqa: S506  _Loader is (C)SafeLoader
        except yaml.YAMLError:
            continue
        if isinstance(doc, dict) and doc.get("kind") == "RayJob":
            yield f"{ref(resource)}[{key}]", doc


def jobs(resources: list[Resource]) -> list[Job]:
    found = []
    for r in resources:
        meta, kind = r.get("metadata") or {}, r.get("kind")
        ns = meta.get("namespace")
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        if kind == "RayJob":
            name = meta.get("name") or f"{meta.get('generateName', 'rayjob-')}{EXAMPLE_SUFFIX}"
            found.append(Job(ref(r), r.get("spec") or {}, name, ns, scheduled=False, labels=labels))
        elif kind == "RayCronJob":
            spec = get(r, "spec", "jobTemplate", default={})
            name = f"{meta.get('name')}-{EXAMPLE_SUFFIX}"
            found.append(Job(f"{ref(r)}.spec.jobTemplate", spec, name, ns, scheduled=True, labels=labels))
        for where, doc in _embedded_rayjobs(r):
            dmeta = doc.get("metadata") or {}
            name = dmeta.get("name") or f"{dmeta.get('generateName', 'rayjob-')}{EXAMPLE_SUFFIX}"
            found.append(Job(where, doc.get("spec") or {}, name, ns, scheduled=True, manifest=doc))
    return found


MAINTENANCE_COMPONENT = "maintenance"
"""`app.kubernetes.io/component` of the CronJob that runs the output's maintenance (compact, vacuum)."""


def is_maintenance(resource: Resource) -> bool:
    """The maintenance schedule (`kuberay/components/maintenance`): a CronJob, not a run of new files."""
    return (
        resource.get("kind") == "CronJob"
        and get(resource, "metadata", "labels", "app.kubernetes.io/component") == MAINTENANCE_COMPONENT
    )


def cluster_pod_templates(where: str, cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = [(f"{where}.headGroupSpec.template", get(cluster, "headGroupSpec", "template", default={}))]
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        found.append((f"{where}.workerGroupSpecs[{i}].template", group.get("template") or {}))
    return found


def pod_templates(resources: list[Resource]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template, named by where it sits: Ray heads, workers, submitters, CronJob pods."""
    found: list[tuple[str, dict[str, Any]]] = []
    for r in resources:
        if r.get("kind") == "RayService":
            found += cluster_pod_templates(
                f"{ref(r)}.spec.rayClusterConfig", get(r, "spec", "rayClusterConfig", default={})
            )
        elif r.get("kind") == "CronJob":
            found.append(
                (f"{ref(r)}.spec.jobTemplate.spec.template", get(r, "spec", "jobTemplate", "spec", "template"))
            )
    for job in jobs(resources):
        if "submitterPodTemplate" in job.spec:
            found.append((f"{job.where}.submitterPodTemplate", job.spec["submitterPodTemplate"]))
        if "rayClusterSpec" in job.spec:
            found += cluster_pod_templates(f"{job.where}.rayClusterSpec", job.spec["rayClusterSpec"])
    return found


def containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_template.get("spec") or {}
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


# --- CRD schemas -------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema with `additionalProperties: false` wherever `properties` is declared.

    Objects that already say what extra keys may hold (`additionalProperties`) or that keep
    unknown fields (`x-kubernetes-preserve-unknown-fields`) are left as they are.
    """
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


class SchemasUnavailable(FileNotFoundError):
    """The CRD schemas cannot be read, so no ray.io resource can be checked against them."""


@functools.cache
def crd_schemas(crd_dir: Path) -> dict[str, dict[str, Any]]:
    """Strict v1 schemas by kind, from the CustomResourceDefinitions in `crd_dir` (all of CRD_KINDS)."""
    if not Path(crd_dir).is_dir():
        raise SchemasUnavailable(f"no KubeRay CRD folder at {crd_dir}")
    files = sorted(Path(crd_dir).glob("*.yaml"))
    if not files:
        raise SchemasUnavailable(f"no CRD files (*.yaml) in {crd_dir}")
    schemas = {}
    for path in files:
        crd = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506  _Loader is (C)SafeLoader
        if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
            continue
        for version in crd["spec"]["versions"]:
            if version["name"] == "v1":
                schemas[crd["spec"]["names"]["kind"]] = strict(version["schema"]["openAPIV3Schema"])
    missing = [kind for kind in CRD_KINDS if kind not in schemas]
    if missing:
        raise SchemasUnavailable(f"no ray.io/v1 CRD for {', '.join(missing)} in {crd_dir}")
    return schemas


def schema_problems(resources: list[Resource], crd_dir: Path = DEFAULT_CRDS) -> list[str]:
    """ray.io resources and embedded RayJob manifests against the strict CRD schemas."""
    from jsonschema import Draft4Validator  # OpenAPI v3.0 schemas are closest to draft 4

    schemas = crd_schemas(Path(crd_dir))
    docs = [(ref(r), r) for r in resources if str(r.get("apiVersion", "")).startswith("ray.io/")]
    docs += [(job.where, job.manifest) for job in jobs(resources) if job.manifest is not None]
    problems = []
    for where, doc in docs:
        schema = schemas.get(doc.get("kind", ""))
        if schema is None or doc.get("apiVersion") != "ray.io/v1":
            problems.append(f"{where}: no ray.io/v1 CRD schema for {doc.get('apiVersion')} {doc.get('kind')}")
            continue
        for error in sorted(Draft4Validator(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
            path = ".".join(str(p) for p in error.absolute_path) or "<root>"
            problems.append(f"{where}: {path}: {error.message}")
    return problems


def core_problems(resources: list[Resource], k8s_version: str = K8S_VERSION) -> list[str]:
    """Kinds other than ray.io against Kubernetes' schemas, strict (unknown fields fail)."""
    import kubernetes_validate

    problems = []
    for r in resources:
        if str(r.get("apiVersion", "")).startswith("ray.io/"):
            continue
        try:
            kubernetes_validate.validate(r, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path) or "<root>"  # a jsonschema error, copied
            problems.append(f"{ref(r)}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{ref(r)}: no Kubernetes {k8s_version} schema for {r.get('apiVersion')} {r.get('kind')}")
    return problems


# --- the operator's own rules ------------------------------------------------------------


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def cluster_spec_problems(where: str, spec: dict[str, Any]) -> list[str]:
    """ValidateRayClusterSpec: the rules a RayCluster spec must meet beyond its schema."""
    problems = []
    groups = [("headGroupSpec", spec.get("headGroupSpec") or {})]
    groups += [(f"workerGroupSpecs[{i}]", g) for i, g in enumerate(spec.get("workerGroupSpecs") or [])]
    names = set()
    for label, group in groups:
        if not get(group, "template", "spec", "containers"):
            problems.append(f"{where}.{label}: needs at least one container")
        params = group.get("rayStartParams") or {}
        if "labels" in params:
            problems.append(f"{where}.{label}.rayStartParams: 'labels' is not supported; use the group's labels")
        if group.get("resources") and any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            problems.append(f"{where}.{label}: resources set both in rayStartParams and in resources")
        if label == "headGroupSpec":
            continue
        name = group.get("groupName")
        if name in names:
            problems.append(f"{where}.{label}: groupName {name!r} is used twice")
        names.add(name)
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        replicas = group.get("replicas", low)
        if not 0 <= low <= high:
            problems.append(f"{where}.{label}: needs 0 <= minReplicas ({low}) <= maxReplicas ({high})")
        elif not low <= replicas <= high:
            problems.append(f"{where}.{label}: replicas {replicas} is outside [{low}, {high}]")
        if group.get("suspend") and spec.get("enableInTreeAutoscaling"):
            problems.append(f"{where}.{label}: a worker group cannot be suspended with autoscaling enabled")
    if get(spec, "authOptions", "mode") == "token":
        version = str(spec.get("rayVersion") or "")
        if not version:
            problems.append(f"{where}: authOptions.mode token needs rayVersion (Ray >= 2.52.0)")
        elif _version(version) < (2, 52, 0):
            problems.append(f"{where}: authOptions.mode token needs Ray >= 2.52.0, not {version}")
    return problems


def _deletion_problems(where: str, spec: dict[str, Any]) -> list[str]:
    strategy = spec.get("deletionStrategy")
    if strategy is None:
        return []
    problems = []
    legacy = "onSuccess" in strategy or "onFailure" in strategy
    rules = strategy.get("deletionRules") or []
    selector = bool(spec.get("clusterSelector"))
    autoscaling = bool(get(spec, "rayClusterSpec", "enableInTreeAutoscaling"))
    if rules and spec.get("shutdownAfterJobFinishes"):
        problems.append(f"{where}: shutdownAfterJobFinishes and deletionStrategy.deletionRules are mutually exclusive")
    if rules and legacy:
        problems.append(f"{where}: deletionStrategy: onSuccess/onFailure and deletionRules cannot be used together")
    if not rules and not ("onSuccess" in strategy and "onFailure" in strategy):
        problems.append(f"{where}: deletionStrategy needs both onSuccess and onFailure, or deletionRules")
    by_status: dict[str, dict[str, int]] = {}
    for i, rule in enumerate(rules):
        cond, policy = rule.get("condition") or {}, rule.get("policy")
        at = f"{where}.deletionStrategy.deletionRules[{i}]"
        if ("jobStatus" in cond) == ("jobDeploymentStatus" in cond):
            problems.append(f"{at}: the condition needs exactly one of jobStatus and jobDeploymentStatus")
        ttl = cond.get("ttlSeconds", 0)
        if ttl < 0:
            problems.append(f"{at}: ttlSeconds must be >= 0")
        if selector and policy in ("DeleteCluster", "DeleteWorkers"):
            problems.append(f"{at}: {policy} is not supported with clusterSelector")
        if autoscaling and policy == "DeleteWorkers":
            problems.append(f"{at}: DeleteWorkers is not supported with autoscaling")
        status = cond.get("jobStatus", "")
        seen = by_status.setdefault(status, {})
        if policy in seen:
            problems.append(f"{at}: a second {policy} rule for jobStatus {status!r}")
        seen[policy] = ttl
    for status, ttls in by_status.items():
        order = [(p, ttls[p]) for p in ("DeleteWorkers", "DeleteCluster", "DeleteSelf") if p in ttls]
        for (p1, t1), (p2, t2) in itertools.pairwise(order):
            if t2 < t1:
                problems.append(f"{where}: for jobStatus {status!r}, {p2} ttlSeconds ({t2}) must be >= {p1}'s ({t1})")
    legacy_policies = (get(strategy, "onSuccess", "policy"), get(strategy, "onFailure", "policy"))
    if legacy and spec.get("shutdownAfterJobFinishes") and "DeleteNone" in legacy_policies:
        problems.append(f"{where}: shutdownAfterJobFinishes with a DeleteNone deletion policy")
    return problems


def job_spec_problems(where: str, spec: dict[str, Any]) -> list[str]:
    """ValidateRayJobSpec: the rules a RayJob spec must meet beyond its schema."""
    problems = []
    selector = spec.get("clusterSelector") or {}
    if bool(selector) == ("rayClusterSpec" in spec):
        problems.append(f"{where}: set exactly one of rayClusterSpec and clusterSelector")
    if selector and not selector.get("ray.io/cluster"):
        problems.append(f"{where}: clusterSelector needs ray.io/cluster")
    shutdown, ttl = bool(spec.get("shutdownAfterJobFinishes")), spec.get("ttlSecondsAfterFinished", 0)
    if spec.get("suspend") and not shutdown:
        problems.append(f"{where}: a RayJob without shutdownAfterJobFinishes cannot be suspended")
    if ttl < 0:
        problems.append(f"{where}: ttlSecondsAfterFinished must be >= 0")
    if ttl > 0 and not shutdown:
        problems.append(f"{where}: ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
    problems += _deletion_problems(where, spec)
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"):
        problems.append(f"{where}: submissionMode {mode!r} is not a KubeRay submission mode")
    if mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
        problems.append(f"{where}: backoffLimit is incompatible with InteractiveMode")
    if mode == "SidecarMode":
        for field in ("submitterPodTemplate", "submitterConfig", "clusterSelector"):
            if field in spec:
                problems.append(f"{where}: SidecarMode does not support {field}")
    if "activeDeadlineSeconds" in spec and spec["activeDeadlineSeconds"] <= 0:
        problems.append(f"{where}: activeDeadlineSeconds must be > 0")
    if spec.get("backoffLimit", 0) < 0:
        problems.append(f"{where}: backoffLimit must be >= 0")
    if "submitterPodTemplate" in spec and not get(spec, "submitterPodTemplate", "spec", "containers"):
        problems.append(f"{where}: submitterPodTemplate needs a container")
    try:
        yaml.safe_load(spec.get("runtimeEnvYAML") or "")
    except yaml.YAMLError as e:
        problems.append(f"{where}: runtimeEnvYAML is not YAML: {e}")
    if "rayClusterSpec" in spec:
        problems += cluster_spec_problems(f"{where}.rayClusterSpec", spec["rayClusterSpec"])
    return problems


_CRON_FIELDS = (
    (0, 59, ()),
    (0, 23, ()),
    (1, 31, ()),
    (1, 12, ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")),
    (0, 6, ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")),
)
_CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def cron_problem(schedule: str) -> str | None:
    """Why `schedule` is not a standard 5-field cron expression (robfig/cron ParseStandard)."""
    text = schedule.strip()
    if text.startswith(("TZ=", "CRON_TZ=")):
        text = text.split(None, 1)[1] if " " in text else ""
    if text in _CRON_DESCRIPTORS or re.fullmatch(r"@every \d+(\.\d+)?(ns|us|ms|s|m|h)(\d+(ns|us|ms|s|m|h))*", text):
        return None
    fields = text.split()
    if len(fields) != 5:
        return f"{schedule!r} has {len(fields)} fields, not 5 (minute hour day-of-month month day-of-week)"
    for field, (low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
        for part in field.split(","):
            value, _, step = part.partition("/")
            if step and not (step.isdigit() and int(step) > 0):
                return f"{schedule!r}: bad step in {part!r}"
            if value in ("*", "?"):
                continue
            bounds = value.split("-")
            if len(bounds) > 2:
                return f"{schedule!r}: bad range {part!r}"
            numbers = []
            for bound in bounds:
                if bound.upper() in names:
                    numbers.append(names.index(bound.upper()) + low)
                elif bound.isdigit():
                    numbers.append(int(bound))
                else:
                    return f"{schedule!r}: {bound!r} is not a value of field {field!r}"
            if not all(low <= n <= high for n in numbers) or numbers != sorted(numbers):
                return f"{schedule!r}: {part!r} is outside {low}-{high}"
    return None


def _name_problems(resource: Resource, limit: int) -> list[str]:
    meta = resource.get("metadata") or {}
    name = meta.get("name")
    if name is None:
        generated = meta.get("generateName")
        return [] if generated else [f"{ref(resource)}: needs metadata.name"]
    problems = []
    if len(name) > limit:
        problems.append(f"{ref(resource)}: the name is {len(name)} characters; KubeRay allows {limit}")
    if not _DNS1035.match(name):
        problems.append(f"{ref(resource)}: the name must be a DNS-1035 label")
    return problems


def operator_problems(resources: list[Resource]) -> list[str]:
    """The operator's cross-field rules for every RayService, RayJob (wherever it is) and RayCronJob."""
    problems = []
    for r in resources:
        kind, spec = r.get("kind"), r.get("spec") or {}
        if kind == "RayService":
            problems += _name_problems(r, MAX_RAYSERVICE_NAME)
            problems += cluster_spec_problems(f"{ref(r)}.spec.rayClusterConfig", spec.get("rayClusterConfig") or {})
            if get(spec, "rayClusterConfig", "headGroupSpec", "headService", "metadata", "name"):
                problems.append(f"{ref(r)}: headService.metadata.name must not be set")
            upgrade = get(spec, "upgradeStrategy", "type")
            if upgrade not in (None, "NewCluster", "NewClusterWithIncrementalUpgrade", "None"):
                problems.append(
                    f"{ref(r)}: upgradeStrategy.type {upgrade!r} is not NewCluster, ...IncrementalUpgrade, None"
                )
            if upgrade == "NewClusterWithIncrementalUpgrade":
                if not get(spec, "rayClusterConfig", "enableInTreeAutoscaling"):
                    problems.append(f"{ref(r)}: NewClusterWithIncrementalUpgrade needs the Ray autoscaler")
                if not get(spec, "upgradeStrategy", "clusterUpgradeOptions"):
                    problems.append(f"{ref(r)}: NewClusterWithIncrementalUpgrade needs clusterUpgradeOptions")
            if spec.get("rayClusterDeletionDelaySeconds", 0) < 0:
                problems.append(f"{ref(r)}: rayClusterDeletionDelaySeconds must be >= 0")
        elif kind == "RayJob":
            problems += _name_problems(r, MAX_RAYJOB_NAME)
        elif kind == "RayCronJob":
            problems += _name_problems(r, MAX_RAYCRONJOB_NAME)
            why = cron_problem(str(spec.get("schedule", "")))
            if why:
                problems.append(f"{ref(r)}: invalid cron schedule: {why}")
            zone = spec.get("timeZone")
            if zone is not None:
                try:
                    zoneinfo.ZoneInfo(zone)
                except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                    problems.append(f"{ref(r)}: timeZone {zone!r} is not a time zone")
    for job in jobs(resources):
        problems += job_spec_problems(job.where, job.spec)
    return problems


# --- the command line --------------------------------------------------------------------


def check(
    resources: list[Resource], *, crd_dir: Path | None = DEFAULT_CRDS, model_dir: Path | None = None
) -> dict[str, list[str]]:
    """Every check's problems by check name; a check that cannot run is a problem, saying why."""
    from kuberay import entrypoints, policy, serve_check

    results: dict[str, list[str]] = {}
    try:
        results["schema"] = schema_problems(resources, DEFAULT_CRDS if crd_dir is None else crd_dir)
    except SchemasUnavailable as e:
        results["schema"] = [f"cannot check the KubeRay CRD schemas: {e}"]
    try:
        results["core"] = core_problems(resources)
    except ImportError:
        results["core"] = ["cannot check the core kinds: the kubernetes-validate package is not installed"]
    results["operator"] = operator_problems(resources)
    results["serve"] = serve_check.serve_problems(resources, model_dir=model_dir)
    results["entrypoints"] = entrypoints.entrypoint_problems(resources)
    results["project"] = policy.project_problems(resources)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberay.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="kustomize directories (default: every overlay)")
    parser.add_argument(
        "--crds", type=Path, default=DEFAULT_CRDS, help="folder of KubeRay CRD YAML files (default: kuberay/crds)"
    )
    parser.add_argument("--model-dir", type=Path, help="a model directory to build the Serve app against")
    args = parser.parse_args(argv)
    try:
        crd_schemas(args.crds)
    except SchemasUnavailable as e:
        print(f"FAILED: cannot check the KubeRay CRD schemas: {e}")
        return 1
    failed = False
    for directory in args.dirs or sorted(p for p in OVERLAYS.iterdir() if p.is_dir()):
        try:
            resources = render(directory)
        except RenderError as e:
            print(f"{directory}: {e}")
            failed = True
            continue
        for name, problems in check(resources, crd_dir=args.crds, model_dir=args.model_dir).items():
            failed |= bool(problems)
            print(f"{directory} {name}: {'ok' if not problems else 'FAILED'}")
            for problem in problems:
                print(f"    {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

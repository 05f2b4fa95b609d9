"""Who each part of raypipe is: its Ray token and its ServiceAccount (`identity_problems`).

- One Ray token per cluster: every Ray cluster names its own token Secret
  (`authOptions.secretName`): the model service, the backfill, the daily clusters. A token is
  the key to a cluster's dashboard and job API, so a job that held the model service's token
  could submit work to it. A submitter sends the token of the cluster it submits to: its
  `RAY_AUTH_TOKEN` comes from that cluster's Secret (KubeRay 1.7 keeps a submitter's own
  `RAY_AUTH_TOKEN` instead of injecting one, common/pod.go SetContainerTokenAuthEnvVars).
- Separate ServiceAccounts: the model service's pods run as one account (it reads the model),
  the job clusters' pods as another (they read the corpus and write the output), the jobs'
  submitters as a third with no cloud role (they only send the entrypoint to their head); none
  runs as the namespace's default account. Where workload identity annotates the accounts, each
  has its own role, and the submitters' has none.
- The model service's bearer token from one Secret: every Ray container of the model service
  and of the job clusters sets `RAYPIPE_SERVICE_TOKEN` (`protos.credential.TOKEN_ENV`) from the
  Secret `raypipe-service-token`, key `token`, never from a literal; the RayService's builder is
  told to check it (`args.token_env`). The model service's replicas check every call against it,
  the jobs' drivers (on their heads) and actors (on their workers) send it. Submitters and the
  pods of an account that creates RayJobs (the legacy scheduler) call no model and hold no such
  token.
- A RayJob creator held in check: an account whose Role may create RayJobs (the legacy daily
  scheduler) may create pods of any shape through them, so a ValidatingAdmissionPolicy must
  match that account's requests on RayJobs (create and delete) and be bound with `Deny`.
- API tokens only where needed: every rendered ServiceAccount sets
  `automountServiceAccountToken: false`; a pod template turns it on only for a Ray head with
  the in-tree autoscaler (KubeRay binds the autoscaler's Role to the head's account) or for the
  legacy daily scheduler (it creates RayJobs).
"""

from __future__ import annotations

from typing import Any

import yaml

from kuberay.validate import Resource, cluster_pod_templates, get, jobs, pod_templates, ref
from protos.credential import TOKEN_ENV

SERVICE_TOKEN_SECRET = "raypipe-service-token"  # noqa: S105  a Secret's name, not a token
SERVICE_TOKEN_KEY = "token"  # noqa: S105  the Secret's key name
"""Where the model service's bearer token comes from (created out of band: docs/kuberay.md)."""
BUILDER = "serve_app.builder:app_builder"

TOKEN_KEY = "auth_token"  # noqa: S105  the Secret's key name, not a token
"""The key KubeRay reads from a token Secret (utils.RAY_AUTH_TOKEN_SECRET_KEY)."""
WORKLOAD_IDENTITY = (
    "eks.amazonaws.com/role-arn",
    "iam.gke.io/gcp-service-account",
    "azure.workload.identity/client-id",
)


def _clusters(resources: list[Resource]) -> list[tuple[str, str, dict[str, Any], dict[str, Any] | None]]:
    """(owner, where its cluster spec is, the spec, the submitter's pod template) of every Ray cluster."""
    found: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = [
        (ref(r), f"{ref(r)}.spec.rayClusterConfig", get(r, "spec", "rayClusterConfig", default={}), None)
        for r in resources
        if r.get("kind") == "RayService"
    ]
    found += [
        (j.where, f"{j.where}.rayClusterSpec", j.spec["rayClusterSpec"], j.spec.get("submitterPodTemplate"))
        for j in jobs(resources)
        if "rayClusterSpec" in j.spec
    ]
    return found


def token_problems(resources: list[Resource]) -> list[str]:
    problems = []
    owners: dict[str, list[str]] = {}
    for where, _, cluster, submitter in _clusters(resources):
        secret = get(cluster, "authOptions", "secretName")
        if not secret:
            continue  # policy.py reports a cluster without token auth from a Secret
        owners.setdefault(str(secret), []).append(where)
        for c in get(submitter, "spec", "containers", default=[]) or []:
            for var in c.get("env") or []:
                key_ref = get(var, "valueFrom", "secretKeyRef")
                if (
                    var.get("name") == "RAY_AUTH_TOKEN"
                    and key_ref is not None
                    and (key_ref.get("name"), key_ref.get("key")) != (secret, TOKEN_KEY)
                ):
                    problems.append(
                        f"{where}.submitterPodTemplate: RAY_AUTH_TOKEN comes from "
                        f"{key_ref.get('name')}[{key_ref.get('key')}], not from its cluster's "
                        f"{secret}[{TOKEN_KEY}]: `ray job submit` would be refused"
                    )
    for secret, wheres in owners.items():
        if len(wheres) > 1:
            problems.append(
                f"{', '.join(wheres)} share the Ray token Secret {secret}: each cluster needs its own "
                "(a job holding the model service's token could submit work to it)"
            )
    return problems


def _pods(resources: list[Resource]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Pod templates by part: the model service's, the jobs' (clusters and submitters)."""
    parts: dict[str, list[tuple[str, dict[str, Any]]]] = {"model service": [], "jobs": [], "submitters": []}
    # The keys name the parts in messages: "the model service and the jobs share ...".
    for owner, where, cluster, submitter in _clusters(resources):
        part = "model service" if owner.startswith("RayService/") else "jobs"
        parts[part] += cluster_pod_templates(where, cluster)
        if submitter is not None:
            parts["submitters"].append((f"{owner}.submitterPodTemplate", submitter))
    return parts


def account_problems(resources: list[Resource]) -> list[str]:
    problems = []
    accounts = {get(r, "metadata", "name"): r for r in resources if r.get("kind") == "ServiceAccount"}
    used: dict[str, set[str]] = {}
    for part, templates in _pods(resources).items():
        used[part] = set()
        for where, pod in templates:
            name = get(pod, "spec", "serviceAccountName")
            if not name:
                problems.append(f"{where}: runs as the namespace's default ServiceAccount; give it the {part} account")
                continue
            used[part].add(name)
            if accounts and name not in accounts:
                problems.append(f"{where}: ServiceAccount {name} is not rendered")
    shared = used["model service"] & used["jobs"]
    if shared:
        problems.append(
            f"the model service and the jobs share ServiceAccount {', '.join(sorted(shared))}: the service reads "
            "the model, the jobs read the corpus and write the output; give each its own"
        )
    lent = used["submitters"] & (used["model service"] | used["jobs"])
    if lent:
        problems.append(
            f"the submitters run as ServiceAccount {', '.join(sorted(lent))} of the clusters: a submitter only sends "
            "the entrypoint to its head and needs none of their S3 access; give them an account of their own"
        )
    for key in WORKLOAD_IDENTITY:
        roles = {
            part: {get(accounts.get(n), "metadata", "annotations", key) for n in names} - {None}
            for part, names in used.items()
        }
        if roles["model service"] & roles["jobs"]:
            problems.append(
                f"the model service and the jobs assume the same {key}: {roles['model service'] & roles['jobs']}"
            )
        if roles["submitters"]:
            problems.append(f"the submitters assume {key} {sorted(roles['submitters'])}: they need no cloud role")
    return problems


def token_mount_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for r in resources:
        if r.get("kind") == "ServiceAccount" and r.get("automountServiceAccountToken") is not False:
            problems.append(f"{ref(r)}: set automountServiceAccountToken: false; the pods that need one say so")
    autoscaled_heads = {
        f"{where}.headGroupSpec.template"
        for _, where, cluster, _ in _clusters(resources)
        if cluster.get("enableInTreeAutoscaling")
    }
    for where, pod in [t for templates in _pods(resources).values() for t in templates]:
        if get(pod, "spec", "automountServiceAccountToken") and where not in autoscaled_heads:
            problems.append(f"{where}: mounts an API token; only a Ray head with the in-tree autoscaler needs one")
    return problems


def _service_token_source(container: dict[str, Any]) -> tuple[str, str] | str | None:
    """Where a container's `TOKEN_ENV` comes from: (Secret, key), "literal", or None (unset)."""
    for var in container.get("env") or []:
        if var.get("name") != TOKEN_ENV:
            continue
        key_ref = get(var, "valueFrom", "secretKeyRef")
        if key_ref is None:
            return "literal" if "value" in var else "elsewhere"
        return (str(key_ref.get("name")), str(key_ref.get("key")))
    return None


def service_token_problems(resources: list[Resource]) -> list[str]:
    problems = []
    wanted = (SERVICE_TOKEN_SECRET, SERVICE_TOKEN_KEY)
    for owner, where, cluster, _ in _clusters(resources):
        role = "checks" if owner.startswith("RayService/") else "sends"
        for at, pod in cluster_pod_templates(where, cluster):
            ray = get(pod, "spec", "containers", 0, default={})
            source = _service_token_source(ray)
            if source == wanted:
                continue
            name = f"{at}.containers[{ray.get('name')}]"
            if source is None:
                problems.append(
                    f"{name}: {TOKEN_ENV} is not set: this Ray container {role} the model service's token; set it "
                    f"from secretKeyRef {SERVICE_TOKEN_SECRET}[{SERVICE_TOKEN_KEY}]"
                )
            else:
                problems.append(
                    f"{name}: {TOKEN_ENV} must come from secretKeyRef {SERVICE_TOKEN_SECRET}[{SERVICE_TOKEN_KEY}], "
                    f"not {source if isinstance(source, str) else '{}[{}]'.format(*source)}"
                )
    for r in resources:
        if r.get("kind") != "RayService":
            continue
        try:
            config = yaml.safe_load(get(r, "spec", "serveConfigV2", default="") or "") or {}
        except yaml.YAMLError:
            continue  # serve_check reports it
        for app in get(config, "applications", default=[]) or []:
            args = app.get("args") or {}
            if app.get("import_path") == BUILDER and args.get("token_env") != TOKEN_ENV:
                problems.append(
                    f"{ref(r)}: application {app.get('name')}: args.token_env must be {TOKEN_ENV}, or its replicas "
                    "answer calls without the token"
                )
    # Pods that call no model: the submitters, and the pods of an account that creates RayJobs.
    creators = _creators(resources)
    bystanders = [(f"{owner}.submitterPodTemplate", sub) for owner, _, _, sub in _clusters(resources) if sub]
    bystanders += [
        (at, pod) for at, pod in pod_templates(resources) if get(pod, "spec", "serviceAccountName") in creators
    ]
    for at, pod in bystanders:
        for c in get(pod, "spec", "containers", default=[]) or []:
            if _service_token_source(c) is not None:
                problems.append(
                    f"{at}.containers[{c.get('name')}]: holds {TOKEN_ENV} but calls no model (a submitter or a "
                    "scheduler): leave it to the Ray containers"
                )
    return problems


def _creators(resources: list[Resource]) -> set[str]:
    """ServiceAccounts bound to a Role that may create RayJobs."""
    roles = {
        get(r, "metadata", "name")
        for r in resources
        if r.get("kind") == "Role"
        and any(
            "ray.io" in (rule.get("apiGroups") or [])
            and {"rayjobs", "*"} & set(rule.get("resources") or [])
            and {"create", "*"} & set(rule.get("verbs") or [])
            for rule in r.get("rules") or []
        )
    }
    return {
        str(s.get("name"))
        for r in resources
        if r.get("kind") == "RoleBinding" and get(r, "roleRef", "name") in roles
        for s in r.get("subjects") or []
        if s.get("kind") == "ServiceAccount"
    }


def creator_problems(resources: list[Resource]) -> list[str]:
    problems = []
    policies = {get(r, "metadata", "name"): r for r in resources if r.get("kind") == "ValidatingAdmissionPolicy"}
    denying = {
        get(r, "spec", "policyName")
        for r in resources
        if r.get("kind") == "ValidatingAdmissionPolicyBinding" and "Deny" in (get(r, "spec", "validationActions") or [])
    }
    for account in sorted(_creators(resources)):
        guarded = [
            name
            for name, r in policies.items()
            if name in denying
            and get(r, "spec", "failurePolicy", default="Fail") == "Fail"
            and any(
                f":{account}'" in str(c.get("expression", "")) for c in get(r, "spec", "matchConditions", default=[])
            )
            and any(
                "rayjobs" in (rule.get("resources") or []) and {"CREATE", "DELETE"} <= set(rule.get("operations") or [])
                for rule in get(r, "spec", "matchConstraints", "resourceRules", default=[])
            )
        ]
        if not guarded:
            problems.append(
                f"ServiceAccount {account} may create RayJobs, i.e. pods of any shape: bind a "
                "ValidatingAdmissionPolicy (failurePolicy Fail, validationActions Deny) on its RayJob creates and "
                "deletes (components/daily-cronjob-legacy/admission-policy.yaml)"
            )
    return problems


def identity_problems(resources: list[Resource]) -> list[str]:
    return (
        token_problems(resources)
        + account_problems(resources)
        + token_mount_problems(resources)
        + service_token_problems(resources)
        + creator_problems(resources)
    )

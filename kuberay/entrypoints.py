"""Checks that every RayJob entrypoint (and the maintenance pod's commands) is a raypipe command the real CLI accepts.

KubeRay's submitter runs `/bin/bash -c "... ray job submit ... -- <entrypoint> ; ..."`, so the
entrypoint is expanded by the submitter's shell with the submitter container's environment
(`$JOB_INPUT_URI` from the raypipe-params ConfigMap, `$JOB_RUN_ID` from the pod's Job name).
This module does the same expansion from the rendered manifests, then:

- parses the command with `raypipe.cli.parser.build_parser()` (so an unknown or misspelt flag fails here,
  not 20 minutes into a cluster start) and validates its settings with raypipe's config;
- checks it calls a RayService of the same rendering at `<name>-serve-svc:<port>`, in the
  way that Service offers: plaintext `host:9000` (the head's serve-grpc port), or TLS
  `grpcs://host:9443` (serve-grpcs, the model-tls component), never the other; a CA file it
  names is mounted on every Ray pod of its cluster (the driver and the actors both call), and
  a bearer token (`service.token_env`) goes only over TLS, from a variable those pods set;
- checks its command: the watcher's RayJob (`raypipe.io/job: watch`) runs `raypipe watch`, a
  scheduled one `raypipe daily`, any other backfill, daily or replay;
- checks its run id: every run names one (a retry must resume the same run), and a scheduled
  run takes it from its Job's name, so each tick is a new run and each retry of a tick is not
  (the watcher names none: its id defaults to one per input, so a retried watcher resumes);
- refuses shell syntax beyond `$VAR` (a `;` would end KubeRay's `if ...; then ...; fi`).

The maintenance CronJob's pod (`maintenance_problems`) runs no RayJob: its init container and
container run `python -m raypipe compact`, then `vacuum`, on the runs' output, parsed the same way.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from typing import Any

import yaml

from kuberay.netpol import TLS_PORT_NAME
from kuberay.validate import Job, Resource, cluster_pod_templates, containers, get, is_maintenance, jobs, ref
from protos.credential import TOKEN_ENV

JOB_NAME_FIELDS = ("metadata.labels['batch.kubernetes.io/job-name']", "metadata.labels['job-name']")
"""Pod fields that hold the submitter's Job name, which KubeRay sets to the RayJob's name."""

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_SHELL = re.compile(r"[;&|<>`\n]|\$\(")


def submitter_env(job: Job, resources: list[Resource]) -> dict[str, str | None]:
    """The submitter container's environment as the entrypoint sees it (None: not resolvable here)."""
    config_maps = {
        get(r, "metadata", "name"): r.get("data") or {}
        for r in resources
        if r.get("kind") == "ConfigMap" and get(r, "metadata", "namespace") == job.namespace
    }
    container = get(job.spec, "submitterPodTemplate", "spec", "containers", 0, default={})
    env: dict[str, str | None] = {}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            for key, value in config_maps.get(source["configMapRef"].get("name"), {}).items():
                env[source.get("prefix", "") + key] = value
    for var in container.get("env") or []:
        name, value_from = var.get("name"), var.get("valueFrom") or {}
        if "value" in var:
            env[name] = str(var["value"])
        elif "configMapKeyRef" in value_from:
            key_ref = value_from["configMapKeyRef"]
            env[name] = config_maps.get(key_ref.get("name"), {}).get(key_ref.get("key"))
        elif get(value_from, "fieldRef", "fieldPath") in JOB_NAME_FIELDS:
            env[name] = job.name
        else:
            env[name] = None
    return env


def _expand(entrypoint: str, env: dict[str, str | None]) -> tuple[str, list[str]]:
    missing: list[str] = []

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if env.get(name) is None:
            missing.append(name)
            return ""
        return str(env[name])

    return _VAR.sub(value, entrypoint), missing


def parse_raypipe(argv: list[str]) -> tuple[Any, str | None]:
    """Parses `argv` (after `python -m raypipe`) with the real CLI parser: (namespace, error)."""
    from raypipe.cli.parser import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv), None
    except SystemExit:
        return None, stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else "usage error"


def settings_problem(args: Any) -> str | None:
    """Why raypipe's config rejects the run's flags and `--set` pairs (as `raypipe.cli` builds them)."""
    from raypipe.cli.parser import set_pairs
    from raypipe.config import load_config
    from raypipe.errors import ConfigError

    try:
        overrides: dict[str, Any] = set_pairs(args.set)
    except SystemExit as e:
        return str(e)
    for flag, section, key in (
        ("input", "input", "uri"),
        ("output", "output", "uri"),
        ("service", "service", "address"),
    ):
        if getattr(args, flag, None) is not None:
            overrides[section] = {**overrides.get(section, {}), key: getattr(args, flag)}
    if getattr(args, "run_id", None) is not None:
        overrides["run_id"] = args.run_id
    try:
        load_config(None, overrides, environ={}, offline=True)  # the CA file exists in the pod only
    except ConfigError as e:
        return str(e).replace("\n", " ")
    return None


@dataclass(frozen=True)
class ServeService:
    """What a RayService's serve Service (`<name>-serve-svc`) offers gRPC clients."""

    namespace: str | None
    plain_port: int | None
    """The gRPC port, when the head declares serve-grpc (KubeRay puts serve* head ports on the Service)."""
    tls_port: int | None
    """The model-tls component's port (serve-grpcs), served by a TLS sidecar on the workers."""


def _services(resources: list[Resource]) -> dict[str, ServeService]:
    """`<name>-serve-svc` of each RayService."""
    found = {}
    for r in resources:
        if r.get("kind") != "RayService":
            continue
        port = None
        with contextlib.suppress(yaml.YAMLError):
            port = get(yaml.safe_load(get(r, "spec", "serveConfigV2", default="")), "grpc_options", "port")
        head = get(r, "spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, default={})
        ports = {p.get("name"): p.get("containerPort") for p in head.get("ports") or []}
        found[f"{get(r, 'metadata', 'name')}-serve-svc"] = ServeService(
            get(r, "metadata", "namespace"),
            port if "serve-grpc" in ports else None,
            ports.get(TLS_PORT_NAME),
        )
    return found


def _service_settings(args: Any) -> dict[str, str]:
    """The `service.*` settings of the run's `--set` pairs."""
    from raypipe.cli.parser import set_pairs

    try:
        service = set_pairs(args.set).get("service", {})
    except SystemExit:
        return {}  # settings_problem reports it
    return {str(k): str(v) for k, v in service.items()} if isinstance(service, dict) else {}


def _service_problem(
    address: str | None, settings: dict[str, str], job: Job, services: dict[str, ServeService]
) -> str | None:
    if not address:
        return "--service is missing: it would call 127.0.0.1:9000"
    scheme, sep, rest = address.partition("://")
    if sep and scheme != "grpcs":
        return f"--service {address}: host:port or grpcs://host:port, not {scheme}://"
    tls = bool(sep) or settings.get("tls", "").lower() in ("true", "1", "yes", "on")
    host, _, port = (rest if sep else address).rpartition(":")
    name, _, domain = host.partition(".")
    if name not in services:
        return (
            f"--service {address}: no RayService renders a Service named {name!r} (expected one of {sorted(services)})"
        )
    svc = services[name]
    if domain:
        if domain.split(".")[0] != svc.namespace or not re.fullmatch(r"[^.]+\.svc(\.cluster\.local)?", domain):
            return f"--service {address}: not the Service {name} in namespace {svc.namespace}"
    elif svc.namespace != job.namespace:
        return f"--service {address}: {name} is in namespace {svc.namespace}; name it {name}.{svc.namespace}.svc"
    if tls and svc.tls_port is None:
        return f"--service {address}: TLS, but {name} offers plaintext gRPC only (components/model-tls adds TLS)"
    if tls and port != str(svc.tls_port):
        return f"--service {address}: the RayService's TLS port is {svc.tls_port}"
    if not tls and svc.plain_port is None:
        return f"--service {address}: plaintext, but {name} offers TLS only: call grpcs://{host}:{svc.tls_port}"
    if not tls and port != str(svc.plain_port):
        return f"--service {address}: the RayService's gRPC port is {svc.plain_port}"
    if not tls and ("ca_file" in settings or "token_env" in settings):
        return f"--service {address}: service.ca_file and service.token_env need TLS (grpcs://)"
    return None


def _client_env_problems(job: Job, settings: dict[str, str]) -> list[str]:
    """The CA file and the token variable are there for every Ray container that calls the service."""
    problems = []
    cluster = job.spec.get("rayClusterSpec") or {}
    for where, pod in cluster_pod_templates("rayClusterSpec", cluster):
        container = get(pod, "spec", "containers", 0, default={})
        mounts = [str(m.get("mountPath", "")).rstrip("/") + "/" for m in container.get("volumeMounts") or []]
        ca_file = settings.get("ca_file")
        if ca_file and not any(ca_file.startswith(m) for m in mounts):
            problems.append(f"service.ca_file {ca_file} is mounted in no volume of {where}'s Ray container")
        token_env = settings.get("token_env")
        if token_env and token_env not in {v.get("name") for v in container.get("env") or []}:
            problems.append(f"service.token_env {token_env} is not set in {where}'s Ray container")
    return problems


def _run_id_problem(job: Job, raw_argv: list[str], args: Any) -> str | None:
    if args.command == "watch":
        return None  # its default id is one per input: a retry in a new cluster resumes it
    if not args.run_id:
        return "--run-id is missing: a retried attempt would start a new run instead of resuming"
    if not job.scheduled:
        return None
    token = raw_argv[raw_argv.index("--run-id") + 1] if "--run-id" in raw_argv else ""
    match = _VAR.fullmatch(token)
    container = get(job.spec, "submitterPodTemplate", "spec", "containers", 0, default={})
    sources = {v.get("name"): get(v, "valueFrom", "fieldRef", "fieldPath") for v in container.get("env") or []}
    if not match or sources.get(match.group(1) or match.group(2)) not in JOB_NAME_FIELDS:
        return (
            f"--run-id {token}: a scheduled run must take its id from its Job's name "
            f"(env fieldRef {JOB_NAME_FIELDS[0]}), or every tick resumes the same run"
        )
    return None


def job_problems(job: Job, resources: list[Resource]) -> list[str]:
    where = f"{job.where}.entrypoint"
    entrypoint = str(job.spec.get("entrypoint") or "")
    if not entrypoint.strip():
        return [f"{where}: empty"]
    if _SHELL.search(entrypoint):
        return [f"{where}: shell syntax other than $VAR (it is pasted into KubeRay's submit command)"]
    expanded, missing = _expand(entrypoint, submitter_env(job, resources))
    if missing:
        return [f"{where}: ${', $'.join(missing)} not set in the submitter container's env"]
    try:
        argv, raw_argv = shlex.split(expanded), shlex.split(entrypoint)
    except ValueError as e:
        return [f"{where}: {e}"]
    if argv[:3] != ["python", "-m", "raypipe"]:
        return [f"{where}: must start with `python -m raypipe`, not {' '.join(argv[:3])!r}"]
    args, error = parse_raypipe(argv[3:])
    if error is not None:
        return [f"{where}: raypipe's CLI rejects it: {error}"]
    expected = {"watch"} if job.watch else {"daily"} if job.scheduled else {"backfill", "daily", "replay"}
    problems = []
    if args.command not in expected:
        problems.append(f"{where}: runs `raypipe {args.command}`; expected {' or '.join(sorted(expected))}")
        return problems
    if args.command == "daily" and args.since is not None:
        problems.append(f"{where}: --since re-reads every file on every tick; a scheduled daily reads new files only")
    settings = _service_settings(args)
    for why in (
        _service_problem(args.service, settings, job, _services(resources)),
        _run_id_problem(job, raw_argv, args),
        settings_problem(args),
        *_client_env_problems(job, settings),
    ):
        if why:
            problems.append(f"{where}: {why}")
    return problems


MAINTENANCE_STEPS = ("compact", "vacuum")
"""What the maintenance schedule's pod runs, in this order: its init container, then its container."""


def maintenance_problems(cronjob: Resource) -> list[str]:
    """The maintenance pod runs `python -m raypipe compact`, then `vacuum`, each on the output the
    runs write (`$(JOB_OUTPUT_URI)` from the raypipe-params ConfigMap, as the runs take it), each
    accepted by raypipe's own CLI parser; no `--force` (a short retention could delete files a live
    run has written but not committed, nor a retention under vacuum's floor) and no model
    service's token (it calls none)."""
    from raypipe.commit.upkeep import VACUUM_FLOOR_HOURS

    where = f"{ref(cronjob)}.spec.jobTemplate.spec.template"
    template = get(cronjob, "spec", "jobTemplate", "spec", "template", default={})
    steps = [(c, [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]) for c in containers(template)]
    commands = [" ".join(argv[:4]) for _, argv in steps]
    if [argv[3:4] for _, argv in steps] != [[step] for step in MAINTENANCE_STEPS]:
        return [f"{where}: runs {commands}; expected `raypipe compact` (init container), then `raypipe vacuum`"]
    problems = []
    for c, argv in steps:
        at = f"{where}.containers[{c.get('name')}]"
        if argv[:3] != ["python", "-m", "raypipe"]:
            problems.append(f"{at}: must run `python -m raypipe`, not {' '.join(argv[:3])!r}")
            continue
        args, error = parse_raypipe(argv[3:])
        if error is not None:
            problems.append(f"{at}: raypipe's CLI rejects it: {error}")
            continue
        source = {v.get("name"): get(v, "valueFrom", "configMapKeyRef") for v in c.get("env") or []}
        if args.output != "$(JOB_OUTPUT_URI)" or source.get("JOB_OUTPUT_URI") != {
            "name": "raypipe-params",
            "key": "JOB_OUTPUT_URI",
        }:
            problems.append(f"{at}: --output must be $(JOB_OUTPUT_URI) from ConfigMap raypipe-params, the runs' output")
        if getattr(args, "force", False):
            problems.append(f"{at}: --force allows a retention that may delete a live run's uncommitted files")
        elif getattr(args, "retention_hours", VACUUM_FLOOR_HOURS) < VACUUM_FLOOR_HOURS:
            problems.append(f"{at}: vacuum refuses a retention under {VACUUM_FLOOR_HOURS:g} h without --force")
        if any(v.get("name") == TOKEN_ENV for v in c.get("env") or []):
            problems.append(f"{at}: holds the model service's token but calls no model")
    return problems


def entrypoint_problems(resources: list[Resource]) -> list[str]:
    problems = []
    for job in jobs(resources):
        problems += job_problems(job, resources)
    for r in resources:
        if is_maintenance(r):
            problems += maintenance_problems(r)
    return problems

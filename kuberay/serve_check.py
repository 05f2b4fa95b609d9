"""Checks of a RayService's serveConfigV2 against Ray Serve itself and against its pods.

- It parses with Ray's `ServeDeploySchema`, and has no key that schema would silently ignore
  (Serve's config models accept unknown keys, so `grpc_option:` would deploy without gRPC).
- The servicer functions and the application's import path import from the installed
  packages; the servicer list includes the one serve_app registers (`SERVICER_FUNCTION`).
- Given a model directory, the application builder runs with the config's `args` (its
  `model_dir` pointed there) the way Serve's controller runs it, and the config's deployment
  overrides apply to the application it returns.
- The config agrees with the pods: the gRPC port is the head's (unless it declares the TLS
  port, serve-grpcs) and the workers' `serve-grpc` container port, `model_dir` is where the
  fetch-model init containers put the model, a replica's CPUs fit a worker, an autoscaled
  deployment leaves `num_replicas` to autoscaling, and the application is the one clients
  name by default (`service.application`).
"""

from __future__ import annotations

import importlib
import os
import typing
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from kuberay.validate import Resource, get, ref


def _models_in(annotation: Any) -> list[type]:
    """The pydantic model classes an annotation allows (through Optional, Union, List...)."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def unknown_keys(data: Any, model: type, where: str) -> list[str]:
    """Keys of `data` (recursively) that `model` has no field (or alias) for."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields  # type: ignore[attr-defined]
    by_key = dict(fields) | {f.alias: f for f in fields.values() if f.alias}
    problems = []
    for key, value in data.items():
        field = by_key.get(key)
        if field is None:
            problems.append(f"{where}.{key}: {model.__name__} has no such field")
            continue
        candidates = _models_in(field.annotation)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            at = f"{where}.{key}[{i}]" if isinstance(value, list) else f"{where}.{key}"
            results = [unknown_keys(item, candidate, at) for candidate in candidates]
            if results and all(results):
                problems += results[0]
    return problems


def import_object(path: str) -> Any:
    """`module:attr` or `module.attr`, as Serve resolves import paths."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", ""): p.get("containerPort") for p in container.get("ports") or []}


def _cpus(value: Any) -> float | None:
    if value is None:
        return None
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _worker_cpus(group: dict[str, Any]) -> float | None:
    """The logical CPUs Ray sees on a worker: rayStartParams num-cpus, else the container's limit."""
    cpus = _cpus(get(group, "rayStartParams", "num-cpus"))
    if cpus is None:
        cpus = _cpus(get(group, "template", "spec", "containers", 0, "resources", "limits", "cpu"))
    return cpus


def _build_problems(where: str, app: Any, args: dict[str, Any], model_dir: Path) -> list[str]:
    """Runs the builder as Serve's controller does and applies the config's deployment overrides."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.deployment_info import DeploymentInfo

    # The pods set the token variable from a Secret (`kuberay.identity` checks they do); here a
    # stand-in lets the builder run as it would there.
    token_env = args.get("token_env")
    stand_in = {token_env: "stand-in"} if isinstance(token_env, str) and not os.environ.get(token_env) else {}
    try:
        builder = import_object(app.import_path)
        with mock.patch.dict(os.environ, stand_in):
            application = call_user_app_builder_with_args_if_necessary(builder, {**args, "model_dir": str(model_dir)})
        built = build_app(application, name=app.name)
        infos = {
            d.name: DeploymentInfo(
                deployment_config=d._deployment_config,
                replica_config=d._replica_config,
                start_time_ms=0,
                deployer_job_id="kuberay-validate",
            )
            for d in built.deployments
        }
        override_deployment_info(infos, app)
    except Exception as e:  # any failure here is a failed deploy on the cluster
        return [f"{where}: the application does not build: {type(e).__name__}: {e}"]
    return []


def serve_problems(resources: list[Resource], *, model_dir: Path | None = None) -> list[str]:
    """Problems of every RayService's serveConfigV2; builds the app when `model_dir` is given."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from raypipe.config import ServiceConfig
    from serve_app.deploy import SERVICER_FUNCTION

    problems: list[str] = []
    for r in resources:
        if r.get("kind") != "RayService":
            continue
        where = f"{ref(r)}.spec.serveConfigV2"
        try:
            data = yaml.safe_load(get(r, "spec", "serveConfigV2", default="") or "")
        except yaml.YAMLError as e:
            problems.append(f"{where}: not YAML: {e}")
            continue
        if not isinstance(data, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        problems += unknown_keys(data, ServeDeploySchema, where)
        try:
            config = ServeDeploySchema.model_validate(data)
        except ValidationError as e:
            problems.append(f"{where}: ServeDeploySchema rejects it: {e}")
            continue

        servicers = list(config.grpc_options.grpc_servicer_functions)
        for path in servicers:
            try:
                if not callable(import_object(path)):
                    problems.append(f"{where}: grpc servicer function {path} is not callable")
            except (ImportError, AttributeError, ValueError) as e:
                problems.append(f"{where}: grpc servicer function {path} does not import: {e}")
        if SERVICER_FUNCTION not in servicers:
            problems.append(f"{where}: grpc_options.grpc_servicer_functions lacks {SERVICER_FUNCTION}")

        cluster = get(r, "spec", "rayClusterConfig", default={})
        port = config.grpc_options.port
        head = get(cluster, "headGroupSpec", "template", "spec", "containers", 0, default={})
        # With the model-tls component the head declares serve-grpcs instead (the Service then offers
        # the workers' TLS sidecar; kuberay.model_service checks that the sidecar forwards to `port`).
        if "serve-grpcs" not in _ports(head) and _ports(head).get("serve-grpc") != port:
            problems.append(f"{where}: grpc port {port} is not the head container's serve-grpc port")
        for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
            worker = get(group, "template", "spec", "containers", 0, default={})
            if _ports(worker).get("serve-grpc") != port:
                problems.append(f"{where}: grpc port {port} is not workerGroupSpecs[{i}]'s serve-grpc port")

        fetched = {
            env.get("value")
            for _, pod in _cluster_pods(cluster)
            for c in get(pod, "spec", "initContainers", default=[])
            for env in c.get("env") or []
            if env.get("name") == "MODEL_DIR"
        }
        worker_cpus = [c for g in cluster.get("workerGroupSpecs") or [] if (c := _worker_cpus(g)) is not None]
        app_names = [app.name for app in config.applications]
        if ServiceConfig().application not in app_names:
            problems.append(
                f"{where}: no application named {ServiceConfig().application!r}, the name clients send by default"
            )
        for app in config.applications:
            at = f"{where}.applications[{app.name}]"
            if not isinstance(app.route_prefix, str):
                problems.append(f"{at}: needs a route_prefix (the gRPC proxy routes none without one)")
            try:
                import_object(app.import_path)
            except (ImportError, AttributeError, ValueError) as e:
                problems.append(f"{at}: import_path {app.import_path} does not import: {e}")
                continue
            if fetched and app.args.get("model_dir") not in fetched:
                problems.append(f"{at}: args.model_dir {app.args.get('model_dir')} is not where the model is fetched")
            for d in app.deployments:
                options = d.model_dump(exclude_unset=True)
                if "autoscaling_config" in options and options.get("num_replicas") != "auto":
                    problems.append(
                        f"{at}.deployments[{d.name}]: with autoscaling_config, set num_replicas: auto "
                        "(the code pins a fixed count)"
                    )
                cpus = get(options, "ray_actor_options", "num_cpus")
                if cpus is not None and worker_cpus and cpus > max(worker_cpus):
                    problems.append(f"{at}.deployments[{d.name}]: a replica's {cpus:g} CPUs fit no worker")
            if model_dir is not None:
                problems += _build_problems(at, app, dict(app.args), model_dir)
    return problems


def _cluster_pods(cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    from kuberay.validate import cluster_pod_templates

    return cluster_pod_templates("", cluster)

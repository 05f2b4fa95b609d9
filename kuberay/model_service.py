"""The model service's own rules, on the rendered RayService (`model_service_problems`).

- A head that runs no replicas (num-cpus 0) and declares KubeRay's default ports plus the port
  the serve Service offers clients (declaring any port drops the defaults): serve-grpc, or
  serve-grpcs with the model-tls component; in-tree autoscaling with room to scale; the
  NewCluster upgrade strategy that keeps the old cluster serving while a new one starts.
- Placement by custom resource, one mechanism with `raypipe serve`: every replica asks for
  `serve_app.deploy.POOL_RESOURCE`, the model service's worker groups advertise
  `POOL_RESOURCE_PER_NODE` of it, and no other group (a head, a job cluster) advertises it.
- The model-tls component, when present: the Service offers only the TLS port; a sidecar on
  every worker serves it with a certificate from a Secret and forwards to the Serve gRPC
  proxy on 127.0.0.1, offering ALPN h2, over HTTP/2 both ways; it refuses a call without an
  `authorization: Bearer` header before forwarding it (an RBAC filter ahead of the router, every
  allowing policy requiring the header), answering UNAUTHENTICATED (its 403 turned into 401).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import yaml

from kuberay.netpol import TLS_PORT_NAME
from kuberay.validate import Resource, get, jobs, ref

DEFAULT_HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {str(p.get("name")): p.get("containerPort") for p in container.get("ports") or [] if p.get("name")}


def _grpc_port(rayservice: Resource) -> int | None:
    try:
        config = yaml.safe_load(get(rayservice, "spec", "serveConfigV2", default="") or "")
    except yaml.YAMLError:
        return None
    port = get(config, "grpc_options", "port")
    return port if isinstance(port, int) else None


def model_service_problems(resources: list[Resource]) -> list[str]:
    problems = []
    services = [r for r in resources if r.get("kind") == "RayService"]
    if len(services) != 1:
        return [f"expected one RayService (the model service), found {len(services)}"]
    rs = services[0]
    where, spec = ref(rs), rs.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or {}
    head = cluster.get("headGroupSpec") or {}
    if get(head, "rayStartParams", "num-cpus") != "0":
        problems.append(f'{where}: the head must run no replicas: rayStartParams num-cpus "0"')
    if not cluster.get("enableInTreeAutoscaling"):
        problems.append(f"{where}: enableInTreeAutoscaling must be true")
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        if not 0 < group.get("minReplicas", 0) < group.get("maxReplicas", 0):
            problems.append(f"{where}: workerGroupSpecs[{i}] needs 0 < minReplicas < maxReplicas to autoscale")
    if get(spec, "upgradeStrategy", "type") != "NewCluster":
        problems.append(
            f"{where}: upgradeStrategy.type must be NewCluster (the old cluster serves until the new is up)"
        )
    port = _grpc_port(rs)
    ports = _ports(get(head, "template", "spec", "containers", 0, default={}))
    service_port = {"serve-grpcs": ports["serve-grpcs"]} if "serve-grpcs" in ports else {"serve-grpc": port}
    for name, number in {**DEFAULT_HEAD_PORTS, **service_port}.items():
        if ports.get(name) != number:
            problems.append(f"{where}: the head container must declare port {name}={number} (declared: {ports})")
    return problems + _pool_problems(rs, resources) + _tls_problems(rs, resources)


def advertised_resources(params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The custom resources a group's rayStartParams advertise, and why they cannot be read.

    Three readers see the `resources` value: bash, in the `ray start --resources=...` line the
    operator writes (common/pod.go, convertParamMap); Ray's autoscaler, which drops its first and
    last character and every backslash (autoscaler/_private/kuberay/autoscaling_config.py); and the
    operator itself, which trims quotes and spaces (common/pod.go, getResourcesMap). All three must
    read the same integer amounts."""
    text = params.get("resources")
    if text is None:
        return {}, None
    text = str(text)
    try:
        words = shlex.split(text)
    except ValueError as e:
        return {}, f"bash cannot parse it ({e})"
    if len(words) != 1:
        return {}, f"bash splits {text!r} into {len(words)} words; quote the JSON (single quotes)"
    readings: list[tuple[str, str]] = [
        ("bash (`ray start --resources=...`)", words[0]),
        ("Ray's autoscaler (it drops the first and last character)", text[1:-1].replace("\\", "")),
        ("KubeRay's operator (getResourcesMap; it logs an error for every pod)", text.strip("'\"` ")),
    ]
    values = []
    for reader, body in readings:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return {}, f"{reader} cannot read {text!r}; write it as '{{\"name\": amount}}' in single quotes"
        if not isinstance(value, dict) or not all(isinstance(v, int) for v in value.values()):
            return {}, f"{reader} reads {value!r}, not a mapping of names to integer amounts"
        values.append(value)
    if any(v != values[0] for v in values):
        return {}, f"its readers disagree: {values}"
    return values[0], None


def _pool_problems(rs: Resource, resources: list[Resource]) -> list[str]:
    """Replicas ask for the pool's resource, which only the model service's worker groups advertise."""
    from serve_app.deploy import POOL_RESOURCE, POOL_RESOURCE_PER_NODE

    problems = []
    clusters = [(f"{ref(rs)}.spec.rayClusterConfig", get(rs, "spec", "rayClusterConfig", default={}), True)]
    clusters += [
        (f"{j.where}.rayClusterSpec", j.spec["rayClusterSpec"], False)
        for j in jobs(resources)
        if "rayClusterSpec" in j.spec
    ]
    for where, cluster, serving in clusters:
        groups = [("headGroupSpec", cluster.get("headGroupSpec") or {}, False)]
        groups += [(f"workerGroupSpecs[{i}]", g, serving) for i, g in enumerate(cluster.get("workerGroupSpecs") or [])]
        for label, group, pool in groups:
            at = f"{where}.{label}.rayStartParams.resources"
            advertised, why = advertised_resources(group.get("rayStartParams") or {})
            if why:
                problems.append(f"{at}: {why}")
            elif pool and advertised.get(POOL_RESOURCE) != POOL_RESOURCE_PER_NODE:
                problems.append(
                    f"{at}: a model worker must advertise {POOL_RESOURCE}={POOL_RESOURCE_PER_NODE} "
                    f"(serve_app.deploy), or no replica can be placed on it nor scale it up"
                )
            elif not pool and POOL_RESOURCE in advertised:
                problems.append(
                    f"{at}: advertises {POOL_RESOURCE}; only the model service's worker groups may "
                    "(replicas would land on this node)"
                )
    try:
        config = yaml.safe_load(get(rs, "spec", "serveConfigV2", default="") or "") or {}
    except yaml.YAMLError:
        return problems  # serve_check reports it
    for app in get(config, "applications", default=[]) or []:
        for d in app.get("deployments") or []:
            amount = get(d, "ray_actor_options", "resources", POOL_RESOURCE)
            if not (isinstance(amount, int | float) and 0 < amount <= POOL_RESOURCE_PER_NODE):
                problems.append(
                    f"{ref(rs)}.spec.serveConfigV2.applications[{app.get('name')}].deployments[{d.get('name')}]: "
                    f"ray_actor_options.resources must request {POOL_RESOURCE} (1 per replica, as `raypipe serve`), "
                    f"so replicas land only on the model's pool; it requests {amount!r}"
                )
    return problems


def _tls_problems(rs: Resource, resources: list[Resource]) -> list[str]:
    """With the model-tls component: the Service offers only the TLS port, which a sidecar on every
    worker serves with a certificate from a Secret, forwarding to the Serve gRPC proxy."""
    where = ref(rs)
    cluster = get(rs, "spec", "rayClusterConfig", default={})
    head = _ports(get(cluster, "headGroupSpec", "template", "spec", "containers", 0, default={}))
    tls = head.get(TLS_PORT_NAME)
    problems = []
    grpc_port = _grpc_port(rs)
    config_maps = {get(r, "metadata", "name"): r.get("data") or {} for r in resources if r.get("kind") == "ConfigMap"}
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        spec = get(group, "template", "spec", default={})
        sidecars = [c for c in (spec.get("containers") or [])[1:] if TLS_PORT_NAME in _ports(c)]
        at = f"{where}.workerGroupSpecs[{i}]"
        if tls is None:
            if sidecars:
                problems.append(
                    f"{at}: a container serves {TLS_PORT_NAME} but the head does not declare it (the Service)"
                )
            continue
        if not sidecars or _ports(sidecars[0])[TLS_PORT_NAME] != tls:
            problems.append(f"{at}: no container serves {TLS_PORT_NAME}={tls}, the port the Service sends clients to")
            continue
        volumes = {v.get("name"): v for v in spec.get("volumes") or []}
        mounted = [volumes.get(m.get("name")) or {} for m in sidecars[0].get("volumeMounts") or []]
        if not any("secret" in v for v in mounted):
            problems.append(
                f"{at}.containers[{sidecars[0].get('name')}]: mounts no Secret to take its certificate from"
            )
        for v in mounted:
            data = config_maps.get(get(v, "configMap", "name"), {})
            problems += [
                f"{at}.containers[{sidecars[0].get('name')}]: {why}" for why in _proxy_problems(data, tls, grpc_port)
            ]
    if tls is not None and "serve-grpc" in head:
        problems.append(
            f"{where}: with {TLS_PORT_NAME}, the head must not declare serve-grpc "
            "(the Service would offer plaintext gRPC too)"
        )
    return problems


def _proxy_problems(data: dict[str, Any], tls: int, grpc_port: int | None) -> list[str]:
    """An Envoy bootstrap in a mounted ConfigMap: listens on the TLS port, offers h2 (gRPC clients
    refuse a TLS server that negotiates no ALPN), forwards to the Serve gRPC proxy on 127.0.0.1."""
    problems = []
    for key, text in data.items():
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as e:
            problems.append(f"{key}: not YAML: {e}")
            continue
        listeners = get(config, "static_resources", "listeners")
        if not isinstance(listeners, list):
            continue
        ports = [get(li, "address", "socket_address", "port_value") for li in listeners]
        if ports != [tls]:
            problems.append(f"{key}: listens on {ports}, not on {TLS_PORT_NAME}={tls}")
        alpn = [
            get(chain, "transport_socket", "typed_config", "common_tls_context", "alpn_protocols", default=[])
            for li in listeners
            for chain in li.get("filter_chains") or []
        ]
        if not alpn or any("h2" not in a for a in alpn):
            problems.append(f"{key}: every filter chain must offer ALPN h2 (gRPC clients require it)")
        upstreams = [
            get(e, "endpoint", "address", "socket_address", default={})
            for c in get(config, "static_resources", "clusters", default=[]) or []
            for ep in get(c, "load_assignment", "endpoints", default=[]) or []
            for e in ep.get("lb_endpoints") or []
        ]
        if [(u.get("address"), u.get("port_value")) for u in upstreams] != [("127.0.0.1", grpc_port)]:
            problems.append(f"{key}: forwards to {upstreams}, not to the Serve gRPC proxy at 127.0.0.1:{grpc_port}")
        problems += [f"{key}: {why}" for why in _credential_problems(config)]
    return problems


HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
RBAC = "envoy.extensions.filters.http.rbac.v3.RBAC"
ROUTER = "envoy.extensions.filters.http.router.v3.Router"
UPSTREAM_HTTP = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _type(node: Any) -> str:
    return str(get(node, "typed_config", "@type", default="")).rpartition("/")[2]


def _requires_bearer(principal: dict[str, Any]) -> bool:
    """Whether an RBAC principal holds only for a request with `authorization: Bearer ...`
    (a header principal, or an and_ids of principals one of which is that)."""
    if "and_ids" in principal:
        return any(_requires_bearer(p) for p in get(principal, "and_ids", "ids", default=[]) or [])
    header = principal.get("header") or {}
    match = header.get("string_match") or {}
    return (
        str(header.get("name", "")).lower() == "authorization"
        and not header.get("invert_match")
        and str(match.get("prefix", "")).lower() == "bearer "
    )


def _credential_problems(config: dict[str, Any]) -> list[str]:
    """The proxy refuses a call without `authorization: Bearer` before the router forwards it."""
    problems = []
    for li in get(config, "static_resources", "listeners", default=[]) or []:
        for chain in li.get("filter_chains") or []:
            filters = chain.get("filters") or []
            if [_type(f) for f in filters] != [HCM]:
                problems.append(
                    f"listener {li.get('name')}: its filter chain must be one HTTP connection manager, not "
                    f"{[_type(f) or f.get('name') for f in filters]} (a TCP proxy cannot see a call's credential)"
                )
                continue
            hcm = filters[0]["typed_config"]
            http = hcm.get("http_filters") or []
            kinds = [_type(f) for f in http]
            rbac = [f["typed_config"] for f in http if _type(f) == RBAC]
            if not kinds or kinds[-1] != ROUTER or not rbac or kinds.index(RBAC) > kinds.index(ROUTER):
                problems.append(
                    f"listener {li.get('name')}: needs an RBAC filter before the router (filters: {kinds}): "
                    "calls without a credential would reach the model service"
                )
                continue
            for r in rbac:
                rules = r.get("rules") or {}
                policies = rules.get("policies") or {}
                open_policies = [
                    name
                    for name, pol in policies.items()
                    if not (pol.get("principals") and all(_requires_bearer(p) for p in pol["principals"]))
                ]
                if rules.get("action", "ALLOW") != "ALLOW" or not policies or open_policies:
                    problems.append(
                        f"listener {li.get('name')}: the RBAC filter must ALLOW only requests with "
                        f"`authorization: Bearer ...` (policies that do not require it: {open_policies or 'all'})"
                    )
            mappers = get(hcm, "local_reply_config", "mappers", default=[]) or []
            if not any(
                get(m, "filter", "status_code_filter", "comparison", "value", "default_value") == 403
                and m.get("status_code") == 401
                for m in mappers
            ):
                problems.append(
                    f"listener {li.get('name')}: a refused call gets PERMISSION_DENIED; map the RBAC filter's 403 "
                    "to 401 (local_reply_config) so it gets UNAUTHENTICATED, as from a replica"
                )
    for c in get(config, "static_resources", "clusters", default=[]) or []:
        options = get(c, "typed_extension_protocol_options", UPSTREAM_HTTP, default={}) or {}
        if get(options, "explicit_http_config", "http2_protocol_options") is None:
            problems.append(f"cluster {c.get('name')}: gRPC needs HTTP/2 to the Serve proxy (explicit_http_config)")
    return problems

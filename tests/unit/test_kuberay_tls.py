"""The model-tls component: TLS to the model service, as kuberay/overlays/prod-tls renders it.

The serve Service offers the TLS port (serve-grpcs, 9443) and no longer the plaintext one; a
sidecar on every worker serves it with a certificate from a Secret and forwards to Serve's gRPC
proxy on 127.0.0.1:9000, offering ALPN h2; the NetworkPolicy admits the model clients to 9443
only. Each of these fails on a broken copy. The jobs' side (grpcs://, the CA) is checked with the
entrypoints (test_kuberay_entrypoints.py). Offline: `kubectl kustomize` renders, nothing runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from kuberay import netpol, policy, validate
from kuberay.validate import Resource

WORKER = "RayService/raypipe.spec.rayClusterConfig.workerGroupSpecs[0].template"


def rendered(overlay: str = "prod-tls") -> list[Resource]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: the kustomize overlays cannot be rendered")
    return validate.render(validate.OVERLAYS / overlay)


def rayservice(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = next(r for r in rs if r["kind"] == "RayService")["spec"]
    return spec


def head(rs: list[Resource]) -> dict[str, Any]:
    container: dict[str, Any] = rayservice(rs)["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return container


def worker_spec(rs: list[Resource]) -> dict[str, Any]:
    spec: dict[str, Any] = rayservice(rs)["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    return spec


def sidecar(rs: list[Resource]) -> dict[str, Any]:
    return next(c for c in worker_spec(rs)["containers"] if c["name"] == "tls-proxy")


def envoy(rs: list[Resource], edit: Callable[[dict[str, Any]], None]) -> None:
    cm = next(r for r in rs if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "raypipe-tls-proxy")
    config = yaml.safe_load(cm["data"]["envoy.yaml"])
    edit(config)
    cm["data"]["envoy.yaml"] = yaml.safe_dump(config)


def listener(config: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = config["static_resources"]["listeners"][0]
    return first


def tls_context(config: dict[str, Any]) -> dict[str, Any]:
    context: dict[str, Any] = listener(config)["filter_chains"][0]["transport_socket"]["typed_config"]
    return context["common_tls_context"]


def upstream(config: dict[str, Any]) -> dict[str, Any]:
    endpoint = config["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    address: dict[str, Any] = endpoint["endpoint"]["address"]["socket_address"]
    return address


def test_prod_tls_renders_the_component() -> None:
    resources = rendered()
    ports = {p["name"]: p["containerPort"] for p in head(resources)["ports"]}
    assert ports.get("serve-grpcs") == 9443 and "serve-grpc" not in ports
    assert sidecar(resources)["ports"] == [{"name": "serve-grpcs", "containerPort": 9443}]
    volumes = {v["name"]: v for v in worker_spec(resources)["volumes"]}
    assert volumes["tls-server"] == {"name": "tls-server", "secret": {"secretName": "raypipe-serve-tls"}}
    grpc = next(r for r in resources if r["kind"] == "NetworkPolicy" and r["metadata"]["name"].endswith("grpc"))
    assert grpc["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9443}]
    net = netpol.network(resources)
    assert net.client_port == 9443


def test_prod_tls_passes_the_project_rules() -> None:
    assert policy.project_problems(rendered()) == []


def test_the_proxy_forwards_to_the_serve_grpc_port() -> None:
    resources = rendered()
    grpc_port = yaml.safe_load(rayservice(resources)["serveConfigV2"])["grpc_options"]["port"]
    checked: dict[str, Any] = {}
    envoy(
        resources, lambda c: checked.update(listen=listener(c), to=upstream(c), alpn=tls_context(c)["alpn_protocols"])
    )
    assert checked["listen"]["address"]["socket_address"]["port_value"] == 9443
    assert checked["to"] == {"address": "127.0.0.1", "port_value": grpc_port}
    assert checked["alpn"] == ["h2"]


# --- the credential at the proxy ------------------------------------------------------------

GRPC_STATUS = {200: 0, 401: 16, 403: 7}  # Envoy's httpToGrpcStatus for the codes in play


def _header_matches(matcher: dict[str, Any], headers: dict[str, str]) -> bool:
    """Envoy's HeaderMatcher, for the forms the proxy's config uses; anything else fails the test."""
    assert set(matcher) <= {"name", "string_match", "invert_match"}, matcher
    value = headers.get(matcher["name"].lower())
    match = matcher["string_match"]
    assert set(match) <= {"prefix", "exact", "ignore_case"}, match
    if value is None:
        return False
    fold = (lambda x: x.lower()) if match.get("ignore_case") else (lambda x: x)
    hit = fold(value).startswith(fold(match["prefix"])) if "prefix" in match else fold(value) == fold(match["exact"])
    return hit != bool(matcher.get("invert_match"))


def _principal(principal: dict[str, Any], headers: dict[str, str]) -> bool:
    if principal.get("any"):
        return True
    if "and_ids" in principal:
        return all(_principal(p, headers) for p in principal["and_ids"]["ids"])
    if "or_ids" in principal:
        return any(_principal(p, headers) for p in principal["or_ids"]["ids"])
    assert set(principal) == {"header"}, principal
    return _header_matches(principal["header"], headers)


def proxy_answer(config: dict[str, Any], headers: dict[str, str]) -> tuple[str, int]:
    """What the TLS proxy does with a gRPC call carrying `headers`: ("forward", cluster) or
    ("refuse", grpc-status), following its filter chain as Envoy does (RBAC filters, then the
    router's route; a refused call's local reply through local_reply_config's mappers)."""
    (chain,) = listener(config)["filter_chains"]
    (network_filter,) = chain["filters"]
    hcm = network_filter["typed_config"]
    if not hcm["@type"].endswith("HttpConnectionManager"):
        return ("forward", 0)  # an L4 proxy passes every call through unseen
    for http_filter in hcm["http_filters"]:
        kind = http_filter["typed_config"]["@type"].rpartition(".")[2]
        if kind == "Router":
            (host,) = hcm["route_config"]["virtual_hosts"]
            route = next(r for r in host["routes"] if headers[":path"].startswith(r["match"]["prefix"]))
            return ("forward", route["route"]["cluster"])
        assert kind == "RBAC", http_filter
        rules = http_filter["typed_config"]["rules"]
        matched = any(
            any(p.get("any") for p in policy_["permissions"])
            and any(_principal(p, headers) for p in policy_["principals"])
            for policy_ in rules["policies"].values()
        )
        if matched != (rules.get("action", "ALLOW") == "ALLOW"):
            status = 403
            for mapper in hcm.get("local_reply_config", {}).get("mappers", []):
                comparison = mapper["filter"]["status_code_filter"]["comparison"]
                if comparison["op"] == "EQ" and comparison["value"]["default_value"] == status:
                    status = mapper["status_code"]
                    break
            return ("refuse", GRPC_STATUS[status])
    raise AssertionError("no router: the call goes nowhere")


def test_the_proxy_refuses_a_call_without_a_bearer_token_before_the_model_service() -> None:
    config: dict[str, Any] = {}
    envoy(rendered(), config.update)
    call = {
        ":path": "/raypipe.v1.EmotionClassifier/Predict",
        "content-type": "application/grpc",
        "application": "raypipe",
    }
    assert proxy_answer(config, call) == ("refuse", 16)  # UNAUTHENTICATED, as from a replica
    assert proxy_answer(config, {**call, "authorization": "Basic dXNlcjpwdw=="}) == ("refuse", 16)
    assert proxy_answer(config, {**call, "authorization": "Bearer 0123abcd"}) == ("forward", "serve-grpc")
    assert proxy_answer(config, {**call, "authorization": "bearer 0123abcd"}) == ("forward", "serve-grpc")
    # the replica, not the proxy, compares the token: its value is not in the proxy's config
    assert "0123abcd" not in yaml.safe_dump(config)


def test_the_proxy_speaks_http2_to_the_serve_proxy_without_a_route_timeout() -> None:
    config: dict[str, Any] = {}
    envoy(rendered(), config.update)
    (cluster,) = config["static_resources"]["clusters"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    hcm = listener(config)["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"].get("timeout") for r in routes] == ["0s"]  # Envoy's default would cut a call at 15 s


def _http(config: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = listener(config)["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _tcp_only(config: dict[str, Any]) -> None:
    listener(config)["filter_chains"][0]["filters"] = [
        {
            "name": "envoy.filters.network.tcp_proxy",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "grpcs",
                "cluster": "serve-grpc",
            },
        }
    ]


def _rbac_rules(config: dict[str, Any]) -> dict[str, Any]:
    rules: dict[str, Any] = _http(config)["http_filters"][0]["typed_config"]["rules"]
    return rules


def _drop_sidecar(rs: list[Resource]) -> None:
    worker_spec(rs)["containers"] = [c for c in worker_spec(rs)["containers"] if c["name"] != "tls-proxy"]


def _plaintext_for_clients(rs: list[Resource]) -> None:
    grpc = next(r for r in rs if r["kind"] == "NetworkPolicy" and r["metadata"]["name"] == "raypipe-model-service-grpc")
    grpc["spec"]["ingress"][0]["ports"].append({"protocol": "TCP", "port": 9000})


BREAKS: dict[str, tuple[str, Callable[[list[Resource]], Any], str]] = {
    "no-sidecar": ("prod-tls", _drop_sidecar, "no container serves serve-grpcs=9443"),
    "sidecar-on-another-port": (
        "prod-tls",
        lambda rs: sidecar(rs)["ports"][0].update(containerPort=9444),
        "no container serves serve-grpcs=9443",
    ),
    "service-still-plaintext": (
        "prod-tls",
        lambda rs: head(rs)["ports"].append({"name": "serve-grpc", "containerPort": 9000}),
        "the head must not declare serve-grpc",
    ),
    "certificate-not-from-a-secret": (
        "prod-tls",
        lambda rs: sidecar(rs).update(
            volumeMounts=[m for m in sidecar(rs)["volumeMounts"] if m["name"] != "tls-server"]
        ),
        "mounts no Secret to take its certificate from",
    ),
    "proxy-listens-elsewhere": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: listener(c)["address"]["socket_address"].update(port_value=9444)),
        "envoy.yaml: listens on [9444], not on serve-grpcs=9443",
    ),
    "proxy-without-alpn": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: tls_context(c).pop("alpn_protocols")),
        "envoy.yaml: every filter chain must offer ALPN h2",
    ),
    "proxy-forwards-elsewhere": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: upstream(c).update(port_value=8000)),
        "not to the Serve gRPC proxy at 127.0.0.1:9000",
    ),
    "proxy-tcp-only": (
        "prod-tls",
        lambda rs: envoy(rs, _tcp_only),
        "must be one HTTP connection manager, not ['envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy']",
    ),
    "proxy-without-rbac": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: _http(c)["http_filters"].pop(0)),
        "needs an RBAC filter before the router",
    ),
    "proxy-rbac-after-the-router": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: _http(c)["http_filters"].reverse()),
        "needs an RBAC filter before the router",
    ),
    "proxy-allows-anyone": (
        "prod-tls",
        lambda rs: envoy(
            rs,
            lambda c: _rbac_rules(c)["policies"].update(
                anyone={"permissions": [{"any": True}], "principals": [{"any": True}]}
            ),
        ),
        "policies that do not require it: ['anyone']",
    ),
    "proxy-denies-with-permission-denied": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: _http(c).pop("local_reply_config")),
        "a refused call gets PERMISSION_DENIED",
    ),
    "proxy-http1-upstream": (
        "prod-tls",
        lambda rs: envoy(rs, lambda c: c["static_resources"]["clusters"][0].pop("typed_extension_protocol_options")),
        "cluster serve-grpc: gRPC needs HTTP/2",
    ),
    "clients-still-on-plaintext": (
        "prod-tls",
        _plaintext_for_clients,
        f"admits the pods of RayJob/raypipe-backfill to {WORKER} on 9443, 9000",
    ),
    "clients-shut-out-of-tls": (
        "prod-tls",
        lambda rs: next(
            r for r in rs if r["kind"] == "NetworkPolicy" and r["metadata"]["name"] == "raypipe-model-service-grpc"
        )["spec"]["ingress"][0]["ports"][0].update(port=9000),
        "(a model client) to port 9443",
    ),
    "sidecar-image-unpinned": (
        "prod-tls",
        lambda rs: sidecar(rs).update(image="envoyproxy/envoy:latest"),
        "image 'envoyproxy/envoy:latest' needs an explicit tag",
    ),
    "sidecar-without-the-service-port": (
        "prod",
        lambda rs: worker_spec(rs)["containers"].append(
            {
                "name": "tls-proxy",
                "image": "envoyproxy/envoy:distroless-v1.39.1",
                "ports": [{"name": "serve-grpcs", "containerPort": 9443}],
            }
        ),
        "a container serves serve-grpcs but the head does not declare it",
    ),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_tls_rules_reject_broken_copies(case: str) -> None:
    overlay, mutate, expected = BREAKS[case]
    resources = rendered(overlay)
    mutate(resources)
    problems = policy.project_problems(resources)
    assert any(expected in p for p in problems), problems


def test_only_the_tls_proxy_may_run_another_image() -> None:
    resources = rendered()
    sidecar(resources)["name"] = "proxy"
    problems = policy.project_problems(resources)
    assert any("more than one image" in p for p in problems), problems

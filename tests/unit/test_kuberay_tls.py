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

"""Whom raypipe's NetworkPolicies let into which pod, and the rules that must hold (`network_problems`).

A NetworkPolicy only adds allowances: a pod that no policy selects takes every connection; once
one selects it for ingress, it takes only what some rule of some policy selecting it admits.
The checks read the rendered policies against the pods the rendered templates make, with the
labels those pods will carry: KubeRay's defaults under the template's labels, then what KubeRay
sets and lets no template override (`labelPod` in common/pod.go: ray.io/node-type, ray.io/group;
ray.io/cluster too, but a generated name is nothing to select on), and on a submitter the
labels of the Job it runs in. Every pod runs in the namespace of the resource that holds it.

The rules (each problem names the policy or the pods):
- every raypipe pod is selected by a policy that isolates it for ingress;
- no rule admits every source (no `from`), an IP block, every namespace, or every pod of one;
- the pods of each Ray cluster admit each other on every port (Ray's own traffic: GCS, raylets,
  object transfer, workers), and a rule that admits every port admits no one else;
- the model service's client port (the gRPC port, or the TLS port of the model-tls component)
  admits the job clusters' pods on the model service's workers, and the head, which serves no
  client (excludeHeadPodFromServeSvc), admits none of them;
- a head's dashboard, GCS and client ports admit, from outside its cluster, only the KubeRay
  operator and, on a job's head, that job's submitter; the operator reaches every head's
  dashboard and each submitter its own head's;
- nothing else from outside a cluster: any other port of a Ray pod, and every port of a
  submitter or scheduler pod (they listen on nothing), admits no one.

Egress is open for every part but the watcher, which runs for months: its pods are closed for
egress (`egress_problems`), and what reaches a pod is what its egress and the target's ingress
both allow. Its egress rules may open its own cluster (every port), the model service's client
port on the workers, DNS (port 53) outside the rendering, and IP blocks on named ports: TCP
only to blocks that hold no pod address (they except the private ranges), other protocols to
any block (no raypipe pod listens on UDP). No rule without `to`, no peer wider than that.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kuberay.validate import Resource, cluster_pod_templates, containers, get, jobs, ref

OPERATOR_NAME = "kuberay-operator"
"""`app.kubernetes.io/name` of the operator's pods (the KubeRay Helm chart, templates/deployment.yaml)."""
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
"""The label every namespace carries with its own name (Kubernetes >= 1.22)."""
DASHBOARD, GCS, CLIENT = 8265, 6379, 10001
HEAD_CONTROL_PORTS = frozenset({DASHBOARD, GCS, CLIENT})
TLS_PORT_NAME = "serve-grpcs"
"""The Service port (on the head's Ray container) and the sidecar's port of the model-tls component."""
_ALL_PORTS = ((1, 65535),)


@dataclass(frozen=True)
class Pod:
    """A pod some template makes, as a NetworkPolicy sees it."""

    where: str
    labels: Mapping[str, str]
    namespace: str
    ports: Mapping[str, int]
    """Named container ports (every container), for rules that name a port."""
    cluster: str | None = None
    """The Ray cluster it is part of: "RayService/raypipe", "RayJob/raypipe-backfill"..."""
    head: bool = False
    submits: str | None = None
    """For a submitter: the cluster it submits to."""


@dataclass
class Network:
    pods: list[Pod]
    policies: list[Resource]
    model_service: str | None = None
    client_port: int | None = None
    """The port the job pods call on the model service's workers (TLS port if there is one)."""
    head_serves: bool = False
    """Whether the model service's head is in the Serve Service (excludeHeadPodFromServeSvc false)."""
    job_clusters: list[str] = field(default_factory=list)
    watchers: list[str] = field(default_factory=list)
    """The watcher's clusters, whose pods must be closed for egress."""

    def cluster_pods(self, cluster: str) -> list[Pod]:
        return [p for p in self.pods if p.cluster == cluster]


def _text(labels: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in (labels or {}).items()}


def _named_ports(template: dict[str, Any]) -> dict[str, int]:
    return {
        str(p["name"]): p["containerPort"]
        for c in containers(template)
        for p in c.get("ports") or []
        if p.get("name") and isinstance(p.get("containerPort"), int)
    }


def _ray_pods(cluster: str, where: str, spec: dict[str, Any], namespace: str) -> list[Pod]:
    """The pods of Ray cluster `cluster` (its spec at `where`), labelled as KubeRay labels them."""
    groups = ["headgroup"] + [str(g.get("groupName")) for g in spec.get("workerGroupSpecs") or []]
    pods = []
    for i, ((at, template), group) in enumerate(zip(cluster_pod_templates(where, spec), groups, strict=True)):
        head = i == 0  # cluster_pod_templates lists the head first
        labels = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": OPERATOR_NAME}
        labels |= {"ray.io/is-ray-node": "yes"} | _text(get(template, "metadata", "labels"))
        labels |= {"ray.io/node-type": "head" if head else "worker", "ray.io/group": group}
        pods.append(Pod(at, labels, namespace, _named_ports(template), cluster=cluster, head=head))
    return pods


def network(resources: list[Resource]) -> Network:
    """The pods and policies of a rendering, and what the model service listens on."""
    pods: list[Pod] = []
    net = Network(pods, [r for r in resources if r.get("kind") == "NetworkPolicy"])
    for r in resources:
        namespace = str(get(r, "metadata", "namespace", default=""))
        if r.get("kind") == "RayService":
            cluster = get(r, "spec", "rayClusterConfig", default={})
            net.model_service = ref(r)
            pods += _ray_pods(ref(r), f"{ref(r)}.spec.rayClusterConfig", cluster, namespace)
            grpc_port = None
            with contextlib.suppress(yaml.YAMLError):
                grpc_port = get(
                    yaml.safe_load(get(r, "spec", "serveConfigV2", default="") or ""), "grpc_options", "port"
                )
            head_ports = _named_ports(get(cluster, "headGroupSpec", "template", default={}))
            net.client_port = head_ports.get(TLS_PORT_NAME, grpc_port if isinstance(grpc_port, int) else None)
            net.head_serves = not get(r, "spec", "excludeHeadPodFromServeSvc", default=False)
        elif r.get("kind") == "CronJob":
            template = get(r, "spec", "jobTemplate", "spec", "template", default={})
            where = f"{ref(r)}.spec.jobTemplate.spec.template"
            pods.append(Pod(where, _text(get(template, "metadata", "labels")), namespace, _named_ports(template)))
    for job in jobs(resources):
        namespace = str(job.namespace or "")
        if "rayClusterSpec" in job.spec:
            net.job_clusters.append(job.where)
            if job.watch:
                net.watchers.append(job.where)
            pods += _ray_pods(job.where, f"{job.where}.rayClusterSpec", job.spec["rayClusterSpec"], namespace)
        template = job.spec.get("submitterPodTemplate")
        if template is not None:
            # The submitter runs in a Job named after the RayJob, whose controller labels its pods.
            labels = _text(get(template, "metadata", "labels")) | {
                "batch.kubernetes.io/job-name": job.name,
                "job-name": job.name,
            }
            pods.append(
                Pod(f"{job.where}.submitterPodTemplate", labels, namespace, _named_ports(template), submits=job.where)
            )
    return net


# --- NetworkPolicy semantics ----------------------------------------------------------------


def matches(selector: dict[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector against labels; an empty selector matches everything."""
    selector = selector or {}
    if any(labels.get(str(k)) != str(v) for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = str(e.get("key")), e.get("operator"), [str(v) for v in e.get("values") or []]
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


@dataclass(frozen=True)
class _Direction:
    """Where a policy keeps its rules for one direction of traffic, and whom they name."""

    policy_type: str
    rules: str
    """The spec's list of rules: "ingress" or "egress"."""
    peers: str
    """A rule's list of peers: "from" (its sources) or "to" (its destinations)."""
    untyped: bool
    """Whether a policy without `policyTypes` selects pods for this direction (Kubernetes: Ingress)."""


INGRESS = _Direction("Ingress", "ingress", "from", untyped=True)
EGRESS = _Direction("Egress", "egress", "to", untyped=False)


def _isolates(policy: Resource, pod: Pod, way: _Direction = INGRESS) -> bool:
    """Whether `policy` selects `pod` for `way` (ingress by default)."""
    types = get(policy, "spec", "policyTypes")
    return (
        str(get(policy, "metadata", "namespace", default="")) == pod.namespace
        and (way.policy_type in types if types is not None else way.untyped)
        and matches(get(policy, "spec", "podSelector"), pod.labels)
    )


def peer_admits(peer: dict[str, Any], pod: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return True  # a block can hold any pod's address
    if "namespaceSelector" in peer:
        in_namespace = matches(peer["namespaceSelector"], {NAMESPACE_LABEL: pod.namespace})
    else:
        in_namespace = pod.namespace == policy_namespace
    return in_namespace and ("podSelector" not in peer or matches(peer["podSelector"], pod.labels))


def is_operator(peer: dict[str, Any]) -> bool:
    """The KubeRay operator's pods, by namespace name and the operator chart's name label."""
    namespace = get(peer, "namespaceSelector", "matchLabels", NAMESPACE_LABEL)
    return (
        "ipBlock" not in peer
        and bool(namespace)
        and get(peer, "podSelector", "matchLabels", "app.kubernetes.io/name") == OPERATOR_NAME
    )


def rule_ports(rule: dict[str, Any], pod: Pod) -> list[tuple[int, int]]:
    """The TCP port ranges an ingress rule opens on `pod`."""
    entries = rule.get("ports")
    if not entries:
        return list(_ALL_PORTS)
    ranges = []
    for p in entries:
        if p.get("protocol", "TCP") != "TCP":
            continue
        value = p.get("port")
        if value is None:
            return list(_ALL_PORTS)
        if isinstance(value, str):
            if value in pod.ports:
                ranges.append((pod.ports[value], pod.ports[value]))
        else:
            ranges.append((value, p.get("endPort", value)))
    return ranges


def _covers(ranges: list[tuple[int, int]], port: int) -> bool:
    return any(low <= port <= high for low, high in ranges)


def _within(ranges: list[tuple[int, int]], allowed: frozenset[int] | None) -> bool:
    """Whether every port in `ranges` is in `allowed` (None: every port is)."""
    if allowed is None:
        return True
    return all(high - low < len(allowed) and all(p in allowed for p in range(low, high + 1)) for low, high in ranges)


def _rules(net: Network, pod: Pod, way: _Direction) -> Iterator[tuple[Resource, dict[str, Any], list[tuple[int, int]]]]:
    """(policy, rule, TCP port ranges) of every `way` rule of a policy that selects `pod` for it.
    For ingress the ranges are the ports opened on `pod`; for egress, on its destinations (a
    named port is read from `pod`'s own, as for ingress)."""
    for policy in net.policies:
        if _isolates(policy, pod, way):
            for rule in get(policy, "spec", way.rules, default=[]) or []:
                yield policy, rule, rule_ports(rule, pod)


def _open_ports(
    net: Network, pod: Pod, peer: Pod, way: _Direction, admits: Callable[[dict[str, Any], Pod, str], bool]
) -> list[tuple[int, int]]:
    """The port ranges `pod`'s `way` rules open to `peer` (every port if no policy selects `pod`
    for `way`); `admits(peer rule entry, peer, policy namespace)` says whether an entry names it."""
    if not any(_isolates(policy, pod, way) for policy in net.policies):
        return list(_ALL_PORTS)
    found = []
    for policy, rule, ranges in _rules(net, pod, way):
        namespace = str(get(policy, "metadata", "namespace", default=""))
        if not rule.get(way.peers) or any(admits(entry, peer, namespace) for entry in rule[way.peers]):
            found += ranges
    return found


def admissions(net: Network, pod: Pod) -> Iterator[tuple[Resource, dict[str, Any], list[tuple[int, int]]]]:
    """(policy, rule, port ranges) of every ingress rule that applies to `pod` (and opens a TCP port)."""
    return ((policy, rule, ranges) for policy, rule, ranges in _rules(net, pod, INGRESS) if ranges)


def admitted_ports(net: Network, source: Pod, pod: Pod) -> list[tuple[int, int]]:
    """The port ranges on which `source` may connect to `pod`."""
    return _open_ports(net, pod, source, INGRESS, peer_admits)


# --- egress -----------------------------------------------------------------------------------

PRIVATE_RANGES = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)
"""Where pod addresses come from (RFC 1918 and the shared range some CNIs use)."""
DNS_PORT = 53


def block_holds_pods(block: dict[str, Any]) -> bool:
    """Whether an ipBlock may hold a pod's address: it overlaps a private range it does not except.

    A block that cannot be read, or an IPv6 one, may hold anything.
    """
    try:
        cidr = ipaddress.ip_network(str(block.get("cidr")), strict=False)
        excepted = [ipaddress.ip_network(str(e), strict=False) for e in block.get("except") or []]
    except ValueError:
        return True
    if not isinstance(cidr, ipaddress.IPv4Network):
        return True
    for private in PRIVATE_RANGES:
        if not cidr.overlaps(private):
            continue
        inside = private if cidr.supernet_of(private) else cidr  # overlapping networks nest
        if not any(isinstance(e, ipaddress.IPv4Network) and e.supernet_of(inside) for e in excepted):
            return True
    return False


def _egress_peer_admits(peer: dict[str, Any], target: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return block_holds_pods(peer["ipBlock"])
    return peer_admits(peer, target, policy_namespace)


def egress_ports(net: Network, source: Pod, target: Pod) -> list[tuple[int, int]]:
    """The TCP port ranges `source`'s egress lets it open on `target`."""
    return _open_ports(net, source, target, EGRESS, _egress_peer_admits)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(max(l1, l2), min(h1, h2)) for l1, h1 in a for l2, h2 in b if max(l1, l2) <= min(h1, h2)]


def reachable_ports(net: Network, source: Pod, target: Pod) -> list[tuple[int, int]]:
    """The TCP port ranges on which `source` can connect to `target`: its egress and the target's ingress."""
    return _intersect(admitted_ports(net, source, target), egress_ports(net, source, target))


def _dns_only(rule: dict[str, Any]) -> bool:
    """Whether a rule opens port 53 and nothing else, whatever the protocol."""
    entries = rule.get("ports") or []
    return bool(entries) and all(p.get("port") == DNS_PORT and "endPort" not in p for p in entries)


def _udp_only(rule: dict[str, Any]) -> bool:
    entries = rule.get("ports") or []
    return bool(entries) and all(p.get("protocol", "TCP") != "TCP" for p in entries)


def egress_problems(net: Network) -> list[str]:
    """The watcher's pods are closed for egress, and every egress rule opens only what a pod needs."""
    problems = []
    for cluster in net.watchers:
        for pod in net.cluster_pods(cluster):
            if not any(_isolates(policy, pod, EGRESS) for policy in net.policies):
                problems.append(
                    f"{pod.where}: no NetworkPolicy closes it for egress; the watcher's pods reach only what they need"
                )
    seen = set()
    for source in net.pods:
        for policy, rule, ranges in _rules(net, source, EGRESS):
            namespace = str(get(policy, "metadata", "namespace", default=""))
            at = f"{ref(policy)}.spec.egress"
            if not rule.get("to"):
                problems.append(f"{at}: a rule without `to` lets {_describe(source)} reach every destination")
                continue
            for peer in rule["to"]:
                if "ipBlock" in peer:
                    if not rule.get("ports"):
                        problems.append(
                            f"{at}: the block {get(peer, 'ipBlock', 'cidr')} is open on every port; name them"
                        )
                    elif block_holds_pods(peer["ipBlock"]) and not _udp_only(rule):
                        problems.append(
                            f"{at}: the block {get(peer, 'ipBlock', 'cidr')} may hold pod addresses and is open "
                            "on TCP; except the private ranges (pods) or open only UDP"
                        )
                    continue
                targets = [t for t in net.pods if t is not source and peer_admits(peer, t, namespace)]
                if not targets and not _dns_only(rule):
                    shown = yaml.safe_dump(peer, default_flow_style=True).strip()
                    problems.append(f"{at}: {shown} is no pod of this rendering; outside it only DNS ({DNS_PORT})")
                for target in targets:
                    allowed = _allowed_ports(net, source, target)
                    if not _within(ranges, allowed):
                        message = f"{at}: lets {_describe(source)} reach {target.where} on " + (
                            "every port" if ranges == list(_ALL_PORTS) else ", ".join(f"{lo}-{hi}" for lo, hi in ranges)
                        )
                        if message not in seen:
                            seen.add(message)
                            problems.append(message)
    return problems


def _union_covers_all(ranges: list[tuple[int, int]]) -> bool:
    reach = 0
    for low, high in sorted(ranges):
        if low > reach + 1:
            return False
        reach = max(reach, high)
    return reach >= 65535


def operator_admitted(net: Network, pod: Pod, port: int) -> bool:
    if not any(_isolates(policy, pod) for policy in net.policies):
        return True
    return any(
        _covers(ranges, port) and (not rule.get("from") or any(is_operator(peer) for peer in rule["from"]))
        for _, rule, ranges in admissions(net, pod)
    )


# --- the rules ------------------------------------------------------------------------------


def _peer_shape_problem(peer: dict[str, Any]) -> str | None:
    if "ipBlock" in peer:
        return f"an IP block ({get(peer, 'ipBlock', 'cidr')}), which can hold any pod"
    namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector")
    if namespaces is not None and not (namespaces.get("matchLabels") or namespaces.get("matchExpressions")):
        return "every namespace (an empty namespaceSelector)"
    if namespaces is not None and pods is None:
        return "every pod of the selected namespaces (a namespaceSelector without podSelector)"
    if pods is not None and not (pods.get("matchLabels") or pods.get("matchExpressions")):
        return "every pod of the namespace (an empty podSelector)"
    return None


def shape_problems(net: Network) -> list[str]:
    """Rules open to every source, and peers wider than the pods they mean."""
    problems = []
    for policy in net.policies:
        for i, rule in enumerate(get(policy, "spec", "ingress", default=[]) or []):
            at = f"{ref(policy)}.spec.ingress[{i}]"
            if not rule.get("from"):
                ports = "every port" if not rule.get("ports") else "its ports"
                problems.append(f"{at}: no `from`: admits every source on {ports}")
            for peer in rule.get("from") or []:
                why = _peer_shape_problem(peer)
                if why:
                    problems.append(f"{at}: admits {why}")
    return problems


def _describe(pod: Pod) -> str:
    if pod.submits:
        return f"the submitter of {pod.submits}"
    if pod.cluster:
        return f"the pods of {pod.cluster}"
    return pod.where


def _allowed_ports(net: Network, source: Pod, target: Pod) -> frozenset[int] | None:
    """The ports `source` may reach on `target` (None: every port)."""
    if source.cluster is not None and source.cluster == target.cluster:
        return None
    if target.cluster is None:
        return frozenset()  # submitters and schedulers listen on nothing
    allowed: set[int] = set()
    if target.head and source.submits == target.cluster:
        allowed |= HEAD_CONTROL_PORTS
    if (
        target.cluster == net.model_service
        and source.cluster in net.job_clusters
        and net.client_port is not None
        and (not target.head or net.head_serves)
    ):
        allowed.add(net.client_port)
    return frozenset(allowed)


def admission_problems(net: Network) -> list[str]:
    """Every rule that applies to a pod admits only what that pod must take, from whom."""
    problems = []
    seen = set()
    for target in net.pods:
        for policy, rule, ranges in admissions(net, target):
            namespace = str(get(policy, "metadata", "namespace", default=""))
            shown = ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
            for peer in rule.get("from") or []:
                if is_operator(peer):
                    if not (target.head and target.cluster and _within(ranges, HEAD_CONTROL_PORTS)):
                        problems.append(
                            f"{ref(policy)}: admits the KubeRay operator to {target.where} on {shown}; "
                            f"it may reach only a head's dashboard, GCS and client ports"
                        )
                    continue
                sources = [s for s in net.pods if s is not target and peer_admits(peer, s, namespace)]
                if not sources and _peer_shape_problem(peer) is None:
                    problems.append(
                        f"{ref(policy)}: admits {yaml.safe_dump(peer, default_flow_style=True).strip()} to "
                        f"{target.where}: no pod of this rendering; only raypipe's own pods and the operator may"
                    )
                for source in sources:
                    allowed = _allowed_ports(net, source, target)
                    if not _within(ranges, allowed):
                        message = (
                            f"{ref(policy)}: admits {_describe(source)} to {target.where} on "
                            f"{'every port' if ranges == list(_ALL_PORTS) else shown}"
                        )
                        if message not in seen:
                            seen.add(message)
                            problems.append(message)
    return problems


def selection_problems(net: Network) -> list[str]:
    return [
        f"{pod.where}: no NetworkPolicy selects it for ingress, so it takes every connection"
        for pod in net.pods
        if not any(_isolates(policy, pod) for policy in net.policies)
    ]


def cluster_problems(net: Network) -> list[str]:
    """Each Ray cluster's pods reach each other on every port; the operator and submitters their heads."""
    problems = []
    for cluster in ([net.model_service] if net.model_service else []) + net.job_clusters:
        pods = net.cluster_pods(cluster)
        closed = [
            (s, t) for t in pods for s in pods if s is not t and not _union_covers_all(reachable_ports(net, s, t))
        ]
        if closed:
            s, t = closed[0]
            problems.append(
                f"{cluster}: its pods must admit each other on every port (Ray's own traffic); "
                f"{t.where} does not admit {s.where}"
            )
        for head in (p for p in pods if p.head):
            if not operator_admitted(net, head, DASHBOARD):
                problems.append(
                    f"{head.where}: no NetworkPolicy admits the KubeRay operator to the dashboard ({DASHBOARD})"
                )
            for submitter in (p for p in net.pods if p.submits == cluster):
                if not _covers(reachable_ports(net, submitter, head), DASHBOARD):
                    problems.append(
                        f"{head.where}: no NetworkPolicy admits its submitter to the dashboard ({DASHBOARD}): "
                        "`ray job submit` cannot reach it"
                    )
    return problems


def client_problems(net: Network) -> list[str]:
    """The job clusters' pods reach the model service's client port on every worker."""
    if net.model_service is None or net.client_port is None:
        return []
    problems = []
    workers = [p for p in net.cluster_pods(net.model_service) if not p.head]
    for job in net.job_clusters:
        for client in net.cluster_pods(job):
            closed = [w for w in workers if not _covers(reachable_ports(net, client, w), net.client_port)]
            if closed:
                problems.append(
                    f"{net.model_service}: no NetworkPolicy admits {client.where} (a model client) "
                    f"to port {net.client_port} on {closed[0].where}"
                )
    return problems


def network_problems(resources: list[Resource]) -> list[str]:
    net = network(resources)
    return (
        selection_problems(net)
        + shape_problems(net)
        + admission_problems(net)
        + cluster_problems(net)
        + client_problems(net)
        + egress_problems(net)
    )

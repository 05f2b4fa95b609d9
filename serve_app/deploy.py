"""Starts Serve's gRPC proxy and runs the EmotionClassifier application on a Ray cluster.

`serve.start(grpc_options=...)` must come before the first `serve.run`, and the proxy's gRPC
port and servicer list cannot change while Serve runs, so `start_grpc_proxy` checks what is
already running instead of silently keeping an old port. Several applications (say a clean
one and a fault-injected one) can share the proxy: clients pick one with the `application`
metadata.

Serve's gRPC proxy binds every interface (`[::]`) and accepts 2 GiB messages; raypipe's binds
`DEFAULT_GRPC_HOST` (loopback) unless given another host, and accepts `MAX_MESSAGE_BYTES`
(`proxy_runtime_env`). A deployment given a token's digest answers only calls that carry the
token (`serve_app.app`, `protos.credential`).

`deploy` waits for the application to be RUNNING for at most `wait_s`. Serve's own wait has no
end: a replica that no node can hold (its CPUs, or the pool resource, on no alive node: a pool
node lost and its replacement not yet joined) keeps it waiting in silence. Past the deadline
`AppNotRunningError` says, on one line, which deployments and replicas are not RUNNING, on
which nodes, and what they wait for (`describe_not_running`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ray import serve
from ray.serve.config import gRPCOptions

from protos.wire import MAX_MESSAGE_BYTES, SERVICER_FUNCTION
from serve_app.settings import ServerSettings

__all__ = [
    "DEFAULT_GRPC_HOST",
    "DEFAULT_WAIT_S",
    "POOL_RESOURCE",
    "SERVICER_FUNCTION",
    "AppNotRunningError",
    "Autoscaling",
    "ControllerUnreachableError",
    "DeploymentOptions",
    "NodeRoom",
    "bind_grpc_proxy_host",
    "build_app",
    "check_controller_answers",
    "cluster_room",
    "deploy",
    "describe_not_running",
    "fit_pool",
    "fit_replicas",
    "pool_nodes",
    "proxy_runtime_env",
    "size_replicas",
    "start_grpc_proxy",
    "start_serve",
    "wait_until_running",
]


#: The Ray custom resource that marks a node of the model's CPU pool. Pool nodes advertise it
#: (`ray start --resources '{"raypipe_pool": 1000}'`, the RayService's worker group does the
#: same) and every replica asks for one unit of it, so replicas land only on pool nodes, never
#: on a head started with `--num-cpus 0` nor on nodes that run the jobs' actors. One mechanism
#: for `raypipe serve` and the manifests; 1000 per node means the resource never limits the count
#: (CPUs do).
POOL_RESOURCE = "raypipe_pool"
POOL_RESOURCE_PER_NODE = 1000


@dataclass(frozen=True)
class Autoscaling:
    """Serve's autoscaling for the replicas (`num_replicas: auto`), as the RayService sets it.

    Serve adds replicas while the calls each one holds (queued in its batcher or computing)
    stay above `target_ongoing_requests` and removes them once the load falls, draining a
    replica's calls before it stops, so clients see neither errors nor retries.
    """

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 4.0
    """Calls per replica Serve aims at. A replica batches up to `batch_max_calls` calls; one
    batch computing and one waiting keeps it busy, so a handful per replica is the right
    order. raypipe's clients raise their in-flight calls while the service answers without
    queueing, so a backfill's load grows past this and the replicas follow it up."""
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    look_back_period_s: float = 30.0
    """Window over which Serve averages the calls each replica holds (Serve's default)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeploymentOptions:
    num_replicas: int = 1
    """Fixed replica count, unless `autoscaling` is set."""
    autoscaling: Autoscaling | None = None
    """Replicas that follow the load between its min and max (`num_replicas` is then ignored)."""
    resources: tuple[tuple[str, float], ...] = ()
    """Custom resources each replica asks for: `((POOL_RESOURCE, 1),)` keeps replicas on the pool's nodes."""
    num_cpus: float = 1.0
    """CPUs reserved per replica; TensorFlow's intra-op threads default to this, rounded up."""
    max_ongoing_requests: int = 64
    """Calls one replica holds at once (its batch queue); beyond it Serve queues them at the
    proxy, where the replica cannot see them. At least `ServerSettings.batch_max_calls` x 2 x the
    replica's model threads (the batches it runs at once)."""
    max_queued_requests: int = 256
    """Calls queued at the proxy before it answers RESOURCE_EXHAUSTED (-1: unbounded). A
    safety net: clients' limiters keep far fewer in flight; a bounded queue turns a client
    that ignores them into fast overload answers instead of deadlines expiring in a queue."""


#: CPUs left to everything but the model on a node: Serve's proxy and controller, raypipe's
#: actors and Ray Data's read tasks.
RESERVED_CPUS = 0.5


def fit_replicas(cluster_cpus: float, *, reserved_cpus: float = RESERVED_CPUS) -> tuple[int, float]:
    """(replicas, CPUs each) for `raypipe serve` on a cluster of `cluster_cpus`: one replica that
    takes every CPU but `reserved_cpus` (TensorFlow's intra-op threads follow, rounded up).

    Measured on a 2-core node against one replica of 1.0 CPU (the old default: one TF thread,
    half the machine idle) and two of 0.75 CPU (one thread each):
    - MiniLM-L6 shape, 3,000 paragraphs: 1 x 1.5 ran 82.8 and 84.5 rows/s, 2 x 0.75 ran 93.9;
    - bert-base shape, 600 paragraphs: 1 x 1.5 ran 12.2 rows/s, 2 x 0.75 ran 10.9.
    Two replicas also hold two copies of the model, so one is the default; set
    `--num-replicas/--num-cpus` for the shape you serve.
    """
    usable = max(cluster_cpus - reserved_cpus, 0.25)
    return 1, math.floor(usable * 100) / 100


def pool_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[float]:
    """CPUs of each alive node that advertises POOL_RESOURCE (from `ray.nodes()`)."""
    return [
        float(n["Resources"].get("CPU", 0.0))
        for n in nodes
        if n.get("Alive") and POOL_RESOURCE in (n.get("Resources") or {})
    ]


def fit_pool(pool_cpus: list[float], *, reserved_cpus: float = RESERVED_CPUS) -> tuple[int, float]:
    """(replicas, CPUs each) on a pool: one replica per node, sized by the smallest node.

    A pool node runs replicas only (the jobs' actors live elsewhere), but it also runs Serve's
    proxy for the node, which parses every call, hence `reserved_cpus`.
    """
    if not pool_cpus:
        raise ValueError("no alive node advertises the pool resource")
    _, cpus = fit_replicas(min(pool_cpus), reserved_cpus=reserved_cpus)
    return len(pool_cpus), cpus


def size_replicas(pool_cpus: list[float], cluster_cpus: float, num_cpus: float | None = None) -> tuple[int, float, int]:
    """(replicas by default, CPUs each, replicas the nodes hold) for `raypipe serve`.

    On a pool (`pool_cpus`: its nodes' CPUs), one replica per node sized by `fit_pool`, or, with
    `num_cpus`, as many replicas of that size as the nodes hold. Without a pool, `fit_replicas`
    of the cluster, or one replica of `num_cpus`. What the nodes hold bounds `num_replicas: auto`.
    """
    if num_cpus is None:
        replicas, cpus = fit_pool(pool_cpus) if pool_cpus else fit_replicas(cluster_cpus)
        return replicas, cpus, replicas
    if pool_cpus:
        capacity = sum(int(c // num_cpus) for c in pool_cpus)
        return max(1, capacity), num_cpus, capacity
    return 1, num_cpus, int(cluster_cpus // num_cpus)


def build_app(
    model_dir: str | Path,
    settings: ServerSettings | None = None,
    options: DeploymentOptions | None = None,
    *,
    token_sha256: str | None = None,
) -> Any:
    """The bound application, ready for `serve.run`; with `token_sha256` (`protos.credential.token_digest`)
    its replicas answer only calls that carry that token."""
    from serve_app.app import EmotionClassifier
    from serve_app.model import read_model_card

    read_model_card(model_dir)  # fail here, with the path, rather than in every replica
    settings = settings or ServerSettings()
    options = options or DeploymentOptions()
    # @serve.deployment turned the class into a Deployment, which mypy cannot see.
    actor_options: dict[str, Any] = {"num_cpus": options.num_cpus}
    if options.resources:
        actor_options["resources"] = dict(options.resources)
    scaling: dict[str, Any] = (
        {"num_replicas": options.num_replicas}
        if options.autoscaling is None
        else {"num_replicas": "auto", "autoscaling_config": options.autoscaling.to_dict()}
    )
    return EmotionClassifier.options(  # type: ignore[attr-defined]
        **scaling,
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        ray_actor_options=actor_options,
    ).bind(str(Path(model_dir).resolve()), settings.to_dict(), token_sha256)


#: How long a question to Serve's controller may take before `raypipe serve` gives up on it.
CONTROLLER_TIMEOUT_S = 60.0


#: The environment of Serve's controller where `raypipe serve` starts it (a value set in the
#: environment of `raypipe serve` wins). Its control loop runs every second instead of Ray's 0.1 s:
#: on 2 cores, idle with the app deployed, the controller took 3.8% of a core at 0.1 s and 1.7% at
#: 1 s, and the GCS it asks 1.8% and 0.85%: cores the model shares. A batch service loses nothing
#: that matters by reacting within a second (a replica's start, a health check, autoscaling).
CONTROLLER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0"}


#: Where raypipe's gRPC proxy listens unless told otherwise: this machine only.
DEFAULT_GRPC_HOST = "127.0.0.1"

#: Tells `bind_grpc_proxy_host`, in the proxy's process, which address to bind.
GRPC_HOST_ENV = "RAYPIPE_SERVE_GRPC_HOST"


def bind_grpc_proxy_host() -> None:
    """Ray's `worker_process_setup_hook` for Serve's processes: the gRPC proxy binds the host in
    `GRPC_HOST_ENV` instead of `[::]`.

    Serve (2.60) hard-codes `[::]:<port>` and has no host option for gRPC (its HTTP proxy has
    one); the proxy looks `add_grpc_address` up in `default_impl` when it starts its server, so
    replacing it there, before the proxy starts, is the one place to choose the address. A Ray
    that moves it fails the loopback test (the socket table), not silently.
    """
    host = os.environ.get(GRPC_HOST_ENV)
    if not host:
        return
    from ray.serve._private import default_impl

    add = default_impl.add_grpc_address
    if getattr(add, "raypipe_host", None) == host:
        return

    def add_grpc_address(grpc_server: Any, server_address: str) -> None:
        port = server_address.rpartition(":")[2]
        add(grpc_server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    add_grpc_address.raypipe_host = host  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address


def proxy_runtime_env(host: str, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The runtime_env of Serve's controller, which the proxies it starts inherit: bound to
    `host` (`bind_grpc_proxy_host`), messages up to `MAX_MESSAGE_BYTES`, and `env_vars`."""
    # Serve lets the controller's runtime_env hold env_vars only, so the setup hook is named the
    # way Ray's own `worker_process_setup_hook` plugin passes a module's hook to a worker: in
    # the variable a starting worker reads (its name taken from Ray, so a rename fails here).
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

    return {
        "env_vars": {
            **(env_vars or {}),
            GRPC_HOST_ENV: host,
            "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_MESSAGE_BYTES),
            WORKER_PROCESS_SETUP_HOOK_ENV_VAR: f"{__name__}.bind_grpc_proxy_host",
        }
    }


def start_grpc_proxy(
    grpc_port: int, *, http_port: int | None = None, controller_env: bool = True, host: str = DEFAULT_GRPC_HOST
) -> None:
    """Starts Serve with a gRPC proxy on host:grpc_port, or checks that the running one matches
    (the port; the host of a running proxy cannot be asked).

    `http_port` matters only when Serve is not running yet (None: Serve's default, 8000), and so
    do `host` and `controller_env`: False leaves out `CONTROLLER_ENV`, for a cluster that lives a
    minute (the demo's), where the control loop's idle cost does not matter.
    """
    env = {k: os.environ.get(k, v) for k, v in CONTROLLER_ENV.items()}
    check_controller_answers()
    start_serve(
        lambda: serve.start(
            http_options=None if http_port is None else {"host": "127.0.0.1", "port": http_port},
            grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]),
            controller_options={"runtime_env": proxy_runtime_env(host, env if controller_env else None)},
        )
    )
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None, "serve.start() just ran"
    running = cast(gRPCOptions, ray.get(client._controller.get_grpc_config.remote(), timeout=CONTROLLER_TIMEOUT_S))
    if running.port != grpc_port or SERVICER_FUNCTION not in running.grpc_servicer_functions:
        raise RuntimeError(
            f"Serve is already running with gRPC port {running.port} and servicers "
            f"{running.grpc_servicer_functions}; restart Serve to use port {grpc_port}"
        )


#: How long `start_serve` waits for a proxy the controller started again (its ready checks give
#: a restarted proxy 10 s, then 15 s, and so on).
PROXY_WAIT_S = 120.0


def _proxy_statuses() -> dict[str, str]:
    return {node: _name(status) for node, status in serve.status().proxies.items()}


def start_serve(
    start: Callable[[], object],
    *,
    proxies: Callable[[], Mapping[str, str]] = _proxy_statuses,
    wait_s: float = PROXY_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """`start()` (`serve.start`), and where an actor it waits on died while starting (the proxy;
    or the controller, which Ray restarts), connects again and waits until every proxy is
    HEALTHY; `TimeoutError` after `wait_s` seconds.

    Serve's controller gives a new proxy 5 s to say it is ready; on a busy node (its 2 cores
    shared with the jobs' actors, a replica loading) a proxy can take longer, and the controller
    kills it and starts another with a longer deadline. `serve.start` has already raised for the
    first one by then, though Serve is up and its next proxy on the way: this waits for that one
    instead of failing the deploy. Tests pass fakes for `start`, `proxies`, the clock and sleep.
    """
    from ray.exceptions import ActorDiedError

    try:
        start()
        return
    except ActorDiedError:  # its proxy (or controller) died: the controller starts another proxy
        pass
    start()  # Serve's controller runs now: this connects to it
    began = clock()
    while True:
        statuses = dict(proxies())
        if statuses and all(status == "HEALTHY" for status in statuses.values()):
            return
        if clock() - began >= wait_s:
            raise TimeoutError(
                f"Serve's proxy died while starting and the next one was not HEALTHY after {wait_s:g} s "
                f"({statuses or 'no proxy'}); see the proxy's log under the session's logs/serve/"
            )
        sleep(0.5)


class ControllerUnreachableError(TimeoutError):
    """Serve's controller exists but did not answer by the deadline (the message says where it is)."""


def check_controller_answers(
    *, timeout_s: float = CONTROLLER_TIMEOUT_S, describe: Callable[[Any], str] | None = None
) -> None:
    """Raises `ControllerUnreachableError` where Serve's controller exists but does not answer
    within `timeout_s`; does nothing where Serve is not running yet.

    Serve keeps its controller on the head node and restarts it without end: where that node's
    raylet died (and the GCS lives on), the controller stays restarting, and `serve.start`, which
    asks it for its HTTP options without a deadline, would wait forever. This asks the same
    question with one. `describe` (tests pass a fake) says where the controller is.
    """
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return  # no Serve yet: serve.start starts its controller
    try:
        ray.get(controller.get_http_config.remote(), timeout=timeout_s)
    except GetTimeoutError:
        try:
            where = (describe or describe_controller)(controller)
        except Exception as e:  # the message must not fail where the controller did
            where = f"where it is could not be read ({e})"
        raise ControllerUnreachableError(
            f"Serve's controller did not answer within {timeout_s:g} s: {where}. Serve keeps its controller "
            "on the head node, so no application can be deployed until Ray runs there again "
            "(restart Ray on the head node, or the cluster)"
        ) from None


def describe_controller(controller: Any) -> str:
    """The controller actor's state, whether a head node is alive, and the dead nodes (from the
    GCS: no dashboard needed)."""
    import ray
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    actor_id = controller._actor_id.hex()
    state = (ray._private.state.actors(actor_id=actor_id) or {}).get("State", "UNKNOWN")
    nodes = ray.nodes()
    heads = [n for n in nodes if n.get("Alive") and HEAD_NODE_RESOURCE_NAME in (n.get("Resources") or {})]
    dead = [n for n in nodes if not n.get("Alive")]
    head = (
        f"the head node {heads[0].get('NodeManagerAddress', '?')} ({str(heads[0]['NodeID'])[:8]}) is alive"
        if heads
        else "no alive node is the head node"
    )
    lost = ", ".join(f"{n.get('NodeManagerAddress', '?')} ({str(n['NodeID'])[:8]})" for n in dead[:3])
    return f"actor {actor_id[:8]} {state}; {head}" + (f"; {len(dead)} node(s) dead: {lost}" if dead else "")


#: `raypipe serve`'s default deadline for the app to be RUNNING: a replica of a bert-base model
#: loads and warms up in well under a minute on 2 cores; an autoscaling cluster adding a node
#: for a replica may need a few (raise `--wait-s` there).
DEFAULT_WAIT_S = 300.0


def deploy(
    model_dir: str | Path,
    *,
    app_name: str = "raypipe",
    grpc_port: int = 9000,
    http_port: int | None = None,
    settings: ServerSettings | None = None,
    options: DeploymentOptions | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    host: str = DEFAULT_GRPC_HOST,
    token_sha256: str | None = None,
) -> str:
    """Deploys the app on the connected Ray cluster; returns the gRPC address clients use.

    The proxy listens on `host` (when this starts Serve); with `token_sha256` the replicas answer
    only calls that carry the token (`raypipe serve` always passes one).

    Returns once every deployment is RUNNING (replicas loaded and warmed); raises
    `RuntimeError` if a replica's constructor fails (a bad model directory, say), and
    `AppNotRunningError` if the app is not RUNNING after `wait_s` seconds (the app stays
    deployed: Serve keeps trying, and `serve.status()` follows it)."""
    if not wait_s > 0:
        raise ValueError(f"wait_s must be > 0, not {wait_s}")
    start_grpc_proxy(grpc_port, http_port=http_port, host=host)
    # `serve.run` waits for RUNNING without an end; this submits, then waits with a deadline.
    from ray.serve.api import _run

    app = build_app(model_dir, settings, options, token_sha256=token_sha256)
    _run(app, _blocking=False, name=app_name, route_prefix=f"/{app_name}")
    wait_until_running(app_name, wait_s=wait_s)
    client_host = DEFAULT_GRPC_HOST if host in ("0.0.0.0", "::", "") else host  # noqa: S104  a bind-all host reached via loopback
    return f"[{client_host}]:{grpc_port}" if ":" in client_host else f"{client_host}:{grpc_port}"


class AppNotRunningError(TimeoutError):
    """The application was not RUNNING by the deadline; the message says what it waits for."""

    def __init__(self, message: str, *, app_name: str, waited_s: float) -> None:
        super().__init__(message)
        self.app_name = app_name
        self.waited_s = waited_s


@dataclass(frozen=True)
class NodeRoom:
    """One alive node's resources: what it has, and what is free now."""

    node_id: str
    ip: str
    total: Mapping[str, float]
    available: Mapping[str, float]

    def holds(self, required: Mapping[str, float]) -> bool:
        return all(self.available.get(k, 0.0) >= v for k, v in required.items() if v > 0)


def cluster_room() -> list[NodeRoom]:
    """Every alive node's total and free resources (`ray.nodes()`, the GCS's free resources)."""
    import ray
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return [
        NodeRoom(
            n["NodeID"],
            str(n.get("NodeManagerAddress", "?")),
            dict(n.get("Resources") or {}),
            free.get(n["NodeID"], {}),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _serve_details() -> dict[str, Any]:
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None, "serve.start() ran before"
    return cast(dict[str, Any], client.get_serve_details())


def wait_until_running(
    app_name: str,
    *,
    wait_s: float,
    details: Callable[[], Mapping[str, Any]] = _serve_details,
    nodes: Callable[[], list[NodeRoom]] = cluster_room,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 0.25,
) -> None:
    """Returns once `app_name` is RUNNING (asked every `poll_s`, one call to the controller);
    raises `RuntimeError` if it failed to deploy, or `AppNotRunningError` (what it waits for,
    `describe_not_running`) after `wait_s` seconds.

    `details` is Serve's status (`get_serve_details()`: applications -> deployments ->
    replicas) and `nodes` the cluster's room; tests pass fakes, and a clock and sleep."""
    start = clock()
    while True:
        app = (details().get("applications") or {}).get(app_name)
        status = _name(app.get("status")) if app else "NOT_STARTED"
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {app_name} failed: {app.get('message') if app else ''}")
        waited = clock() - start
        if waited >= wait_s:
            # The message names the deadline (`--wait-s`); the last status call may have ended past it.
            raise AppNotRunningError(
                describe_not_running(app_name, app, nodes(), waited_s=wait_s), app_name=app_name, waited_s=waited
            )
        sleep(min(poll_s, max(wait_s - waited, 0.0)))


def _name(value: Any) -> str:
    """An enum's value or a plain string, as Serve's details hold either."""
    return str(getattr(value, "value", value))


def _fmt(x: float) -> str:
    return f"{x:g}"


def describe_not_running(
    app_name: str, app: Mapping[str, Any] | None, nodes: list[NodeRoom], *, waited_s: float
) -> str:
    """One line: each deployment not HEALTHY, its replicas not RUNNING with their state and
    node, and what the unplaced ones wait for (the resources no alive node has free)."""
    head = f"application {app_name!r} not RUNNING after {waited_s:.0f} s"
    if app is None:
        return f"{head}: Serve does not know it (deleted, or the controller restarted)"
    parts: list[str] = []
    for name, dep in sorted((app.get("deployments") or {}).items()):
        if _name(dep.get("status")) == "HEALTHY":
            continue
        replicas = list(dep.get("replicas") or [])
        target = int(dep.get("target_num_replicas") or 0)
        running = sum(1 for r in replicas if _name(r.get("state")) == "RUNNING")
        words = [f"deployment {name} {_name(dep.get('status'))}, {running}/{target} replicas RUNNING"]
        unplaced = max(target - len(replicas), 0)
        for r in replicas:
            state = _name(r.get("state"))
            if state == "RUNNING":
                continue
            if not r.get("node_id"):
                unplaced += 1
                continue
            words.append(
                f"replica {str(r.get('replica_id', '?'))[:8]} {state} on node {r.get('node_ip') or '?'} "
                f"({str(r['node_id'])[:8]}): started, not ready (the model loading, or its constructor failing "
                "and restarting: see the replica's log)"
            )
        if unplaced:
            words.append(f"{unplaced} replica{'s' if unplaced != 1 else ''} on no node yet: {_room(dep, nodes)}")
        parts.append("; ".join(words))
    if not parts:
        message = str(app.get("message") or "").strip().splitlines()
        parts.append(f"status {_name(app.get('status'))}" + (f" ({message[0]})" if message else ""))
    return f"{head}: " + " | ".join(parts)


def _room(dep: Mapping[str, Any], nodes: list[NodeRoom]) -> str:
    required = {str(k): float(v) for k, v in (dep.get("required_resources") or {}).items() if float(v) > 0}
    ask = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(required.items())) or "nothing"
    fits = [n for n in nodes if n.holds(required)]
    if fits:
        where = ", ".join(n.ip for n in fits[:3])
        return f"each needs {ask}, which node {where} has free: waiting for Ray to place it (or its runtime_env)"
    if not nodes:
        return f"each needs {ask}, and no node is alive"
    seen = []
    for n in nodes[:6]:
        have = ", ".join(
            f"{k} {_fmt(n.available.get(k, 0.0))} of {_fmt(n.total[k])} free" if k in n.total else f"no {k}"
            for k in sorted(required)
        )
        seen.append(f"{n.ip} ({n.node_id[:8]}): {have}")
    more = f"; {len(nodes) - 6} more" if len(nodes) > 6 else ""
    return f"waits for resources: each needs {ask}, and no alive node has that free ({'; '.join(seen)}{more})"

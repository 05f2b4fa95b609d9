"""serve_app.deploy: where replicas go and how many, without Ray."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ray.exceptions import ActorDiedError

from serve_app.deploy import (
    POOL_RESOURCE,
    AppNotRunningError,
    Autoscaling,
    DeploymentOptions,
    NodeRoom,
    build_app,
    fit_pool,
    pool_nodes,
    size_replicas,
    wait_until_running,
)


def node(cpus: float, *, pool: bool, alive: bool = True) -> dict:
    resources = {"CPU": cpus, "memory": 1e9}
    if pool:
        resources[POOL_RESOURCE] = 1000.0
    return {"Alive": alive, "Resources": resources}


def test_pool_nodes_are_the_alive_nodes_advertising_the_pool_resource():
    nodes = [node(0, pool=False), node(4, pool=True), node(2, pool=True), node(8, pool=True, alive=False)]
    assert pool_nodes(nodes) == [4.0, 2.0]  # not the head (no pool), not the dead node


def test_one_replica_per_pool_node_sized_by_the_smallest():
    assert fit_pool([4.0, 2.0]) == (2, 1.5)
    with pytest.raises(ValueError, match="no alive node"):
        fit_pool([])


def test_the_bound_app_carries_the_placement_and_the_autoscaling(demo_model_dir):
    app = build_app(
        demo_model_dir,
        options=DeploymentOptions(
            autoscaling=Autoscaling(max_replicas=3, upscale_delay_s=2),
            resources=((POOL_RESOURCE, 1.0),),
            num_cpus=1.5,
        ),
    )
    config = app._bound_deployment._deployment_config
    actor_options = app._bound_deployment.ray_actor_options
    assert actor_options["resources"] == {POOL_RESOURCE: 1.0} and actor_options["num_cpus"] == 1.5
    assert config.autoscaling_config.max_replicas == 3 and config.autoscaling_config.upscale_delay_s == 2
    fixed = build_app(demo_model_dir, options=DeploymentOptions(num_replicas=2))
    assert fixed._bound_deployment._deployment_config.num_replicas == 2
    assert "resources" not in fixed._bound_deployment.ray_actor_options


def test_serve_sizes_replicas_to_the_pool_or_to_the_one_machine():
    assert size_replicas([4.0, 2.0], 6.0) == (2, 1.5, 2), "one per pool node, sized by the smallest"
    assert size_replicas([1.0, 1.0], 2.0, num_cpus=1.0) == (2, 1.0, 2), "--num-cpus fills the pool"
    assert size_replicas([4.0, 2.0], 6.0, num_cpus=2.0) == (3, 2.0, 3)
    assert size_replicas([1.0], 1.0, num_cpus=2.0) == (1, 2.0, 0), "too big for every node: one, left pending"
    assert size_replicas([], 2.0) == (1, 1.5, 1), "one machine: one replica of all but the reserve"
    assert size_replicas([], 8.0, num_cpus=2.0) == (1, 2.0, 4), "one machine keeps one replica of the size asked"


# -- the deadline of `raypipe serve` (a fake Serve status, a fake clock) --------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def replica(rid: str, state: str, node: str | None = None, ip: str | None = None) -> dict:
    return {"replica_id": rid, "state": state, "node_id": node, "node_ip": ip}


def serve_app(status: str, *replicas: dict, target: int = 2, dep_status: str = "UPDATING", **extra) -> dict:
    deployment = {
        "status": dep_status,
        "target_num_replicas": target,
        "required_resources": {"CPU": 1.5, POOL_RESOURCE: 1.0},
        "replicas": list(replicas),
    }
    return {"applications": {"raypipe": {"status": status, "deployments": {"EmotionClassifier": deployment}, **extra}}}


POOL = [
    NodeRoom("aaaaaaaa11", "10.0.0.1", {"CPU": 0.0}, {"CPU": 0.0}),  # the head: no pool resource
    NodeRoom("bbbbbbbb22", "10.0.0.2", {"CPU": 2.0, POOL_RESOURCE: 1000.0}, {"CPU": 0.5, POOL_RESOURCE: 999.0}),
]


def test_serve_waits_until_the_app_is_running():
    clock = Clock()
    states = iter([serve_app("DEPLOYING"), serve_app("DEPLOYING"), serve_app("RUNNING")])
    wait_until_running(
        "raypipe", wait_s=30, details=lambda: next(states), nodes=lambda: POOL, clock=clock, sleep=clock.sleep
    )
    assert clock.sleeps == [0.25, 0.25]


def test_past_its_deadline_serve_names_the_replicas_their_nodes_and_what_they_wait_for():
    clock = Clock()
    stuck = serve_app(
        "DEPLOYING",
        replica("r1-running", "RUNNING", "bbbbbbbb22", "10.0.0.2"),
        replica("r2-unplaced", "STARTING"),  # a pool node was lost: no node holds its CPUs
        target=3,  # and one replica not even created yet
    )
    with pytest.raises(AppNotRunningError) as e:
        wait_until_running(
            "raypipe", wait_s=5, details=lambda: stuck, nodes=lambda: POOL, clock=clock, sleep=clock.sleep
        )
    message = str(e.value)
    assert "\n" not in message and e.value.waited_s == 5 and sum(clock.sleeps) == 5
    assert "application 'raypipe' not RUNNING after 5 s" in message
    assert "deployment EmotionClassifier UPDATING, 1/3 replicas RUNNING" in message
    assert "2 replicas on no node yet" in message
    assert f"each needs CPU 1.5, {POOL_RESOURCE} 1, and no alive node has that free" in message
    assert f"10.0.0.1 (aaaaaaaa): CPU 0 of 0 free, no {POOL_RESOURCE}" in message
    assert f"10.0.0.2 (bbbbbbbb): CPU 0.5 of 2 free, {POOL_RESOURCE} 999 of 1000 free" in message


def test_a_replica_placed_but_not_ready_is_named_with_its_node():
    clock = Clock()
    loading = serve_app("DEPLOYING", replica("r1abcdefgh", "STARTING", "bbbbbbbb22", "10.0.0.2"), target=1)
    with pytest.raises(AppNotRunningError, match=r"replica r1abcdef STARTING on node 10\.0\.0\.2 \(bbbbbbbb\)"):
        wait_until_running(
            "raypipe", wait_s=2, details=lambda: loading, nodes=lambda: POOL, clock=clock, sleep=clock.sleep
        )


def test_room_on_a_node_says_the_wait_is_ray_placing_the_replica():
    roomy = [
        NodeRoom("cccccccc33", "10.0.0.3", {"CPU": 4.0, POOL_RESOURCE: 1000.0}, {"CPU": 4.0, POOL_RESOURCE: 1000.0})
    ]
    clock = Clock()
    pending = serve_app("DEPLOYING", replica("r1", "STARTING"), target=1)
    with pytest.raises(AppNotRunningError, match=r"which node 10\.0\.0\.3 has free: waiting for Ray to place it"):
        wait_until_running(
            "raypipe", wait_s=1, details=lambda: pending, nodes=lambda: roomy, clock=clock, sleep=clock.sleep
        )


def test_a_failed_deploy_raises_at_once_and_a_vanished_app_is_named():
    clock = Clock()
    failed = serve_app("DEPLOY_FAILED", message="replica constructor: no model card in /m")
    with pytest.raises(RuntimeError, match="no model card") as e:
        wait_until_running(
            "raypipe", wait_s=9, details=lambda: failed, nodes=lambda: POOL, clock=clock, sleep=clock.sleep
        )
    assert not isinstance(e.value, AppNotRunningError) and clock.sleeps == []
    with pytest.raises(AppNotRunningError, match="Serve does not know it"):
        wait_until_running("raypipe", wait_s=1, details=lambda: {}, nodes=lambda: POOL, clock=clock, sleep=clock.sleep)


def test_a_controller_that_does_not_answer_is_named_by_the_deadline_not_waited_for(monkeypatch):
    """`serve.start` asks an existing controller without a deadline: where its node died, it would
    wait forever. The check asks first, with one, and names where the controller is."""
    from types import SimpleNamespace

    import ray
    from ray.exceptions import GetTimeoutError

    from serve_app.deploy import ControllerUnreachableError, check_controller_answers

    asked: list[float | None] = []

    controller = SimpleNamespace(get_http_config=SimpleNamespace(remote=lambda: "ref"))

    def no_controller(name: str, namespace: str) -> None:
        raise ValueError(f"Failed to look up actor {name}")

    monkeypatch.setattr(ray, "get_actor", no_controller)
    check_controller_answers(timeout_s=5)  # no Serve yet: serve.start starts one

    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: controller)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: asked.append(timeout) or {"port": 8000})
    check_controller_answers(timeout_s=5)  # it answers
    assert asked == [5]

    def silent(ref: str, timeout: float | None = None) -> None:
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", silent)
    where = "actor 1a2b3c4d RESTARTING; no alive node is the head node; 1 node(s) dead: 127.0.0.1 (ab12cd34)"
    with pytest.raises(ControllerUnreachableError) as raised:
        check_controller_answers(timeout_s=5, describe=lambda controller: where)
    message = str(raised.value)
    assert "did not answer within 5 s" in message and where in message and "head node" in message


def starts(failures: int) -> tuple[list[int], Callable[[], None]]:
    """A fake `serve.start` whose first `failures` calls raise as a proxy killed while starting."""
    calls: list[int] = []

    def start() -> None:
        calls.append(1)
        if len(calls) <= failures:
            raise ActorDiedError()

    return calls, start


def test_a_proxy_killed_while_starting_is_waited_for_not_a_failed_deploy():
    """On a busy node the controller kills a proxy slow to start and starts another: `serve.start`
    raises for the first (ActorDiedError); the deploy connects again and waits for the next."""
    from serve_app.deploy import start_serve

    clock = Clock()
    calls, start = starts(1)
    statuses = iter([{"n1": "UNHEALTHY"}, {"n1": "STARTING"}, {"n1": "HEALTHY"}])
    start_serve(start, proxies=lambda: next(statuses), clock=clock, sleep=clock.sleep)
    assert len(calls) == 2 and clock.sleeps == [0.5, 0.5]

    calls, start = starts(0)  # started at once: no status asked, no wait
    start_serve(start, proxies=lambda: {}, clock=clock, sleep=clock.sleep)
    assert len(calls) == 1 and clock.sleeps == [0.5, 0.5]

    calls, start = starts(1)
    with pytest.raises(TimeoutError, match=r"not HEALTHY after 2 s \({'n1': 'STARTING'}\)"):
        start_serve(start, proxies=lambda: {"n1": "STARTING"}, wait_s=2, clock=clock, sleep=clock.sleep)

    calls, start = starts(2)  # killed again: not hidden a second time
    with pytest.raises(ActorDiedError):
        start_serve(start, proxies=lambda: {}, clock=clock, sleep=clock.sleep)

"""serve_app.deploy: where replicas go and how many, without Ray."""

from __future__ import annotations

import pytest

from serve_app.deploy import (
    POOL_RESOURCE,
    Autoscaling,
    DeploymentOptions,
    build_app,
    fit_pool,
    pool_nodes,
    size_replicas,
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

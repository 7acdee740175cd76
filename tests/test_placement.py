"""Where new workers replacing dead ones go, and what a placement group (a Tune trial) reserved."""

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dsgd.cluster.placement import place_new_workers, reserved_cpus
from dsgd.cluster.server_group import plan_servers

ONE_CPU = {"CPU": 1}


def test_new_workers_go_beside_the_survivors_first_and_on_the_dead_workers_nodes_last():
    free = {"lost": {"CPU": 2}, "idle": {"CPU": 2}, "survivor": {"CPU": 1}}
    # Ray may still list a lost node as alive: it is the last choice, a node where a worker answered the first.
    assert place_new_workers(1, ONE_CPU, free, first=["survivor"], last=["lost"]) == ["survivor"]
    assert place_new_workers(3, ONE_CPU, free, first=["survivor"], last=["lost"]) == ["survivor", "idle", "idle"]
    # The lost node only when nothing else has room.
    assert place_new_workers(4, ONE_CPU, free, first=["survivor"], last=["lost"]) == [
        "survivor", "idle", "idle", "lost"]


def test_fewer_nodes_than_workers_means_the_next_one_fits_nowhere():
    free = {"a": {"CPU": 3, "GPU": 1}, "b": {"CPU": 1, "GPU": 2}}
    needs = {"CPU": 2, "GPU": 1}
    assert place_new_workers(2, needs, free) == ["a"]  # b has the GPUs but not the CPUs
    assert place_new_workers(1, {"CPU": 1}, {"a": {"CPU": 0}}) == []
    assert place_new_workers(1, {"CPU": 1}, {}) == []
    assert free["a"] == {"CPU": 3, "GPU": 1}  # the caller's view is left as it was


@ray.remote(num_cpus=1)
def plan_inside_the_group():
    """What the engine's driver sees in a trial: the CPUs its group reserved, and the servers it plans."""
    node = ray.get_runtime_context().get_node_id()
    cpus = reserved_cpus()
    return node, cpus, plan_servers([node, node], cpus, cpus_per_worker=1, requested=None)


def test_inside_a_placement_group_servers_are_planned_on_its_bundles_not_the_nodes_cpus(ray_session):
    assert reserved_cpus() is None  # the driver is in no group
    # A trial's group: its driver (bundle 0) and 2 workers of 1 CPU, on a node of 8 CPUs.
    group = placement_group([{"CPU": 1}] * 3, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=60)
        node, cpus, plan = ray.get(plan_inside_the_group.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0)).remote(), timeout=60)
    finally:
        remove_placement_group(group)
    assert cpus == {node: 3.0}
    assert plan == [node]  # 1 CPU left by the workers: one server, where the node's 8 CPUs would give 2
    assert plan_servers([node, node], {node: 8.0}, cpus_per_worker=1, requested=None) == [node, node]

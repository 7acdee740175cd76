"""Where the engine's actors are scheduled: spread over the cluster, or inside the caller's placement group.

A DistributedSGD built inside a placement group (a Ray Tune trial, see
``dsgd.tune``) must start its workers and parameter servers in that group,
on the resources reserved with it; scheduled anywhere else they would wait
for, or take, resources that other trials reserved.

New workers that replace dead ones go where ``place_new_workers`` finds
room for them.
"""

from __future__ import annotations

from typing import Collection, Mapping, Union

import ray

from ray.util.placement_group import get_current_placement_group, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

# A Ray ``scheduling_strategy`` option.
Placement = Union[str, NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy]


def actor_placement(node_id: str | None = None) -> Placement:
    """The ``scheduling_strategy`` for one of the engine's actors.

    Inside a placement group (the caller is a task or actor scheduled in one):
    that group, in a bundle on ``node_id`` if it has one, else in any bundle
    with room. Outside: hard affinity to ``node_id``, or "SPREAD" without one.
    """
    group = get_current_placement_group()
    if group is None:
        return "SPREAD" if node_id is None else NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    bundle = -1
    if node_id is not None:
        bundle_nodes = placement_group_table(group).get("bundles_to_node_id", {})
        bundle = min((int(b) for b, n in bundle_nodes.items() if n == node_id), default=-1)
    # Capture nothing: the actors' own tasks are not the engine's to place.
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle,
                                            placement_group_capture_child_tasks=False)


def in_placement_group() -> bool:
    """The caller runs inside a placement group (a Tune trial): the engine's workers are its fixed bundles."""
    return get_current_placement_group() is not None


def reserved_cpus() -> dict[str, float] | None:
    """CPUs per node that the caller's placement group reserved (all its bundles), or None outside one.

    Inside a group (a Tune trial) the engine may use only those, whatever
    else the nodes have.
    """
    group = get_current_placement_group()
    if group is None:
        return None
    table = placement_group_table(group)
    cpus: dict[str, float] = {}
    for bundle, node in table.get("bundles_to_node_id", {}).items():
        cpus[node] = cpus.get(node, 0.0) + table["bundles"][bundle].get("CPU", 0.0)
    return cpus


def place_new_workers(count: int, needs: Mapping[str, float], free: Mapping[str, Mapping[str, float]],
                      first: Collection[str] = (), last: Collection[str] = (), spread: bool = False) -> list[str]:
    """A node for each of ``count`` new workers in turn, each needing ``needs``, while they fit.

    ``free``: resources free per node. Nodes in ``first`` are tried first,
    those in ``last`` last, the others in between, each group in the order
    of ``free``; with ``spread``, a node that takes a worker goes to the end
    of that order (round robin). Fewer than ``count`` nodes mean the next
    worker fits nowhere.
    """
    left = {node: dict(resources) for node, resources in free.items()}
    order = sorted(left, key=lambda n: (n not in first, n in last))
    nodes: list[str] = []
    for _ in range(count):
        node = next((n for n in order if all(left[n].get(r, 0) >= a for r, a in needs.items())), None)
        if node is None:
            break
        for r, amount in needs.items():
            left[node][r] = left[node].get(r, 0) - amount
        nodes.append(node)
        if spread:
            order.remove(node)
            order.append(node)
    return nodes


def nodes_with(resource: str | None, nodes: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The nodes of ``nodes`` (node id -> resources) that have some of the custom ``resource``, in id order
    (none if ``resource`` is None): with ``server_resource``, the parameter servers' nodes."""
    return sorted(node for node, have in nodes.items() if resource is not None and have.get(resource, 0) > 0)


def in_driver() -> bool:
    """The caller is a Ray driver, not a task or actor (such as a Tune trial)."""
    return ray.get_runtime_context().worker.mode == ray.SCRIPT_MODE


def actor_state(actor) -> str:
    """"ALIVE", "DEAD", ... as Ray's actor table (in its GCS) lists ``actor`` now.

    Read through ``ray._private.state`` (Ray 2.60): the public state API
    (``ray.util.state``) needs the dashboard, which a cluster may run without.
    """
    return ray._private.state.actors(actor_id=actor._actor_id.hex()).get("State", "DEAD")


def live_node_resources() -> dict[str, dict[str, float]]:
    """Node id -> total resources, of the nodes Ray lists as alive."""
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}

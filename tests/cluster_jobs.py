"""For job scripts (see ``job_processes.run_job``) that run dsgd on a multi-node Ray cluster on this machine.

A ``ray.cluster_utils.Cluster`` gives every node its own raylet and object
store, as on separate machines. The tests check what ``relays_of`` and
``relay_transports`` report with ``assert_relays_push_down_streams``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import ray
from ray._private import internal_api
from ray.cluster_utils import Cluster

from job_processes import worker_runtime_env


@contextlib.contextmanager
def local_cluster(*nodes: dict) -> Iterator[Cluster]:
    """A ``ray.cluster_utils.Cluster`` of ``nodes`` (``add_node`` arguments, the first the head), Ray connected to it."""
    cluster = Cluster()
    try:
        head, *others = nodes
        cluster.add_node(**head, include_dashboard=False)
        for node in others:
            cluster.add_node(**node)
        ray.init(address=cluster.address, logging_level="ERROR",
                 runtime_env=worker_runtime_env())
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def actor_node(actor) -> str:
    """The node an actor runs on, from the GCS actor table (needs no dashboard)."""
    return ray._private.state.actors(actor_id=actor._actor_id.hex())["Address"]["NodeID"]


def live_actors() -> dict[str, list[tuple[str, str]]]:
    """Class name ("SGDWorker", "ParameterServer") -> (actor id, node) of each live actor of that class, by id, from
    the GCS actor table: also the actors of an engine the job holds no handle to (a Tune trial's)."""
    actors: dict[str, list[tuple[str, str]]] = {}
    for actor_id, actor in sorted(ray._private.state.actors().items()):
        if actor["State"] == "ALIVE":
            actors.setdefault(actor["ActorClassName"].rsplit(".", 1)[-1], []).append(
                (actor_id, actor["Address"]["NodeID"]))
    return actors


def objects_created(node_id: str | None = None) -> int:
    """Objects a node's object store has created since it started (Ray's node stats); the first live node if None."""
    node = next(n for n in ray.nodes() if n["Alive"] and node_id in (None, n["NodeID"]))
    reply = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
    return reply.store_stats.cumulative_created_objects


def relays_of(group) -> list:
    """Per partition of a ``ServerGroup``: [relaying server, the workers it sums] of each node that relays it."""
    return [[[r, list(ws)] for r, ws in group.relays.get(j, {}).items()] for j in range(len(group.layout))]


def relay_transports(group) -> list:
    """Per server of a ``ServerGroup``: the server it relays partitions to -> how its partial sums go there
    ("stream", "object store")."""
    return [{str(home): how for home, how in transports.items()}
            for transports in ray.get([a.relay_transports.remote() for a in group.actors], timeout=60)]


def assert_relays_push_down_streams(relays: list, transports: list, placement: list) -> None:
    """Every relaying server (``relays``: per partition, [server, workers] of each node that relays it) pushes its
    partial sums to each partition's server down a stream, and no other server relays."""
    expected: dict[int, dict[str, str]] = {r: {} for r in range(len(transports))}
    for j, by in enumerate(relays):
        for r, _ in by:
            expected[r][str(placement[j])] = "stream"
    assert transports == [expected[r] for r in range(len(transports))]
    assert any(transports)

"""Replacing dead actors, between steps (the step ledger's recovery calls ``Cluster.replace_dead``).

Replacements go on live nodes: a new worker on a node with room for it
beside the surviving workers (else a DSGDError names what is missing), a
new parameter server beside the workers, or with ``server_resource`` on
one of the servers' own nodes (``server_hosts``), so a server lost with
its node moves to a live one. An elastic engine without room for every dead worker
closes up the survivors' indices and goes on with fewer (``_shrink_around``),
as long as ``min_workers`` remain.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from dsgd.cluster.placement import live_node_resources, nodes_with
from dsgd.cluster.room import amounts
from dsgd.errors import ActorFailure, DSGDError

if TYPE_CHECKING:
    from dsgd.cluster.cluster import Cluster

logger = logging.getLogger(__name__)

ELASTIC_PLACEMENTS = 5  # an elastic engine places replacements this often before a lost node's failure is raised


def replace_dead(cluster: Cluster) -> set[int]:
    """Start new actors for dead ones, reconnect; the indices of the new workers.

    Workers first, on live nodes with room (a DSGDError names what is
    missing if there are none); then parameter servers, beside the
    workers, so a server lost with its node moves to a live one. An
    elastic engine without room for every dead worker goes on with fewer
    (``_shrink_around``), as long as ``min_workers`` remain.
    """
    dead_workers = cluster.calls.unresponsive(cluster.workers)
    if len(dead_workers) == cluster.topology.num_workers:
        raise DSGDError("every worker died, so no replica is left to restore the weights from; "
                        "restore from a checkpoint (DistributedSGD.restore) in a new engine")
    if cluster.options.elastic:
        dead_workers, shrunk = _replace_or_shrink(cluster, dead_workers)
    else:
        _replace_workers(cluster, dead_workers)
        shrunk = False
    rebuilt = dead_workers
    if cluster.split_datasets():  # new splits for every replica: survivors rebuild theirs too
        rebuilt = range(cluster.topology.num_workers)
    if rebuilt:
        cluster._build_models(rebuilt)
    if shrunk:
        cluster.connect_exchange()
        return set(dead_workers)
    dead_servers = cluster.calls.unresponsive(cluster.servers.actors) if cluster.servers else []
    if dead_servers or (cluster.servers and rebuilt):  # new workers may sit on other nodes: relays re-planned
        hosts = server_hosts(cluster, dead_servers)
        # Where a new worker or server sits on another node, a survivor's push order changes too (else a relay
        # could deadlock): its send scheduler takes the new one as it connects, nothing rebuilt.
        started = cluster.servers.replace(dead_servers, cluster.worker_nodes, hosts)
        for identity in cluster.calls.identify(started):
            logger.warning("parameter server %d %s; started a new one, pid %d on node %s", identity.index,
                           "is dead" if identity.index in dead_servers else
                           "serves a new relay plan (a new worker runs on another node)",
                           identity.pid, identity.node_id[:8])
        cluster.server_slots.connect(cluster.workers)
    return set(dead_workers)


def server_hosts(cluster: Cluster, dead: list[int]) -> list[str] | None:
    """The nodes that may take the new servers for ``dead`` (``ServerGroup.replace``): None (beside the
    workers) without ``server_resource``; else the servers' own nodes known up.

    Those are the nodes of the servers that answered, and those Ray lists
    with the resource where no server died (a node added since counts).
    Only if there are none, the dead servers' nodes Ray still lists alive
    (a server that failed alone; were its node lost, starting there fails
    and the step ledger recovers again). A DSGDError if no node is left.
    """
    resource = cluster.options.server_resource
    if resource is None:
        return None
    nodes = cluster.servers.nodes
    answered = {node for j, node in enumerate(nodes) if j not in dead}
    lost = {nodes[j] for j in dead} - answered
    listed = set(nodes_with(resource, live_node_resources()))
    hosts = sorted(answered | (listed - lost)) or sorted(listed)
    if not hosts:
        raise DSGDError(f"parameter servers {dead} are dead and no live Ray node with server_resource={resource!r} "
                        f"is left to start new ones on; add such a node and restore from a checkpoint")
    return hosts


def _replace_or_shrink(cluster: Cluster, dead: list[int]) -> tuple[list[int], bool]:
    """An elastic engine's ``_replace_workers``: replace the dead workers that fit, go on without the others.

    Returns the indices of the new workers and whether the engine shrank
    (``_shrink_around``). A new worker placed on a node that turns out
    lost (Ray had not yet seen it dead) counts as dead: the engine looks
    again at the room there is.
    """
    shrunk, placements = False, 0
    while True:
        dead, shrank = _shrink_around(cluster, dead)
        shrunk = shrunk or shrank
        try:
            _replace_workers(cluster, dead, place_again=False)
            return dead, shrunk
        except ActorFailure:
            placements += 1
            if placements == ELASTIC_PLACEMENTS:
                raise
            logger.warning("a node chosen for a new worker is lost too; looking again at the room there is")
            dead = cluster.calls.unresponsive(cluster.workers)


def _replace_workers(cluster: Cluster, dead: list[int], place_again: bool = True) -> None:
    """Kill what is left of workers ``dead``, start new ones on live nodes (their models are not built yet).

    If a node chosen for a new worker turns out lost as well (Ray had not
    yet seen it dead), the new workers are placed again without it (or,
    without ``place_again``, the ActorFailure raised).
    """
    if not dead:
        return
    needs = amounts(cluster.room.needs)
    while True:
        nodes = cluster.room.nodes_for(dead, cluster.worker_nodes)
        for i, node in zip(dead, nodes):
            logger.warning("worker %d is dead; starting a new one on node %s", i, node[:8])
            ray.kill(cluster.workers[i])
            cluster.workers[i] = cluster.new_worker(i, node)
        try:
            identities = cluster.calls.identify([cluster.workers[i] for i in dead],
                                        f"new workers {dead} to start (each needs {needs} on its node)")
            break
        except ActorFailure:
            if not place_again or set(nodes) <= live_node_resources().keys():
                raise
            logger.warning("a node chosen for a new worker is lost too; placing the new workers again")
    for i, identity in zip(dead, identities):
        cluster.worker_nodes[i] = identity.node_id


def _shrink_around(cluster: Cluster, dead: list[int]) -> tuple[list[int], bool]:
    """An elastic engine's dead workers without room for all: drop those that fit nowhere, close up the indices.

    Returns the indices of the dead workers still to replace and whether
    the engine shrank. The surviving workers keep their order and take
    the indices from 0 (``SGDWorker.renumber``); the replacements that
    fit come last. Below ``min_workers`` nothing changes (and
    ``_replace_workers`` raises the error naming what is missing).
    """
    fit = len(cluster.room.place(dead, cluster.worker_nodes)[0])
    keep = len(cluster.workers) - len(dead) + fit
    if fit >= len(dead) or keep < cluster.options.min_workers:
        return dead, False
    for i in dead:
        ray.kill(cluster.workers[i])
    order = [i for i in range(len(cluster.workers)) if i not in dead] + dead[:fit]
    cluster.workers = [cluster.workers[i] for i in order]
    cluster.worker_nodes = [cluster.worker_nodes[i] for i in order]
    survivors = len(order) - fit
    moved = [new for new, old in enumerate(order[:survivors]) if new != old]
    cluster.calls.call([cluster.workers[i].renumber.remote(i) for i in moved], "the survivors to take new indices")
    cluster.calls.identify([cluster.workers[i] for i in moved], "the survivors to answer")
    logger.warning("workers %s are lost and the live nodes have room for %d of them: going on with %d workers "
                   "(num_workers=%s)", dead, fit, keep, (cluster.options.min_workers, cluster.options.max_workers))
    cluster.set_size(keep)
    return list(range(survivors, keep)), True

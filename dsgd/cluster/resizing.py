"""Starting or stopping workers between steps (``DistributedSGD.resize``, through the step ledger).

New workers are built before anything else changes (meanwhile the servers
of the new count start and the survivors prepare its exchange), so a size
the cluster cannot hold, or a new worker that fails to build, leaves the
engine as it was; ``connect_exchange`` then gives every worker the exchange
of the new count and its parameter servers, planned as at start.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import ray

from dsgd.cluster.server_group import plan_group
from dsgd.cluster.topology import Topology
from dsgd.common.stopwatch import Phases
from dsgd.errors import ActorFailure

if TYPE_CHECKING:
    from dsgd.cluster.cluster import Cluster

logger = logging.getLogger(__name__)


def resize(cluster: Cluster, n: int, state: ray.ObjectRef | None, phases: Phases, fetch_stats: bool) -> None:
    """Start or stop workers so that ``n`` run.

    Growing, the new workers start on nodes with room (a DSGDError names
    what is missing, before any starts) and build their models, starting
    from ``state`` (a survivor's ``get_state()``, taken once the steps in
    flight were settled: no step runs during a resize); meanwhile
    the parameter servers of the new count start and the survivors build
    its exchange and have TensorFlow plan its step (``fetch_stats``: as
    the last step fetched stats or not; ``SGDWorker.prepare_exchange``),
    without taking it up. If that fails (or is interrupted), the new
    workers and servers are killed and the engine is as it was (with
    datasets, the survivors get splits for the old count again). Shrinking
    stops the highest-indexed workers (with datasets, the survivors then
    get new splits). Once the topology's count is ``n`` (also if an error
    comes later), call ``connect_exchange`` before the next step. ``phases``
    times each part.
    """
    old = cluster.topology.num_workers
    resized = cluster.topology.resized(n)
    if n > old:
        new = list(range(old, n))
        nodes = cluster.room.nodes_for(new, cluster.worker_nodes, f"grow to {n} workers: no room for new worker")
        if resized.uses_ps:
            cluster.check_object_store(n)
        try:
            _grow(cluster, new, nodes, resized, state, phases, fetch_stats)
        except BaseException:
            cluster.server_slots.drop_staged()
            _stop_workers(cluster, old)
            if cluster.split_datasets():
                cluster._build_models(range(old))
            raise
        cluster.set_size(n)
        return
    with phases("stop workers"):
        _stop_workers(cluster, n)
    cluster.set_size(n)
    if cluster.split_datasets():
        with phases("build models"):
            cluster._build_models(range(n))


def _grow(cluster: Cluster, new: list[int], nodes: list[str], resized: Topology, state: ray.ObjectRef | None,
          phases: Phases, fetch_stats: bool) -> None:
    """Start workers ``new`` on ``nodes`` and build their models from ``state``; meanwhile, with "ps", the
    servers of ``resized`` start (``ServerSlots.stage``, made current by ``connect_exchange``) and the survivors
    prepare its exchange; the new workers prepare it once built, planned for the feeds of a survivor's last step
    (so their first step is not TensorFlow planning it while every other worker waits). With datasets every
    worker builds its model again (new splits): nothing is prepared."""
    survivors = cluster.workers[:new[0]]
    preparing, group = [], None
    with phases("start workers"):
        cluster.workers += [cluster.new_worker(i, node, resized) for i, node in zip(new, nodes)]
        if resized.uses_ps and not cluster.splits.datasets:
            # The new workers run on ``nodes`` (hard node affinity), so the servers are planned as at start.
            group = plan_group(cluster.options, resized, cluster.signature.exchange, cluster.worker_nodes + nodes)
            cluster.server_slots.stage(group)
            feed_names = survivors[0].step_feed_names.remote()  # before it is busy preparing
            preparing = [w.prepare_exchange.remote(resized.exchange, fetch_stats, group.layout, group.placement,
                                                   group.rounds[i])
                         for i, w in enumerate(survivors)]
        identities = cluster.calls.identify(cluster.workers[len(survivors):], f"new workers {new} to start")
    cluster.worker_nodes += [i.node_id for i in identities]
    with phases("build models"):
        rebuilt = range(len(cluster.workers)) if cluster.split_datasets() else new
        cluster._build_models(rebuilt, state, new)
    if group is not None:
        preparing += [w.prepare_exchange.remote(resized.exchange, fetch_stats, group.layout, group.placement,
                                                group.rounds[i], feed_names)
                      for i, w in enumerate(cluster.workers[len(survivors):], len(survivors))]
        with phases("start servers"):
            cluster.calls.identify(group.actors, "the parameter servers to start")
    if not preparing:
        return
    with phases("prepare workers"):
        try:
            cluster.calls.call_startup(preparing, f"the workers to prepare the exchange of "
                                                  f"{resized.num_workers} workers")
        except ActorFailure as e:  # a dead survivor is replaced once the new workers are in (connect_exchange)
            logger.warning("%s; the grow goes on", e)


def _stop_workers(cluster: Cluster, keep: int) -> None:
    """Kill the workers from index ``keep`` on."""
    for worker in cluster.workers[keep:]:
        ray.kill(worker)
    del cluster.workers[keep:], cluster.worker_nodes[keep:]


def connect_exchange(cluster: Cluster, phases: Phases) -> None:
    """Every worker combines gradients as the engine's count asks; the parameter servers planned anew.

    After a resize: with "ps" and several workers, the servers are
    planned (how many, where, the partitions) from the workers' nodes as
    at start, and every worker connects to them: those a grow started
    meanwhile (``_grow``), the servers kept from before the last resize if
    they are what the plan asks (a resize back), else new ones. The
    servers of the old count are kept, idle, for a resize back (the group
    kept before is killed). Safe to call again after a failure.
    """
    slots = cluster.server_slots
    previous = slots.vacate()
    try:
        with phases("set exchange"):
            cluster.calls.call_startup([w.set_exchange.remote(cluster.topology.exchange) for w in cluster.workers],
                                       "the workers to change their exchange")
        if slots.promote_staged():  # started while a grow's new workers built
            with phases("connect"):
                cluster.server_slots.connect(cluster.workers)
        elif cluster.topology.uses_ps:
            cluster._start_parameter_servers(cluster.worker_nodes, phases)
    finally:
        slots.retire(previous)

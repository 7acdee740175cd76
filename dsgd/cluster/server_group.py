"""The driver's parameter servers of one engine: planned, started, replaced, aborted, reset.

Partitions and server processes are separate choices. A partition (about
``grad_shard_bytes``) is what travels and is pipelined with back-propagation;
a server process sums many partitions. ``plan_group`` plans an engine's
servers from Ray's view of the nodes, with ``dsgd.cluster.server_plan``: by
default a few servers on the nodes that hold workers, from each node's CPUs
and the workers placed there, or, with ``server_resource``, on nodes of
their own, where no worker runs; the partition size from the model and the
server count (``dsgd.wire.partitions.default_partition_bytes``); partitions
spread over the servers by bytes. Workers reach a server on their own node
through shared memory, others down a stream (``dsgd.exchange.ps_client``),
each worker in an order of its own that spreads every moment's pushes over
the nodes. Node-local aggregation: on a node with several workers, a server
there sums their copies of each partition summed elsewhere and pushes one
partial sum per partition and step across (``dsgd.server.relays.Relay``),
down a stream of its own to the partition's server (``connect_relays``).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ray

from dsgd import ps_actor
from dsgd.server.layout import BufferLayout, partial_sum_offsets
from dsgd.server.relays import Relay
from dsgd.wire import partitions
from dsgd.config import Options, server_sums
from dsgd.cluster.topology import Topology
from dsgd.cluster.placement import actor_placement, live_node_resources, nodes_with, reserved_cpus
from dsgd.cluster.server_plan import assign_partitions, home_for, plan_relays, plan_servers, send_rounds
from dsgd.errors import DSGDError
from dsgd.wire.partitions import Partition, VarSpec

logger = logging.getLogger(__name__)


class ServerGroup:
    """Starts, replaces, aborts, resets and traces the parameter servers of one engine."""

    def __init__(self, layout: Sequence[Partition], nodes: Sequence[str], num_workers: int, step_timeout_s: float,
                 backup_workers: int = 0, worker_nodes: Sequence[str] | None = None):
        """``nodes[j]``: where server j runs; ``step_timeout_s`` bounds a push's wait for the others; a step
        averages the first ``num_workers - backup_workers`` workers' pushes.

        ``worker_nodes[w]``: worker w's node, for node-local aggregation
        (``plan_relays``; without it, or with backup workers, every worker
        pushes every partition to its server) and the order of its pushes
        (``send_rounds``; without it, the same on every worker).
        """
        self.layout = list(layout)
        self.nodes = list(nodes)
        self.num_workers = num_workers
        self.step_timeout_s = step_timeout_s
        self.backup_workers = backup_workers
        self.sums_as_arriving = server_sums() == "arriving"
        self.worker_nodes = list(worker_nodes) if worker_nodes is not None else None
        self.placement = assign_partitions(self.layout, len(self.nodes))
        self.actors: list[Any] = [None] * len(self.nodes)
        self.relays = self._plan_relays(worker_nodes)
        self.rounds = self._plan_rounds(worker_nodes)
        self.generation = 0  # resets so far: every server of the group has it (``ParameterServer.reset``)

    def plan(self) -> tuple:
        """What the group was planned as: two groups of one plan are interchangeable (a server holds nothing
        across steps)."""
        return (self.layout, self.nodes, self.placement, self.relays, self.rounds, self.num_workers,
                self.step_timeout_s, self.backup_workers)

    def _plan_rounds(self, worker_nodes: Sequence[str] | None) -> list[list[list[int]]]:
        """``rounds[w]``: worker w's pushes in order (``send_rounds``), for its node and the servers' nodes now. Not
        only a matter of the links' load: with relays, a worker that pushed its own node's partitions before the
        relayed ones could deadlock (``send_rounds``), so a worker or server on another node needs new rounds."""
        serverless = [node for node in dict.fromkeys(worker_nodes or ()) if node not in self.nodes]
        return [send_rounds(self.placement, self.nodes, node, serverless)
                for node in (worker_nodes if worker_nodes is not None else [None] * self.num_workers)]

    def _plan_relays(self, worker_nodes: Sequence[str] | None) -> dict[int, dict[int, tuple[int, ...]]]:
        """``plan_relays``, where node-local aggregation applies: without backup workers (a node's partial sum
        would wait for its slowest worker)."""
        if worker_nodes is None or self.backup_workers:
            return {}
        return plan_relays(self.layout, self.placement, self.nodes, worker_nodes)

    def partitions_of(self, server: int) -> list[Partition]:
        return [s for s, j in zip(self.layout, self.placement) if j == server]

    def relays_of(self, server: int) -> list[Relay]:
        """The partitions of other servers that ``server`` sums for its node's workers."""
        return [Relay(self.layout[j], self.placement[j], by[server])
                for j, by in sorted(self.relays.items()) if server in by]

    def routes(self, worker: int) -> list[int]:
        """``routes[j]``: the server ``worker`` pushes partition j to: its node's relay of j, else j's server."""
        return [next((r for r, workers in self.relays.get(j, {}).items() if worker in workers), self.placement[j])
                for j in range(len(self.layout))]

    def crossings(self, worker_nodes: Sequence[str]) -> list[tuple[str, str, int, int]]:
        """``(from node, to node, bytes pushed, bytes of the mean back)`` of every push per step that crosses
        between nodes: a worker's (or its relay's) partition to a server on another node. Means travel in the
        wire dtype; a relay's partial sum in float32 (``Partition.nbytes``) under compression too."""
        crossing = []
        for w, node in enumerate(worker_nodes):
            for partition, r in zip(self.layout, self.routes(w)):
                if self.nodes[r] != node:
                    crossing.append((node, self.nodes[r], partition.wire_nbytes, partition.wire_nbytes))
        for j, by in self.relays.items():
            for r in by:
                partition = self.layout[j]
                crossing.append((self.nodes[r], self.nodes[self.placement[j]], partition.nbytes, partition.wire_nbytes))
        return crossing

    def node_sent_bytes(self, worker_nodes: Sequence[str]) -> dict[str, int]:
        """Node -> the gradient bytes its workers (or its relays) push to servers on other nodes per step."""
        sent: dict[str, int] = {}
        for source, _, pushed, _ in self.crossings(worker_nodes):
            sent[source] = sent.get(source, 0) + pushed
        return sent

    def node_link_bytes(self, worker_nodes: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Node -> the bytes its link carries per step (out, in): out, what it pushes and the means of what was
        pushed to it; in, what is pushed to it and the means of what it pushed."""
        link = {node: [0, 0] for node in worker_nodes}
        for source, target, pushed, mean in self.crossings(worker_nodes):
            link.setdefault(target, [0, 0])
            link[source][0] += pushed
            link[source][1] += mean
            link[target][1] += pushed
            link[target][0] += mean
        return {node: (out, into) for node, (out, into) in link.items()}

    def node_buffer_bytes(self) -> dict[str, int]:
        """Node -> the bytes its servers' buffers take once every worker has attached (``BufferLayout``): per
        server, a mean buffer per slot and an input buffer per worker (shared memory for a worker on its node,
        private for one down a stream), each as large as its partitions and relayed ones; a stream's buffer of
        partial sums per relaying node."""
        slots = 2 if self.backup_workers else 1
        need: dict[str, int] = {}
        for server, node in enumerate(self.nodes):
            summed = self.partitions_of(server) + [relay.partition for relay in self.relays_of(server)]
            need[node] = need.get(node, 0) + BufferLayout.bytes_for(summed) * (slots + self.num_workers)
        relayed: dict[tuple[int, int], list[Partition]] = {}  # (home server, relaying server) -> partitions
        for j, by in self.relays.items():
            for r in by:
                relayed.setdefault((self.placement[j], r), []).append(self.layout[j])
        for (home, _), sums in relayed.items():
            need[self.nodes[home]] += partial_sum_offsets(sums)[1]
        return need

    def start(self, indices: Sequence[int] | None = None) -> list:
        """Start servers (all, or ``indices``) on their nodes; the actors started (they start in the background).

        Each has hard affinity to its node: Ray's SPREAD does not spread actors
        that reserve no CPU, and soft affinity spills them to other nodes under
        load, so placement is explicit. Inside a placement group (a Tune
        trial): the group's bundle on that node.
        """
        indices = range(len(self.nodes)) if indices is None else indices
        for j in indices:
            node_sums = {k: list(by.values()) for k, by in self.relays.items() if self.placement[k] == j}
            self.actors[j] = ps_actor.start(j, self.num_workers, self.partitions_of(j), self.step_timeout_s,
                                            self.backup_workers, self.relays_of(j), node_sums, self.generation,
                                            sums_as_arriving=self.sums_as_arriving,
                                            scheduling_strategy=actor_placement(self.nodes[j]))
        return [self.actors[j] for j in indices]

    def connect_relays(self) -> list:
        """Refs of giving every relaying server the actors it pushes to (after any start, before workers push): it
        opens its streams to them (``ParameterServer.set_peers``), closing those to the servers before."""
        return [actor.set_peers.remote(self.actors) for j, actor in enumerate(self.actors) if self.relays_of(j)]

    def replace(self, dead: Sequence[int], worker_nodes: Sequence[str], hosts: Sequence[str] | None = None) -> list:
        """Kill what is left of servers ``dead`` and start new ones on ``hosts`` (``home_for``; default beside
        the workers); the new actors.

        ``worker_nodes``: the nodes of the (live) workers. If they change
        which servers relay what (``plan_relays``), every server is started
        anew with the new plan (a server holds nothing across steps). The
        workers' rounds are planned again for the nodes now (``_plan_rounds``),
        which each worker's send scheduler takes up as it connects again.
        """
        for j in dead:
            self.nodes[j] = home_for(self.nodes, j, worker_nodes if hosts is None else hosts)
        self.worker_nodes = list(worker_nodes)
        self.rounds = self._plan_rounds(worker_nodes)
        relays = self._plan_relays(worker_nodes)
        if relays != self.relays:
            self.relays, dead = relays, range(len(self.nodes))
        for j in dead:
            ray.kill(self.actors[j])
        return self.start(dead)

    def abort(self) -> None:
        """Fail every waiting and future push until ``reset`` (fire and forget)."""
        for actor in self.actors:
            actor.abort.remote(self.generation)

    def excuse(self, worker_index: int) -> None:
        """Close steps without waiting for the dead worker ``worker_index`` until ``reset`` (fire and forget)."""
        for actor in self.actors:
            actor.excuse.remote(worker_index, self.generation)

    def reset(self, step_id: int) -> list:
        """Refs of every server's reset to expect ``step_id`` next, in the group's next generation (a relay's
        partial sum summed before it is refused)."""
        self.generation += 1
        return [actor.reset.remote(step_id, self.generation) for actor in self.actors]

    def traces(self, step_id: int) -> list:
        return [actor.trace.remote(step_id) for actor in self.actors]

    def describe(self) -> str:
        """'4 partitions of up to 42.5 MiB on 1 parameter server (178.2 MiB)', for the log (bytes on the wire);
        with relays, how many partitions each node's workers sum before they cross ('; summed within the node
        first: 2 partitions on node 1a2b3c4d, ...')."""
        loads = ", ".join(f"{sum(s.wire_nbytes for s in self.partitions_of(j)) / 2**20:.1f}"
                          for j in range(len(self.nodes)))
        largest = max(s.wire_nbytes for s in self.layout) / 2**20
        relayed: dict[str, int] = {}
        for by in self.relays.values():
            for r in by:
                relayed[self.nodes[r]] = relayed.get(self.nodes[r], 0) + 1
        return (f"{len(self.layout)} partition{'s' * (len(self.layout) != 1)} of up to {largest:.1f} MiB on "
                f"{len(self.nodes)} parameter server{'s' * (len(self.nodes) != 1)} ({loads} MiB)"
                + ("; summed within the node first: " + ", ".join(f"{n} partitions on node {node[:8]}"
                                                                  for node, n in sorted(relayed.items()))
                   if relayed else ""))

    def kill(self) -> None:
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor)
        self.actors = [None] * len(self.nodes)


def plan_group(options: Options, topology: Topology, exchange: Sequence[VarSpec],
               worker_nodes: Sequence[str]) -> ServerGroup:
    """The servers (``plan_servers``) and partitions (``dsgd.wire.partitions``) for ``exchange`` between the
    workers of ``topology``, not started yet.

    The nodes' CPUs are the engine's placement group's inside a Tune trial,
    else the live nodes'. With ``server_resource``, the servers go to the
    live nodes that have it (a DSGDError if none is left). The choice is logged.
    """
    live = live_node_resources()
    node_cpus = reserved_cpus()  # inside a Tune trial: its bundles, not the nodes' CPUs
    if node_cpus is None:
        node_cpus = {node: have.get("CPU", 0) for node, have in live.items()}
    server_nodes = nodes_with(options.server_resource, live)
    if options.server_resource is not None and not server_nodes:
        raise DSGDError(f"server_resource={options.server_resource!r}: no live Ray node has that resource any "
                        f"more, so the parameter servers have no node of their own to run on; add such a node")
    nodes = plan_servers(worker_nodes, node_cpus, options.cpus_per_worker, options.num_parameter_servers,
                         server_nodes)
    partition_bytes = options.grad_shard_bytes
    if partition_bytes is None:
        partition_bytes = partitions.default_partition_bytes(exchange, len(nodes),
                                                             across_nodes=len({*worker_nodes, *nodes}) > 1)
    layout = partitions.plan_partitions(exchange, partition_bytes, options.compression)
    group = ServerGroup(layout, nodes[:len(layout)], topology.num_workers, options.timeout_s,
                        topology.backup_workers, worker_nodes)
    chosen = options.grad_shard_bytes is None and options.num_parameter_servers is None
    logger.info("strategy 'ps'%s%s: %s%s", f", {options.compression} on the wire" if options.compression else "",
                f", servers on the {len(server_nodes)} nodes with {options.server_resource!r}" if server_nodes else "",
                group.describe(), "" if chosen else
                f" (grad_shard_bytes={options.grad_shard_bytes}, num_parameter_servers={options.num_parameter_servers})")
    return group

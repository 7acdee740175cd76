"""Where an engine's parameter servers go and what each does: pure functions of nodes and the partition layout.

``plan_servers`` picks each server's node, ``assign_partitions`` the
partitions each sums, ``send_rounds`` the order a worker pushes them in,
``plan_relays`` node-local aggregation, and ``home_for`` the node of a server
started again. ``dsgd.cluster.server_group`` plans an engine's group with
them (from Ray's view of the nodes) and runs it.
"""

from __future__ import annotations

from typing import Sequence

from dsgd.wire.partitions import Partition

CPUS_PER_SERVER = 2  # spare CPUs on a node that justify one more server there


def plan_servers(worker_nodes: Sequence[str], node_cpus: dict[str, float], cpus_per_worker: int,
                 requested: int | None, server_nodes: Sequence[str] = ()) -> list[str]:
    """The node of every server to start.

    ``requested`` servers are spread round robin over the nodes holding
    workers (most workers first). ``None`` picks per such node: one server
    for every ``CPUS_PER_SERVER`` CPUs the node's workers leave free, at
    least one and at most one per worker there.

    With ``server_nodes`` (nodes of their own, ``server_resource``), the
    servers go there instead: ``requested`` round robin, or by default one
    for every ``CPUS_PER_SERVER`` CPUs of each (at least one): no worker
    runs there, so all its CPUs are spare.
    """
    if server_nodes:
        if requested is not None:
            return [server_nodes[j % len(server_nodes)] for j in range(requested)]
        return [node for node in server_nodes for _ in range(max(1, int(node_cpus.get(node, 0) // CPUS_PER_SERVER)))]
    counts: dict[str, int] = {}
    for node in worker_nodes:
        counts[node] = counts.get(node, 0) + 1
    nodes = sorted(counts, key=lambda n: (-counts[n], n))
    if requested is not None:
        return [nodes[j % len(nodes)] for j in range(requested)]
    plan = []
    for node in nodes:
        spare = node_cpus.get(node, 0) - counts[node] * cpus_per_worker
        plan += [node] * max(1, min(counts[node], int(spare // CPUS_PER_SERVER)))
    return plan


def assign_partitions(layout: Sequence[Partition], num_servers: int) -> list[int]:
    """``placement[j]``: the server of partition j, balancing bytes.

    In layout order (the order back-propagation produces gradients) the
    partitions are taken ``num_servers`` at a time, so partitions ready at
    about the same time are summed by different servers; within such a
    round the largest goes to the server with the fewest bytes so far. Every
    server, and so every server node's link, ends with about the same bytes
    (ResNet-101 on 8 servers: the busiest 1.035x the mean, against 1.097x
    placing one partition at a time).
    """
    load = [0] * num_servers
    placement = [0] * len(layout)
    for start in range(0, len(layout), num_servers):
        ready = sorted(range(start, min(start + num_servers, len(layout))), key=lambda j: -layout[j].wire_nbytes)
        idle = list(range(num_servers))
        for j in ready:
            server = min(idle, key=lambda k: (load[k], k))
            idle.remove(server)
            placement[j] = server
            load[server] += layout[j].wire_nbytes
    return placement


def send_rounds(placement: Sequence[int], server_nodes: Sequence[str], node: str | None,
                serverless: Sequence[str] = ()) -> list[list[int]]:
    """The partitions a worker on ``node`` pushes, round by round, each round in the order it pushes them.

    A round is ``assign_partitions``'s: ``len(server_nodes)`` consecutive
    partitions of the layout, each on its own server. Every worker pushes
    the rounds in layout order (back-propagation's), so partitions ready
    together leave together. Within a round it pushes first those summed on
    the next node on the ring of server nodes (in ``server_nodes``' order),
    then the node after, and so on round the ring, its own node's last.
    Were the order the same on every worker, all of them would push one
    partition to one server at once: that node's link would carry every
    other node's push while the other links waited (incast). Rotated, at
    each point of a round every node pushes to a different node. A node's
    workers share the order, so the node's relay (``plan_relays``) has every
    copy of a partition at once. Own node's last: a worker's channel to a
    server on its node is answered in order (``dsgd.transport.signals``),
    except the partitions that server relays; with relayed partitions first
    in every round, no answer of a round waits for a push queued behind it
    on another node's channel.

    A node without servers, the i-th of ``serverless`` (the worker nodes
    without servers, in order), goes round from the ring's i-th node (modulo
    its length): with servers on nodes of their own, at each point of a
    round the worker nodes push to different server nodes, as long as
    there are as many of these. Another (``None``: not known) goes round
    from the ring's first node.
    """
    ring = list(dict.fromkeys(server_nodes))
    if node in ring:
        own = ring.index(node)
    else:
        own = list(serverless).index(node) - 1 if node in serverless else -1
    size = len(server_nodes)

    def offset(j: int) -> int:  # 1 for the next node, ..., len(ring) for its own
        return (ring.index(server_nodes[placement[j]]) - own - 1) % len(ring) + 1

    return [sorted(range(start, min(start + size, len(placement))), key=lambda j: (offset(j), j))
            for start in range(0, len(placement), size)]


def plan_relays(layout: Sequence[Partition], placement: Sequence[int], server_nodes: Sequence[str],
                worker_nodes: Sequence[str]) -> dict[int, dict[int, tuple[int, ...]]]:
    """Node-local aggregation: ``relays[j] = {server r: the workers whose copies of partition j r sums}``.

    For every partition j and every node that is not its server's, holds at
    least two workers and a server: that node's server with the fewest bytes
    to sum so far (its own partitions, then the relayed ones in layout order)
    sums the node's workers' copies of j and pushes the sum to j's server, so
    one copy of j leaves the node per step instead of one per worker. A node
    with one worker pushes directly (the same bytes, one hop fewer), and so
    does every worker when the servers run on nodes of their own
    (``server_resource``): no worker node holds a server to relay.
    """
    workers_on: dict[str, list[int]] = {}
    for w, node in enumerate(worker_nodes):
        workers_on.setdefault(node, []).append(w)
    load = [0] * len(server_nodes)
    for partition, j in zip(layout, placement):
        load[j] += partition.wire_nbytes
    relays: dict[int, dict[int, tuple[int, ...]]] = {}
    for partition, home in zip(layout, placement):
        for node, workers in sorted(workers_on.items()):
            here = [r for r, n in enumerate(server_nodes) if n == node]
            if node == server_nodes[home] or len(workers) < 2 or not here:
                continue
            r = min(here, key=lambda k: (load[k], k))
            load[r] += partition.wire_nbytes
            relays.setdefault(partition.index, {})[r] = tuple(workers)
    return relays


def home_for(server_nodes: Sequence[str], server: int, hosts: Sequence[str]) -> str:
    """The node for a new server ``server`` (``server_nodes[j]``: where server j ran), one of ``hosts``.

    ``hosts``: the nodes known to be up that may hold servers: the live
    workers' (servers beside the workers), or the servers' own nodes
    (``server_resource``, see ``dsgd.cluster.replacement``). It stays on its
    node if that is one of them; else that node was lost, and it moves to
    the host with the fewest servers. Ray lists a lost node as alive for
    seconds after its actors fail: only the nodes of actors that answered
    just now are known to be up.
    """
    if server_nodes[server] in hosts:
        return server_nodes[server]
    return min(hosts, key=lambda n: (list(server_nodes).count(n), n))

"""Whether the Ray cluster has room for the engine's workers and its exchange, and on which nodes.

``WorkerRoom`` answers for workers: the CPUs and GPUs to check before any
starts, a live node for each new one beside those that run (a DSGDError
names what is missing), how many more fit, how many an elastic engine
starts with. ``check_object_store`` answers for the exchange, once the
workers have built their models (its size is the model's), and
``check_server_memory`` for the parameter servers' buffers on each node,
before they start.
``HeldResources`` waits until killed workers' resources are free again.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import ray

from dsgd.cluster.server_group import ServerGroup
from dsgd.common.calls import Calls
from dsgd.cluster.placement import (actor_placement, actor_state, in_driver, live_node_resources, nodes_with,
                                    place_new_workers)
from dsgd.config import Options
from dsgd.errors import DSGDError
from dsgd.wire import codec
from dsgd.wire.partitions import VarSpec

logger = logging.getLogger(__name__)

ELASTIC_POLL_S = 1.0  # an elastic engine waiting for room for its minimum looks again this often
RELEASE_POLL_S = 0.02  # a wait for killed workers' resources looks again this often
RESOURCE_EPSILON = 1e-4  # Ray counts resources in units of 1/10000


class WorkerRoom:
    """Room for the workers of an engine of ``options``; ``worker_nodes[i]`` is where worker i runs."""

    def __init__(self, options: Options):
        self.options = options
        opts = options
        self.needs = {"CPU": opts.cpus_per_worker, **({"GPU": opts.devices_per_worker} if opts.gpu else {})}

    def check(self, num_workers: int) -> None:
        """Fail fast, naming what is missing, instead of waiting forever for ``num_workers`` workers: with
        ``server_resource``, a live node with it, and room for the workers outside such nodes."""
        live = live_node_resources()
        marked = self.options.server_resource
        servers = nodes_with(marked, live)
        if marked is not None and not servers:
            raise ValueError(
                f"server_resource={marked!r}: no live Ray node has that resource, so the parameter servers have "
                f"no node of their own to run on; start those nodes with ray start --resources='{{\"{marked}\": 1}}' "
                f"(or leave server_resource=None to run the servers beside the workers)")
        nodes = [have for node, have in live.items() if node not in servers]
        outside = f" outside the {len(servers)} server node{'s' * (len(servers) != 1)} ({marked!r})" if servers else ""
        for resource, per_worker in self.needs.items():
            have = sum(n.get(resource, 0) for n in nodes)
            largest = max((n.get(resource, 0) for n in nodes), default=0)
            what = f"{'gpu=True with ' if resource == 'GPU' else ''}{num_workers} workers x {per_worker} {resource}"
            if per_worker > largest:
                raise ValueError(
                    f"{what}: each worker needs {per_worker} {resource} on one node, but the largest "
                    f"Ray node{outside} has {largest:g} (cluster total{outside} {have:g})")
            if per_worker * num_workers > have:
                raise ValueError(
                    f"{what} needs {per_worker * num_workers} {resource} in all, but the Ray cluster{outside} "
                    f"has {have:g}; lower num_workers/cpus_per_worker or start Ray with more")

    def worker_node_resources(self) -> dict[str, dict[str, float]]:
        """Node id -> total resources, of the live nodes workers may run on: all but the parameter servers' own
        (those with ``server_resource``)."""
        live = live_node_resources()
        servers = nodes_with(self.options.server_resource, live)
        return {node: have for node, have in live.items() if node not in servers}

    def place(self, new: list[int], worker_nodes: Sequence[str],
              spread: bool = False) -> tuple[list[str], dict[str, dict[str, float]]]:
        """A live node for each of the new workers ``new`` in turn, as long as they fit; each node's free resources.

        Nodes where other workers run come first (they answered just now),
        the dead workers' own nodes last: Ray sees a lost node dead only
        seconds after its actors. Only the engine's workers count as holding
        resources (what other Ray jobs hold may be freed; waiting for that is
        bounded). Never on the parameter servers' own nodes
        (``worker_node_resources``). ``spread``: round robin over the nodes
        (``place_new_workers``).
        """
        free = {node: {r: have.get(r, 0) for r in self.needs} for node, have in self.worker_node_resources().items()}
        others = [node for i, node in enumerate(worker_nodes) if i not in new]
        own = [worker_nodes[i] for i in new if i < len(worker_nodes)]
        for node in others:
            if node in free:
                for r, amount in self.needs.items():
                    free[node][r] -= amount
        return place_new_workers(len(new), self.needs, free, first=others, last=own, spread=spread), free

    def nodes_for(self, new: list[int], worker_nodes: Sequence[str], what: str = "replace dead worker",
                  spread: bool = False) -> list[str]:
        """A live node for each of the new workers ``new`` (``place``); a DSGDError naming what is missing if
        not all fit."""
        nodes, free = self.place(new, worker_nodes, spread)
        if len(nodes) < len(new):
            room = "; ".join(f"node {n[:8]} has {amounts(have)} free" for n, have in free.items())
            marked = self.options.server_resource
            raise DSGDError(f"cannot {what} {new[len(nodes)]}: it needs {amounts(self.needs)} on one "
                            f"node, and no live node{f' without {marked!r} (the servers own those)' if marked else ''} "
                            f"has that free beside the other workers ({room or 'no node is alive'})")
        return nodes

    def start_nodes(self, count: int) -> list[str | None]:
        """The node of each of the ``count`` workers an engine starts with: None (Ray spreads them), or with
        ``server_resource`` round robin over the nodes without it (``place``; a DSGDError if they do not fit)."""
        if self.options.server_resource is None:
            return [None] * count
        return self.nodes_for(list(range(count)), [], "start worker", spread=True)

    def to_grow(self, worker_nodes: Sequence[str]) -> int:
        """How many more workers (up to ``max_workers``) fit beside the engine's, and in what Ray has free now.

        The second bound keeps a grow from waiting for resources that other
        Ray jobs hold.
        """
        n = len(worker_nodes)
        fit = len(self.place(list(range(n, self.options.max_workers or n)), worker_nodes)[0])
        available = ray.available_resources()
        return min([fit] + [int(available.get(r, 0) // amount) for r, amount in self.needs.items()])

    def elastic_start_count(self) -> int:
        """The workers an elastic engine starts with: as many as fit, up to max; waits up to startup_timeout_s
        for min."""
        opts = self.options
        deadline = time.monotonic() + opts.startup_timeout_s
        while True:
            fit = len(self.place(list(range(opts.max_workers)), [])[0])
            if fit >= opts.min_workers:
                return fit
            if time.monotonic() >= deadline:
                raise DSGDError(
                    f"num_workers={(opts.min_workers, opts.max_workers)}: after {opts.startup_timeout_s:.0f}s the "
                    f"live Ray nodes have room for {fit} workers of {amounts(self.needs)}, fewer than the "
                    f"minimum {opts.min_workers}; add nodes or lower the minimum")
            logger.info("num_workers=%s: room for %d workers, waiting for %d", (opts.min_workers, opts.max_workers),
                        fit, opts.min_workers)
            time.sleep(ELASTIC_POLL_S)


class HeldResources:
    """The resources that the live ones of ``actors`` hold (``needs`` each), and how much of them Ray listed free
    before: ``wait_released`` waits, after they are killed, until Ray lists those free again.

    Ray gives a killed actor's resources back some 0.1 s after it lists the
    actor dead; an actor started meanwhile is placed as if they were taken
    (with "SPREAD", on the other nodes). Only a driver waits: a task
    gives its own CPU back while it waits on Ray and takes it again after,
    so what Ray lists free is no reference there; and inside a placement
    group (a Tune trial) a new worker waits for a bundle with room rather
    than going to another node.
    """

    def __init__(self, actors: Sequence, needs: dict[str, float]):
        live = sum(actor_state(a) == "ALIVE" for a in actors) if in_driver() else 0
        self.held = {r: amount * live for r, amount in needs.items() if live}
        self.free_before = ray.available_resources() if self.held else {}

    def released(self) -> bool:
        """Ray lists the held resources free again (or, if another job took some meanwhile, all it has)."""
        free, total = ray.available_resources(), ray.cluster_resources()
        return all(free.get(r, 0) >= min(self.free_before.get(r, 0) + amount, total.get(r, 0)) - RESOURCE_EPSILON
                   for r, amount in self.held.items())

    def wait_released(self, timeout_s: float) -> None:
        """Wait, up to ``timeout_s``, until ``released``; log a warning if it is not."""
        deadline = time.monotonic() + timeout_s
        while self.held and not self.released():
            if time.monotonic() >= deadline:
                logger.warning("%.0f s after the workers were killed Ray still lists some of their %s as taken; "
                               "an engine started now may be placed as if they were", timeout_s, amounts(self.held))
                return
            time.sleep(RELEASE_POLL_S)


def check_object_store(exchange: Sequence[VarSpec], compression: str | None, num_workers: int) -> None:
    """Each step may hold every worker's partitions of ``exchange`` plus their means; a ValueError if the
    object store cannot."""
    size = sum(s.size * codec.wire_dtype(s.dtype, compression).itemsize for s in exchange)
    need = size * (num_workers + 1)
    have = ray.cluster_resources().get("object_store_memory", 0)
    if need > have:
        raise ValueError(
            f"the exchange needs {need / 2**20:.0f} MiB of Ray object-store memory per step "
            f"({num_workers} workers' gradients of {size / 2**20:.0f} MiB plus their mean), "
            f"but the cluster has {have / 2**20:.0f} MiB; start Ray with a larger object_store_memory")


def free_memory_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes this node can still give to new memory: the kernel's MemAvailable, capped by what this process's
    memory cgroup (v2, else v1) has left under its limit.

    The servers' shared buffers are anonymous memory files (``dsgd.transport.shared_memory``): they count
    against RAM and the cgroup, not against /dev/shm's size.
    """
    with open(meminfo) as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                              "memory/memory.usage_in_bytes")):
        try:
            with open(f"{cgroup}/{limit}") as l, open(f"{cgroup}/{usage}") as u:
                cap, used = l.read().strip(), int(u.read())
        except (OSError, ValueError):
            continue
        if cap.isdigit():
            free = min(free, max(0, int(cap) - used))
        break
    return free


def _free_memory_on(worker) -> int:
    """``free_memory_bytes`` on the node of ``worker`` (called there through ``SGDWorker.apply_fn``)."""
    return free_memory_bytes()


@ray.remote(num_cpus=0)
def _free_memory_task() -> int:
    """``free_memory_bytes`` on the node a task runs on: a parameter servers' own node, where no worker runs."""
    return free_memory_bytes()


def check_server_memory(group: ServerGroup, workers: Sequence, calls: Calls) -> None:
    """Each node has the memory ``group``'s buffers will take there (``ServerGroup.node_buffer_bytes``), read from
    a worker on each server's node, or on a node without workers (``server_resource``) by a task there; a
    ValueError naming the node, the bytes needed and free, and what to change, before any server starts."""
    if group.worker_nodes is None:  # a group planned without its workers' nodes (``ServerGroup``): not checked
        return
    readers = {}
    for worker, node in zip(workers, group.worker_nodes):
        readers.setdefault(node, worker)
    needed = group.node_buffer_bytes()
    reads = [readers[node].apply_fn.remote(_free_memory_on) if node in readers else
             _free_memory_task.options(scheduling_strategy=actor_placement(node)).remote() for node in needed]
    free = dict(zip(needed, calls.call_startup(reads, "the servers' nodes to report their free memory")))
    for node, nbytes in needed.items():
        if nbytes > free[node]:
            servers = group.nodes.count(node)
            raise ValueError(
                f"the parameter servers' buffers need {nbytes / 2**20:.0f} MiB ({nbytes} bytes) on node "
                f"{node[:8]} ({servers} server{'s' * (servers != 1)}, each with a mean buffer and an input buffer "
                f"for each of the {group.num_workers} workers, as large as its partitions), but only "
                f"{free[node] / 2**20:.0f} MiB "
                f"({free[node]} bytes) are free there (MemAvailable, capped by the memory cgroup's limit); "
                f"free memory on that node, add nodes (each server then sums fewer partitions), or use "
                f"compression='bf16' (half the bytes)")


def amounts(resources: dict[str, float]) -> str:
    """'2 CPU, 1 GPU'."""
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())

"""Scaling out: how an exchange step's cost grows from 2 to 8 nodes on links of known bandwidth, against Ray Train.

For each `--configs` entry, NODESxWORKERS (default 2x1 4x1 8x1 4x2), a
linked cluster (``benchmarks.linked_cluster``: Ray nodes in network
namespaces, each behind a veth link limited with `tc` to `--link-gbit`
each way; the head, with this driver, runs no worker) and on it:

  probe     a `--probe-mb` MB object moved node -> head and back, per node:
            the rate the links give through Ray's object store;
  floor     one dsgd worker alone (1-worker engine): the step's compute;
  ps        dsgd, strategy="ps", one worker per node slot, defaults otherwise
            (servers beside the workers; with 2 workers a node, its
            servers sum the node's copies before they cross: relays);
  ps-bf16   the same with compression="bf16";
  ps-servers  "ps" with its servers on `--server-nodes` nodes of their own
            (``server_resource``: BytePS's layout; each behind a link of
            the same rate, with 0 CPUs so that no worker of any system
            runs there), one server on each by default;
  ps-sched, ps-servers-sched  "ps" and "ps-servers" with the workers' send
            scheduler under `--send-schedule`'s policy (``DSGD_SEND_SCHEDULE``;
            by default "rounds", one push at a time in the rounds' order, as
            the sends once chained into the step went), beside the engine's
            own ("streams"), to compare;
  ps-servers-paced  "ps-servers" with the scheduler's equal-rate policy at
            `--link-gbit` (every stream paced by the kernel at its share);
  ps-servers-whole  "ps-servers" with servers that sum a partition once
            every push of it is in (``DSGD_SERVER_SUMS=whole``), beside the
            engine's own (summed as the pushes arrive), to compare;
  simple    dsgd, strategy="simple" (the driver averages);
  raytrain  Ray Train's TensorflowTrainer, MultiWorkerMirroredStrategy,
            the same workers all-reducing a gradient of the same variables
            (``benchmarks.peers.RayTrainRun``; its step timed in rank 0);
  floor+compute  the model with real compute (`--compute-rows`), a
            1-worker engine per worker of the config, all stepped at once:
            the compute alone, its workers sharing this machine's cores as
            ps+compute's do;
  ps+compute  "ps" on that model: its step against max(compute,
            exchange), the exchange hidden behind back-propagation or not.

The model is `benchmarks.exchange`'s "resnet101" shape: ResNet-101's 314
variables, loss sum_k reduce_sum(v_k) * x_k, so compute is one read and
write of the weights and the step is the exchange; the "+compute" systems
make the variables a network of 64 x 64 layers that a batch of
`--compute-rows` rows goes through (back-propagation layer by layer, last
variable first), and print ps+compute's step against max(floor+compute, ps): the
step within 1.1 x the larger of compute and exchange means they overlap.
Every node shares this machine's 2 cores, so the compute is measured with
as many workers computing at once (floor+compute). `--scale` shrinks every
variable (1-D, that fraction of its elements) so that 8 nodes stay
link-bound on this 2-core machine. M is one worker's float32 gradient
bytes, B the link rate: "ps" moves M each way per worker with servers of
their own, and each link 2(n-1)/n x M each way with the servers beside the
workers (as here), what a ring all-reduce moves too; "ps-servers" moves M
each way on every worker node's link.

The systems run interleaved (`common.run_rounds`: each takes a step in
turn, the order rotated every round), all alive at once; with `--in-turn`
(configs whose systems do not fit in memory together) one at a time, in
rotating order, `--repeats` times, each built, stepped `--warmup` +
`--turn-steps` times and closed. Per system and config: the median step, the median step
less the floor's, M/B and 2(n-1)/n x M/B, the probe's rate, every
process's CPU seconds per step (from /proc, charged to the system whose
step ran), and, once everything is built, every process's RSS and each
node's shared memory (memfd files, dsgd's buffers) against the plan's.
With `--link-busy`, every link's byte counters are sampled every 20 ms:
per system and link, the fraction of its measured steps' time the link
carried at least 80 % of its rate each way, and its mean load.
Writes benchmarks/results/scaling/scaling.json and scaling.png. Needs root
and iproute2 (`ip`, `tc`). From the repository root:

    .venv/bin/python benchmarks/scaling.py --link-gbit 0.1 --scale 0.2 --in-turn 8x1 4x2
    .venv/bin/python -m benchmarks.scaling --configs 2x1 --scale 0.05 --warmup 1 --steps 2   # a smoke run
    .venv/bin/python -m benchmarks.scaling --configs 4x1 --server-nodes 4 --systems floor ps ps-servers raytrain
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/scaling.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

import dsgd
from dsgd.config import SEND_SCHEDULE_ENV, SERVER_SUMS_ENV
from benchmarks import common, exchange, peers, processes
from benchmarks.flows import FlowMonitor, print_flows
from benchmarks.linked_cluster import (SERVER_RESOURCE, LinkedCluster, linked_cluster, measure_link,
                                       missing_requirements, worker_node_ids)

# The systems that run the engine otherwise than at its defaults, to compare with it: not on the curve.
COMPARISONS = ("-sched", "-paced", "-whole")
SYSTEMS = ("floor", "ps", "ps-bf16", "ps-servers", "ps-sched", "ps-servers-sched", "ps-servers-paced",
           "ps-servers-whole", "simple",
           "raytrain", "floor+compute", "ps+compute")
COMPUTE = "+compute"  # the suffix of the systems on the model with real compute
RESULTS = common.RESULTS_DIR / "scaling"
TARGETS = {"ps/(M/B)": 1.3, "ps 8 nodes / 2 nodes": 1.15, "ps-bf16/ps": 0.6, "raytrain/ps at 8 nodes": 1.3,
           "ps-servers/(M/B)": 1.3, "ps+compute/max(compute, exchange)": 1.1}


@dataclasses.dataclass(frozen=True)
class Config:
    """A cluster: ``nodes`` worker nodes, ``per_node`` workers of each system on each."""

    nodes: int
    per_node: int

    @property
    def workers(self) -> int:
        return self.nodes * self.per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.per_node}"


def config(text: str) -> Config:
    """"4x2" -> 4 nodes, 2 workers a node (argparse's type)."""
    try:
        nodes, per_node = (int(n) for n in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a config is NODESxWORKERS, like 4x2; got {text!r}") from None
    if nodes < 2 or per_node < 1:
        raise argparse.ArgumentTypeError(f"a config needs at least 2 nodes and 1 worker a node; got {text!r}")
    return Config(nodes, per_node)


class System(Protocol):
    name: str

    def step(self) -> float:
        """One step; its seconds."""

    def roles(self) -> dict[int, str]:
        """Its processes it can name: pid -> role."""

    def close(self) -> None: ...


class DsgdSystem:
    """A dsgd engine on the exchange model; a step is ``step(fetch_stats=True)``, timed in the driver."""

    def __init__(self, name: str, variables: list[tuple[str, list[int]]], workers: int, compute_rows: int = 0,
                 **engine_kwargs: Any):
        self.name = name
        creator = functools.partial(exchange.ExchangeModel, shapes=variables, compute_rows=compute_rows)
        self.sgd = dsgd.DistributedSGD(creator, num_workers=workers, **engine_kwargs)
        self.step = common.timed(functools.partial(self.sgd.step, fetch_stats=True))

    def roles(self) -> dict[int, str]:
        return {i.pid: f"{self.name} {i}" for i in common.identities(self.sgd)}

    def details(self) -> dict[str, Any]:
        """Where its actors run and, with servers, their plan: link bytes per step, buffer bytes per node."""
        found = {"actors_per_node": common.actors_per_node(self.sgd)}
        group = self.sgd._cluster.servers
        if group:
            worker_nodes = self.sgd._cluster.worker_nodes
            found.update(servers=len(group.nodes), partitions=len(group.layout), relayed=len(group.relays),
                         link_bytes={n[:8]: way for n, way in group.node_link_bytes(worker_nodes).items()},
                         buffer_bytes={n[:8]: b for n, b in group.node_buffer_bytes().items()})
        return found

    def write_timeline(self, path: Path) -> None:
        """One more step, traced: a Chrome trace of every worker's and server's events on one clock."""
        self.sgd.step(write_timeline=str(path))

    def close(self) -> None:
        self.sgd.shutdown()


class ComputeFloor:
    """The compute alone, under the CPU sharing ps+compute's workers see: one 1-worker engine (no exchange) on
    the model with compute per worker of the config, all stepped at once (their workers share this machine's
    cores as the config's do, whichever nodes they are on); a step's time is the slowest's."""

    def __init__(self, name: str, variables: list[tuple[str, list[int]]], workers: int, compute_rows: int):
        self.name = name
        self.floors = [DsgdSystem(f"{name} {i}", variables, 1, compute_rows) for i in range(workers)]
        self._pool = ThreadPoolExecutor(workers)

    def step(self) -> float:
        return max(self._pool.map(lambda floor: floor.step(), self.floors))

    def roles(self) -> dict[int, str]:
        return {pid: role for floor in self.floors for pid, role in floor.roles().items()}

    def details(self) -> dict[str, Any]:
        return {"engines": len(self.floors), "timed": "the slowest of the engines' steps, taken at once"}

    def close(self) -> None:
        self._pool.shutdown()
        for floor in self.floors:
            floor.close()


def all_reduce_loop(variables: list[tuple[str, list[int]]]) -> Callable[[dict[str, Any]], None]:
    """Ray Train's loop: the exchange model's variables under MultiWorkerMirroredStrategy, their gradients
    all-reduced by its v1 optimizer, a step each time ``peers.Turnstile`` opens a turn."""

    def loop(config: dict[str, Any]) -> None:
        from ray import train

        peers.prepare_ray_train_worker(config)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            weights = [tf.Variable(tf.zeros(shape), name=name.split(":")[0]) for name, shape in variables]
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(exchange.LEARNING_RATE)

        def replica_step() -> tf.Tensor:
            scales = tf.unstack(tf.random.uniform([len(weights)], 0.5, 1.5))
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v) * scale for v, scale in zip(weights, scales)])
                scaled_loss = loss / strategy.num_replicas_in_sync  # v1 optimizers sum the replicas'
            optimizer.apply_gradients(zip(tape.gradient(scaled_loss, weights), weights))
            return loss

        peers.take_turns(config["turnstile"], train.get_context().get_world_rank(),
                         peers.timed_step(strategy, replica_step))

    return loop


class RayTrainSystem:
    """Ray Train's all-reduce of the exchange model's gradients (``peers.RayTrainRun``), one worker per slot."""

    name = "raytrain"

    def __init__(self, variables: list[tuple[str, list[int]]], workers: int):
        cfg = common.BenchConfig(num_workers=workers, cpus_per_worker=1)
        self.run = peers.RayTrainRun(cfg, spread=True, train_loop=all_reduce_loop(variables))
        self.step = self.run.step

    def roles(self) -> dict[int, str]:
        return {}  # its workers are named by their process titles ("ray::RayTrainWorker")

    def details(self) -> dict[str, Any]:
        return {"timed": "rank 0's tf.function step, inside the worker"}

    def close(self) -> None:
        self.run.close()


def build(name: str, variables: list[tuple[str, list[int]]], cfg: Config, grad_shard_bytes: int | None,
          send_schedule: str = "rounds", link_gbit: float = 0.0, compute_rows: int = 0) -> System:
    """System ``name`` (one of SYSTEMS) on the cluster, built and ready to step; ``grad_shard_bytes`` for the
    "ps" systems (None: dsgd's default partitions), ``send_schedule`` for the "-sched" ones, ``link_gbit`` for
    the "-paced" one, ``compute_rows`` for the "+compute" ones."""
    start = time.perf_counter()
    if name == "raytrain":
        system = RayTrainSystem(variables, cfg.workers)
    elif name == "floor":
        system = DsgdSystem(name, variables, 1)
    elif name == "floor" + COMPUTE:
        system = ComputeFloor(name, variables, cfg.workers, compute_rows)
    elif name == "ps" + COMPUTE:
        system = DsgdSystem(name, variables, cfg.workers, compute_rows, strategy="ps",
                            grad_shard_bytes=grad_shard_bytes)
    elif name == "simple":
        system = DsgdSystem(name, variables, cfg.workers, strategy="simple")
    else:
        extra = {"ps-bf16": {"compression": "bf16"}, "ps-servers": {"server_resource": SERVER_RESOURCE}}
        base, environment = name, {}
        if name.endswith("-paced"):
            base, environment = name.removesuffix("-paced"), {SEND_SCHEDULE_ENV: f"equal-rate:{link_gbit:g}"}
        elif name.endswith("-sched"):
            base, environment = name.removesuffix("-sched"), {SEND_SCHEDULE_ENV: send_schedule}
        elif name.endswith("-whole"):
            base, environment = name.removesuffix("-whole"), {SERVER_SUMS_ENV: "whole"}
        with common.environment(**environment):
            system = DsgdSystem(name, variables, cfg.workers, strategy="ps", grad_shard_bytes=grad_shard_bytes,
                                **extra.get(base, {}))
    print(f"  {name}: built in {time.perf_counter() - start:.1f} s", flush=True)
    return system


def node_name(cluster: LinkedCluster, node: int) -> str:
    """"node 3", or "server node 5" for a parameter servers' own node."""
    return f"{'server ' * cluster.is_server_node(node)}node {node}"


class Processes:
    """The cluster's processes (and this driver), each named by node and role, their CPU charged per system."""

    def __init__(self, cluster: LinkedCluster):
        self.cluster = cluster
        namespaces = {os.stat(f"/run/netns/{cluster.namespace(k)}").st_ino: node_name(cluster, k)
                      for k in cluster.linked}
        self.node_of = lambda pid: namespaces.get(processes.network_namespace(pid), "head")
        self.names: dict[int, tuple[str, str]] = {}
        self.cpu: dict[str, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)

    def refresh(self, systems: list[System]) -> None:
        """List the processes again (after systems were built or closed), naming each: a system's own role, or
        its process title (Ray's "ray::ClassName", "raylet", ...)."""
        roles = {pid: role for system in systems for pid, role in system.roles().items()}
        pids = [*self.cluster.leftover_pids(), os.getpid()]
        self.names = {}
        for pid in pids:
            title = "driver" if pid == os.getpid() else processes.title(pid)
            words = [word.rsplit("/", 1)[-1] for word in title.split()[:2]] or ["?"]
            if words[0].startswith("python") and len(words) > 1:  # a Ray agent: its script's name
                words = words[1:]
            role = roles.get(pid) or ("raytrain worker" if "RayTrainWorker" in title else words[0])
            self.names[pid] = (self.node_of(pid), role)

    def charged(self, system: str, step: Callable[[], float]) -> Callable[[], float]:
        """``step`` with every process's CPU seconds during it charged to ``system``."""
        def run() -> float:
            before = processes.cpu_seconds(self.names)
            seconds = step()
            after = processes.cpu_seconds(self.names)
            for pid, spent in after.items():
                self.cpu[system][self.names[pid]] += spent - before.get(pid, spent)
            self.steps[system] += 1
            return seconds
        return run

    def cpu_per_step(self, system: str) -> dict[str, float]:
        """"node k: role" -> CPU seconds per step of ``system`` (the processes that spent any), busiest first."""
        steps = max(1, self.steps[system])
        spent = {f"{node}: {role}": s / steps for (node, role), s in self.cpu[system].items() if s > 0}
        return dict(sorted(spent.items(), key=lambda item: -item[1]))

    def memory(self) -> dict[str, Any]:
        """Every process's RSS; per node, the memfd bytes its processes hold (dsgd's shared buffers); the
        machine's /dev/shm use (Ray's object stores) and Shmem."""
        by_node: dict[str, list[int]] = defaultdict(list)
        for pid, (node, _) in self.names.items():
            by_node[node].append(pid)
        return {"rss_bytes": {f"{node}: {role} (pid {pid})": processes.rss_bytes(pid)
                              for pid, (node, role) in sorted(self.names.items())},
                "memfd_bytes_per_node": {node: processes.memfd_bytes(pids) for node, pids in sorted(by_node.items())},
                "dev_shm_used_bytes": shutil.disk_usage("/dev/shm").used,
                "shmem_bytes": processes.meminfo_bytes("Shmem"),
                "mem_available_bytes": processes.meminfo_bytes("MemAvailable")}


class LinkMonitor:
    """Every link's byte counters sampled every ``SAMPLE_S`` in a thread while the systems run; each system's
    measured steps timed, for how busy each link was during them (``busy``)."""

    SAMPLE_S = 0.02
    BUSY = 0.8  # a link is busy in a sample interval that carried at least this fraction of its rate

    def __init__(self, cluster: LinkedCluster):
        self.cluster = cluster
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self.steps: dict[str, list[tuple[float, float]]] = defaultdict(list)  # system -> (start, end) of its steps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="link monitor", daemon=True)

    def __enter__(self) -> LinkMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.SAMPLE_S)

    def _sample(self) -> None:
        while not self._stop.wait(self.SAMPLE_S):
            self.samples.append((time.perf_counter(), self.cluster.link_bytes()))

    def timed(self, system: str, step: Callable[[], float]) -> Callable[[], float]:
        """``step``, its start and end kept as one of ``system``'s measured steps."""
        def run() -> float:
            start = time.perf_counter()
            seconds = step()
            self.steps[system].append((start, time.perf_counter()))
            return seconds
        return run

    def busy(self, system: str) -> dict[str, dict[str, float]]:
        """"node k" -> the fraction of ``system``'s measured steps' time its link was busy ("out", "in": carried
        at least ``BUSY`` of its rate) and what it carried on average ("out mean", "in mean", of its rate)."""
        rate = self.cluster.link_gbit * 1e9 / 8 * self.SAMPLE_S  # bytes in a sample interval at the link's rate
        nodes = list(self.cluster.linked)
        busy = np.zeros((len(nodes), 2))
        carried = np.zeros((len(nodes), 2))
        spans = 0
        for (t0, before), (t1, after) in zip(self.samples, self.samples[1:]):
            if any(start <= t0 and t1 <= end for start, end in self.steps[system]):
                moved = (np.array(after) - np.array(before)) * self.SAMPLE_S / (t1 - t0)
                busy += moved >= self.BUSY * rate
                carried += moved / rate
                spans += 1
        spans = max(1, spans)
        return {node_name(self.cluster, node): {"out": float(busy[k, 0] / spans), "in": float(busy[k, 1] / spans),
                                                "out mean": float(carried[k, 0] / spans),
                                                "in mean": float(carried[k, 1] / spans)}
                for k, node in enumerate(nodes)}


USED_LOAD = 0.01  # a link that carried less (of its rate, both ways) in a system's steps is not one it uses


def print_link_busy(record: dict[str, Any]) -> None:
    print(f"\n  links busy (>= {LinkMonitor.BUSY:.0%} of the rate), fraction of the measured steps' time, "
          "per node out/in; mean carried:", flush=True)
    for name, links in record["link_busy"].items():
        used = [v for v in links.values() if v["out mean"] + v["in mean"] >= USED_LOAD] or \
            [{"out mean": 0.0, "in mean": 0.0}]
        print(f"  {name:9s} " + "  ".join(f"{node}: {v['out']:.2f}/{v['in']:.2f}" for node, v in links.items())
              + f"   mean carried (links used) out {np.mean([v['out mean'] for v in used]):.2f}, "
              + f"in {np.mean([v['in mean'] for v in used]):.2f}", flush=True)


def run_config(cfg: Config, args: argparse.Namespace, variables: list[tuple[str, list[int]]],
               m_bytes: int) -> dict[str, Any]:
    """One cluster of ``cfg``: probe its links, run the systems, measure; its record."""
    print(f"\n== {cfg}: {cfg.nodes} nodes, {cfg.per_node} worker(s) each, links {args.link_gbit:g} Gbit/s", flush=True)
    record: dict[str, Any] = {"config": str(cfg), "nodes": cfg.nodes, "workers": cfg.workers,
                              "server_nodes": args.server_nodes,
                              "mode": "in turn" if cfg in args.in_turn else "interleaved", "details": {}, "memory": []}
    with linked_cluster(cfg.nodes, args.link_gbit, cpus_per_node=cfg.per_node * len(args.systems), head_cpus=0,
                        object_store_memory=args.object_store_memory, dashboard="raytrain" in args.systems,
                        server_nodes=args.server_nodes) as cluster, \
            common.environment(**{peers.ALLOCATOR_ENV: peers.ALLOCATORS["bfc"]}):
        rates = []
        for ip, node_id in sorted(worker_node_ids().items()):
            rates += measure_link(node_id, int(args.probe_mb * 1e6)).values()
        record["probe_gbit"] = {"min": min(rates), "max": max(rates)}
        print(f"  probe: {min(rates):.3f} - {max(rates):.3f} Gbit/s each way", flush=True)
        watch = Processes(cluster)
        names = {cluster.node_ip(node): node_name(cluster, node) for node in cluster.linked}
        with LinkMonitor(cluster) if args.link_busy else contextlib.nullcontext() as links, \
                FlowMonitor(cluster, {cluster.head_ip: "head", **names}) if args.flows else \
                contextlib.nullcontext() as flows:
            measured = (lambda name, step: links.timed(name, watch.charged(name, step))) if links else watch.charged
            if cfg in args.in_turn:
                times = run_in_turn(cfg, args, variables, watch, measured, record)
            else:
                times = run_together(cfg, args, variables, watch, measured, record)
        if links:
            record["link_busy"] = {name: links.busy(name) for name in times}
        if flows:
            record["flows"] = {name: flows.per_step(links.steps[name]) for name in times}
    record["step_s"] = times
    record["median_ms"] = {name: statistics.median(t) * 1000 if t else None for name, t in times.items()}
    record["cpu_s_per_step"] = {name: watch.cpu_per_step(name) for name in times}
    m_over_b = m_bytes * 8 / (args.link_gbit * 1e9) * 1000
    record.update(m_over_b_ms=m_over_b, ring_ms=2 * (cfg.nodes - 1) / cfg.nodes * m_over_b,
                  exchange_ms=exchange_times(record["median_ms"]), overlap=overlap(record["median_ms"]))
    print_config(record)
    if "link_busy" in record:
        print_link_busy(record)
    for name, rows in record.get("flows", {}).items():
        print_flows(name, rows)
    return record


def exchange_times(median_ms: dict[str, float | None]) -> dict[str, float | None]:
    """Per system but the floors: its median step less its model's floor (the "+compute" systems' is
    floor+compute): the exchange time a step does not hide."""
    times = {}
    for name, ms in median_ms.items():
        if name.startswith("floor"):
            continue
        floor = median_ms.get("floor" + COMPUTE if name.endswith(COMPUTE) else "floor")
        times[name] = ms - floor if ms is not None and floor is not None else None
    return times


def overlap(median_ms: dict[str, float | None]) -> dict[str, float] | None:
    """ps+compute's step against its compute alone (floor+compute) and the exchange alone ("ps", whose compute
    is one read of the weights): ``ratio`` = step / max(compute, exchange), 1.0 if they overlap fully, up to
    (compute + exchange) / max if not at all. None without the three systems."""
    step, compute, exchange_ms = (median_ms.get(n) for n in ("ps" + COMPUTE, "floor" + COMPUTE, "ps"))
    if step is None or compute is None or exchange_ms is None:
        return None
    return {"step_ms": step, "compute_ms": compute, "exchange_ms": exchange_ms,
            "ratio": step / max(compute, exchange_ms), "serial": (compute + exchange_ms) / max(compute, exchange_ms)}


Measured = Callable[[str, Callable[[], float]], Callable[[], float]]  # (system, step) -> the step, measured


def run_together(cfg: Config, args: argparse.Namespace, variables: list[tuple[str, list[int]]], watch: Processes,
                 measured: Measured, record: dict[str, Any]) -> dict[str, list[float]]:
    """Every system built and alive at once, then interleaved rounds; each system's measured step times."""
    systems: list[System] = []
    try:
        for name in args.systems:
            systems.append(build(name, variables, cfg, args.grad_shard_bytes, args.send_schedule,
                                 args.link_gbit, args.compute_rows))
        watch.refresh(systems)
        record["details"] = {s.name: s.details() for s in systems}
        record["memory"].append({"alive": [s.name for s in systems], **watch.memory()})
        _, warm_order, interrupted = common.run_rounds({s.name: s.step for s in systems}, args.warmup, args.warmup,
                                                       settle_s=args.settle_s)
        times, order, record["interrupted"] = ({s.name: [] for s in systems}, [], True) if interrupted else \
            common.run_rounds({s.name: measured(s.name, s.step) for s in systems}, args.steps,
                              settle_s=args.settle_s)
        record["order"] = warm_order + order
        if args.timeline and not interrupted:
            write_timelines(systems, args.timeline, cfg)
    finally:
        for system in systems:
            system.close()
    return times


def write_timelines(systems: list[System], directory: Path, cfg: Config) -> None:
    """A traced step of every dsgd system but the floor, after the measured ones: ``directory/<config>-<system>.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    for system in systems:
        if isinstance(system, DsgdSystem) and system.name != "floor":
            path = directory / f"{cfg}-{system.name}.json"
            system.write_timeline(path)
            print(f"  {system.name}: a traced step written to {path}", flush=True)


def run_in_turn(cfg: Config, args: argparse.Namespace, variables: list[tuple[str, list[int]]], watch: Processes,
                measured: Measured, record: dict[str, Any]) -> dict[str, list[float]]:
    """One system alive at a time, in rotating order, ``args.repeats`` times: built, stepped ``args.warmup`` +
    ``args.turn_steps`` times, closed."""
    times: dict[str, list[float]] = {name: [] for name in args.systems}
    record["order"] = []
    for repeat in range(args.repeats):
        for name in common.rotated(args.systems, repeat):
            system = build(name, variables, cfg, args.grad_shard_bytes, args.send_schedule, args.link_gbit,
                           args.compute_rows)
            try:
                watch.refresh([system])
                record["details"].setdefault(name, system.details())
                record["memory"].append({"alive": [name], **watch.memory()})
                step = measured(name, system.step)
                for k in range(args.warmup + args.turn_steps):
                    time.sleep(args.settle_s)
                    seconds = system.step() if k < args.warmup else step()
                    print(f"[{name} {repeat + 1}/{args.repeats} {'warm-up' if k < args.warmup else 'measure'}] "
                          f"{seconds * 1000:8.1f} ms", flush=True)
                    if k >= args.warmup:
                        times[name].append(seconds)
                record["order"].append(name)
            finally:
                system.close()
    return times


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def config_rows(record: dict[str, Any]) -> list[str]:
    """Markdown rows of one config: per system, the medians, against M/B and the ring's bytes, and CPU."""
    rows = []
    m_over_b, ring = record["m_over_b_ms"], record["ring_ms"]
    for name, ms in record["median_ms"].items():
        exchange_ms = record["exchange_ms"].get(name)
        cpu = record["cpu_s_per_step"][name]
        busiest = ", ".join(f"{who} {s:.2f}" for who, s in list(cpu.items())[:3])
        rows.append(f"| {record['config']} | {name} | {_ms(ms)} | {_ms(exchange_ms)} | {m_over_b:.0f} | {ring:.0f} | "
                    + ("–" if exchange_ms is None else f"{exchange_ms / m_over_b:.2f}") + " | "
                    + f"{record['probe_gbit']['min']:.3f} | {sum(cpu.values()):.2f} | {busiest} |")
    return rows


TABLE_HEAD = ["| nodes x workers | system | median step ms | less floor ms | M/B ms | 2(n-1)/n x M/B ms | "
              "(step − floor)/(M/B) | probe Gbit/s (min) | CPU s/step, all | busiest processes, CPU s/step |",
              "|---|---|---|---|---|---|---|---|---|---|"]


def print_config(record: dict[str, Any]) -> None:
    print("\n" + "\n".join(TABLE_HEAD + config_rows(record)), flush=True)
    found = record.get("overlap")
    if found:
        print(f"\noverlap: ps+compute {found['step_ms']:.0f} ms against compute {found['compute_ms']:.0f} ms "
              f"(floor+compute) and exchange {found['exchange_ms']:.0f} ms (ps): {found['ratio']:.2f} x the larger "
              f"(1.00 if they overlap fully, {found['serial']:.2f} if not at all)", flush=True)


def verdicts(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each target's measured value(s) and whether it is met (None where the run lacks the systems)."""
    single = {r["nodes"]: r for r in records if r["workers"] == r["nodes"]}
    found: dict[str, Any] = {}

    def over_mb(r: dict[str, Any], system: str = "ps") -> float | None:
        ms = r["exchange_ms"].get(system)
        return None if ms is None else ms / r["m_over_b_ms"]

    found["ps/(M/B)"] = {r["config"]: over_mb(r) for r in records}
    found["ps-servers/(M/B)"] = {r["config"]: over_mb(r, "ps-servers") for r in records}
    if 2 in single and 8 in single and single[2]["exchange_ms"].get("ps") and single[8]["exchange_ms"].get("ps"):
        found["ps 8 nodes / 2 nodes"] = single[8]["exchange_ms"]["ps"] / single[2]["exchange_ms"]["ps"]
    found["ps-bf16/ps"] = {r["config"]: r["exchange_ms"]["ps-bf16"] / r["exchange_ms"]["ps"] for r in records
                           if r["exchange_ms"].get("ps-bf16") and r["exchange_ms"].get("ps")}
    if 8 in single and single[8]["median_ms"].get("raytrain") and single[8]["median_ms"].get("ps"):
        found["raytrain/ps at 8 nodes"] = single[8]["median_ms"]["raytrain"] / single[8]["median_ms"]["ps"]
    found["ps+compute/max(compute, exchange)"] = {r["config"]: r["overlap"]["ratio"] for r in records
                                                  if r.get("overlap")}
    return found


def verdict_lines(found: dict[str, Any]) -> list[str]:
    lines = []
    for name, target in TARGETS.items():
        value = found.get(name)
        values = value.values() if isinstance(value, dict) else [value]
        measured = [v for v in values if v is not None]
        if not measured:
            lines.append(f"{name}: not measured")
            continue
        met = all(v >= target for v in measured) if name.startswith("raytrain") else all(v <= target for v in measured)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in value.items() if v is not None) if isinstance(value, dict) \
            else f"{value:.2f}"
        lines.append(f"{name}: {shown} ({'meets' if met else 'misses'} {'>=' if name.startswith('raytrain') else '<='} "
                     f"{target})")
    return lines


PLOT_SIZE_IN, PLOT_DPI = (6, 4), 120


def scaling_figure(records: list[dict[str, Any]]):
    """A matplotlib Figure: exchange time per step (median step less the floor's) over node count, a line per
    system (one worker a node), 2 workers a node as hollow markers, and the lines M/B and 2(n-1)/n x M/B."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE_IN)
    ax = fig.add_subplot()
    single = sorted((r for r in records if r["workers"] == r["nodes"]), key=lambda r: r["nodes"])
    nodes = [r["nodes"] for r in single]
    systems = [s for s in SYSTEMS if not s.startswith("floor") and not s.endswith((COMPUTE, *COMPARISONS))
               and any(r["exchange_ms"].get(s) is not None for r in records)]
    colors = dict(zip(systems, ("tab:blue", "tab:cyan", "tab:green", "tab:orange", "tab:red")))
    for name in systems:
        points = [(r["nodes"], r["exchange_ms"][name] / 1000) for r in single if r["exchange_ms"].get(name)]
        if points:
            ax.plot(*zip(*points), marker="o", color=colors[name], label=name)
        for r in records:
            if r["workers"] > r["nodes"] and r["exchange_ms"].get(name):
                ax.plot([r["nodes"]], [r["exchange_ms"][name] / 1000], marker="s", markerfacecolor="none",
                        linestyle="none", color=colors[name],
                        label=f"{name}, {r['per_node']} workers a node")
    if single:
        ax.plot(nodes, [r["m_over_b_ms"] / 1000 for r in single], linestyle="--", color="black", label="M/B")
        ax.plot(nodes, [r["ring_ms"] / 1000 for r in single], linestyle=":", color="black", label="2(n-1)/n x M/B")
    ax.set_xticks(nodes)
    ax.set_xlabel("nodes (one worker each)")
    ax.set_ylabel("exchange time per step, s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    if records:
        ax.set_title(f"ResNet-101's gradient x {records[0]['scale']:g} ({records[0]['m_bytes'] / 1e6:.0f} MB), "
                     f"links {records[0]['link_gbit']:g} Gbit/s", fontsize=9)
    fig.tight_layout()
    return fig


def summary(command: str, args: argparse.Namespace, variables: list, m_bytes: int,
            records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's record: its configs' records, the table of them all, the targets met or missed."""
    found = verdicts(records)
    return {"command": command, "link_gbit": args.link_gbit, "scale": args.scale, "m_bytes": m_bytes,
            "grad_shard_bytes": args.grad_shard_bytes,
            "tensors": len(variables), "repeats_in_turn": args.repeats, "configs": records,
            "table": "\n".join(TABLE_HEAD + [row for r in records for row in config_rows(r)]),
            "targets": TARGETS, "measured": found, "verdicts": verdict_lines(found), **common.machine()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=config, nargs="+", default=[config(c) for c in ("2x1", "4x1", "8x1", "4x2")],
                   help="NODESxWORKERS: nodes, and workers of each system on each node")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--link-gbit", type=float, default=0.25, help="every link's rate each way")
    p.add_argument("--scale", type=float, default=0.25, help="the resnet101 shape's size fraction")
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds (steps per turn with --in-turn)")
    p.add_argument("--steps", type=int, default=5, help="measured rounds")
    p.add_argument("--in-turn", type=config, nargs="*", default=[],
                   help="configs whose systems run one alive at a time, in rotating order (they do not fit in "
                        "memory together)")
    p.add_argument("--repeats", type=int, default=2, help="with --in-turn: turns of every system")
    p.add_argument("--turn-steps", type=int, default=3, help="with --in-turn: measured steps per turn")
    p.add_argument("--settle-s", type=float, default=0.1, help="pause before every step")
    p.add_argument("--server-nodes", type=int, default=0,
                   help="nodes of the parameter servers' own, after the worker nodes, for ps-servers")
    p.add_argument("--grad-shard-bytes", type=int, default=None,
                   help="the \"ps\" systems' partition bytes (default: dsgd's; across nodes about 16 a server, at "
                        "least 1 MiB)")
    p.add_argument("--compute-rows", type=int, default=1536,
                   help="the \"+compute\" systems' batch rows through the variables' layers "
                        "(benchmarks.exchange.ExchangeModel)")
    p.add_argument("--probe-mb", type=float, default=16.0)
    p.add_argument("--object-store-memory", type=int, default=1 << 30, help="bytes per node")
    p.add_argument("--link-busy", action="store_true",
                   help=f"sample every link's byte counters every {LinkMonitor.SAMPLE_S * 1000:.0f} ms; record per "
                        "system how busy each link was during its measured steps")
    p.add_argument("--send-schedule", default="rounds",
                   help="the send scheduler's policy of the -sched systems (the others run the engine's own, streams): "
                        "rounds, streams, equal-rate:<Gbit/s>")
    p.add_argument("--flows", action="store_true",
                   help="(with --link-busy's timing) sample every TCP flow's delivered bytes in every node's namespace "
                        "(`ss -tin`, benchmarks.flows); print per system when each flow of a step started and "
                        "finished, and its rate")
    p.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeline", type=Path, default=None, metavar="DIR",
                   help="after the measured rounds (interleaved configs), one traced step of each dsgd system, "
                        "a Chrome trace per system in DIR")
    p.add_argument("--plot-from", type=Path, nargs="+", default=[],
                   help="run nothing: plot the configs of these records (a later record's system replaces the "
                        "same config's system of an earlier one) into --out's .png")
    args = p.parse_args(argv)
    if args.plot_from:
        return args
    args.link_busy = args.link_busy or args.flows  # the flows are cut into the link monitor's timed steps
    if "floor" not in args.systems:
        p.error("--systems needs floor: the exchange time is a step less the floor's")
    if "ps" + COMPUTE in args.systems and not {"floor" + COMPUTE, "ps"} <= set(args.systems):
        p.error("ps+compute is measured against floor+compute (the compute) and ps (the exchange): give all three")
    if any(s.startswith("ps-servers") for s in args.systems) != (args.server_nodes > 0):
        p.error("ps-servers runs its parameter servers on nodes of their own: give --systems ps-servers and "
                "--server-nodes K (K >= 1) together")
    return args


def plot_records(paths: list[Path], png: Path) -> dict[str, dict[str, str]]:
    """``scaling_figure`` of several runs' records: each system of each config (nodes x workers) from the last
    record that measured it; every record must share the link rate and scale. Returns, per config, which record
    gave each system."""
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    sources: dict[tuple[int, int], dict[str, str]] = {}
    for path in paths:
        for record in json.loads(path.read_text())["configs"]:
            key = record["nodes"], record["workers"]
            earlier = merged.get(key, {"exchange_ms": {}})
            merged[key] = {**record, "exchange_ms": {**earlier["exchange_ms"], **record["exchange_ms"]}}
            sources.setdefault(key, {}).update(dict.fromkeys(record["exchange_ms"], str(path)))
    records = [merged[key] for key in sorted(merged)]
    if len({(r["link_gbit"], r["scale"]) for r in records}) > 1:
        sys.exit("benchmarks.scaling --plot-from: the records differ in link rate or scale; plot them apart")
    scaling_figure(records).savefig(png, dpi=PLOT_DPI, format="png")
    named = {f"{nodes}x{workers // nodes}": sources[nodes, workers] for nodes, workers in sorted(merged)}
    print(f"plot written to {png} from " + "; ".join(
        f"{config}: " + ", ".join(f"{system} {path}" for system, path in systems.items())
        for config, systems in named.items()))
    return named


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.plot_from:
        return plot_records(args.plot_from, args.out.with_suffix(".png"))
    reason = missing_requirements()
    if reason:
        sys.exit(f"benchmarks.scaling: {reason}; nothing was started.")
    command = common.command_line("benchmarks.scaling", argv)
    print(f"command: {command}", flush=True)
    variables = exchange.variable_shapes("resnet101", args.scale)
    m_bytes = sum(int(np.prod(dims)) for _, dims in variables) * 4
    print(f"resnet101 x {args.scale:g}: {len(variables)} tensors, M = {m_bytes / 1e6:.1f} MB; "
          f"M/B at {args.link_gbit:g} Gbit/s = {m_bytes * 8 / (args.link_gbit * 1e9) * 1000:.0f} ms", flush=True)
    records: list[dict[str, Any]] = []
    for cfg in args.configs:
        record = run_config(cfg, args, variables, m_bytes)
        record.update(per_node=cfg.per_node, scale=args.scale, m_bytes=m_bytes, link_gbit=args.link_gbit)
        records.append(record)
        result = summary(command, args, variables, m_bytes, records)  # written after every config
        common.write_json(result, args.out)
        if record.get("interrupted"):
            break
    modes = "; ".join(f"{r['config']}: {r['mode']}" for r in records)
    print(f"\n{command}\n({modes}; 'in turn': one system alive at a time, in rotating order, "
          f"{args.repeats} turns)\n\n{result['table']}\n\n" + "\n".join(result["verdicts"]))
    print(f"record written to {args.out}")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        scaling_figure(records).savefig(png, dpi=PLOT_DPI, format="png")
        print(f"plot written to {png}")
    return result


if __name__ == "__main__":
    main()

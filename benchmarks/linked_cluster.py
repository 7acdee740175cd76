"""A Ray cluster of several nodes on this machine, joined by links of a chosen bandwidth.

The head node runs in this process's network namespace; every other node's
Ray processes run in a network namespace of their own, joined to the head
by a veth pair: the head's ends hang on a bridge (a switch), every address
is link-local (169.254.77.0/24). Each veth end's egress is limited with
`tc` (token bucket), so a node's link carries at most the chosen rate each
way, like a full-duplex NIC on a switch; traffic between two worker nodes
crosses both of their links. Nothing else is touched: traffic stays on
those veths and loopback.

With ``server_nodes=K`` (`--server-nodes`), K more nodes follow the worker
nodes, each in its own namespace behind a link of the same rate, started
with 0 CPUs and the custom resource ``SERVER_RESOURCE``: dsgd's parameter
servers run there with ``server_resource`` (they reserve no CPU), and no
worker of any system can (each needs a CPU).

With ``tls=True`` (`--tls`) Ray encrypts its traffic, and dsgd's streams
theirs: ``with_tls`` makes a CA and a certificate naming every node's
address (``benchmarks.tls_files``) and runs the script again with Ray's TLS
environment (Ray reads it once, when imported), which every node inherits.

Needs root and iproute2's `ip` and `tc` (``missing_requirements`` names
what is absent). Everything is torn down on leaving the context, on an
error, Ctrl-C or SIGTERM included: the Ray processes (found by the
cluster's private temp dir), the namespaces, the veths, the bridge.

    with linked_cluster(nodes=2, link_gbit=1.0, cpus_per_node=3) as cluster:
        ...  # this process is connected to it (ray.init)
        cluster.set_link_gbit(10.0)

Run as a script it starts a cluster, measures each link both ways with an
object of `--probe-mb` MB, prints the rates and tears it down:

    .venv/bin/python benchmarks/linked_cluster.py --nodes 2 --link-gbit 1 [--tls]
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/linked_cluster.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

from benchmarks import common, tls_files
from dsgd.transport import tls as ray_tls

PREFIX = "dsgd-ln"  # names of every namespace, veth and bridge made here (<= 15 characters each)
BRIDGE = f"{PREFIX}-br"
SUBNET = "169.254.77"  # link-local /24: .1 the head, .2 and up the other nodes
START_TIMEOUT_S = 60.0
SERVER_RESOURCE = "dsgd_server"  # the custom resource of the server nodes (dsgd's ``server_resource``)
TLS_DIR_PREFIX = "dsgd-ln-tls-"  # the temp dir of the CA ``with_tls`` makes, deleted with the cluster


def auth_mode() -> dict[str, str]:
    """One token-authentication setting for every process of the cluster, this one included.

    Ray turns token authentication on for `ray start` when a token file exists
    (~/.ray/auth_token), while a driver given an explicit address sends the
    token only in token mode. A process whose environment already says
    "token" (a process that ran `ray.init` with a token file, and its
    children) read it when it imported Ray: keep it. Otherwise "disabled":
    the cluster is reachable only on its own link-local bridge.
    """
    return {"RAY_AUTH_MODE": "token" if os.environ.get("RAY_AUTH_MODE") == "token" else "disabled"}


def missing_requirements() -> str | None:
    """Why this machine cannot make a linked cluster (not root, no `ip`/`tc`), or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"it needs iproute2's `{tool}` on PATH"
    return None


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


def _quiet(*argv: str) -> None:
    subprocess.run(argv, capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tbf_args(gbit: float) -> list[str]:
    """`tc` arguments of a token bucket at `gbit` Gbit/s: a burst of 1 ms at that rate, at least 128 KiB
    (one offloaded 64 KiB segment must fit), and at most 50 ms of queue."""
    rate_bytes = gbit * 1e9 / 8
    burst = max(int(rate_bytes / 1000), 128 << 10)
    return ["tbf", "rate", f"{gbit * 1000:.0f}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass
class LinkedCluster:
    """The nodes' names and addresses, and the running Ray processes; made by ``linked_cluster``.

    Nodes 1 to ``nodes`` are worker nodes, the ``server_nodes`` after them
    the parameter servers' own.
    """

    nodes: int
    link_gbit: float
    temp_dir: str
    port: int = field(default_factory=_free_port)
    processes: list[subprocess.Popen] = field(default_factory=list)
    server_nodes: int = 0

    @property
    def linked(self) -> range:
        """Every node behind a link (all but the head): the worker nodes, then the server nodes."""
        return range(1, self.nodes + self.server_nodes + 1)

    def is_server_node(self, node: int) -> bool:
        return node > self.nodes

    @property
    def head_ip(self) -> str:
        return f"{SUBNET}.1"

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def namespace(self, node: int) -> str:
        return f"{PREFIX}{node}"

    def node_ip(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def veths(self, node: int) -> tuple[str, str]:
        """(the head's end, the node's end) of node `node`'s link."""
        return f"{PREFIX}{node}h", f"{PREFIX}{node}n"

    def make_network(self) -> None:
        """The bridge with the head's address, and per node a namespace, a veth pair and both ends' limits."""
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for node in self.linked:
            ns, (head_end, node_end) = self.namespace(node), self.veths(node)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", head_end, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", node_end, "netns", ns)
            _run("ip", "link", "set", head_end, "master", BRIDGE)
            _run("ip", "link", "set", head_end, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_ip(node)}/24", "dev", node_end)
            _run("ip", "-n", ns, "link", "set", node_end, "up")
        self.set_link_gbit(self.link_gbit)

    def set_link_gbit(self, gbit: float) -> None:
        """Every link limited to `gbit` Gbit/s each way (both veth ends' egress)."""
        for node in self.linked:
            head_end, node_end = self.veths(node)
            _run("tc", "qdisc", "replace", "dev", head_end, "root", *tbf_args(gbit))
            _run("ip", "netns", "exec", self.namespace(node),
                 "tc", "qdisc", "replace", "dev", node_end, "root", *tbf_args(gbit))
        self.link_gbit = gbit

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per linked node (1 first, server nodes last): the bytes its link has carried so far (out of the node, into it), from the
        counters of the head's end of its veth (what it receives, what it sends)."""
        def counter(device: str, name: str) -> int:
            return int(Path(f"/sys/class/net/{device}/statistics/{name}").read_text())

        return [(counter(head_end, "rx_bytes"), counter(head_end, "tx_bytes"))
                for head_end, _ in map(self.veths, self.linked)]

    def start_ray(self, head_cpus: int, cpus_per_node: int, object_store_memory: int, dashboard: bool) -> None:
        """`ray start --block` for the head here and for every node in its namespace (a server node with 0 CPUs
        and ``SERVER_RESOURCE``); connect this process."""
        ray_cli = str(Path(sys.executable).with_name("ray"))
        common_args = [f"--object-store-memory={object_store_memory}", "--disable-usage-stats", "--block"]
        head = [ray_cli, "start", "--head", f"--node-ip-address={self.head_ip}", f"--port={self.port}",
                f"--temp-dir={self.temp_dir}", f"--num-cpus={head_cpus}",
                f"--include-dashboard={'true' if dashboard else 'false'}",
                f"--dashboard-port={_free_port()}", *common_args]
        self._spawn(head)
        self._wait_for_head()
        common.start_ray(self.address, node_ip_address=self.head_ip)
        # One at a time: nodes starting together on one machine pick clashing ports.
        for node in self.linked:
            role = ["--num-cpus=0", f"--resources={{\"{SERVER_RESOURCE}\": 1}}"] if self.is_server_node(node) else \
                [f"--num-cpus={cpus_per_node}"]
            self._spawn(["ip", "netns", "exec", self.namespace(node), ray_cli, "start",
                         f"--address={self.address}", f"--node-ip-address={self.node_ip(node)}",
                         *role, *common_args])
            self._wait_for_nodes(node + 1)

    def _wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (alive := sum(n["Alive"] for n in ray.nodes())) < count:
            if self.processes[-1].poll() is not None or time.monotonic() > deadline:
                log = (Path(self.temp_dir) / f"start-{len(self.processes) - 1}.log").read_text()[-2000:]
                raise RuntimeError(f"{alive} of {count} Ray nodes up after {START_TIMEOUT_S:.0f} s; "
                                   f"the last one's start:\n{log}")
            time.sleep(0.5)

    def _spawn(self, argv: list[str]) -> None:
        log = open(Path(self.temp_dir) / f"start-{len(self.processes)}.log", "w")
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, **auth_mode()}))

    def _wait_for_head(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((self.head_ip, self.port)) == 0:
                    return
            if self.processes[0].poll() is not None or time.monotonic() > deadline:
                log = (Path(self.temp_dir) / "start-0.log").read_text()[-2000:]
                raise RuntimeError(f"the Ray head did not start on {self.address}:\n{log}")
            time.sleep(0.5)

    def stop_ray(self) -> None:
        """Disconnect, stop the `ray start` processes, then kill whatever Ray process of this cluster is left."""
        ray.shutdown()
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def leftover_pids(self) -> list[int]:
        """Processes of this cluster still running: in its namespaces, or naming its temp dir or port."""
        pids = set()
        for node in self.linked:
            listed = subprocess.run(["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True)
            pids.update(int(p) for p in listed.stdout.split())
        marks = (self.temp_dir.encode(), f"{self.head_ip}:{self.port}".encode())
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    cmdline = (entry / "cmdline").read_bytes()
                    if any(mark in cmdline for mark in marks):
                        pids.add(int(entry.name))
        return sorted(pids)

    def remove_network(self) -> None:
        """Delete the namespaces (their veth ends, and so the pairs, go with them) and the bridge."""
        remove_network(len(self.linked))


def remove_network(nodes: int) -> None:
    """Delete what ``make_network`` makes for `nodes` nodes, whatever of it exists (a crashed run's too)."""
    for node in range(1, nodes + 1):
        _quiet("ip", "netns", "del", f"{PREFIX}{node}")
        _quiet("ip", "link", "del", f"{PREFIX}{node}h")
    _quiet("ip", "link", "del", BRIDGE)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")


def with_tls(nodes: int, module: str, argv: list[str] | None) -> None:
    """Make sure Ray's TLS is on in this process for a linked cluster of `nodes` nodes: if it is not, run the
    benchmark again in this process's place (its own command line, or `python -m module argv` when `main(argv)` was
    called from Python), its environment turning Ray's TLS on with a CA and a certificate naming every node's
    address, made in a new temp dir (Ray reads its TLS setting once, when it is imported)."""
    if ray_tls.ray_uses_tls():
        return
    addresses = [f"{SUBNET}.{node + 1}" for node in range(nodes + 1)]  # the head's and every node's
    env = tls_files.make(tempfile.mkdtemp(prefix=TLS_DIR_PREFIX), addresses)
    command = sys.orig_argv[1:] if argv is None else ["-m", module, *argv]
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *command], {**os.environ, **env})


@contextlib.contextmanager
def linked_cluster(nodes: int, link_gbit: float, cpus_per_node: int, head_cpus: int = 1,
                   object_store_memory: int = 1 << 30, dashboard: bool = False,
                   tls: bool = False, server_nodes: int = 0) -> Iterator[LinkedCluster]:
    """A running linked cluster of `nodes` worker nodes, `server_nodes` server nodes and a head, this process
    connected to it; with `tls`, Ray's TLS on in every process of it, as it is in this one (``with_tls``).

    Raises RuntimeError naming what is missing when the machine cannot make one.
    """
    reason = missing_requirements()
    if reason:
        raise RuntimeError(f"a linked cluster cannot be made here: {reason}")
    if tls and not ray_tls.ray_uses_tls():
        raise RuntimeError("a linked cluster with TLS needs Ray's TLS on in this process before Ray is imported "
                           "(Ray reads it once): call `with_tls` first")
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    cluster = LinkedCluster(nodes, link_gbit, tempfile.mkdtemp(prefix="dsgd-ln-"), server_nodes=server_nodes)
    remove_network(len(cluster.linked))
    try:
        with common.environment(**auth_mode()):
            cluster.make_network()
            cluster.start_ray(head_cpus, cpus_per_node, object_store_memory, dashboard)
            yield cluster
    finally:
        try:
            cluster.stop_ray()
            cluster.remove_network()
            shutil.rmtree(cluster.temp_dir, ignore_errors=True)
            if tls and Path(os.environ[ray_tls.CA]).parent.name.startswith(TLS_DIR_PREFIX):
                shutil.rmtree(Path(os.environ[ray_tls.CA]).parent, ignore_errors=True)
        finally:
            signal.signal(signal.SIGTERM, previous_sigterm)


@ray.remote(num_cpus=0)
def _payload(nbytes: int) -> np.ndarray:
    return np.ones(nbytes, np.uint8)


@ray.remote(num_cpus=0)
def _receive(payload: np.ndarray) -> int:
    return int(payload.nbytes)


def measure_link(node_id: str, nbytes: int) -> dict[str, float]:
    """Gbit/s of moving `nbytes` from the node to the head and back, through the object store."""
    on_node = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False)
    ref = _payload.options(scheduling_strategy=on_node).remote(nbytes)
    ray.wait([ref], fetch_local=False, timeout=60)
    start = time.perf_counter()
    local = ray.get(ref, timeout=120)
    up_s = time.perf_counter() - start
    mine = ray.put(local)
    start = time.perf_counter()
    ray.get(_receive.options(scheduling_strategy=on_node).remote(mine), timeout=120)
    down_s = time.perf_counter() - start
    return {"node_to_head_gbit": nbytes * 8 / up_s / 1e9, "head_to_node_gbit": nbytes * 8 / down_s / 1e9}


def worker_node_ids() -> dict[str, str]:
    """Node IP -> node id of every live node but the head (the one this process runs on)."""
    here = ray.get_runtime_context().get_node_id()
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes, each in its own namespace")
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[1.0], help="link rates to measure in turn")
    parser.add_argument("--probe-mb", type=float, default=64.0, help="size of the object moved each way")
    parser.add_argument("--server-nodes", type=int, default=0, help="server nodes after the worker nodes (0 CPUs, "
                        f"resource {SERVER_RESOURCE!r})")
    parser.add_argument("--tls", action="store_true", help="Ray's TLS on, with a CA made for the cluster")
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason:
        sys.exit(f"linked_cluster: {reason}; nothing was started.")
    if args.tls:
        with_tls(args.nodes + args.server_nodes, "benchmarks.linked_cluster", argv)
    with linked_cluster(args.nodes, args.link_gbit[0], cpus_per_node=1, tls=args.tls,
                        server_nodes=args.server_nodes) as cluster:
        for gbit in args.link_gbit:
            cluster.set_link_gbit(gbit)
            for ip, node_id in sorted(worker_node_ids().items()):
                rates = measure_link(node_id, int(args.probe_mb * 1e6))
                print(f"link {gbit:g} Gbit/s, node {ip}: node -> head {rates['node_to_head_gbit']:.2f} Gbit/s, "
                      f"head -> node {rates['head_to_node_gbit']:.2f} Gbit/s", flush=True)


if __name__ == "__main__":
    main()

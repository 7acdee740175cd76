"""How many parameter servers, where, and which partitions each sums (no Ray needed)."""

import numpy as np
import pytest

from types import SimpleNamespace

from dsgd.cluster import placement, replacement, room
from dsgd.errors import DSGDError
from dsgd.cluster.server_group import ServerGroup
from dsgd.cluster.server_plan import assign_partitions, home_for, plan_relays, plan_servers, send_rounds
from dsgd.wire.partitions import MIN_PARTITION_BYTES, VarSpec, default_partition_bytes, plan_partitions


def test_default_is_one_server_per_worker_node_plus_one_per_two_spare_cpus():
    # A 2-core laptop with 2 one-CPU workers: no spare CPUs, one server.
    assert plan_servers(["a", "a"], {"a": 2}, 1, None) == ["a"]
    # 8 logical CPUs, 2 workers: 6 spare -> up to 3 more, capped at one server per worker.
    assert plan_servers(["a", "a"], {"a": 8}, 1, None) == ["a", "a"]
    # Two nodes, one worker each: a server beside every worker; nodes without workers get none.
    assert plan_servers(["b", "a"], {"a": 3, "b": 3, "c": 64}, 1, None) == ["a", "b"]
    # A big node with 4 workers and 32 CPUs: 4 servers, never one per partition.
    assert plan_servers(["a"] * 4, {"a": 32}, 1, None) == ["a"] * 4


def test_an_explicit_server_count_is_spread_over_worker_nodes_most_workers_first():
    assert plan_servers(["b", "a", "b"], {"a": 2, "b": 2}, 1, 3) == ["b", "a", "b"]
    assert plan_servers(["a", "a"], {"a": 2}, 1, 1) == ["a"]


def test_with_server_nodes_the_servers_go_there_only_and_by_default_one_per_two_of_their_cpus():
    # Workers on w1, w2 (8 CPUs each, nearly idle): no server goes there.
    cpus = {"w1": 8, "w2": 8, "s1": 4, "s2": 1}
    assert plan_servers(["w1", "w2"], cpus, 1, None, ["s1", "s2"]) == ["s1", "s1", "s2"]
    assert plan_servers(["w1", "w2"], cpus, 1, 3, ["s1", "s2"]) == ["s1", "s2", "s1"]


def test_a_new_server_stays_beside_its_workers_or_leaves_a_lost_node_for_the_least_loaded_worker_node():
    # Server 1's node still runs a worker: the new server 1 goes there.
    assert home_for(["a", "b"], 1, ["a", "b"]) == "b"
    # Node b was lost, its worker replaced on c: the new server 1 goes to c, which has none yet, even if
    # Ray still lists b as alive.
    assert home_for(["a", "b"], 1, ["a", "c"]) == "c"
    assert home_for(["a", "b", "b"], 2, ["a", "a"]) == "a"
    # Servers on nodes of their own (s1, s2, s3; the hosts are those known up): server 2's node s2 was lost, it
    # goes to the server node with the fewest servers, never to a worker node.
    assert home_for(["s1", "s1", "s2", "s3"], 2, ["s1", "s3"]) == "s3"
    assert home_for(["s1", "s1", "s2", "s3"], 0, ["s1", "s3"]) == "s1"  # failed alone: stays on its node


def test_with_server_nodes_new_servers_go_to_the_server_nodes_known_up(monkeypatch):
    cluster = SimpleNamespace(options=SimpleNamespace(server_resource="dsgd_server"),
                              servers=SimpleNamespace(nodes=["s1", "s1", "s2"]))
    marked = {"dsgd_server": 1.0}
    listed = {"w1": {"CPU": 2.0}, "s1": marked, "s2": marked, "s3": marked}
    monkeypatch.setattr(replacement, "live_node_resources", lambda: listed)
    # Server 2 died with s2, which Ray still lists: s1 (a server answered there) and s3 (no server died there).
    assert replacement.server_hosts(cluster, [2]) == ["s1", "s3"]
    # Every server died and no other node has the resource: the nodes Ray still lists (a server may fail alone).
    del listed["s3"]
    assert replacement.server_hosts(cluster, [0, 1, 2]) == ["s1", "s2"]
    listed.clear()
    with pytest.raises(DSGDError, match="no live Ray node with server_resource='dsgd_server' is left"):
        replacement.server_hosts(cluster, [0, 1, 2])
    cluster.options.server_resource = None
    assert replacement.server_hosts(cluster, [2]) is None  # beside the workers


def test_partitions_are_balanced_over_servers_by_bytes_in_backprop_order():
    specs = [VarSpec(f"v{i}", (n,), np.dtype(np.float32)) for i, n in enumerate([100, 100, 100, 100, 300, 100])]
    layout = plan_partitions(specs, 400)  # 3200 bytes -> 8 partitions of about 100 floats
    placement = assign_partitions(layout, 3)
    assert placement[:3] == [0, 1, 2]  # neighbours go to different servers
    loads = [sum(s.nbytes for s, j in zip(layout, placement) if j == k) for k in range(3)]
    assert max(loads) - min(loads) <= max(s.nbytes for s in layout)


def floats(*sizes):
    return [VarSpec(f"v{i}", (n,), np.dtype(np.float32)) for i, n in enumerate(sizes)]


def test_default_partition_size_gives_each_server_a_few_partitions_of_at_least_1_mib():
    many = floats(*[445_000] * 100)  # 178 MB in 1.78 MB variables
    assert default_partition_bytes(many, 1) == 44_500_000
    assert default_partition_bytes(many, 2) == 22_250_000
    assert default_partition_bytes(floats(250), 1) == MIN_PARTITION_BYTES
    # Across nodes, 16 a server: more rounds, so less of the means waits for the last pushes.
    assert default_partition_bytes(many, 2, across_nodes=True) == 5_562_500
    assert default_partition_bytes(floats(250), 2, across_nodes=True) == MIN_PARTITION_BYTES


@pytest.mark.parametrize("across_nodes", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.1, 0.05])
def test_default_partitions_fill_whole_rounds_of_one_per_server(scale, across_nodes):
    # At a tenth of ResNet-101, 8 servers got 17 partitions of at least 1 MiB: a last round of one, pushed by
    # every worker into one node's link at once. Now 16.
    from benchmarks.exchange import variable_shapes

    specs = [VarSpec(name, tuple(shape), np.dtype(np.float32)) for name, shape in variable_shapes("resnet101", scale)]
    for servers in range(1, 9):
        count = len(plan_partitions(specs, default_partition_bytes(specs, servers, across_nodes)))
        assert count % servers == 0 or count < servers, (servers, count)
    expected = {1.0: 128 if across_nodes else 32, 0.1: 16, 0.05: 8}[scale]  # below 1.0, 1 MiB is the least
    assert len(plan_partitions(specs, default_partition_bytes(specs, 8, across_nodes))) == expected


@pytest.mark.parametrize("worker_nodes, per_server", [(["a", "a"], 4), (["a", "b"], 16)])
def test_the_engines_default_partitions_are_finer_when_its_workers_span_nodes(monkeypatch, resnet101, worker_nodes,
                                                                               per_server):
    # ResNet-101's gradients and 2 one-CPU workers, each node of 8 CPUs: 2 servers, beside the workers.
    from dsgd.cluster import server_group
    from dsgd.cluster.topology import Topology
    from dsgd_test_models import engine_options

    options = engine_options(num_workers=2)
    monkeypatch.setattr(server_group, "live_node_resources", lambda: {n: {"CPU": 8} for n in worker_nodes})
    monkeypatch.setattr(server_group, "reserved_cpus", lambda: None)
    group = server_group.plan_group(options, Topology.of(options), resnet101, worker_nodes)
    assert sorted(group.nodes) == worker_nodes
    assert len(group.layout) == per_server * 2


def test_default_splits_a_variable_only_across_servers():
    huge = floats(22_250_000, 22_250_000)  # two 89 MB variables
    assert len(plan_partitions(huge, default_partition_bytes(huge, 1))) == 2  # each whole
    layout = plan_partitions(huge, default_partition_bytes(huge, 2))
    assert len(layout) == 4  # each in two pieces, one per server
    assert assign_partitions(layout, 2) == [0, 1, 0, 1]


def test_relays_sum_each_node_with_several_workers_for_partitions_summed_elsewhere():
    layout = plan_partitions([VarSpec("v", (4000,), np.dtype(np.float32))], 4000)  # 4 partitions of 4 KB
    placement = assign_partitions(layout, 3)  # servers 0, 1, 2, 0
    assert placement == [0, 1, 2, 0]
    servers = ["a", "b", "b"]
    # Node a: workers 0, 1; node b: workers 2, 3; node c: worker 4 (no server there).
    relays = plan_relays(layout, placement, servers, ["a", "a", "b", "b", "c"])
    # Partitions of server 0 (node a) are relayed on node b by the less loaded of servers 1 and 2; those of
    # servers 1 and 2 (node b) on node a by server 0. Node c has one worker: it pushes directly.
    assert relays == {0: {1: (2, 3)}, 1: {0: (0, 1)}, 2: {0: (0, 1)}, 3: {2: (2, 3)}}
    group = ServerGroup(layout, servers, 5, 30.0, worker_nodes=["a", "a", "b", "b", "c"])
    assert group.relays == relays
    assert group.routes(0) == [0, 0, 0, 0] and group.routes(2) == [1, 1, 2, 2] and group.routes(4) == placement
    assert group.describe().endswith("; summed within the node first: 2 partitions on node a, 2 partitions on node b")
    # Bytes per step leaving each node: a and b one copy of the 2 partitions summed elsewhere, c all 4.
    assert group.node_sent_bytes(["a", "a", "b", "b", "c"]) == {"a": 2 * 4000, "b": 2 * 4000, "c": 4 * 4000}
    # One worker per node, or backup workers: no relays.
    assert plan_relays(layout, placement, servers, ["a", "b"]) == {}
    assert ServerGroup(layout, servers, 4, 30.0, backup_workers=1, worker_nodes=["a", "a", "b", "b"]).relays == {}
    # Compressed: workers push 16 bits, a relay's partial sum crosses in float32.
    bf16 = plan_partitions([VarSpec("v", (4000,), np.dtype(np.float32))], 4000, "bf16")
    group = ServerGroup(bf16, servers, 5, 30.0, worker_nodes=["a", "a", "b", "b", "c"])
    assert group.relays == plan_relays(bf16, group.placement, servers, ["a", "a", "b", "b", "c"]) != {}
    sent = group.node_sent_bytes(["a", "a", "b", "b", "c"])
    assert sent["c"] == sum(s.wire_nbytes for s in bf16)  # node c's one worker pushes 16 bits directly
    assert sent["a"] == sum(bf16[j].nbytes for j, by in group.relays.items() if 0 in by)


def test_a_replacement_plans_every_workers_rounds_for_the_nodes_they_run_on_now(monkeypatch):
    """A worker replaced onto the other node must push its new node's partitions last (own node first can
    deadlock a relay: a chaos run timed out re-running a step so); the servers restart with the new relays."""
    layout = plan_partitions([VarSpec("v", (4000,), np.dtype(np.float32))], 2000)  # 2 rounds of 2 partitions
    group = ServerGroup(layout, ["a", "b"], 4, 30.0, worker_nodes=["a", "a", "b", "b"])
    assert group.rounds[0] == send_rounds(group.placement, ["a", "b"], "a")
    killed, started = [], []
    monkeypatch.setattr("dsgd.cluster.server_group.ray.kill", killed.append)
    monkeypatch.setattr(group, "start", lambda indices: started.extend(indices) or [])
    group.actors = ["server a", "server b"]
    group.replace([], ["b", "a", "b", "b"])  # worker 0 replaced on node b
    assert group.worker_nodes == ["b", "a", "b", "b"]
    assert group.rounds == [send_rounds(group.placement, ["a", "b"], node) for node in ["b", "a", "b", "b"]]
    own_last = [[group.placement[j] for j in r] for r in group.rounds[0]]
    assert all(r[-1] == 1 for r in own_last), own_last  # server 1 is on node b, now worker 0's own
    assert group.relays == plan_relays(layout, group.placement, ["a", "b"], ["b", "a", "b", "b"])
    assert sorted(started) == [0, 1] and killed == ["server a", "server b"]  # a new relay plan: every server anew


@pytest.fixture(scope="module")
def resnet101():
    """ResNet-101's gradients as the engine passes them (last layer first), float32."""
    from benchmarks.exchange import resnet_shapes

    return [VarSpec(name, tuple(shape), np.dtype(np.float32)) for name, shape in reversed(resnet_shapes("resnet101"))]


@pytest.mark.parametrize("nodes, workers_per_node", [(2, 1), (4, 1), (8, 1), (4, 2)])
@pytest.mark.parametrize("compression", [None, "bf16"])
def test_every_node_holds_servers_and_no_link_carries_more_than_its_share(resnet101, nodes, workers_per_node,
                                                                          compression):
    # The scaling benchmark's cluster: 8 logical CPUs per node, one-CPU workers.
    names = [f"node{k}" for k in range(nodes)]
    worker_nodes = [node for node in names for _ in range(workers_per_node)]
    servers = plan_servers(worker_nodes, dict.fromkeys(names, 8), 1, None)
    layout = plan_partitions(resnet101, default_partition_bytes(resnet101, len(servers), across_nodes=True),
                             compression)
    group = ServerGroup(layout, servers[:len(layout)], len(worker_nodes), 30.0, worker_nodes=worker_nodes)
    assert sorted(set(group.nodes)) == names
    assert group.nodes.count(names[0]) == workers_per_node  # a server per worker on every node
    # Each way, a link carries (n-1)/n of the pushes and of the means with the servers' loads even: out what its
    # node pushes and the means of what is pushed to it, in the converse (a relay's partial sum is float32).
    means = sum(p.wire_nbytes for p in layout)
    pushes = sum(p.nbytes for p in layout) if group.relays else means
    share = (pushes + means) * (nodes - 1) / nodes
    links = group.node_link_bytes(worker_nodes)
    assert sorted(links) == names
    busiest = max(b for way in links.values() for b in way)
    assert busiest <= 1.03 * share, {node: [round(b / share, 3) for b in way] for node, way in links.items()}


@pytest.mark.parametrize("nodes, workers_per_node", [(2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (4, 2)])
def test_at_every_point_of_a_round_each_node_pushes_to_a_different_node(resnet101, nodes, workers_per_node):
    # The scaling benchmark's cluster (as above). In lock-step, the k-th push of a round of every worker leaves
    # at once; with one order on every worker they all went to one server (incast).
    names = [f"node{k}" for k in range(nodes)]
    worker_nodes = [node for k in range(workers_per_node) for node in names]  # SPREAD: worker w on node w % n
    servers = plan_servers(worker_nodes, dict.fromkeys(names, 8), 1, None)
    layout = plan_partitions(resnet101, default_partition_bytes(resnet101, len(servers), across_nodes=True))
    group = ServerGroup(layout, servers[:len(layout)], len(worker_nodes), 30.0, worker_nodes=worker_nodes)
    assert len(layout) % len(group.nodes) == 0  # whole rounds only: a partial round has fewer targets than nodes
    for w, rounds in enumerate(group.rounds):
        assert rounds == send_rounds(group.placement, group.nodes, worker_nodes[w])
        # The rounds are assign_partitions' (the same partitions on every worker, in layout order), reordered.
        assert [sorted(r) for r in rounds] == [list(range(k, k + len(group.nodes)))
                                               for k in range(0, len(layout), len(group.nodes))]
        # A node's workers share an order: its relay has every copy of a partition at once.
        assert rounds == group.rounds[worker_nodes.index(worker_nodes[w])]
        # Its own node's partitions last in every round: those its servers relay come before their own (their
        # channels answer in order, relayed ones apart), else two nodes' answers could wait for each other.
        for r in rounds:
            own = [group.nodes[group.placement[j]] == worker_nodes[w] for j in r]
            assert own == sorted(own), (w, r)
    for k in range(len(layout)):  # the k-th push of every node (its workers', or its relay's)
        targets = [group.nodes[group.placement[[j for r in group.rounds[w] for j in r][k]]]
                   for w in range(nodes)]  # workers 0..n-1: one on each node
        assert sorted(targets) == names, (k, targets)
        if workers_per_node == 1:  # and so to a different server
            assert len({[j for r in group.rounds[w] for j in r][k] for w in range(nodes)}) == nodes


def test_send_rounds_go_round_the_ring_from_the_next_node_to_the_workers_own():
    placement = [0, 1, 2, 2, 1, 0, 0]  # rounds of 3: [0, 1, 2], [3, 4, 5], [6]
    servers = ["a", "b", "c"]
    assert send_rounds(placement, servers, "a") == [[1, 2, 0], [4, 3, 5], [6]]
    assert send_rounds(placement, servers, "b") == [[2, 0, 1], [3, 5, 4], [6]]
    assert send_rounds(placement, servers, "c") == [[0, 1, 2], [5, 4, 3], [6]]
    assert send_rounds(placement, servers, None) == send_rounds(placement, servers, "c")  # node not known
    # Two servers on node a: its partitions go together, last on a's workers.
    assert send_rounds([0, 1, 2, 2, 1, 0], ["a", "b", "a"], "b") == [[0, 2, 1], [3, 5, 4]]
    assert send_rounds([0, 1, 2, 2, 1, 0], ["a", "b", "a"], "a") == [[1, 0, 2], [4, 3, 5]]


def test_with_server_nodes_each_worker_node_pushes_to_a_different_server_node_at_every_point_of_a_round(
        resnet101):
    # 4 worker nodes, 4 server nodes of 2 CPUs (one server each): no worker node holds a server, so the rounds
    # are rotated by the worker node's place among the worker nodes; else every worker pushed to one node at once.
    worker_nodes = [f"w{k}" for k in range(4)]
    server_nodes = [f"s{k}" for k in range(4)]
    servers = plan_servers(worker_nodes, dict.fromkeys(server_nodes, 2), 1, None, server_nodes)
    assert servers == server_nodes
    layout = plan_partitions(resnet101, default_partition_bytes(resnet101, len(servers), across_nodes=True))
    group = ServerGroup(layout, servers, len(worker_nodes), 30.0, worker_nodes=worker_nodes)
    assert group.relays == {}  # no server on a worker node to relay: every worker pushes directly
    assert all(group.routes(w) == group.placement for w in range(4))
    assert len(layout) % len(servers) == 0
    for k in range(len(layout)):
        targets = [group.nodes[group.placement[[j for r in group.rounds[w] for j in r][k]]] for w in range(4)]
        assert sorted(targets) == server_nodes, (k, targets)
    # Each worker node's link carries its pushes out and the means in, nothing else; each server node's all
    # workers' pushes in and their means out.
    total = sum(p.wire_nbytes for p in layout)
    links = group.node_link_bytes(worker_nodes)
    assert all(links[node] == (total, total) for node in worker_nodes)
    assert sum(links[node][0] for node in server_nodes) == 4 * total


def test_send_rounds_of_nodes_without_servers_start_at_their_place_among_them():
    placement = [0, 1, 2, 2, 1, 0]  # rounds of 3: [0, 1, 2], [3, 4, 5]
    servers = ["s1", "s2", "s3"]
    serverless = ["w1", "w2", "w3", "w4"]
    assert send_rounds(placement, servers, "w1", serverless) == [[0, 1, 2], [5, 4, 3]]
    assert send_rounds(placement, servers, "w2", serverless) == [[1, 2, 0], [4, 3, 5]]
    assert send_rounds(placement, servers, "w3", serverless) == [[2, 0, 1], [3, 5, 4]]
    assert send_rounds(placement, servers, "w4", serverless) == send_rounds(placement, servers, "w1", serverless)
    # A node with servers keeps its own order (its own node's partitions last).
    assert send_rounds(placement, servers, "s1", serverless) == send_rounds(placement, servers, "s1")


def test_the_memory_servers_buffers_take_per_node_counts_a_mean_and_an_input_buffer_per_worker():
    partition = 4096  # bytes, a multiple of the alignment
    layout = plan_partitions([VarSpec("v", (partition,), np.dtype(np.float32))], partition)  # 4 partitions
    group = ServerGroup(layout, ["a", "b"], 2, 30.0, worker_nodes=["a", "b"])
    assert group.node_buffer_bytes() == {"a": 2 * partition * (1 + 2), "b": 2 * partition * (1 + 2)}
    # Backup workers: two mean slots.
    group = ServerGroup(layout, ["a", "b"], 2, 30.0, backup_workers=1)
    assert group.node_buffer_bytes()["a"] == 2 * partition * (2 + 2)
    # Node a's two workers' copies of server 1's partitions are summed on a first: server 0 holds them too
    # (its buffers hold 4 partitions), and server 1 a stream's buffer of node a's partial sums of its 2.
    group = ServerGroup(layout, ["a", "b"], 3, 30.0, worker_nodes=["a", "a", "b"])
    assert group.node_buffer_bytes() == {"a": 4 * partition * (1 + 3), "b": 2 * partition * (1 + 3) + 2 * partition}


class _Worker:
    """A worker whose ``apply_fn.remote(fn)`` runs ``fn`` here (no Ray)."""

    def __init__(self):
        self.apply_fn = self

    def remote(self, fn):
        return fn(self)


class _Calls:
    def call_startup(self, values, what):
        return values


def test_servers_that_would_not_fit_in_a_nodes_free_memory_are_refused_before_they_start(monkeypatch):
    layout = plan_partitions([VarSpec("v", (4_000_000,), np.dtype(np.float32))], 4_000_000)  # 4 of 4 MB
    group = ServerGroup(layout, ["a", "b"], 2, 30.0, worker_nodes=["a", "b"])
    needed = group.node_buffer_bytes()["a"]
    monkeypatch.setattr(room, "free_memory_bytes", lambda: needed)
    room.check_server_memory(group, [_Worker(), _Worker()], _Calls())  # fits exactly
    monkeypatch.setattr(room, "free_memory_bytes", lambda: needed - 1)
    with pytest.raises(ValueError) as refused:
        room.check_server_memory(group, [_Worker(), _Worker()], _Calls())
    message = str(refused.value)
    assert f"({needed} bytes) on node a" in message and f"({needed - 1} bytes) are free there" in message
    assert "add nodes" in message and "compression='bf16'" in message


def test_a_server_node_without_workers_reports_its_free_memory_by_a_task_there(monkeypatch):
    layout = plan_partitions([VarSpec("v", (4_000_000,), np.dtype(np.float32))], 4_000_000)
    server_node = "5e" * 28  # a Ray node id: 28 bytes in hex
    group = ServerGroup(layout, [server_node, server_node], 2, 30.0, worker_nodes=["a", "b"])
    needed = group.node_buffer_bytes()
    assert list(needed) == [server_node]  # the workers' nodes hold no buffers
    tasks = []

    class _Task:
        def options(self, scheduling_strategy):
            tasks.append((scheduling_strategy.node_id, scheduling_strategy.soft))
            return self

        def remote(self):
            return needed[server_node] - 1

    monkeypatch.setattr(room, "_free_memory_task", _Task())
    # Not inside a placement group: asked of Ray, that would start one in this process.
    monkeypatch.setattr(placement, "get_current_placement_group", lambda: None)
    with pytest.raises(ValueError, match=f"\\({needed[server_node]} bytes\\) on node 5e5e5e5e \\(2 servers"):
        room.check_server_memory(group, [_Worker(), _Worker()], _Calls())
    assert tasks == [(server_node, False)]  # read on that node, by hard affinity


def test_free_memory_is_memavailable_capped_by_the_cgroups_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 8000 kB\nMemFree: 1000 kB\nMemAvailable: 3000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert room.free_memory_bytes(str(tmp_path / "meminfo"), str(cgroup)) == 3000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("5000\n")
    assert room.free_memory_bytes(str(tmp_path / "meminfo"), str(cgroup)) == 3000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{1_000_000 + 5000}\n")
    assert room.free_memory_bytes(str(tmp_path / "meminfo"), str(cgroup)) == 1_000_000

"""How many parameter servers, where, and which partitions each sums (no Ray needed)."""

import numpy as np

from dsgd.cluster.server_group import ServerGroup, assign_partitions, home_for, plan_relays, plan_servers
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


def test_a_new_server_stays_beside_its_workers_or_leaves_a_lost_node_for_the_least_loaded_worker_node():
    # Server 1's node still runs a worker: the new server 1 goes there.
    assert home_for(["a", "b"], 1, ["a", "b"]) == "b"
    # Node b was lost, its worker replaced on c: the new server 1 goes to c, which has none yet, even if
    # Ray still lists b as alive.
    assert home_for(["a", "b"], 1, ["a", "c"]) == "c"
    assert home_for(["a", "b", "b"], 2, ["a", "a"]) == "a"


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

"""Run dsgd on a two-node Ray cluster on this machine; print what happened as JSON.

Started by tests/test_multinode.py in its own process (``run_job``). Each node
of ``ray.cluster_utils.Cluster`` has its own raylet and object store, so
gradient partitions really move between object stores, as on separate machines.

A float32 engine steps 3 times; beside it, in lockstep on the same data
(``compression_runs.lockstep``: each step from the float32 run's weights),
a bf16 engine (op path) and an fp16 engine (Python path), whose 16-bit
partitions and means cross the object stores too.

Prints one stdout line, ``RESULT`` and a JSON object: the cluster's node
ids, the node of every worker (by its ``identity()`` and by the GCS actor
table) and of every parameter server (GCS actor table) of the float32
engine, per engine which partitions each worker reads through shared
memory, the start weights, every replica's final weights and the lockstep
record, weights as nested lists; under "backup", the same for a run with a
straggler held at a gate and one backup worker (``run_with_backup``); under "node_local",
2 workers per node, whose partitions cross through each node's relay
(``run_node_local``), and under "node_local_bf16" the same under bf16
compression, each step's weights before and after (``run_node_local_bf16``); under
"server_nodes", a third node joins marked with ``SERVER_RESOURCE`` and 2 workers
step with the parameter servers on it alone, then through a killed server's
recovery (``run_server_nodes``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile

import numpy as np
import ray

import dsgd
from dsgd.transport.listener import shut_down
from cluster_jobs import actor_node, local_cluster, objects_created, relay_transports, relays_of
from compression_runs import FLOAT32, STEPS, lockstep
from dsgd_test_models import (FixedDataMomentumNet, Gate, GatedStragglerNet, TanhNet, kill, replica_weights,
                              set_start_weights, ps_actors, server_group)
from job_processes import RESULT_PREFIX

NODE_ARGS = {"num_cpus": 3, "object_store_memory": 200 * 1024 * 1024}
PARTITION_BYTES = 40  # 112 bytes of gradients -> 3 partitions, on 1 parameter server per node
SERVER_RESOURCE = "dsgd_server"
# The servers' own node: 2 CPUs (room for a worker, were they not kept off it) -> one server by default.
SERVER_NODE_ARGS = {**NODE_ARGS, "num_cpus": 2, "resources": {SERVER_RESOURCE: 1}}
ENGINES = {FLOAT32: {}, "bf16": dict(compression="bf16", use_ops=True),
           "fp16-python": dict(compression="fp16", use_ops=False)}


def _listed(weights: dict) -> dict:
    return {k: v.tolist() for k, v in weights.items()}


def run() -> dict:
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(dsgd.DistributedSGD(TanhNet, num_workers=2, devices_per_worker=1,
                                                                 strategy="ps", grad_shard_bytes=PARTITION_BYTES,
                                                                 **kwargs))
                   for name, kwargs in ENGINES.items()}
        record = lockstep(engines, STEPS)
        sgd = engines[FLOAT32]
        result = {
            "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])],
            "worker_nodes_gcs": [actor_node(w) for w in sgd.workers],
            "ps_nodes": [actor_node(ps) for ps in ps_actors(sgd)],
            # per engine, worker and partition: its transport (shared memory with its server's node, a stream)
            "transports": {name: _transports(e) for name, e in engines.items()},
            "placement": server_group(sgd).placement,
            "start": _listed(record[0]["before"]),
            "replicas": [_listed(r) for r in record[-1]["replicas"][FLOAT32]],
            "steps": STEPS,
            "compressed": {name: kwargs["compression"] for name, kwargs in ENGINES.items() if kwargs},
            "record": [{"before": _listed(e["before"]), "sent_bytes": e["sent_bytes"],
                        "replicas": {n: [_listed(r) for r in rs] for n, rs in e["replicas"].items()}}
                       for e in record],
        }
        result["broken_stream"] = break_a_stream(sgd)
        result["objects_created"] = objects_created_by_steps(sgd, result["nodes"])
        return result


FLAT_STEPS = 10


def objects_created_by_steps(sgd, nodes: list[str]) -> dict[str, int]:
    """Per node: the objects its object store created over ``FLAT_STEPS`` steps (some fetching stats), counted
    once the steps before have ended on every worker."""
    sgd.foreach_worker(lambda worker: None)
    before = {node: objects_created(node) for node in nodes}
    for i in range(FLAT_STEPS):
        sgd.step(fetch_stats=(i % 3 == 0))
    sgd.foreach_worker(lambda worker: None)
    return {node: objects_created(node) - before[node] for node in nodes}


def _shut_worker_0s_stream(worker) -> int:
    """On worker 0: shut its stream to the other node's server down (the socket only; both actors live on)."""
    if worker.worker_index != 0:
        return 0
    ends = [end for end in worker.client.server_ends if type(end).__name__ == "StreamWorkerEnd"]
    for end in ends:
        shut_down(end.stream._socket)
    return len(ends)


def break_a_stream(sgd) -> dict:
    """Worker 0's stream ends under it with both actors alive; the next step fails on it, and the recovery must
    open a new one (not fail again on the old until ``max_failures``)."""
    failures = sgd.failures
    shut = sgd.foreach_worker(_shut_worker_0s_stream)
    for _ in range(2):
        sgd.step()
    return {"shut": shut, "failures": sgd.failures - failures, "transports": _transports(sgd),
            "replicas": [_listed(r) for r in replica_weights(sgd)]}


class GatedWorker1(GatedStragglerNet):
    SLOW_WORKER = 1


# A step closes only once every worker has begun the one before, so a worker held in its first batch lets the
# others take two steps without it.
HELD_STEPS = 2


def run_with_backup(gates: str) -> dict:
    """One backup worker; worker 1 held at the gate of its first batch (``gates``, see ``GatedStragglerNet``)
    while ``HELD_STEPS`` steps close with worker 0's gradient alone, then let go: it catches up."""
    gate = Gate(gates + "-0")
    gate.close()
    with dsgd.DistributedSGD(functools.partial(GatedWorker1, gates=gates), num_workers=2, strategy="ps",
                             grad_shard_bytes=PARTITION_BYTES, backup_workers=1) as sgd:
        start = set_start_weights(sgd)
        dropped = []
        for _ in range(HELD_STEPS):
            dropped.append(sgd.step(fetch_stats=True)["dropped_gradients"])
            gate.wait_arrived()  # worker 1 is at the gate (raises if not): this step closed without it
        # Asked of worker 0 alone: worker 1 is still inside its first step, held.
        applied_while_held = ray.get(sgd.workers[0].applied_steps_count.remote(), timeout=60)
        gate.open()
        replicas = replica_weights(sgd)  # after the drain, which waits for worker 1 to catch up
        return {"start": {k: v.tolist() for k, v in start.items()}, "dropped": dropped, "steps": HELD_STEPS,
                "applied_while_held": applied_while_held,
                "batches_computed": sgd.foreach_model(lambda m: m.step),
                "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])],
                "replicas": [{k: v.tolist() for k, v in r.items()} for r in replicas],
                "transports": _transports(sgd)}


def _transports(sgd) -> list:
    """Per worker, per partition: the class name of the transport end it pushes through."""
    return sgd.foreach_worker(lambda w: [type(end).__name__ for end in w.client.ends])


def run_node_local(scratch: str) -> dict:
    """2 nodes x 2 workers: each node's relay sums its workers' copies of the other node's partitions, ``STEPS``
    steps; the same steps again from a checkpoint of the start (in ``scratch``), bit for bit the same or not; then
    worker 3 is killed and ``STEPS`` more steps run through the recovery, then server 0 and ``STEPS`` more."""
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=4, devices_per_worker=1, strategy="ps",
                             grad_shard_bytes=PARTITION_BYTES) as sgd:
        start = set_start_weights(sgd)
        sgd.save(scratch)
        stats = [sgd.step(fetch_stats=True) for _ in range(STEPS)]
        first_run = replica_weights(sgd)
        group = server_group(sgd)
        # per server: partition -> pushes that came from another node
        traffic = [{str(j): n for j, n in t.items()} for t in ray.get([a.traffic.remote() for a in group.actors],
                                                                      timeout=60)]
        sgd.restore(scratch)  # weights, momentum and step count as at the start
        for _ in range(STEPS):
            sgd.step()
        second_run = replica_weights(sgd)
        group = server_group(sgd)
        result = {
            "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])],
            "ps_nodes": [actor_node(ps) for ps in group.actors],
            "placement": group.placement,
            "partition_bytes": [s.wire_nbytes for s in group.layout],
            "relays": relays_of(group),
            "routes": [group.routes(w) for w in range(4)],
            "traffic": traffic,
            "relay_transports": relay_transports(group),
            "rerun_identical": all(np.array_equal(a[k], b[k]) for a, b in zip(first_run, second_run) for k in a),
            "node_sent_bytes": [s["node_sent_bytes"] for s in stats],
            "sent_bytes": [s["sent_bytes"] for s in stats]}
        kill(sgd.workers[3])
        for _ in range(STEPS):
            sgd.step()
        result.update(failures=sgd.failures, relays_after=relays_of(server_group(sgd)),
                      relay_transports_after=relay_transports(server_group(sgd)))
        kill(server_group(sgd).actors[0])  # the server the other node's relay streams its partial sums to
        for _ in range(STEPS):
            sgd.step()
        return {**result, "failures_after_server": sgd.failures,
                "relays_after_server": relays_of(server_group(sgd)),
                "relay_transports_after_server": relay_transports(server_group(sgd)),
                "start": _listed(start), "replicas": [_listed(r) for r in replica_weights(sgd)]}


def run_node_local_bf16() -> dict:
    """2 nodes x 2 workers under bf16 (op path): the relays' float32 partial sums cross, their 16-bit means come
    back; ``STEPS`` steps, each's weights before it and every replica's after it."""
    with dsgd.DistributedSGD(TanhNet, num_workers=4, devices_per_worker=1, strategy="ps", grad_shard_bytes=PARTITION_BYTES,
                             compression="bf16", use_ops=True) as sgd:
        set_start_weights(sgd)
        steps = []
        for _ in range(STEPS):
            before = sgd.get_weights()
            sgd.step()
            steps.append({"before": _listed(before), "replicas": [_listed(r) for r in replica_weights(sgd)]})
        group = server_group(sgd)
        return {"steps": steps, "relays": relays_of(group), "relay_transports": relay_transports(group),
                "placement": group.placement,
                "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])]}


def run_server_nodes(cluster) -> dict:
    """A node marked with ``SERVER_RESOURCE`` joins; 2 workers step ``STEPS`` times with ``server_resource``, then
    server 0 is killed and ``STEPS`` more run through the recovery. Where every actor ran, before and after."""
    server_node = cluster.add_node(**SERVER_NODE_ARGS).node_id
    cluster.wait_for_nodes()
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="ps", grad_shard_bytes=PARTITION_BYTES,
                             server_resource=SERVER_RESOURCE) as sgd:
        start = set_start_weights(sgd)
        for _ in range(STEPS):
            sgd.step()
        group = server_group(sgd)
        result = {"server_node": server_node,
                  "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])],
                  "ps_nodes": [actor_node(ps) for ps in group.actors], "relays": relays_of(group),
                  "transports": _transports(sgd), "start": _listed(start)}
        kill(group.actors[0])
        for _ in range(STEPS):
            sgd.step()
        return {**result, "failures": sgd.failures, "ps_nodes_after": [actor_node(ps) for ps in ps_actors(sgd)],
                "replicas": [_listed(r) for r in replica_weights(sgd)]}


def main() -> None:
    with local_cluster(NODE_ARGS, NODE_ARGS) as cluster, tempfile.TemporaryDirectory() as scratch:
        result = run()
        result["backup"] = run_with_backup(scratch + "/gate")
        result["node_local"] = run_node_local(scratch + "/start.npz")
        result["node_local_bf16"] = run_node_local_bf16()
        result["server_nodes"] = run_server_nodes(cluster)
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

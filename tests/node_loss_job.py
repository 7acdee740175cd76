"""Lose a whole node of a multi-node Ray cluster during training; print what happened as JSON.

Started by tests/test_node_loss.py in its own process (``run_job``). The
head node has no CPUs (it holds only the driver), so every worker runs on a
node that can be removed; nodes are removed as a crash would (no graceful
shutdown; ``crash_node``), and Ray's health checks, every second, see them dead within
about five seconds.

Three 2-CPU nodes besides the head:

1. ``replaced``: two workers of 1 CPU, each with a parameter server on its
   node. Worker 1 is held before its batches of step 1 (``GatedWorker1Net``); while
   worker 0 waits on the servers for worker 1's pushes of step 1, the node
   of worker 0 is lost. The live nodes have room for a new worker: the
   engine replaces worker 0 and the server there, re-runs step 1 and trains
   step 2. Reports where everything runs afterwards, the number of
   recoveries, every replica's weights and the seconds from the loss to the
   re-run step applied.
2. ``no_room``: on the two nodes left, two workers of 2 CPUs, one on each.
   The node of worker 0 is lost after step 1 and no live node has 2 CPUs
   free: the next step's error, the seconds it took, the recoveries it
   counted, the actors still waiting to start afterwards, then ``save`` (worker 1's state) restored
   into a one-worker engine on the node left.
3. ``relays_lost``: a node joins the one left; two workers of 1 CPU on
   each of the two, so every partition is relayed from the node other than
   its server's (node-local aggregation). A third node joins; worker 1 is
   held before its batches of step 1 while the server on its node holds
   worker 3's pushes, and the other node is lost. Reports the relays and where everything runs before and
   after, the recoveries, every replica's weights.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import tempfile
import time

import ray
from ray._private import ray_constants

import dsgd
from cluster_jobs import actor_node, local_cluster
from dsgd_test_models import (FixedDataMomentumNet, Gate, GatedWorker1Net, known_actors, pushes_waiting,
                              replica_weights, server_group, set_start_weights, steps_applied, wait_until, ps_actors)
from job_processes import RESULT_PREFIX

MIB = 1024 * 1024
HEAD = {"num_cpus": 0, "object_store_memory": 100 * MIB,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}}
NODE = {"num_cpus": 2, "object_store_memory": 100 * MIB}
PARTITION_BYTES = 40  # 112 bytes of gradients -> 3 partitions on the 2 servers
TIMEOUT_S = 60.0


def as_lists(weights: dict) -> dict:
    return {k: v.tolist() for k, v in weights.items()}


def engine_actors(sgd) -> list:
    """Every worker's and parameter server's identity, workers first (asked between steps: a worker answers after its step)."""
    return ray.get([a.identity.remote() for a in sgd.workers + ps_actors(sgd)], timeout=TIMEOUT_S)


def crash_node(cluster, node_id: str, actors: list) -> None:
    """SIGKILL the raylet of node ``node_id`` and the engine's ``actors`` there at once, then remove the node.

    ``remove_node`` alone stops only the raylet and its helpers; the actors'
    processes would run on until they noticed.
    """
    [node] = [n for n in cluster.worker_nodes if n.node_id == node_id]
    [raylet] = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
    for pid in [raylet.process.pid] + [a.pid for a in actors if a.node_id == node_id]:
        os.kill(pid, signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)


def cpu_nodes() -> list[str]:
    """The live nodes that can hold workers."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)


def replaced(cluster, gate: Gate) -> dict:
    with dsgd.DistributedSGD(functools.partial(GatedWorker1Net, gate=gate), num_workers=2, strategy="ps",
                             grad_shard_bytes=PARTITION_BYTES, timeout_s=TIMEOUT_S) as sgd:
        start = set_start_weights(sgd)
        worker_nodes_before = [actor_node(w) for w in sgd.workers]
        ps_nodes_before = [actor_node(ps) for ps in ps_actors(sgd)]
        actors = engine_actors(sgd)
        lost = actors[0].node_id
        sgd.step()
        assert steps_applied(sgd) == [1, 1]  # step 0 done: the gate holds step 1
        gate.close()
        sgd.step()  # step 1: worker 1 is held before its batch, worker 0 pushes and waits
        gate.wait_arrived(TIMEOUT_S)
        wait_until(lambda: any(pushes_waiting(ps) for ps in ps_actors(sgd)), TIMEOUT_S)
        waiting_for = sorted({w for ps in ps_actors(sgd) for ws in pushes_waiting(ps).values() for w in ws})
        crash_node(cluster, lost, actors)
        fault = time.monotonic()
        gate.open()
        sgd.get_weights()  # waits for step 1: recovery re-runs it
        recover_s = time.monotonic() - fault
        sgd.step()
        replicas = replica_weights(sgd)
        return {
            "waiting_for_at_loss": waiting_for,
            "lost_node": lost,
            "live_nodes": cpu_nodes(),
            "worker_nodes_before": worker_nodes_before,
            "ps_nodes_before": ps_nodes_before,
            "worker_nodes": [actor_node(w) for w in sgd.workers],
            "ps_nodes": [actor_node(ps) for ps in ps_actors(sgd)],
            "failures": sgd.failures,
            "recover_s": recover_s,
            "start": as_lists(start),
            "replicas": [as_lists(r) for r in replicas],
            "steps": sgd.num_steps,
        }


def no_room(cluster, checkpoint_dir: str) -> dict:
    sgd = dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="ps", cpus_per_worker=2,
                              timeout_s=TIMEOUT_S, startup_timeout_s=2 * TIMEOUT_S)
    try:
        start = set_start_weights(sgd)
        worker_nodes = [actor_node(w) for w in sgd.workers]
        sgd.step()
        sgd.step()
        actors = engine_actors(sgd)
        lost = actors[0].node_id
        crash_node(cluster, lost, actors)
        fault = time.monotonic()
        try:
            sgd.step(fetch_stats=True)
            error = None
        except dsgd.DSGDError as e:
            error = e
        error_s = time.monotonic() - fault
        failures = sgd.failures
        waiting_to_start = sorted(name for name, state in known_actors().values()
                                  if state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY"))
        sgd.save(checkpoint_dir)
    finally:
        sgd.shutdown()
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=1, cpus_per_worker=2) as restored:
        restored.restore(checkpoint_dir)
        return {
            "worker_nodes": worker_nodes,
            "lost_node": lost,
            "error_type": type(error).__name__,
            "error": str(error),
            "error_s": error_s,
            "failures": failures,
            "timeout_s": TIMEOUT_S,
            "waiting_to_start": waiting_to_start,
            "start": as_lists(start),
            "restored_steps": restored.num_steps,
            "restored": as_lists(restored.get_weights()),
        }


def contributors_waiting(server) -> dict[int, list[int]]:
    """Partition -> the contributors (workers, or a node's relay keyed by its lowest worker) whose pushes of the
    current step a server holds."""
    def waiting(ps) -> dict[int, list[int]]:  # runs in the server (nested: pickled by value)
        with ps.changed:
            return {j: sorted(p.waiting) for j, p in ps.partitions.items() if p.waiting}

    return ray.get(server.__ray_call__.remote(waiting), timeout=TIMEOUT_S)


def relays_lost(cluster, gate: Gate) -> dict:
    """Two nodes of two workers each, every partition relayed from the node other than its server's; a third node
    joins. Worker 1 is held before its batches of step 1, the step in flight; the other node is lost. The engine replaces its two workers
    and its server on the new node, relays again, re-runs step 1 and trains step 2."""
    with dsgd.DistributedSGD(functools.partial(GatedWorker1Net, gate=gate), num_workers=4, strategy="ps",
                             grad_shard_bytes=PARTITION_BYTES, timeout_s=TIMEOUT_S) as sgd:
        start = set_start_weights(sgd)
        servers, plan = ps_actors(sgd), server_group(sgd)
        worker_nodes_before = [actor_node(w) for w in sgd.workers]
        ps_nodes_before = [actor_node(ps) for ps in servers]
        relays_before = {j: {r: list(ws) for r, ws in by.items()} for j, by in plan.relays.items()}
        actors = engine_actors(sgd)
        lost = next(n for n in worker_nodes_before if n != worker_nodes_before[1])
        [kept] = [s for s, n in enumerate(ps_nodes_before) if n != lost]
        sgd.step()
        assert steps_applied(sgd) == [1] * 4  # step 0 done: the gate holds step 1
        cluster.add_node(**NODE)  # room for the lost node's workers
        gate.close()
        sgd.step()  # step 1: worker 1 is held before its batch, the others push
        gate.wait_arrived(TIMEOUT_S)
        # Step 1 is in flight: the kept server holds worker 3's first push (to sum, or to relay), not worker 1's.
        # (Whether the lost node's partial sums are in by then depends on the order the pushes came in: a server's
        # channel from a worker of its node is read in order, and a push of a partition it sums waits there for
        # the step to close, here for worker 1, before the worker's next pushes are read.)
        wait_until(lambda: contributors_waiting(servers[kept]), TIMEOUT_S)
        waiting_at_loss = contributors_waiting(servers[kept])
        crash_node(cluster, lost, actors)
        gate.open()
        sgd.get_weights()  # waits for step 1: recovery re-runs it
        sgd.step()
        plan = server_group(sgd)
        return {
            "lost_node": lost,
            "waiting_at_loss": {str(j): keys for j, keys in waiting_at_loss.items()},
            "live_nodes": cpu_nodes(),
            "worker_nodes_before": worker_nodes_before,
            "ps_nodes_before": ps_nodes_before,
            "relays_before": {str(j): {str(r): ws for r, ws in by.items()} for j, by in relays_before.items()},
            "worker_nodes": [actor_node(w) for w in sgd.workers],
            "ps_nodes": [actor_node(ps) for ps in ps_actors(sgd)],
            "relays": {str(j): {str(r): list(ws) for r, ws in by.items()} for j, by in plan.relays.items()},
            "failures": sgd.failures,
            "start": as_lists(start),
            "replicas": [as_lists(r) for r in replica_weights(sgd)],
            "steps": sgd.num_steps,
        }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, local_cluster(HEAD, NODE, NODE, NODE) as cluster:
        result = {"replaced": replaced(cluster, Gate(os.path.join(tmp, "gate"))),
                  "no_room": no_room(cluster, os.path.join(tmp, ""))}
        cluster.add_node(**NODE)  # with the node left: two nodes of 2 CPUs, for 2 workers each
        result["relays_lost"] = relays_lost(cluster, Gate(os.path.join(tmp, "relays-gate")))
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

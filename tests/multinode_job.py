"""Run dsgd on a two-node Ray cluster on this machine; print what happened as JSON.

Started by tests/test_multinode.py in its own process (``run_job``). Each node
of ``ray.cluster_utils.Cluster`` has its own raylet and object store, so
gradient shards really move between object stores, as on separate machines.

Prints one stdout line, ``RESULT`` and a JSON object: the cluster's node
ids, the node of every worker (by its ``identity()`` and by the GCS actor
table) and of every parameter server (GCS actor table), the start weights
and every replica's final weights as nested lists; under "backup", the same
for a run with a straggler and one backup worker (``run_with_backup``).
"""

from __future__ import annotations

import json

import ray

import dsgd
from cluster_jobs import actor_node, local_cluster
from dsgd_test_models import (RESULT_PREFIX, StragglerNet, TanhNet, replica_weights, set_start_weights, ps_actors,
                              server_group)

NODE_ARGS = {"num_cpus": 3, "object_store_memory": 200 * 1024 * 1024}
STEPS = 3
SHARD_BYTES = 40  # 112 bytes of gradients -> 3 partitions, on 1 parameter server per node


def run() -> dict:
    with dsgd.DistributedSGD(TanhNet, num_workers=2, devices_per_worker=1, strategy="ps",
                             grad_shard_bytes=SHARD_BYTES) as sgd:
        start = set_start_weights(sgd)
        for step in range(STEPS):
            sgd.step(fetch_stats=(step == STEPS - 1))
        replicas = replica_weights(sgd)
        return {
            "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers])],
            "worker_nodes_gcs": [actor_node(w) for w in sgd.workers],
            "ps_nodes": [actor_node(ps) for ps in ps_actors(sgd)],
            # per worker, per partition: read through shared memory (its server's node) or the object store
            "shared": sgd.foreach_worker(lambda w: [type(e).__name__ == "SharedMemoryWorkerEnd" for e in w.client.ends]),
            "placement": server_group(sgd).placement,
            "start": {k: v.tolist() for k, v in start.items()},
            "replicas": [{k: v.tolist() for k, v in r.items()} for r in replicas],
            "steps": STEPS,
        }


class SlowWorker1(StragglerNet):
    SLOW_WORKER = 1


def run_with_backup() -> dict:
    """Worker 1 a straggler and one backup worker: every step is worker 0's alone, the replicas alike."""
    with dsgd.DistributedSGD(SlowWorker1, num_workers=2, strategy="ps", grad_shard_bytes=SHARD_BYTES,
                             backup_workers=1) as sgd:
        start = set_start_weights(sgd)
        dropped = [sgd.step(fetch_stats=True)["dropped_gradients"] for _ in range(STEPS)]
        replicas = replica_weights(sgd)
        return {"start": {k: v.tolist() for k, v in start.items()}, "dropped": dropped,
                "replicas": [{k: v.tolist() for k, v in r.items()} for r in replicas]}


def main() -> None:
    with local_cluster(NODE_ARGS, NODE_ARGS):
        result = run()
        result["backup"] = run_with_backup()
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

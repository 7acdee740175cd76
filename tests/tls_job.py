"""Run dsgd on a two-node Ray cluster whose Ray encrypts its traffic (TLS); print what happened as JSON.

Started by tests/test_tls.py in its own process (``run_job``), with one
argument: the JSON of the environment that turns Ray's TLS on (``RAY_USE_TLS``
and the files of a CA made by the test, ``benchmarks.tls_files``), set here
before Ray is imported (Ray reads it once), so this driver and every Ray
process of the cluster, every actor's too, use it. 2 workers, one per node, and dsgd's default servers (one per
node) run "ps" for ``STEPS`` steps: each worker's partitions summed on the
other node cross down a stream.

Prints one stdout line, ``RESULT`` and a JSON object: the nodes, each
worker's node, per worker and partition its transport end's class, per
worker the encryption of each of its streams (``Stream.encryption``: None
if plain), per server the pushes it took from other nodes (``traffic``), the
start weights and every replica's final weights.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # before Ray is imported: it reads its TLS setting once
    os.environ.update(json.loads(sys.argv[1]))

import ray  # noqa: E402

import dsgd  # noqa: E402
from cluster_jobs import local_cluster  # noqa: E402
from dsgd_test_models import TanhNet, replica_weights, server_group, set_start_weights  # noqa: E402
from job_processes import RESULT_PREFIX  # noqa: E402

NODE_ARGS = {"num_cpus": 2, "object_store_memory": 200 * 1024 * 1024}
PARTITION_BYTES = 40  # 112 bytes of gradients -> 3 partitions
STEPS = 3


def _streams(worker) -> list:
    """On a worker: the encryption of each of its streams (None: plain TCP)."""
    return [end.stream.encryption for end in worker.client.server_ends if type(end).__name__ == "StreamWorkerEnd"]


def run() -> dict:
    with dsgd.DistributedSGD(TanhNet, num_workers=2, devices_per_worker=1, strategy="ps",
                             grad_shard_bytes=PARTITION_BYTES) as sgd:
        start = set_start_weights(sgd)
        for _ in range(STEPS):
            sgd.step()
        group = server_group(sgd)
        return {
            "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "worker_nodes": [i.node_id for i in ray.get([w.identity.remote() for w in sgd.workers], timeout=60)],
            "transports": sgd.foreach_worker(lambda w: [type(end).__name__ for end in w.client.ends]),
            "encryption": sgd.foreach_worker(_streams),
            "traffic": [{str(j): n for j, n in t.items()}
                        for t in ray.get([a.traffic.remote() for a in group.actors], timeout=60)],
            "steps": STEPS,
            "start": {k: v.tolist() for k, v in start.items()},
            "replicas": [{k: v.tolist() for k, v in r.items()} for r in replica_weights(sgd)],
        }


def main() -> None:
    with local_cluster(NODE_ARGS, NODE_ARGS):
        result = run()
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

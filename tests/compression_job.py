"""Compressed runs beside a float32 run on a two-node Ray cluster on this machine; print the record as JSON.

Started by tests/test_compression.py in its own process (``run_job``), as
tests/multinode_job.py is: each node has its own raylet and object store, so
a worker reaches the parameter server on the other node through the object
store, with its partitions (and the mean it reads back) in 16-bit form.

Prints one stdout line, ``RESULT`` and a JSON object: the node ids, per
engine and worker which partitions went through shared memory, the
compressed engines' compressions and ``compression_runs.lockstep``'s record
(weights as nested lists).
"""

from __future__ import annotations

import contextlib
import json

import ray

import dsgd
from cluster_jobs import local_cluster
from compression_runs import FLOAT32, lockstep
from dsgd_test_models import RESULT_PREFIX, TanhNet

NODE_ARGS = {"num_cpus": 4, "object_store_memory": 200 * 1024 * 1024}
SHARD_BYTES = 40  # TanhNet's 112 bytes of float32 gradients -> 3 partitions, on 1 parameter server per node
ENGINES = {FLOAT32: {}, "bf16": dict(compression="bf16", use_ops=True),
           "fp16-python": dict(compression="fp16", use_ops=False)}


def _listed(weights: dict) -> dict:
    return {k: v.tolist() for k, v in weights.items()}


def run() -> dict:
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="ps",
                                                                 grad_shard_bytes=SHARD_BYTES, **kwargs))
                   for name, kwargs in ENGINES.items()}
        record = lockstep(engines)
        return {
            "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
            "shared": {name: sgd.foreach_worker(lambda w: [type(e).__name__ == "SharedMemoryWorkerEnd"
                                                           for e in w.client.ends])
                       for name, sgd in engines.items()},
            "compressed": {name: kwargs["compression"] for name, kwargs in ENGINES.items() if kwargs},
            "record": [{"before": _listed(e["before"]), "sent_bytes": e["sent_bytes"],
                        "replicas": {n: [_listed(r) for r in rs] for n, rs in e["replicas"].items()}}
                       for e in record],
        }


def main() -> None:
    with local_cluster(NODE_ARGS, NODE_ARGS):
        result = run()
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

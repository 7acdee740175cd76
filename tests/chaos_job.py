"""A chaos run across two nodes (benchmarks/faults.py): print its record as JSON.

Started by tests/test_chaos.py in its own process (``run_job``) with the seed,
the steps and the faults as arguments. Two nodes of a ``ray.cluster_utils``
cluster, 3 CPUs each; ``faults.TWO_NODES_WORKERS`` workers (2 per node, so
every partition is relayed from the node other than its server's) under
``faults.TWO_NODES``; the run shrinks to 3 workers and grows back.
"""

from __future__ import annotations

import json
import os
import sys

from cluster_jobs import local_cluster
from job_processes import RESULT_PREFIX, TESTS_DIR

REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path.insert(0, REPO_ROOT)
os.chdir(REPO_ROOT)  # Ray gives the workers the driver's directory: they import benchmarks.faults from there

from benchmarks import faults  # noqa: E402  (after the path above)

NODE = {"num_cpus": 3, "object_store_memory": 200 * 1024 * 1024}


def main() -> None:
    seed, steps, count = (int(a) for a in sys.argv[1:4])
    plan = faults.make_plan(seed, steps, count, faults.TWO_NODES_WORKERS)
    with local_cluster(NODE, NODE):
        run = faults.run(plan, faults.TWO_NODES_WORKERS, **faults.TWO_NODES)
    print(RESULT_PREFIX + json.dumps(run.record()))


if __name__ == "__main__":
    main()

"""A chaos run across two nodes (benchmarks/faults.py): print its record as JSON.

Started by tests/test_chaos.py in its own process (``run_job``) with the seed,
the steps, the faults and the configuration (a name of
``faults.ACROSS_TWO_NODES``) as arguments. Two nodes of a
``ray.cluster_utils`` cluster, 3 CPUs each; the configuration's workers
and engine; the run shrinks by one worker and grows back.
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
    num_workers, engine = faults.ACROSS_TWO_NODES[sys.argv[4]]
    plan = faults.make_plan(seed, steps, count, num_workers)
    with local_cluster(NODE, NODE):
        run = faults.run(plan, num_workers, **engine)
    print(RESULT_PREFIX + json.dumps(run.record()))


if __name__ == "__main__":
    main()

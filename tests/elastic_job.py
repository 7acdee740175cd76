"""An elastic engine (num_workers=(2, 4)) on a multi-node Ray cluster losing and gaining nodes; prints JSON.

Started by tests/test_elastic.py in its own process (``run_job``). The head
node has no CPUs; three nodes of 2 CPUs each hold one worker of 2 CPUs, so
the engine starts with 3 workers (room for 3 of its maximum 4). Then:

1. the node of worker 1 is lost between steps and no node has room for a
   new worker: the next step goes on with the 2 survivors (worker 2 takes
   index 1);
2. a node joins: within ``resize_interval_s`` plus a build, the engine grows
   back to 3 workers;
3. two nodes are lost at once: 1 worker would remain, below the minimum of
   2: the step raises the error that names what is missing.

Reports, per stage, the steps run and the data index (``worker_index`` the
model was built with) of every replica, the start weights and the final
weights, the sizes seen, the seconds to grow back and the error.
"""

from __future__ import annotations

import json
import time

import ray

import dsgd
from cluster_jobs import local_cluster
from dsgd_test_models import FixedDataMomentumNet, actor_pids, replica_weights, set_start_weights
from job_processes import RESULT_PREFIX
from node_loss_job import HEAD, NODE, as_lists, crash_node, engine_actors

TIMEOUT_S = 60.0
INTERVAL_S = 1.0


def data_indices(sgd) -> list[int]:
    return sgd.foreach_model(lambda model: model.worker_index)


def main() -> None:
    with local_cluster(HEAD, NODE, NODE, NODE) as cluster:
        sgd = dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=(2, 4), strategy="ps", cpus_per_worker=2,
                                  timeout_s=TIMEOUT_S, startup_timeout_s=TIMEOUT_S, resize_interval_s=INTERVAL_S)
        try:
            start = set_start_weights(sgd)
            result = {"start_workers": sgd.num_workers, "start": as_lists(start), "stages": []}
            stage = data_indices(sgd)
            for _ in range(2):
                sgd.step()
            result["stages"].append((2, stage))

            actors = engine_actors(sgd)
            pids = actor_pids(sgd.workers[0], sgd.workers[2])
            crash_node(cluster, actors[1].node_id, actors)
            result["after_loss_replicas"] = sgd.step(fetch_stats=True)["num_replicas"]
            result["after_loss_workers"] = sgd.num_workers
            result["survivor_pids_kept"] = actor_pids(*sgd.workers) == pids
            stage = data_indices(sgd)
            sgd.step()
            result["stages"].append((2, stage))

            cluster.add_node(**NODE)
            joined = time.monotonic()
            steps = 0
            while sgd.num_workers < 3 and time.monotonic() - joined < TIMEOUT_S:
                sgd.step(fetch_stats=True)
                steps += 1
            result["grow_s"] = time.monotonic() - joined
            result["stages"].append((steps - 1, stage))  # the last of these steps ran after the grow
            stage = data_indices(sgd)
            sgd.step()
            result["stages"].append((2, stage))
            result["grown_workers"] = sgd.num_workers
            result["replicas"] = [as_lists(r) for r in replica_weights(sgd)]

            actors = engine_actors(sgd)
            for node in {a.node_id for a in actors[1:sgd.num_workers]}:
                crash_node(cluster, node, actors)
            try:
                sgd.step(fetch_stats=True)
                result["below_min_error"] = None
            except dsgd.DSGDError as e:
                result["below_min_error"] = str(e)
        finally:
            sgd.shutdown()
        ray.shutdown()
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

"""Node-local aggregation (relays) with the features and kinds of model its other tests do not run; print what
happened as JSON.

Started by tests/test_relays.py in its own process (``run_job``), with a
scratch directory (for the timeline and the TensorBoard logdir) and the
engines to run as its arguments. Two nodes of 3 CPUs
(``ray.cluster_utils.Cluster``, each its own raylet and object store); 4
workers of 1 CPU spread over them, so some node holds two or more and a
server there relays the other node's partitions. The engines, one after
another:

- ``keras3``: an elastic engine, ``num_workers=(2, 4)``, of a Keras 3 model
  with batch normalization (``tf2_test_models.keras_creator``, fixed
  batches), 2 devices per worker, momentum SGD, ``nan_policy="skip"``, a
  ``logdir``. It starts at 4; a traced step and ``STAGE_STEPS - 1`` more; a
  step whose mean is NaN (a kernel set to NaN: skipped); a resize to 3 and
  ``STAGE_STEPS`` steps; then, once ``resize_interval_s`` has passed, the
  engine grows back to 4 at its next step, and ``STAGE_STEPS`` steps.
- ``tf_keras``: 4 workers of a tf_keras model (``keras_test_models.dense_creator``), ``km.STEPS`` steps.
- ``tf2``: 4 workers of a ``dsgd.TF2Model`` (``tf2_test_models.FixedRegression``), ``TF2_STEPS`` steps.
- ``tf2_data``: 4 workers of a ``dsgd.TF2Model`` reading a Ray Dataset
  (``data_test_models.row_id_tf2_creator``), ``DATA_STEPS`` steps.
- ``tune``: a Ray Tune trial (``dsgd.tune.trainable``) of 4 workers of
  ``tune_test_models.Regression``, momentum SGD, a checkpoint every report. Its
  placement group packs the trial's bundle and two workers' on one node, the
  other two workers' on the other. Worker 1 kills itself at step
  ``TUNE_KILL_AT`` (``max_failures=0``: the trial fails), and Tune restarts
  the trial from its last checkpoint. At every report a Tune callback reads
  where the trial's placement group, workers and servers are.

Prints one stdout line, ``RESULT`` and a JSON object: per engine, where its
workers and servers ran and the relays planned (``plan``, at each size),
the weights it started from, every replica's weights (nested lists) and
what else its test checks (each step's stats, the skipped step's weights and
warnings, the rows each replica read; for ``tune``, the layout at each report,
the trial's reports and its last checkpoint); the seconds each engine took,
from its start to its shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np
import ray

import dsgd
import data_test_models as dm
import keras_test_models as km
import tf2_test_models as m
from cluster_jobs import actor_node, live_actors, local_cluster, relay_transports, relays_of
from dsgd_test_models import replica_weights, server_group
from job_processes import RESULT_PREFIX

NODE_ARGS = {"num_cpus": 3, "object_store_memory": 200 * 1024 * 1024}
STAGE_STEPS = 2
INTERVAL_S = 3600.0  # resize_interval_s: the job moves the engine's clock, not the wall clock
KERAS3_PARTITION_BYTES = 200  # about 850 bytes of gradients -> 5 partitions
TF_KERAS_PARTITION_BYTES = 24  # 84 bytes -> 4 partitions
TF2_PARTITION_BYTES, TF2_STEPS = 8, 3  # 28 bytes -> 4 partitions
DATA_ROWS, DATA_STEPS = 80, 3  # 4 replicas x 20 rows: 2 steps an epoch
TUNE_LR, TUNE_MOMENTUM = 0.05, 0.5
TUNE_STEPS_PER_REPORT, TUNE_REPORTS, TUNE_KILL_AT = 2, 4, 5  # killed in the third report, resumed after the second
TUNE_METRICS = ("training_iteration", "num_steps", "loss", "node_sent_bytes", "num_replicas")
TIMEOUTS = dict(timeout_s=120, startup_timeout_s=300)


def listed(weights: dict) -> dict:
    return {k: np.asarray(v).tolist() for k, v in weights.items()}


def plan(sgd) -> dict:
    """Where the engine's workers and servers run, which partitions they hold and relay, and how the relays push."""
    group = server_group(sgd)
    return {"worker_nodes": [actor_node(w) for w in sgd.workers],
            "ps_nodes": [actor_node(ps) for ps in group.actors],
            "placement": group.placement, "relays": relays_of(group), "relay_transports": relay_transports(group)}


class Warnings(logging.Handler):
    """Collects the messages of the warnings logged where it is added."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def a_kernel(weights: dict) -> str:
    return next(name for name in weights if name.endswith("kernel"))


def keras3(scratch: str) -> dict:
    with dsgd.DistributedSGD(m.keras_creator("sequential", "sgd", fixed=True), num_workers=(2, 4),
                             devices_per_worker=2, strategy="ps", grad_shard_bytes=KERAS3_PARTITION_BYTES,
                             nan_policy="skip", logdir=os.path.join(scratch, "logs"), resize_interval_s=INTERVAL_S,
                             **TIMEOUTS) as sgd:
        result = {"start": listed(sgd.get_weights()), "plans": [plan(sgd)]}
        stats = [sgd.step(fetch_stats=True, write_timeline=os.path.join(scratch, "step.json"))]
        stats += [sgd.step(fetch_stats=True) for _ in range(STAGE_STEPS - 1)]
        good = sgd.get_weights()
        poisoned = {**good, a_kernel(good): np.full_like(good[a_kernel(good)], np.nan)}
        sgd.set_weights(poisoned)
        warnings = Warnings()
        logging.getLogger("dsgd").addHandler(warnings)
        try:
            stats.append(sgd.step(fetch_stats=True))
        finally:
            logging.getLogger("dsgd").removeHandler(warnings)
        result.update(poisoned=listed(poisoned), after_skip=[listed(r) for r in replica_weights(sgd)],
                      skip_warnings=warnings.messages)
        sgd.set_weights(good)
        sgd.resize(3)
        stats += [sgd.step(fetch_stats=True) for _ in range(STAGE_STEPS)]
        result["plans"].append(plan(sgd))
        result["replicas_at_3"] = [listed(r) for r in replica_weights(sgd)]
        sgd._ledger.resizer._last_look -= INTERVAL_S  # resize_interval_s has passed since the engine last looked
        stats += [sgd.step(fetch_stats=True) for _ in range(STAGE_STEPS)]
        result["plans"].append(plan(sgd))
        return {**result, "stats": [{k: float(v) for k, v in s.items()} for s in stats], "num_workers": sgd.num_workers,
                "replicas": [listed(r) for r in replica_weights(sgd)]}


def tf_keras() -> dict:
    with dsgd.DistributedSGD(km.dense_creator, num_workers=4, strategy="ps", grad_shard_bytes=TF_KERAS_PARTITION_BYTES,
                             **TIMEOUTS) as sgd:
        start = sgd.get_weights()
        for _ in range(km.STEPS):
            sgd.step()
        return {"plan": plan(sgd), "start": listed(start), "replicas": [listed(r) for r in replica_weights(sgd)]}


def tf2() -> dict:
    with dsgd.DistributedSGD(m.FixedRegression, num_workers=4, strategy="ps", grad_shard_bytes=TF2_PARTITION_BYTES,
                             **TIMEOUTS) as sgd:
        start = sgd.get_weights()
        for _ in range(TF2_STEPS):
            sgd.step()
        return {"plan": plan(sgd), "start": listed(start), "steps": TF2_STEPS,
                "replicas": [listed(r) for r in replica_weights(sgd)]}


def tf2_data() -> dict:
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    with dsgd.DistributedSGD(dm.row_id_tf2_creator(DATA_ROWS), datasets={"train": ray.data.range(DATA_ROWS)},
                             num_workers=4, strategy="ps", grad_shard_bytes=4, **TIMEOUTS) as sgd:
        for _ in range(DATA_STEPS):
            sgd.step()
        return {"plan": plan(sgd), "rows": DATA_ROWS, "steps": DATA_STEPS,
                "seen": sgd.foreach_model(lambda model: model.split.seen),
                "replicas": [listed(r) for r in replica_weights(sgd)]}


def tune_trial(scratch: str) -> dict:
    from ray import tune

    import dsgd.tune as dsgd_tune
    import tune_test_models

    class Reports(tune.Callback):
        """Every report as it arrives (a restarted trial's metrics_dataframe may hold only those after the restart),
        and the layout while the trial's engine runs: the nodes of its placement group's bundles, workers and
        parameter servers, and the workers' actor ids (a restarted trial's engine has new ones)."""

        def __init__(self):
            self.seen: list[dict] = []

        def on_trial_result(self, iteration, trials, trial, result, **info):
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
            actors = live_actors()
            workers, servers = actors.get("SGDWorker", []), actors.get("ParameterServer", [])
            self.seen.append({**{k: float(result[k]) for k in TUNE_METRICS},
                              "bundles": [{str(b): n for b, n in g["bundles_to_node_id"].items()} for g in groups],
                              "workers": [node for _, node in workers], "servers": [node for _, node in servers],
                              "worker_ids": [actor_id for actor_id, _ in workers]})

    marker = os.path.join(scratch, "killed")
    trainable = dsgd_tune.trainable(tune_test_models.regression_creator, steps_per_report=TUNE_STEPS_PER_REPORT,
                                    num_workers=4, strategy="ps", grad_shard_bytes=4, max_failures=0, **TIMEOUTS)
    reports = Reports()
    results = tune_test_models.run(trainable, {"lr": TUNE_LR, "momentum": TUNE_MOMENTUM, "kill_at": TUNE_KILL_AT,
                                               "marker": marker}, os.path.join(scratch, "tune"), TUNE_REPORTS,
                                   callbacks=[reports])
    return {"reports": reports.seen, "killed": os.path.exists(marker), "lr": TUNE_LR, "momentum": TUNE_MOMENTUM,
            "checkpoint": listed(tune_test_models.final_state(results[0]))}


def main(scratch: str, runs: list[str]) -> None:
    engines = {"keras3": lambda: keras3(scratch), "tf_keras": tf_keras, "tf2": tf2, "tf2_data": tf2_data,
               "tune": lambda: tune_trial(scratch)}
    with local_cluster(NODE_ARGS, NODE_ARGS):
        result: dict = {"nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]), "seconds": {}}
        for name in runs:
            start = time.monotonic()
            result[name] = engines[name]()
            result["seconds"][name] = time.monotonic() - start
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

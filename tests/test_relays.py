"""Node-local aggregation (relays) together with 2 devices, a resize, an elastic engine, a timeline, a logdir,
nan_policy, and a Keras 3 model; and (slow) with tf_keras and TF2Model models, Ray Data and in a Ray Tune trial;
each against a single-process reference.

tests/relays_job.py runs the engines one after another on a two-node cluster
in a subprocess (``run_job``); see its docstring for the set-up. The default
suite runs one job, the Keras 3 engine (the TF2 runtime's relays; a
``TF2Model`` runs on the same runtime). The slow runs (the suite's time
budget): the tf_keras and ``TF2Model`` engines, one job; the Ray Data run
and the Tune trial, a job each (the engine alone took 39 s; the trial with
its restart, 58 s). tests/test_multinode.py runs relays with TF1 models
(bf16, a checkpoint, faults), whose runtime a tf_keras model runs on.
"""

import os
from pathlib import Path

import numpy as np
import pytest

import data_test_models as dm
import keras_test_models as km
import tf2_test_models as m
from background_jobs import QUEUE, Job
from cluster_jobs import assert_relays_push_down_streams
from dsgd_test_models import assert_weights_close, identical_job_replicas, weights_from_json
from job_processes import run_job
from readers import load_trace, read_scalars
from tune_test_models import numpy_descent

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relays_job.py")
TIMEOUT_S = 480
DEVICES, STAGE_STEPS = 2, 2


BACKGROUND_JOBS = {"job": Job(JOB, TIMEOUT_S, ("keras3",), scratch=True),
                   "other_models_job": Job(JOB, TIMEOUT_S, ("tf_keras", "tf2"), scratch=True)}


@pytest.fixture(scope="module")
def scratch() -> Path:
    """The job's directory (its timeline and logdir), which the slow jobs share."""
    return Path(QUEUE.scratch(BACKGROUND_JOBS["job"].name))


@pytest.fixture(scope="module")
def job() -> dict:
    return QUEUE.result(BACKGROUND_JOBS["job"])


@pytest.fixture(scope="module")
def other_models_job() -> dict:
    return QUEUE.result(BACKGROUND_JOBS["other_models_job"])


def replicas(workers: int) -> list[tuple[int, int]]:
    return [(w, d) for w in range(workers) for d in range(DEVICES)]


def assert_relayed(plan: dict) -> None:
    """Some partition is relayed; every partition is relayed from every node other than its server's that holds two
    or more workers (by a server there, summing exactly that node's workers) and from no other node, and the
    relays' partial sums go down streams."""
    workers_on: dict[str, list[int]] = {}
    for w, node in enumerate(plan["worker_nodes"]):
        workers_on.setdefault(node, []).append(w)
    ps_nodes = plan["ps_nodes"]
    for home, relays in zip(plan["placement"], plan["relays"]):
        expected = sorted([node, workers] for node, workers in workers_on.items()
                          if node != ps_nodes[home] and len(workers) >= 2 and node in ps_nodes)
        assert sorted([ps_nodes[r], workers] for r, workers in relays) == expected
    assert any(plan["relays"]), plan
    assert_relays_push_down_streams(plan["relays"], plan["relay_transports"], plan["placement"])


def test_keras3_elastic_engine_with_relays_resizes_skips_a_nan_step_and_trains_like_the_reference(job):
    """A Keras 3 model with batch normalization, 2 devices per worker, in an elastic engine: 4 workers on two nodes
    (relays planned), a traced step, a step whose mean is NaN skipped on every replica (every weight as it was), a
    resize to 3 (a node of 2 workers still relays), a grow back to 4 by the engine (relays planned again). Every
    replica is bit-identical at each size, and the weights equal the eager reference of the replicas alive at each
    step, the momentum carried through."""
    run = job["keras3"]
    at_4, at_3, back_at_4 = run["plans"]
    assert len(at_4["worker_nodes"]) == 4 and set(at_4["worker_nodes"]) == set(job["nodes"])
    assert_relayed(at_4)
    assert len(at_3["worker_nodes"]) == 3
    assert_relayed(at_3)
    assert len(back_at_4["worker_nodes"]) == 4 and run["num_workers"] == 4
    assert_relayed(back_at_4)
    # the skipped step: every replica holds the poisoned weights, NaN where they were NaN, the rest unchanged
    poisoned = weights_from_json(run["poisoned"])
    for replica in [weights_from_json(r) for r in run["after_skip"]]:
        assert list(replica) == list(poisoned)
        for name in poisoned:
            assert np.array_equal(replica[name], poisoned[name], equal_nan=True), name
    at_sizes = [8.0] * (STAGE_STEPS + 1) + [6.0] * STAGE_STEPS + [8.0] * STAGE_STEPS  # 4 workers (the skip too), 3, 4
    assert [s["num_replicas"] for s in run["stats"]] == at_sizes
    assert any(message.startswith("skipped a step (nan_policy='skip'): non-finite") for message in run["skip_warnings"])
    start = weights_from_json(run["start"])
    at_3 = identical_job_replicas(run["replicas_at_3"], 3 * DEVICES)
    stages = [(STAGE_STEPS, replicas(4)), (STAGE_STEPS, replicas(3))]
    expected, _ = m.reference_stages("sequential", "sgd", start, stages, fixed=True)
    assert_keras3_close(at_3, expected)
    final = identical_job_replicas(run["replicas"], 4 * DEVICES)
    expected, _ = m.reference_stages("sequential", "sgd", start, stages + [(STAGE_STEPS, replicas(4))], fixed=True)
    assert_keras3_close(final, expected)


def assert_keras3_close(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name in got:
        np.testing.assert_allclose(got[name], expected[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_the_relayed_steps_timeline_shows_each_relays_partial_sum_and_the_logdir_every_fetched_step(job, scratch):
    """The traced step (4 workers): each relaying server's trace has its push of the node's partial sum of each
    partition it relays, and the partition's server the partial sum's arrival; the TensorBoard logdir has every
    fetched step's scalars, the replica count following the resizes."""
    run = job["keras3"]
    at_4 = run["plans"][0]
    processes, spans = load_trace(scratch / "step.json")
    assert sorted(processes.values()) == sorted(["driver"] + [f"worker {w}" for w in range(4)]
                                                + [f"parameter server {s}" for s in range(len(at_4["ps_nodes"]))])
    names = {process: [e["name"] for e in events] for process, events in spans.items()}
    relayed = 0
    for j, (home, relays) in enumerate(zip(at_4["placement"], at_4["relays"])):
        for r, workers in relays:
            pushed = [n for n in names[f"parameter server {r}"]
                      if n.startswith(f"push the node's partial sum of partition {j} (workers {workers},")]
            assert pushed and pushed[0].endswith(f"to parameter server {home}"), (j, r)
            arrived = f"the partial sum of workers {workers}: push of partition {j} (waits for the sum)"
            assert arrived in names[f"parameter server {home}"], (j, home)
            relayed += 1
    assert relayed > 0
    scalars = read_scalars(scratch / "logs")
    assert [value for _, value, _ in scalars["num_replicas"]] == [s["num_replicas"] for s in run["stats"]]
    assert [value for _, value, _ in scalars["node_sent_bytes"]] == [s["node_sent_bytes"] for s in run["stats"]]


@pytest.mark.slow
def test_tf_keras_model_with_relays_trains_like_sgd_on_the_union_of_batches(other_models_job):
    run = other_models_job["tf_keras"]
    assert_relayed(run["plan"])
    got = identical_job_replicas(run["replicas"], 4)
    expected = {k: np.array(v, np.float64) for k, v in run["start"].items()}
    for step in range(km.STEPS):
        expected = km.dense_sgd_step(expected, [(w, 0) for w in range(4)], step)
    assert_weights_close(got, expected)


@pytest.mark.slow
def test_tf2_model_with_relays_trains_like_the_reference(other_models_job):
    run = other_models_job["tf2"]
    assert_relayed(run["plan"])
    got = identical_job_replicas(run["replicas"], 4)
    expected = m.regression_reference(weights_from_json(run["start"]), [(w, 0) for w in range(4)], run["steps"],
                                      fixed=True)
    assert_weights_close(got, expected)


@pytest.mark.slow
def test_tf2_model_reading_ray_data_with_relays_trains_on_every_replicas_own_rows(scratch):
    """A TF2Model reading a Ray Dataset (its first batch at build) on 4 workers over two nodes: each replica reads
    its own split, and every step trains on the replicas' batches, as the numpy reference does."""
    run = run_job(JOB, TIMEOUT_S, str(scratch), "tf2_data")["tf2_data"]
    assert_relayed(run["plan"])
    seen, rows = run["seen"], run["rows"]
    assert [[len(ids) for ids in s] for s in seen] == [[2 * dm.BATCH, dm.BATCH]] * 4
    dm.assert_disjoint_equal_cover([s[0] for s in seen], rows)
    w = np.zeros(2)
    for step in range(run["steps"]):  # step k: each replica's k-th batch
        w = dm.numpy_step(w, [(s[0] + s[1])[step * dm.BATCH:(step + 1) * dm.BATCH] for s in seen], rows)
    got = identical_job_replicas(run["replicas"], 4)
    np.testing.assert_allclose(got["w"], w, rtol=1e-5)


@pytest.mark.slow
def test_a_tune_trial_over_two_nodes_relays_resumes_from_its_checkpoint_and_trains_like_numpy(scratch):
    """A Ray Tune trial (``dsgd.tune.trainable``) of 4 workers: its placement group packs the trial's bundle and two
    workers' on one node, two workers' on the other, so each node's server relays the other's partitions. Worker 1
    dies in the third report and Tune restarts the trial from the second's checkpoint, on a new engine that plans
    the relays again. Every report's loss, and the last checkpoint's weights, are those of momentum SGD on the
    4 replicas' batches in numpy, step for step across the restart."""
    run = run_job(JOB, TIMEOUT_S, str(scratch), "tune")
    nodes, trial = run["nodes"], run["tune"]
    reports = trial["reports"]
    assert trial["killed"]
    assert [(r["training_iteration"], r["num_steps"]) for r in reports] == [(1, 2), (2, 4), (3, 6), (4, 8)]
    engines = [r["worker_ids"] for r in reports]
    assert engines[0] == engines[1] and engines[2] == engines[3] and not set(engines[1]) & set(engines[2])
    for report in reports:
        (bundles,) = report["bundles"]  # the trial's placement group, the job's only one
        trial_node = bundles["0"]
        assert sorted(bundles.values()) == sorted([trial_node] * 3 + [n for n in nodes if n != trial_node] * 2)
        assert sorted(report["workers"]) == sorted(nodes * 2) and sorted(report["servers"]) == nodes
        # 5 partitions of 4 bytes on the two servers (3 and 2): a node's relay sends the sum of its two workers'
        # copies of the other node's partitions, at most 3 x 4 bytes a step; without relays both copies, 24
        assert report["node_sent_bytes"] == 12 and report["num_replicas"] == 4
    replicas = [(w, 0) for w in range(4)]
    weights, losses = numpy_descent(trial["lr"], replicas, 8, trial["momentum"])
    np.testing.assert_allclose([r["loss"] for r in reports], [losses[int(r["num_steps"]) - 1] for r in reports],
                               rtol=1e-4)
    np.testing.assert_allclose(trial["checkpoint"]["weights/w"], weights, rtol=1e-4, atol=1e-6)

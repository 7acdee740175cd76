"""Backup workers: a step averages the first num_workers - b workers, a straggler catches up without
computing, the replicas stay identical, and a dead worker does not stop the steps."""

import concurrent.futures
import functools
import json

import numpy as np
import pytest
import ray

import dsgd
from dsgd.cluster.topology import Topology
from dsgd.common.results import Backup, StepResult, Value
from dsgd.driver import checkpoint, step_stats
from dsgd.transport import object_store
from dsgd import ps_actor
from dsgd.wire.partitions import VarSpec, plan_partitions, segments
from dsgd_test_models import (LR, Gate, GatedStragglerNet, TanhNet, actor_pids, assert_replicas_identical,
                              assert_weights_close, batch, kill, numpy_forward, numpy_gradients, numpy_step, ps_actors,
                              pushes_waiting,
                              server_group, set_start_weights, wait_until)

FAST = [(0, 0), (1, 0)]  # (worker, device) of the workers that keep up with each other


def _begun(server) -> dict[int, int]:
    """Worker -> the last step it began, on one parameter server."""
    return ray.get(server.__ray_call__.remote(lambda ps: dict(ps.begun)), timeout=30)


# ---- the server's rule ------------------------------------------------------

LAYOUT = plan_partitions([VarSpec("a", (6,), np.dtype(np.float32))], 0)
TWO_PARTITIONS = plan_partitions([VarSpec("a", (6,), np.dtype(np.float32)), VarSpec("b", (6,), np.dtype(np.float32))],
                                 24)


def _push(server, step, worker, value, partition=LAYOUT[0]):
    flat = np.full(partition.size, value, np.float32)
    return server.push.remote(step, worker, partition.index, object_store.put([flat[s.start:s.start + s.size]
                                                                               for s in segments(partition)]))


def _mean(answer):
    [ref], averaged = answer
    return object_store.join(ray.get(ref, timeout=30), [LAYOUT[0].size])[0][0], averaged


def test_a_server_averages_the_first_pushes_and_answers_a_late_one_with_their_mean(ray_session):
    server = ps_actor.start(0, 3, LAYOUT, 30.0, backup_workers=1)
    try:
        first = [_push(server, 0, 2, 4.0), _push(server, 0, 0, 2.0)]
        assert _mean(ray.get(first[0], timeout=30)) == (3.0, (0, 2))
        assert _mean(ray.get(first[1], timeout=30)) == (3.0, (0, 2))
        assert _mean(ray.get(_push(server, 0, 1, 100.0), timeout=30)) == (3.0, (0, 2))  # late: dropped
        # Worker 1 begins step 1 and finds it open; workers 0 and 2 close it without worker 1.
        assert ray.get(server.begin.remote(1, 1), timeout=30) == {}
        step_1 = [_push(server, 1, 0, 1.0), _push(server, 1, 2, 3.0)]
        assert _mean(ray.get(step_1[0], timeout=30)) == (2.0, (0, 2))
        # Step 2 closes only once every worker has begun step 1: worker 1 has, so it closes.
        step_2 = [_push(server, 2, 0, 5.0), _push(server, 2, 1, 7.0)]
        assert _mean(ray.get(step_2[0], timeout=30)) == (6.0, (0, 1))
        # Worker 2 has not begun step 2, so step 3 waits for it: nobody is ever two steps behind.
        step_3 = [_push(server, 3, 0, 1.0), _push(server, 3, 1, 1.0)]
        wait_until(lambda: pushes_waiting(server) == {0: [2]})  # both pushes arrived; not closed without worker 2
        assert not ray.wait(step_3, timeout=0)[0]
        closed = ray.get(server.begin.remote(2, 2), timeout=30)  # worker 2 finds step 2 closed: it catches up
        assert list(closed) == [0] and _mean(closed[0]) == (6.0, (0, 1))
        assert _mean(ray.get(step_3[0], timeout=30)) == (1.0, (0, 1))
    finally:
        ray.kill(server)


def test_a_server_with_backup_workers_chooses_the_workers_of_each_partition_apart(ray_session):
    """One step, two partitions pushed in opposite orders: partition 0 averages workers 0 and 1, which came
    first, and partition 1 workers 1 and 2; each late push is answered with its own partition's mean."""
    first, second = TWO_PARTITIONS
    server = ps_actor.start(0, 3, TWO_PARTITIONS, 30.0, backup_workers=1)
    try:
        early = {first: [_push(server, 0, w, value, first) for w, value in [(0, 2.0), (1, 4.0)]]}
        assert [_mean(a) for a in ray.get(early[first], timeout=30)] == [(3.0, (0, 1))] * 2
        early[second] = [_push(server, 0, w, value, second) for w, value in [(2, 8.0), (1, 4.0)]]
        assert [_mean(a) for a in ray.get(early[second], timeout=30)] == [(6.0, (1, 2))] * 2
        assert _mean(ray.get(_push(server, 0, 2, 100.0, first), timeout=30)) == (3.0, (0, 1))
        assert _mean(ray.get(_push(server, 0, 0, 100.0, second), timeout=30)) == (6.0, (1, 2))
    finally:
        ray.kill(server)


def worker_result(loss: list[float], abs_error: list[float], computed: bool = True) -> StepResult:
    """A worker's step result: each replica's loss and metric, and its backup outcome (workers 0 and 2 kept)."""
    values = {"loss": Value.mean(loss), "abs_error": Value.mean(abs_error)} if computed else {}
    return StepResult(values, backup=Backup(computed, (0, 2)))


def test_a_steps_loss_and_metrics_are_the_means_of_the_workers_that_computed_it():
    """A worker that caught up on the step (it applied the servers' means without computing) returns no loss."""
    per_worker = [worker_result([1.0, 1.0], [4.0, 4.0]), worker_result([], [], computed=False),
                  worker_result([3.0, 3.0], [8.0, 8.0])]
    stats = step_stats.combine(5, per_worker, Topology("ps", 3, 1), devices_per_worker=2)
    assert stats == {"loss": 2.0, "abs_error": 6.0, "num_replicas": 4.0, "dropped_gradients": 1.0}


def test_workers_that_report_different_metrics_are_named_not_averaged():
    per_worker = [StepResult({"loss": Value.mean([1.0]), "abs_error": Value.mean([4.0])}),
                  StepResult({"loss": Value.mean([3.0]), "accuracy": Value.mean([0.5])})]
    with pytest.raises(dsgd.WorkerMismatchError, match=r"different metrics: \['abs_error', 'loss'\] and "
                                                       r"\['accuracy', 'loss'\]"):
        step_stats.combine(5, per_worker, Topology("ps", 2, 0), devices_per_worker=1)


# ---- the engine ---------------------------------------------------------------

def test_a_straggler_is_left_out_and_catches_up_without_computing(ray_session, tmp_path):
    """Through the op library (``backup_engine``'s tests take the Python path).

    The straggler is held at a gate in its first batch, not slowed by a sleep. A step closes only once every
    worker has begun the one before, so the held worker lets the others take two steps without it; let go, it
    finds the second closed and catches up without computing it. Then worker 1 is held too, more held workers
    than backups: the step waits until one of them is let go, and leaves the other out."""
    gate = Gate(str(tmp_path / "gate-0"))  # GatedStragglerNet's gate for its batch 0
    gate.close()
    creator = functools.partial(GatedStragglerNet, gates=str(tmp_path / "gate"))
    with dsgd.DistributedSGD(creator, num_workers=3, strategy="ps", use_ops=True, backup_workers=1,
                             grad_shard_bytes=40) as sgd:
        expected = set_start_weights(sgd)
        servers = ps_actors(sgd)
        steps = 2
        for step in range(steps):
            stats = sgd.step(fetch_stats=True)
            gate.wait_arrived()  # the straggler is held in step 0 while this step closes
            assert stats["num_replicas"] == 2 and stats["dropped_gradients"] == 1
            # The loss and the metric are the means of the two workers that computed the step.
            losses, errors = zip(*[numpy_forward(expected, *batch(w, d, step))[2:] for w, d in FAST])
            assert np.isclose(stats["loss"], np.mean(losses), rtol=1e-5)
            assert np.isclose(stats["abs_error"], np.mean(errors), rtol=1e-5)
            # Step `step` closed: every worker has begun step - 1 (so applied every step before it).
            assert all(min(_begun(server).values()) >= step - 1 for server in servers)
            expected = numpy_step(expected, FAST, step)
        assert ray.get([w.applied_steps_count.remote() for w in sgd.workers[:2]], timeout=30) == [steps] * 2
        gate.open()
        sgd.save(tmp_path / "ckpt.npz")  # the straggler is behind: save waits for it
        with np.load(tmp_path / "ckpt.npz") as saved:
            assert json.loads(str(saved[checkpoint.META_KEY]))["applied_steps"] == steps
            assert_weights_close({k: saved[f"weights/{k}"] for k in expected}, expected)
        assert_weights_close(sgd.get_weights(), expected)  # the means of workers 0 and 1 only
        assert_replicas_identical(sgd, 3)  # the drain waited for the straggler to catch up
        # The straggler computed step 0 and caught up on step 1 without computing it.
        assert sgd.foreach_model(lambda m: m.step) == [steps, steps, 1]
        assert ray.get([w.applied_steps_count.remote() for w in sgd.workers], timeout=30) == [steps] * 3
        # Workers 1 and 2 held at their next batch (1's batch 2, 2's batch 1): worker 0's push alone cannot close
        # the step. Let worker 1 go: the step closes with workers 0 and 1 on every partition (the weights are
        # theirs), worker 2 left out. (Untraced: a traced step waits for every worker's spans.)
        worker_1_gates = str(tmp_path / "worker-1-gate")
        held = {1: Gate(f"{worker_1_gates}-{steps}"), 2: Gate(str(tmp_path / "gate-1"))}
        for worker_gate in held.values():
            worker_gate.close()
        sgd.foreach_model(lambda model: model.held.update({1: worker_1_gates}))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            step = pool.submit(sgd.step, fetch_stats=True)
            try:
                for worker_gate in held.values():
                    worker_gate.wait_arrived()
                assert not step.done()  # both held before computing: one push of three, the step stays open
                held[1].open()
                stats = step.result(timeout=120)
            finally:
                for worker_gate in held.values():
                    worker_gate.open()
        assert stats["num_replicas"] == 2 and stats["dropped_gradients"] == 1
        assert_weights_close(sgd.get_weights(), numpy_step(expected, FAST, steps))
        assert_replicas_identical(sgd, 3)


def _trace_of_step(sgd, path) -> tuple[tuple[int, ...], set[int]]:
    """Run one step with a timeline; the workers its partition averaged, and those that pushed it."""
    sgd.step(write_timeline=str(path))
    with open(path) as f:
        names = [e["name"] for e in json.load(f)["traceEvents"]]
    [averaged] = [n for n in names if n.startswith("average partition 0 of workers")]
    pushed = {int(n.split()[1][:-2]) for n in names if n.startswith("worker ") and "push of partition" in n}
    return tuple(json.loads(averaged.split("workers ")[1])), pushed


@pytest.fixture(scope="module")
def backup_engine(ray_session):
    """3 workers of TanhNet, one a backup, one partition (so each step averages the same workers everywhere), the
    Python path (the straggler test above takes the op library's), for the tests below that start from it."""
    with dsgd.DistributedSGD(TanhNet, num_workers=3, strategy="ps", backup_workers=1, grad_shard_bytes=0,
                             use_ops=False) as sgd:
        yield sgd


def test_without_a_straggler_each_step_averages_the_workers_it_kept(backup_engine, tmp_path):
    sgd = backup_engine
    weights = set_start_weights(sgd)
    batches = [0, 0, 0]  # per worker: the batches it has asked (a worker that catches up asks none)
    for step in range(3):
        averaged, pushed = _trace_of_step(sgd, tmp_path / f"step{step}.json")
        assert len(averaged) == 2 and set(averaged) <= pushed
        grads = [numpy_gradients(weights, *batch(w, 0, batches[w])) for w in averaged]
        weights = {k: weights[k] - LR * np.mean([g[k] for g in grads], axis=0) for k in weights}
        for w in pushed:
            batches[w] += 1
    assert_weights_close(sgd.get_weights(), weights)
    assert_replicas_identical(sgd, 3)
    stats = sgd.step(fetch_stats=True)
    assert stats["num_replicas"] == 2 and stats["dropped_gradients"] == 1
    with pytest.raises(ValueError, match="n must be > backup_workers=1"):  # a step of one would close on no worker
        sgd.resize(1)
    assert sgd.num_workers == 3 and sgd.step(fetch_stats=True)["num_replicas"] == 2


def test_a_worker_killed_does_not_stop_the_steps_and_is_replaced_more_than_b_are_recovered(backup_engine):
    sgd = backup_engine
    set_start_weights(sgd)
    sgd.step(fetch_stats=True)
    steps, failures = sgd.num_steps, sgd.failures
    dead = sgd.workers[2]
    kill(dead)
    stats = sgd.step(fetch_stats=True)  # closes with workers 0 and 1
    assert np.isfinite(stats["loss"]) and stats["dropped_gradients"] == 1
    assert sgd.failures == failures  # no step was aborted or re-run for it
    for _ in range(2):
        sgd.step(fetch_stats=True)
    assert sgd.failures == failures + 1 and sgd.workers[2] is not dead  # replaced, before the next step
    assert_replicas_identical(sgd, 3)
    assert sgd.num_steps == steps + 3
    kill(sgd.workers[1], sgd.workers[2])  # more dead workers than backups: the step cannot close
    stats = sgd.step(fetch_stats=True)  # recovered as without backup workers: replaced, the step run again
    assert sgd.failures == failures + 2 and np.isfinite(stats["loss"])
    assert_replicas_identical(sgd, 3)
    assert ray.get([w.applied_steps_count.remote() for w in sgd.workers], timeout=30) == [steps + 4] * 3


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_workers": 3, "backup_workers": 3}, ValueError, r"backup_workers must be < num_workers.*got backup_workers=3"),
    ({"num_workers": 3, "backup_workers": -1}, ValueError, r"backup_workers must be >= 0"),
    ({"num_workers": 3, "backup_workers": 1.0}, TypeError, r"backup_workers must be an integer"),
    ({"num_workers": 3, "backup_workers": True}, TypeError, r"backup_workers must be an integer"),
    ({"num_workers": 3, "backup_workers": 1, "strategy": "simple"}, ValueError,
     r"backup_workers needs strategy='ps'"),
    ({"num_workers": 1, "backup_workers": 1}, ValueError, r"backup_workers needs several workers"),
])
def test_bad_backup_workers_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        dsgd.DistributedSGD(TanhNet, **kwargs)


@pytest.mark.slow  # the suite's time budget (50 s): backup workers, bf16 and a resize together are
# test_features_together's "ps" runs; the refusal of a size not above backup_workers is the test above
def test_backup_workers_with_bf16_partitions_through_a_resize(ray_session):
    """The three together: one backup worker, 16-bit partitions, 3 -> 4 -> 3 workers; replicas stay identical."""
    with dsgd.DistributedSGD(TanhNet, num_workers=3, strategy="ps", backup_workers=1, compression="bf16",
                             grad_shard_bytes=40) as sgd:
        half_of_float32 = sum(partition.size for partition in server_group(sgd).layout) * 2  # float32 elements, 2 bytes
        pids = actor_pids(*sgd.workers)
        # No straggler here, so which worker each partition leaves out depends on arrival order; a worker left
        # out of any partition counts as dropped, hence a range (the exact count is tested with a straggler).
        stats = sgd.step(fetch_stats=True)
        assert (stats["num_replicas"], stats["sent_bytes"]) == (2, half_of_float32)
        assert 1 <= stats["dropped_gradients"] <= 3
        sgd.resize(4)
        stats = sgd.step(fetch_stats=True)
        assert stats["num_replicas"] == 3 and 1 <= stats["dropped_gradients"] <= 4
        assert_replicas_identical(sgd, 4)
        with pytest.raises(ValueError, match="n must be > backup_workers=1"):
            sgd.resize(1)
        sgd.resize(3)
        assert actor_pids(*sgd.workers) == pids
        assert sgd.step(fetch_stats=True)["num_replicas"] == 2
        assert_replicas_identical(sgd, 3)

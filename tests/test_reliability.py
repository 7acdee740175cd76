"""Faults and non-finite gradients: no run is lost, no replica diverges (checkpoints: test_checkpoint.py)."""

import contextlib
import dataclasses
import functools
import logging
import os
import time

import numpy as np
import pytest
import ray
import tensorflow as tf

import dsgd
from dsgd.wire import partitions
from dsgd.worker import finite_checks, nonfinite
from dsgd.config import WorkerConfig
from dsgd_test_models import (REPLICAS_2x1, BatchNormNet, FixedDataMomentumNet, Gate, GatedWorker1Net, KillCue,
                              NaNOnWorker1AtStep1, TanhNet, actor_pids, actors_started_since,
                              assert_replicas_identical, assert_weights_close, kill, known_actors, numpy_momentum_run,
                              ps_actors, pushes_waiting, set_start_weights, steps_applied, wait_until)
from reliability_test_models import GatedKillOnCues


@pytest.fixture
def warnings_seen(caplog):
    caplog.set_level(logging.WARNING, logger="dsgd")
    return caplog


# Recoveries the shared engine may make over all its tests (each test counts its own).
SHARED_MAX_FAILURES = 50


@dataclasses.dataclass
class SharedEngine:
    """A 2-worker "ps" engine with tiny partitions, shared by the fault tests that need no other configuration.

    Its model is GatedKillOnCues: FixedDataMomentumNet, whose worker 1 passes
    ``gate`` before each batch (open unless a test closes it) and fires
    ``cues["build"]`` as it builds its model, ``cues["feed"]`` as it feeds
    (each unarmed unless a test arms it). ``checkpoint`` holds its start:
    ``start`` weights, zero momentum, step 0.
    """

    sgd: dsgd.DistributedSGD
    gate: Gate
    cues: dict[str, KillCue]
    start: dict
    checkpoint: str

    def fresh(self) -> tuple[dsgd.DistributedSGD, dict]:
        """The engine back at its start (gate open, cues unarmed, the start checkpoint restored) and the start
        weights."""
        self.gate.open()
        for cue in self.cues.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(cue.path)
        self.sgd.restore(self.checkpoint)
        return self.sgd, self.start


@pytest.fixture(scope="module")
def shared(ray_session, tmp_path_factory):
    """The module's SharedEngine: built for its first test, shut down after its last."""
    folder = tmp_path_factory.mktemp("shared_engine")
    gate, cues = Gate(str(folder / "gate")), {at: KillCue(str(folder / f"{at}_cue")) for at in ("build", "feed")}
    creator = functools.partial(GatedKillOnCues, gate=gate, build_cue=cues["build"], feed_cue=cues["feed"])
    with dsgd.DistributedSGD(creator, num_workers=2, strategy="ps", grad_shard_bytes=40,
                             max_failures=SHARED_MAX_FAILURES) as sgd:
        start = set_start_weights(sgd)
        checkpoint = str(folder / "start.ckpt")
        sgd.save(checkpoint)
        yield SharedEngine(sgd, gate, cues, start, checkpoint)


def test_parameter_server_killed_between_and_during_steps(shared, warnings_seen):
    sgd, start = shared.fresh()
    gate, failures = shared.gate, sgd.failures
    sgd.step()
    sgd.get_weights()  # waits for step 0
    # Between steps: both workers have applied step 0 (asked directly: the driver's calls would
    # first wait for the steps in flight), and no push waits on any server.
    assert steps_applied(sgd) == [1, 1]
    assert [pushes_waiting(server) for server in ps_actors(sgd)] == [{}, {}]
    kill(ps_actors(sgd)[0])
    sgd.step(fetch_stats=True)
    assert "parameter server 0 is dead" in warnings_seen.text
    gate.close()
    sgd.step()  # worker 1 is held before its batch; worker 0 pushes its partitions and waits
    gate.wait_arrived()
    server_1 = ps_actors(sgd)[1]
    wait_until(lambda: pushes_waiting(server_1))
    # During a step: worker 0's push of step 2 waits on server 1 for worker 1's, which is held.
    assert set(map(tuple, pushes_waiting(server_1).values())) == {(1,)}
    kill(server_1)
    gate.open()
    got = sgd.get_weights()
    assert "parameter server 1 is dead" in warnings_seen.text
    assert sgd.failures - failures == 2
    assert_replicas_identical(sgd, 2)
    assert_weights_close(got, numpy_momentum_run(start, REPLICAS_2x1, 3))


def test_worker_killed_is_replaced_with_weights_and_optimizer_state(shared, warnings_seen):
    sgd, start = shared.fresh()
    sgd.step()
    sgd.step()
    old_pid = ray.get(sgd.workers[1].identity.remote()).pid
    kill(sgd.workers[1])
    stats = sgd.step(fetch_stats=True)
    assert np.isfinite(stats["loss"])
    assert "worker 1 is dead" in warnings_seen.text
    assert ray.get(sgd.workers[1].identity.remote()).pid != old_pid
    sgd.step()
    assert_replicas_identical(sgd, 2)
    # Momentum slots came along: the result equals an uninterrupted run.
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 4))


def test_worker_killed_while_save_reads_its_state_is_replaced_and_the_state_read_again(shared, warnings_seen,
                                                                                      tmp_path, monkeypatch):
    """Worker 0 dies after ``save`` asked every worker for its step count and before it reads worker 0's state."""
    path = str(tmp_path / "run.ckpt")
    sgd, start = shared.fresh()
    failures = sgd.failures
    sgd.step()
    calls, worker_0 = sgd._ledger.cluster.calls, sgd.workers[0]
    answers, pids = calls.answers, actor_pids(worker_0)

    def answers_then_kill(*args, **kwargs):
        monkeypatch.undo()
        result = answers(*args, **kwargs)
        kill(worker_0, pids=pids)
        return result

    monkeypatch.setattr(calls, "answers", answers_then_kill)
    sgd.save(path)
    assert "worker 0 is dead" in warnings_seen.text and sgd.failures - failures == 1
    sgd.step()
    sgd.restore(path)
    assert sgd.num_steps == 1
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 1))


def test_worker_killed_between_steps_is_recovered_by_the_calls_that_need_it(shared, warnings_seen):
    """get_weights recovers and reads; foreach_model recovers but does not run the user's function twice."""
    sgd, start = shared.fresh()
    failures = sgd.failures
    sgd.step()
    sgd.get_weights()  # waits for step 0: nothing is in flight when worker 0 dies
    kill(sgd.workers[0])
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 1))
    assert "worker 0 is dead" in warnings_seen.text and sgd.failures - failures == 1
    kill(sgd.workers[1])
    with pytest.raises(dsgd.DSGDError, match=r"^foreach_model may have run on some workers and not others, so "
                                             r"it was not run again after the engine recovered .* worker 1 "
                                             r"failed \(pid \d+"):
        sgd.foreach_model(lambda model: 1)
    assert sgd.failures - failures == 2
    assert sgd.foreach_model(lambda model: 1) == [1, 1]
    sgd.step()
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))


def test_past_max_failures_the_error_names_the_dead_actor(ray_session):
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="simple", max_failures=0) as sgd:
        sgd.step()
        kill(sgd.workers[0])
        with pytest.raises(dsgd.DSGDError, match="giving up after 0 recoveries.*worker 0 failed"):
            sgd.step()


def test_every_worker_killed_says_to_restore_from_a_checkpoint(ray_session):
    with dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="simple") as sgd:
        sgd.step()
        for worker in sgd.workers:
            kill(worker)
        with pytest.raises(dsgd.DSGDError, match="every worker died, so no replica is left to restore the weights "
                                                 "from; restore from a checkpoint"):
            sgd.step(fetch_stats=True)


# ---- faults at once: each ends recovered, every replica identical -------------


def test_worker_and_parameter_server_killed_in_the_same_step(shared, warnings_seen):
    sgd, start = shared.fresh()
    gate, failures = shared.gate, sgd.failures
    sgd.step()
    worker_1, server_0 = sgd.workers[1], ps_actors(sgd)[0]
    pids = actor_pids(worker_1, server_0)
    assert steps_applied(sgd) == [1, 1]  # step 0 done: the gate holds step 1
    gate.close()
    sgd.step()  # step 1: worker 1 is held before its batch; worker 0 pushes its partitions and waits
    gate.wait_arrived()
    wait_until(lambda: any(pushes_waiting(server) for server in ps_actors(sgd)))
    # Mid-step: every push waiting on a server waits for worker 1 only.
    assert {tuple(w) for server in ps_actors(sgd) for w in pushes_waiting(server).values()} == {(1,)}
    fault = time.monotonic()
    kill(worker_1, server_0, pids=pids)
    gate.open()  # for the replacement worker 1, which re-runs step 1
    got = sgd.get_weights()  # waits for step 1, which recovery re-runs
    print(f"time to recover, a worker and a parameter server killed in one step: {time.monotonic() - fault:.1f}s")
    assert "worker 1 is dead" in warnings_seen.text
    assert "parameter server 0 is dead" in warnings_seen.text
    assert sgd.failures - failures == 1
    assert_replicas_identical(sgd, 2)
    assert_weights_close(got, numpy_momentum_run(start, REPLICAS_2x1, 2))


@pytest.mark.parametrize("at", ["build", "feed"])
def test_parameter_server_killed_during_recovery(shared, warnings_seen, at):
    """Worker 1 is killed; while the driver recovers, the new worker 1 kills server 0.

    "build": as it builds its model, inside ``replace_dead``: the servers are
    checked after the workers are replaced, so one recovery replaces both.
    "feed": as it feeds the re-run step: that re-run fails, and a second
    recovery replaces the server and runs the step again.
    """
    sgd, start = shared.fresh()
    cue, failures = shared.cues[at], sgd.failures
    sgd.step()
    sgd.get_weights()
    cue.arm(actor_pids(ps_actors(sgd)[0])[0])
    fault = time.monotonic()
    kill(sgd.workers[1])
    stats = sgd.step(fetch_stats=True)  # step 1: recovery starts a new worker 1, which kills server 0
    print(f"time to recover, a parameter server killed while recovering from a dead worker ({at}): "
          f"{time.monotonic() - fault:.1f}s from the worker's kill, {time.time() - cue.fired_at():.1f}s from "
          "the server's")
    assert np.isfinite(stats["loss"])
    assert "worker 1 is dead" in warnings_seen.text
    assert "parameter server 0 is dead" in warnings_seen.text
    assert sgd.failures - failures == {"build": 1, "feed": 2}[at]
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))


@pytest.mark.parametrize("call", ["save", "set_weights"])
def test_parameter_server_killed_while_the_driver_saves_or_sets_weights(shared, warnings_seen, tmp_path, call,
                                                                      monkeypatch):
    """Step 1 is in flight, worker 1 held before its batch, when the driver calls ``call``; once the driver is
    inside the call (its wait for the steps in flight), server 0 is killed and worker 1 let on.

    The call meets the failure, recovers, re-runs step 1, then saves or sets the weights.
    """
    path = str(tmp_path / "run.ckpt")
    sgd, start = shared.fresh()
    gate, failures = shared.gate, sgd.failures
    sgd.step()
    assert steps_applied(sgd) == [1, 1]
    server_0 = ps_actors(sgd)[0]
    pids = actor_pids(server_0)
    gate.close()
    sgd.step()
    gate.wait_arrived()
    drain, faults = sgd._ledger.drain, []

    def fault_then_drain(*args, **kwargs):
        if not faults:  # the call's first wait: step 1 is in flight, worker 1 still held
            kill(server_0, pids=pids)
            faults.append(time.monotonic())
            gate.open()
        return drain(*args, **kwargs)

    monkeypatch.setattr(sgd._ledger, "drain", fault_then_drain)
    shifted = {k: v + 1 for k, v in start.items()}
    if call == "save":
        sgd.save(path)
    else:
        sgd.set_weights(shifted)
    print(f"time to recover, a parameter server killed while the driver is in {call}: "
          f"{time.monotonic() - faults[0]:.1f}s")
    monkeypatch.undo()
    assert "parameter server 0 is dead" in warnings_seen.text
    assert sgd.failures - failures == 1
    assert_replicas_identical(sgd, 2)
    if call == "save":  # the checkpoint holds step 1, re-run
        sgd.step()
        sgd.restore(path)
        assert sgd.num_steps == 2
        assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))
    else:
        got = sgd.get_weights()
        assert all(np.array_equal(got[k], shifted[k]) for k in shifted)
    sgd.step()
    assert_replicas_identical(sgd, 2)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_non_finite_gradient_is_raised_or_skipped_on_every_replica(ray_session, warnings_seen, policy):
    with dsgd.DistributedSGD(NaNOnWorker1AtStep1, num_workers=2, devices_per_worker=2, strategy="ps",
                             nan_policy=policy) as sgd:
        sgd.step()
        before = sgd.get_weights()
        if policy == "raise":
            with pytest.raises(dsgd.NonFiniteGradientError, match="non-finite gradient of variable '[a-z/]+'"):
                sgd.step(fetch_stats=True)
        else:
            sgd.step(fetch_stats=True)
            assert "skipped a step" in warnings_seen.text
        assert_replicas_identical(sgd, 4)
        after = sgd.get_weights()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        assert np.isfinite(sgd.step(fetch_stats=True)["loss"])  # training goes on


@pytest.mark.parametrize("bad", [None, ("big", np.nan), ("big", -np.inf), ("small", np.nan), ("small", np.inf)])
def test_the_non_finite_check_names_the_variable_in_small_and_large_tensors(bad):
    """Small tensors get a CheckNumerics op, large ones a vectorized check and one assert: both name the variable."""
    sizes = {"small": finite_checks.SMALL_CHECK_ELEMENTS, "big": finite_checks.SMALL_CHECK_ELEMENTS + 1, "other": 7,
             "bigger": 3 * finite_checks.SMALL_CHECK_ELEMENTS}
    config = WorkerConfig(exchange="ps", devices_per_worker=1, gpu=False, all_reduce_alg="auto", cpus_per_worker=1,
                          step_timeout_s=10, startup_timeout_s=10)
    values = {name: np.ones(n, np.float32) for name, n in sizes.items()}
    if bad is not None:
        values[bad[0]][sizes[bad[0]] // 2] = bad[1]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        tensors = [tf.constant(v) for v in values.values()]
        checks = finite_checks.finite_tensors(tensors, list(values), "gradient", config)
        assert len(checks) == 3  # the two small tensors' CheckNumerics and the large ones' assert
        if bad is None:
            session.run(checks)
            return
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            session.run(checks)
    found = nonfinite._MESSAGE.search(raised.value.message)
    assert found is not None and found.groups() == ("gradient", bad[0])


def test_the_apply_waits_for_the_checks_of_gradients_and_values_alike():
    """A non-finite moving statistic fails (or skips) the step before any weight moves: every apply op of the
    gradients depends on the values' check as well as the gradients'."""
    from dsgd.sgd_worker import SGDWorker

    worker = SGDWorker(0, WorkerConfig(exchange="alone", devices_per_worker=1, gpu=False, all_reduce_alg="simple",
                                       cpus_per_worker=1, step_timeout_s=10, startup_timeout_s=10))
    worker.setup(BatchNormNet)
    ops = worker.sess.graph.get_operations()
    applies = [op for op in ops if op.type.startswith("ResourceApply")]
    checks = {kind: {op for op in ops if op.name.startswith(f"{finite_checks.FINITE_SCOPE}_{kind}")}
              for kind in ("gradients", "values")}
    assert applies and all(checks.values())
    for apply in applies:
        upstream = _upstream(apply)
        assert all(upstream & checks[kind] for kind in checks), apply.name


def _upstream(op: tf.Operation) -> set[tf.Operation]:
    """Every op ``op`` waits for, through data or control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for before in [t.op for t in current.inputs] + list(current.control_inputs):
            if before not in seen:
                seen.add(before)
                todo.append(before)
    return seen


@pytest.mark.parametrize("wire", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("bad", [None, ("a", 2, np.nan), ("b", 20, np.inf), ("c", 70_017, -np.inf), ("gap", 6, np.nan)])
def test_the_partition_check_names_the_variable_and_ignores_the_gaps_between_pieces(wire, bad):
    """"ps" through the ops checks each received partition once; a non-finite element in a piece names its
    variable (a gradient, or a value for the exchange's non-trainable tail), one between pieces does not count."""
    specs = [partitions.VarSpec("a", (5,), np.dtype(np.float32)), partitions.VarSpec("b", (70_000,), np.dtype(np.float32)),
             partitions.VarSpec("c", (3,), np.dtype(np.float32))]
    layout = partitions.plan_partitions(specs, 1 << 30)
    assert [(p.partition_offset, p.size) for p in layout[0].pieces] == [(0, 5), (16, 70_000), (70_016, 3)]
    config = WorkerConfig(exchange="ps", devices_per_worker=1, gpu=False, all_reduce_alg="auto", cpus_per_worker=1,
                          step_timeout_s=10, startup_timeout_s=10)
    values = np.ones(layout[0].size, np.float32)
    if bad is not None:
        values[bad[1]] = bad[2]
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        checks = finite_checks.finite_partitions([tf.cast(tf.constant(values), wire)], layout, specs, 2, config)
        assert len(checks) == 1
        if bad is None or bad[0] == "gap":
            session.run(checks)
            return
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            session.run(checks)
    found = nonfinite._MESSAGE.search(raised.value.message)
    assert found is not None and found.groups() == ("value" if bad[0] == "c" else "gradient", bad[0])


def test_exchange_larger_than_the_object_store_is_refused_before_any_parameter_server_starts(ray_session):
    before = known_actors()
    with pytest.raises(ValueError, match="needs 1144 MiB of Ray object-store memory per step.*cluster has 1024 MiB"):
        dsgd.DistributedSGD(Huge, num_workers=2, strategy="ps")
    # The exchange's size is the model's: the two workers started to build it, then were killed (dead by the
    # time the constructor raised). No parameter server started.
    assert actors_started_since(before) == [("SGDWorker", "DEAD")] * 2


class Huge(dsgd.Model):
    """100 M float32 parameters (381 MiB): three copies do not fit in 1 GiB."""

    def __init__(self, worker_index, device_index):
        w = tf.compat.v1.get_variable("w", [100_000_000], initializer=tf.compat.v1.zeros_initializer())
        self.loss = tf.reduce_sum(w)

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def test_slow_step_times_out_with_a_message(ray_session, tmp_path):
    """The driver's bound on a step: "simple", where no parameter server's bound can fire first (their own
    is test_ps_actor's), and worker 1 held until the error came."""
    gate = Gate(str(tmp_path / "gate"))
    with dsgd.DistributedSGD(functools.partial(GatedWorker1Net, gate=gate), num_workers=2, strategy="simple",
                             timeout_s=1) as sgd:
        gate.close()
        try:
            with pytest.raises(dsgd.DSGDTimeoutError, match="timed out after 1s waiting for the workers' gradients of "
                                                            "step 0; raise timeout_s"):
                sgd.step(fetch_stats=True)
            # Worker 1 cannot pass the closed gate, so it had not computed when the bound fired; on a loaded
            # machine it may reach the gate only after the 1 s bound, so wait for it instead of asserting at once.
            gate.wait_arrived()
        finally:
            gate.open()


def test_step_after_shutdown_is_refused(ray_session):
    sgd = dsgd.DistributedSGD(TanhNet, num_workers=1)
    sgd.shutdown()
    for call in (sgd.step, sgd.get_weights, sgd.warmup):
        with pytest.raises(dsgd.DSGDError, match="has been shut down"):
            call()

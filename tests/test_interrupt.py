"""Ctrl-C (KeyboardInterrupt) during step(): the engine stays usable with identical replicas, or shuts down cleanly."""

import json
import os
import signal

import numpy as np
import pytest
import ray

import dsgd
from dsgd.common import calls
from dsgd.driver import checkpoint
from dsgd_test_models import (REPLICAS_2x1, FixedDataMomentumNet, assert_replicas_identical, assert_weights_close,
                              known_actors, numpy_momentum_run, replica_weights, set_start_weights, wait_until,
                              weights_from_json)
from job_processes import run_job

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS_DIR, "interrupt_job.py")
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def job(ray_session) -> dict:
    """The job's result; it runs as another driver of this session's Ray."""
    return run_job(JOB, JOB_TIMEOUT_S, ray.get_runtime_context().gcs_address)


def assert_raised_in_step(result: dict) -> None:
    """The job's KeyboardInterrupt came out of DistributedSGD.step (the functions it passed through say where)."""
    assert "distributed_sgd.py:step" in result["raised_through"], result["raised_through"]


def test_ctrl_c_leaving_a_with_block_leaves_no_actor_alive(job):
    result = job["with_block"]
    assert_raised_in_step(result)
    assert result["started"] == ["ParameterServer", "SGDWorker", "SGDWorker"]  # one server, as the job asks
    assert result["alive_after"] == []


def test_after_ctrl_c_the_next_engine_steps_on_with_identical_replicas_and_is_freed_when_dropped(job):
    result = job["next_engine"]
    assert_raised_in_step(result)
    # Ctrl-C came while the driver gathered the gradients ("simple"), before any apply was sent:
    # the interrupted step counts on no replica. One step before it and one after.
    assert result["num_steps"] == 2
    replicas = [weights_from_json(r) for r in result["replicas"]]
    for name in replicas[0]:
        assert np.array_equal(replicas[1][name], replicas[0][name]), name
    start = weights_from_json(result["start"])
    assert_weights_close(replicas[0], numpy_momentum_run(start, REPLICAS_2x1, result["num_steps"]))
    assert result["alive_after"] == []


@pytest.fixture(scope="module")
def engine(ray_session, tmp_path_factory):
    """The in-process tests' engine and a checkpoint of it as built: each test restores it (no step, no momentum)."""
    path = str(tmp_path_factory.mktemp("interrupt") / "built.ckpt")
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="ps", grad_shard_bytes=40,
                             timeout_s=20) as sgd:
        sgd.save(path)
        yield sgd, path


def fresh(engine) -> tuple[dsgd.DistributedSGD, dict[str, np.ndarray]]:
    """``engine``'s engine as built (no step, no momentum) from known start weights; those weights."""
    sgd, built = engine
    sgd.restore(built)
    return sgd, set_start_weights(sgd)


def submit_to_worker_0_then_interrupt(workers, step_id, fetch_stats):
    """What Ctrl-C between the two workers' calls of a "ps" step leaves: worker 0's call sent, worker 1's not."""
    workers[0].step.remote(step_id, fetch_stats)
    raise KeyboardInterrupt


@pytest.mark.parametrize("worker_1_dies_meanwhile", [False, True], ids=["settled", "recovered"])
def test_interrupt_between_two_workers_calls_is_settled_by_the_next_call(engine, monkeypatch,
                                                                         worker_1_dies_meanwhile):
    # The window is a few microseconds, too short to hit with a real signal: the strategy's submit is
    # replaced for one step. timeout_s bounds the hang this would be without settling.
    sgd, start = fresh(engine)
    failures = sgd.failures
    sgd.step()
    with monkeypatch.context() as patch:
        patch.setattr(sgd._ledger.driver_half, "submit", submit_to_worker_0_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            sgd.step()
    if worker_1_dies_meanwhile:
        actor_id = ray.get(sgd.workers[1].identity.remote(), timeout=30).actor_id
        ray.kill(sgd.workers[1])
        wait_until(lambda: known_actors()[actor_id][1] == "DEAD")
    stats = sgd.step(fetch_stats=True)
    assert np.isfinite(stats["loss"])
    assert_replicas_identical(sgd, 2)
    # Step 0 completes. Worker 0's half of the interrupted step waits for worker 1's: settled, it is
    # aborted and counts nowhere; recovered (worker 1 replaced), it is run again and counts everywhere.
    assert sgd.num_steps == (3 if worker_1_dies_meanwhile else 2)
    assert sgd.failures - failures == int(worker_1_dies_meanwhile)
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, sgd.num_steps))


def interrupt_once(patch, obj, name: str) -> None:
    """Make ``obj.name`` raise KeyboardInterrupt on its next call (as Ctrl-C there would), then work again."""
    original = getattr(obj, name)

    def interrupted(*args, **kwargs):
        patch.setattr(obj, name, original)
        raise KeyboardInterrupt

    patch.setattr(obj, name, interrupted)


def test_interrupt_during_a_recovery_or_a_restore_is_settled_by_the_next_call(engine, monkeypatch, tmp_path):
    sgd, start = fresh(engine)
    failures = sgd.failures
    sgd.step()
    sgd.save(str(tmp_path / "one_step.ckpt"))
    ray.kill(sgd.workers[1])
    # Ctrl-C while the recovery from worker 1's death replaces it.
    interrupt_once(monkeypatch, sgd._cluster, "replace_dead")
    with pytest.raises(KeyboardInterrupt):
        sgd.step(fetch_stats=True)
    # The next call finishes the recovery, and the interrupted step counts on every replica.
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))
    assert sgd.num_steps == 2 and sgd.failures - failures == 2
    assert_replicas_identical(sgd, 2)
    # Ctrl-C in restore after the workers loaded the checkpoint: the next call counts its step.
    interrupt_once(monkeypatch, sgd._cluster, "reset_servers")
    with pytest.raises(KeyboardInterrupt):
        sgd.restore(str(tmp_path / "one_step.ckpt"))
    sgd.step()
    assert sgd.num_steps == 2
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))


def applied_steps_saved(path: str) -> int:
    with np.load(path) as saved:
        return json.loads(str(saved[checkpoint.META_KEY]))["applied_steps"]


def test_ctrl_c_while_a_set_of_calls_is_sent_raises_once_the_last_is_sent():
    """What keeps set_weights from reaching some workers and not others (``dsgd.common.calls.sending``)."""
    sent = []
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a CI shell may have SIGINT ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            with calls.sending():
                os.kill(os.getpid(), signal.SIGINT)
                sent += ["worker 0", "worker 1"]
        assert sent == ["worker 0", "worker 1"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler it found, again
    finally:
        signal.signal(signal.SIGINT, handler)


def test_ctrl_c_while_a_call_between_steps_waits_for_the_workers_leaves_the_engine_usable(engine, monkeypatch,
                                                                                          tmp_path):
    """get_weights, set_weights, save and foreach_worker, each interrupted once its calls are sent; then
    set_weights interrupted between its calls to the two workers (``dsgd.common.calls.sending``)."""
    path = str(tmp_path / "run.ckpt")
    sgd, start = fresh(engine)
    sgd.step()
    interrupt_once(monkeypatch, sgd._cluster.calls, "call")
    with pytest.raises(KeyboardInterrupt):
        sgd.get_weights()
    assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 1))

    sgd.save(path)
    sgd.step()
    interrupt_once(monkeypatch, sgd._cluster.calls, "call")
    with pytest.raises(KeyboardInterrupt):
        sgd.save(path)
    assert applied_steps_saved(path) == 1  # the interrupted save wrote nothing
    sgd.save(path)
    assert applied_steps_saved(path) == 2

    interrupt_once(monkeypatch, sgd._cluster.calls, "call")
    with pytest.raises(KeyboardInterrupt):
        sgd.foreach_worker(lambda worker: worker.runtime.applied_steps)
    assert sgd.foreach_worker(lambda worker: worker.runtime.applied_steps) == [2, 2]

    new = {k: np.full_like(v, 0.5) for k, v in start.items()}
    interrupt_once(monkeypatch, sgd._cluster.calls, "call")
    with pytest.raises(KeyboardInterrupt):
        sgd.set_weights(new)
    assert_weights_close(sgd.get_weights(), new)  # sent to every worker, so set on every replica
    assert_replicas_identical(sgd, 2)

    # Ctrl-C (a real SIGINT) between the two workers' submissions: it takes effect once both are sent.
    newer = {k: np.full_like(v, 0.25) for k, v in start.items()}
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a CI shell may have SIGINT ignored
    try:
        with monkeypatch.context() as patch:
            first, *others = sgd._cluster.workers
            patch.setattr(sgd._cluster, "workers", [CtrlCOnceSubmitted(first), *others])
            with pytest.raises(KeyboardInterrupt):
                sgd.set_weights(newer)
    finally:
        signal.signal(signal.SIGINT, handler)
    for replica in replica_weights(sgd):  # on both workers, read from their graphs
        assert_weights_close(replica, newer)
    assert np.isfinite(sgd.step(fetch_stats=True)["loss"])
    assert sgd.num_steps == 3
    assert_replicas_identical(sgd, 2)


class CtrlCOnceSubmitted:
    """A worker's actor handle whose calls each send this process SIGINT, as Ctrl-C would, right after they are
    submitted: the interrupt lands between that worker's call and the next worker's."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name: str):
        return _Interrupting(getattr(self.worker, name))


class _Interrupting:
    def __init__(self, method):
        self.method = method

    def remote(self, *args, **kwargs):
        ref = self.method.remote(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return ref

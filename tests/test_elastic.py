"""Elastic training: DistributedSGD.resize and num_workers=(min, max) engines (SPEC "Elastic training")."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import ray

import dsgd
import tensorflow as tf
from background_jobs import QUEUE, Job
from dsgd_test_models import (FixedDataMomentumNet, actor_pids, actors_started_since, assert_all_identical,
                              assert_replicas_identical, assert_weights_close, is_dead, kill, known_actors,
                              local_worker, numpy_momentum_stages, ps_actors, set_start_weights, wait_until,
                              weights_from_json)


def momentum_reference(weights: dict, stages: list[tuple[int, int | list[tuple[int, int]]]],
                       devices_per_worker: int = 1) -> dict:
    """Momentum SGD on FixedDataMomentumNet's batches, each step averaging the replicas alive at it.

    ``stages``: (steps, workers) or (steps, [(worker, device) of each replica]).
    """
    return numpy_momentum_stages(weights, [
        (steps, workers if isinstance(workers, list) else
         [(w, d) for w in range(workers) for d in range(devices_per_worker)]) for steps, workers in stages])


def _count_prepared_runs(worker) -> None:
    """Count the runs of each step the worker's exchange has planned ahead (in ``PreparedRun.runs``)."""
    for prepared in worker.exchange.fused._prepared.values():
        def counted(*values, _prepared=prepared, _call=prepared.call):
            _prepared.runs += 1
            return _call(*values)

        prepared.runs, prepared.call = 0, counted


def engine(num_workers=2, strategy="ps", creator=FixedDataMomentumNet, **kwargs) -> dsgd.DistributedSGD:
    kwargs = {"timeout_s": 60, "startup_timeout_s": 60, **kwargs}
    return dsgd.DistributedSGD(creator, num_workers=num_workers, strategy=strategy, **kwargs)


def no_model_for_new_workers_while(flag: str):
    """A model creator of FixedDataMomentumNet replicas; while the file ``flag`` exists, workers from index 2 on
    (those a resize of two workers adds) cannot build theirs."""
    def create(worker_index: int, device_index: int) -> FixedDataMomentumNet:
        if worker_index >= 2 and os.path.exists(flag):
            raise RuntimeError(f"no model for worker {worker_index}")
        return FixedDataMomentumNet(worker_index, device_index)
    return create


def run_steps(sgd, steps: int) -> dict:
    for _ in range(steps):
        stats = sgd.step(fetch_stats=True)
    return stats


# "simple" in the slow tier (the suite's time budget): the resize path is the same, its exchange has no servers
@pytest.mark.parametrize("strategy", ["ps", pytest.param("simple", marks=pytest.mark.slow)])
def test_2_3_1_workers_match_the_mean_of_the_replicas_alive_at_each_step(ray_session, strategy, caplog):
    """"ps" through the op library (the Python path is in the next test, in the slow tier)."""
    caplog.set_level(logging.INFO, logger="dsgd")
    with engine(2, strategy) as sgd:
        start = set_start_weights(sgd)
        assert run_steps(sgd, 2)["num_replicas"] == 2
        pids = actor_pids(*sgd.workers)

        sgd.resize(3)
        assert sgd.num_workers == 3 and len(sgd.workers) == 3
        assert actor_pids(*sgd.workers[:2]) == pids
        assert_replicas_identical(sgd, 3)
        grew = [r for r in caplog.records if "grew from 2 to 3 workers" in r.message]
        assert len(grew) == 1 and {"start workers", "build models", "resynchronize"} <= set(grew[0].resize_phases)
        assert sgd.num_steps == 2 and sgd.foreach_worker(lambda w: w.runtime.applied_steps) == [2, 2, 2]
        # the new worker's variables started from worker 0's state: it built no assign ops to load it afterwards
        assert sgd.foreach_worker(lambda w: len(w.runtime.worker_graph.state_assigns._built))[2] == 0
        if strategy == "ps":  # every worker planned the step of 3 during the grow (the new one for worker 0's feeds)
            assert sgd.foreach_worker(lambda w: set(w.exchange.fused._prepared)) == [{True}, {True}, {True}]
            sgd.foreach_worker(_count_prepared_runs)
        assert run_steps(sgd, 2)["num_replicas"] == 3
        if strategy == "ps":  # and their steps ran it
            assert sgd.foreach_worker(lambda w: [p.runs for p in w.exchange.fused._prepared.values()]) == [[2], [2], [2]]

        sgd.resize(1)
        assert sgd.num_workers == 1 and actor_pids(*sgd.workers) == pids[:1]
        assert [r.levelname for r in caplog.records if "shrank from 3 to 1" in r.message] == ["WARNING"]
        assert run_steps(sgd, 1)["num_replicas"] == 1
        assert sgd.num_steps == 5
        assert_weights_close(sgd.get_weights(), momentum_reference(start, [(2, 2), (2, 3), (1, 1)]))


@pytest.mark.slow  # the suite's time budget (19 s); 2 devices through a shrink and a grow, the replica count in
# the logdir, by default: test 43 of docs/features.md (test_features_together[tf1], through the op library)
def test_devices_per_worker_2_grows_from_one_worker_and_shrinks_back(ray_session, tmp_path):
    """1 -> 2 -> 1 workers of 2 devices; "ps" through Python (the op library's path is in the test above); the
    replica count is a TensorBoard scalar."""
    from readers import read_scalars

    with engine(1, "ps", devices_per_worker=2, use_ops=False, logdir=str(tmp_path)) as sgd:
        start = set_start_weights(sgd)
        run_steps(sgd, 1)
        sgd.resize(2)
        assert run_steps(sgd, 2)["num_replicas"] == 4
        assert_replicas_identical(sgd, 4)
        sgd.resize(1)
        run_steps(sgd, 1)
        assert_replicas_identical(sgd, 2)
        assert_weights_close(sgd.get_weights(), momentum_reference(start, [(1, 1), (2, 2), (1, 1)], 2))
    assert [(step, value) for step, value, _ in read_scalars(tmp_path)["num_replicas"]] == [
        (0, 2.0), (1, 4.0), (2, 4.0), (3, 2.0)]


@pytest.fixture(scope="module")
def no_model_flag(tmp_path_factory) -> Path:
    """While this file exists, ``shared_engine``'s new workers cannot build their models."""
    return tmp_path_factory.mktemp("no_model") / "no-model"


@pytest.fixture(scope="module")
def two_workers(ray_session, tmp_path_factory, no_model_flag):
    """One engine(2, "ps") for the tests below that start from two workers; and its checkpoint as built."""
    built = str(tmp_path_factory.mktemp("two_workers") / "built.npz")
    with engine(2, "ps", creator=no_model_for_new_workers_while(str(no_model_flag))) as sgd:
        sgd.save(built)
        yield sgd, built


@pytest.fixture
def shared_engine(two_workers, no_model_flag) -> dsgd.DistributedSGD:
    """The module's engine(2, "ps") as built: two workers, step 0, no momentum, whatever the tests before did to it
    (resized it, replaced its workers, stepped it); its workers are the ones it has, its new ones build."""
    sgd, built = two_workers
    no_model_flag.unlink(missing_ok=True)
    if sgd.num_workers != 2:
        sgd.resize(2)
    sgd.restore(built)
    return sgd


@pytest.mark.parametrize("bad, error", [("3", TypeError), (2.0, TypeError), (True, TypeError), (None, TypeError),
                                        (0, ValueError), (-1, ValueError)])
def test_bad_sizes_are_refused_and_the_engine_keeps_stepping(shared_engine, bad, error):
    sgd = shared_engine
    pids = actor_pids(*sgd.workers)
    with pytest.raises(error, match="resize"):
        sgd.resize(bad)
    assert sgd.num_workers == 2 and actor_pids(*sgd.workers) == pids
    sgd.step(fetch_stats=True)


def test_a_size_the_cluster_cannot_hold_names_what_is_missing_and_changes_nothing(shared_engine):
    sgd = shared_engine
    pids = actor_pids(*sgd.workers)
    start = set_start_weights(sgd)
    steps = sgd.num_steps
    before = known_actors()
    with pytest.raises(dsgd.DSGDError, match=r"grow to 9 workers: no room for new worker 8: it needs 1 CPU"):
        sgd.resize(9)  # the session's Ray has 8 CPUs
    assert actors_started_since(before) == []  # refused before any worker (or server) started
    assert sgd.num_workers == 2 and actor_pids(*sgd.workers) == pids
    assert_weights_close(sgd.get_weights(), start)
    run_steps(sgd, 1)
    assert sgd.num_steps == steps + 1 and sgd.foreach_worker(lambda w: w.runtime.applied_steps) == [steps + 1] * 2


def test_a_survivor_that_dies_while_the_servers_are_re_planned_is_replaced(shared_engine, monkeypatch):
    """Growing 2 -> 3: once the new worker is built, survivor 1 is killed as the workers take up the exchange of 3
    (the servers planned anew), then the new worker while the survivor's replacement builds (found dead as the
    workers connect to the servers started for it); the resize goes on, replaces both from the other survivor's
    state and steps on."""
    sgd = shared_engine
    run_steps(sgd, 1)
    weights, steps, failures = sgd.get_weights(), sgd.num_steps, sgd.failures
    survivor, grown, cluster = sgd.workers[1], [], sgd._cluster
    replace_dead = cluster.replace_dead

    def kill_the_new_worker():
        grown.append(sgd.workers[2])
        kill(grown[0])

    def replace_dead_killing_the_new_worker():  # once: the new worker dies while the survivor's replacement builds
        cluster.replace_dead = replace_dead
        before_first_wait(sgd, "build their models", kill_the_new_worker, monkeypatch)
        return replace_dead()

    monkeypatch.setattr(cluster, "replace_dead", replace_dead_killing_the_new_worker)
    before_first_wait(sgd, "change their exchange", lambda: kill(survivor), monkeypatch)
    sgd.resize(3)
    assert is_dead(survivor) and sgd.workers[1] is not survivor
    assert is_dead(grown[0]) and sgd.workers[2] is not grown[0]
    assert sgd.num_workers == 3 and sgd.failures == failures + 2
    assert sgd.foreach_worker(lambda w: w.runtime.applied_steps) == [steps] * 3
    assert_weights_close(sgd.get_weights(), weights)  # the replacement and the new worker hold the survivors' state
    assert_replicas_identical(sgd, 3)
    assert run_steps(sgd, 2)["num_replicas"] == 3
    assert_replicas_identical(sgd, 3)


@pytest.mark.slow  # the suite's time budget (24 s); a worker lost mid-resize by default: the re-planned servers' test
def test_worker_0_killed_before_a_grow_reads_its_state_is_replaced_and_the_grow_tried_again(shared_engine,
                                                                                            monkeypatch):
    """Growing 2 -> 3, worker 0 dies as the resize starts: the new worker cannot read its state, so the grow fails
    and leaves the engine at 2; worker 0 is then replaced from worker 1's state and the grow tried again."""
    sgd = shared_engine
    run_steps(sgd, 1)
    weights, steps, failures = sgd.get_weights(), sgd.num_steps, sgd.failures
    worker_0, drain = sgd.workers[0], sgd._ledger.drain

    def drain_then_kill(*args, **kwargs):
        monkeypatch.undo()
        result = drain(*args, **kwargs)
        kill(worker_0)
        return result

    monkeypatch.setattr(sgd._ledger, "drain", drain_then_kill)
    sgd.resize(3)
    assert is_dead(worker_0) and sgd.workers[0] is not worker_0
    assert sgd.num_workers == 3 and sgd.failures == failures + 1
    assert sgd.foreach_worker(lambda w: w.runtime.applied_steps) == [steps] * 3
    assert_weights_close(sgd.get_weights(), weights)
    assert run_steps(sgd, 1)["num_replicas"] == 3
    assert_replicas_identical(sgd, 3)


def test_a_new_worker_that_fails_to_build_is_stopped_and_the_engine_is_as_it_was(shared_engine, no_model_flag):
    """The defined state after a fault while growing: the new workers stopped, the error raised, the old size.
    (Building new workers does not depend on the strategy; "simple" grows in the first test.)"""
    sgd = shared_engine
    no_model_flag.touch()
    start = set_start_weights(sgd)
    pids = actor_pids(*sgd.workers)
    run_steps(sgd, 1)
    exchanges = sgd.foreach_worker(lambda worker: id(worker.exchange))
    servers = actor_pids(*ps_actors(sgd))
    before = known_actors()
    with pytest.raises(dsgd.DSGDError, match="no model for worker 2"):
        sgd.resize(3)
    assert sgd.num_workers == 2 and actor_pids(*sgd.workers) == pids
    started = actors_started_since(before)  # the new worker, and the servers of 3 started meanwhile
    assert [a[0] for a in started if a[0] == "SGDWorker"] == ["SGDWorker"]
    assert any(a[0] == "ParameterServer" for a in started)
    wait_until(lambda: all(state == "DEAD" for _, state in actors_started_since(before)))
    assert sgd.foreach_worker(lambda worker: id(worker.exchange)) == exchanges  # still the exchange of 2
    assert actor_pids(*ps_actors(sgd)) == servers
    assert run_steps(sgd, 2)["num_replicas"] == 2
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), momentum_reference(start, [(3, 2)]))


BACKGROUND_JOBS = {"elastic_job": Job(os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_job.py"), 300)}


@pytest.fixture(scope="module")
def elastic_job() -> dict:
    return QUEUE.result(BACKGROUND_JOBS["elastic_job"])


def test_elastic_engine_starts_with_the_room_there_is_and_goes_on_without_a_lost_node(elastic_job):
    run = elastic_job
    assert run["start_workers"] == 3  # room for 3 of num_workers=(2, 4)
    assert run["after_loss_workers"] == 2 and run["after_loss_replicas"] == 2
    assert run["survivor_pids_kept"]  # worker 2 went on as worker 1, same process
    # The survivor that took index 1 still reads the batches its model was built for (worker 2's).
    assert [indices for _, indices in run["stages"]][:2] == [[0, 1, 2], [0, 2]]


def test_elastic_engine_grows_back_when_a_node_joins(elastic_job):
    run = elastic_job
    assert run["grown_workers"] == 3
    print(f"grew back {run['grow_s']:.1f}s after the node joined (resize_interval_s=1)")
    replicas = [weights_from_json(r) for r in run["replicas"]]
    assert_all_identical(replicas)
    expected = momentum_reference(weights_from_json(run["start"]),
                                  [(steps, [(w, 0) for w in indices]) for steps, indices in run["stages"]])
    assert_weights_close(replicas[0], expected)


def test_elastic_engine_below_its_minimum_raises_the_error_naming_what_is_missing(elastic_job):
    error = elastic_job["below_min_error"]
    assert error is not None and "cannot replace dead worker" in error and "it needs 2 CPU on one node" in error


def before_first_wait(sgd, what: str, action, monkeypatch) -> None:
    """``action()`` in the driver the first time it waits for ``what`` while building or connecting, its calls
    sent (undone by ``monkeypatch`` at the test's end if it never waits for it)."""
    calls = sgd._cluster.calls
    wait = calls.call_startup

    def acted(refs, waiting_for):
        if what in waiting_for and calls.call_startup is acted:
            calls.call_startup = wait
            action()
        return wait(refs, waiting_for)

    monkeypatch.setattr(calls, "call_startup", acted)


def _ctrl_c() -> None:
    raise KeyboardInterrupt


def interrupt_once(sgd, what: str, monkeypatch) -> None:
    """Ctrl-C (a KeyboardInterrupt) in the driver the first time it waits for ``what`` while building or connecting."""
    before_first_wait(sgd, what, _ctrl_c, monkeypatch)


def test_ctrl_c_while_new_workers_build_leaves_the_engine_at_its_old_size(shared_engine, monkeypatch):
    sgd = shared_engine
    start = set_start_weights(sgd)
    pids = actor_pids(*sgd.workers)
    interrupt_once(sgd, "build their models", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        sgd.resize(3)
    assert run_steps(sgd, 2)["num_replicas"] == 2
    assert sgd.num_workers == 2 and actor_pids(*sgd.workers) == pids
    assert_weights_close(sgd.get_weights(), momentum_reference(start, [(2, 2)]))


@pytest.mark.slow  # the suite's time budget (13 s); Ctrl-C mid-resize by default: the test above (while they build)
def test_ctrl_c_after_the_new_workers_are_built_finishes_the_resize_at_the_next_call(shared_engine, monkeypatch):
    sgd = shared_engine
    start = set_start_weights(sgd)
    run_steps(sgd, 1)
    interrupt_once(sgd, "change their exchange", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        sgd.resize(3)
    assert run_steps(sgd, 2)["num_replicas"] == 3
    assert_replicas_identical(sgd, 3)
    assert_weights_close(sgd.get_weights(), momentum_reference(start, [(1, 2), (2, 3)]))


def test_inside_a_placement_group_resize_elastic_engines_and_server_nodes_are_refused(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import dsgd.tune

    with pytest.raises(ValueError, match="elastic engines do not run in Tune trials"):
        dsgd.tune.trainable(lambda config: FixedDataMomentumNet, steps_per_report=1, num_workers=(1, 2))

    def refusal(call, error: type[Exception]) -> str:
        """The message of the ``error`` that ``call()`` raises; "" if it raises none."""
        try:
            call()
        except error as e:
            return str(e)
        return ""

    @ray.remote(num_cpus=1)
    def trial() -> tuple[str, str, str, int]:
        elastic_error = refusal(lambda: dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=(1, 2)), ValueError)
        server_error = refusal(lambda: dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2,
                                                           server_resource="dsgd_server"), ValueError)
        with engine(1, "ps") as sgd:
            resize_error = refusal(lambda: sgd.resize(2), dsgd.DSGDError)
            sgd.step(fetch_stats=True)
            return elastic_error, server_error, resize_error, sgd.num_workers

    group = placement_group([{"CPU": 1}, {"CPU": 1}])
    try:
        ray.get(group.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        elastic_error, server_error, resize_error, num_workers = ray.get(
            trial.options(scheduling_strategy=strategy).remote(), timeout=180)
    finally:
        remove_placement_group(group)
    assert "an elastic engine cannot run inside a placement group" in elastic_error
    assert "server_resource='dsgd_server' cannot be used inside a placement group" in server_error
    assert "resize(2) inside a placement group (a Ray Tune trial) is refused" in resize_error
    assert num_workers == 1


@pytest.mark.slow  # the suite's time budget (24 s); an elastic engine that starts at its maximum, shrinks and grows
# back once resize_interval_s has passed, by default: test 43 of docs/features.md (test_features_together[tf1])
def test_elastic_engine_in_one_ray_instance_starts_at_max_refuses_sizes_outside_and_grows_back(ray_session, caplog):
    caplog.set_level(logging.INFO, logger="dsgd")
    interval = 3600.0  # the test moves the engine's clock, not the wall clock
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=(1, 2), strategy="ps", resize_interval_s=interval,
                             timeout_s=60, startup_timeout_s=60) as sgd:
        assert sgd.num_workers == 2  # the session's 8 CPUs have room for the maximum
        with pytest.raises(ValueError, match=r"resize\(n\): n must be between 1 and 2 \(num_workers=\(1, 2\)\), got 3"):
            sgd.resize(3)
        sgd.resize(1)
        assert sgd.step(fetch_stats=True)["num_replicas"] == 1  # within resize_interval_s of the resize
        assert sgd.step(fetch_stats=True)["num_replicas"] == 1
        sgd._ledger.resizer._last_look -= interval  # resize_interval_s has passed since the engine last looked
        assert sgd.step(fetch_stats=True)["num_replicas"] == 2  # grown back into the room there is
        assert "grew from 1 to 2 workers" in caplog.text
        assert_replicas_identical(sgd, 2)


def _mapped_server_buffers(worker) -> int:
    """How many parameter-server buffers (memfd mappings) the worker's process has mapped."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:dsgd-ps" in line for line in maps)


def test_a_resize_back_reuses_the_exchange_and_the_servers_and_unmaps_the_old_servers_buffers(shared_engine):
    """The survivors map only the current servers' buffers. Back at a count seen before, each survivor takes up
    the exchange it built for it (graph ops and all), and the servers of that count, kept idle since, are taken
    up again; only the servers of the last count before are kept."""
    sgd = shared_engine
    start = set_start_weights(sgd)
    sgd.step()
    mapped = sgd.foreach_worker(_mapped_server_buffers)
    exchanges = sgd.foreach_worker(lambda worker: id(worker.exchange))
    servers = ps_actors(sgd)
    server_pids = actor_pids(*servers)
    assert mapped[0] > 0
    sgd.resize(3)
    servers_of_3 = ps_actors(sgd)
    sgd.step()
    sgd.resize(2)
    sgd.step()
    assert sgd.foreach_worker(_mapped_server_buffers) == mapped
    assert sgd.foreach_worker(lambda worker: id(worker.exchange)) == exchanges
    assert actor_pids(*ps_actors(sgd)) == server_pids
    assert_replicas_identical(sgd, 2)
    assert_weights_close(sgd.get_weights(), momentum_reference(start, [(1, 2), (1, 3), (1, 2)]))
    sgd.resize(1)  # now 2 is the last count before: the servers of 3 go
    wait_until(lambda: all(map(is_dead, servers_of_3)))
    assert not any(map(is_dead, servers))


class SharedInitialValueNet(dsgd.Model):
    """Two weights initialized from one tensor (their initializers cannot be fed apart), one of its own, and
    momentum slots for all three."""

    def __init__(self, worker_index, device_index):
        shared = tf.random.normal([3])
        a, b = tf.Variable(shared, name="a"), tf.Variable(shared, name="b")
        c = tf.compat.v1.get_variable("c", [2, 2])
        self.loss = tf.reduce_sum(a * b) + tf.reduce_sum(a) + tf.reduce_sum(c * c)

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)


def test_a_worker_built_from_a_state_starts_from_it_on_every_replica():
    source = local_worker(SharedInitialValueNet)
    for step in range(3):
        source.step(step, fetch_stats=False)
    state = source.get_state()
    assert state["applied_steps"] == 3 and not np.array_equal(state["weights"]["a"], state["weights"]["b"])

    joined = local_worker(SharedInitialValueNet, devices_per_worker=2, state=state)
    assert joined.runtime.applied_steps == 3
    for group in ("weights", "optimizer"):
        for replica in joined.sess.run([dict(v) for v in joined.runtime.worker_graph.state_vars[group]]):
            assert replica.keys() == state[group].keys()
            for name, value in replica.items():
                np.testing.assert_array_equal(value, state[group][name], err_msg=f"{group} {name}")
    # only the two weights that share an initial value were assigned after initializing
    assert sorted(name for _, name in joined.runtime.worker_graph.state_assigns._built) == ["a", "b"]


def test_a_state_of_another_model_is_refused_by_name():
    state = local_worker(SharedInitialValueNet).get_state()
    state["weights"]["d"] = state["weights"].pop("c")
    with pytest.raises(dsgd.DSGDError, match=r"of another model: its weights lack \['c'\] and have \['d'\], "):
        local_worker(SharedInitialValueNet, state=state)

"""A replica's local state across a recovery (``dsgd.driver.recovery``), without Ray: what the driver keeps of each
worker's step results, and which new worker starts from which."""

from __future__ import annotations

import types

import numpy as np

from dsgd.common.results import LocalState, StepResult
from dsgd.driver.recovery import Recovery


class Worker:
    """A worker actor's stand-in: records the local state it is told to start from."""

    def __init__(self, name: str):
        self.name = name
        self.taken: list[LocalState] = []
        self.take_local_state = types.SimpleNamespace(remote=self.taken.append)


def recovery_of(workers: list[Worker]) -> Recovery:
    calls = types.SimpleNamespace(call=lambda refs, what: refs)
    return Recovery(types.SimpleNamespace(workers=workers, calls=calls), max_failures=3)


def state(applied_steps: int, value: float) -> LocalState:
    return LocalState(applied_steps, [np.full(2, value)])


def test_a_new_worker_starts_from_what_its_slots_lost_worker_reported_with_the_last_step():
    lost, survivor = Worker("lost"), Worker("survivor")
    recovery = recovery_of([survivor, lost])
    recovery.keep_local_state({0: StepResult(local_state=state(4, 0.0)), 1: StepResult(local_state=state(4, 1.0))})
    recovery.keep_local_state({0: StepResult(local_state=state(5, 0.5)), 1: StepResult(local_state=state(5, 1.5))})
    recovery.keep_local_state({0: StepResult()})  # a result without local state keeps the last one
    before = list(recovery.cluster.workers)
    new = recovery.cluster.workers[1] = Worker("new")
    recovery._pass_on_local_state({1}, before, applied=5)
    assert [s.applied_steps for s in new.taken] == [5]
    np.testing.assert_array_equal(new.taken[0].replicas[0], [1.5, 1.5])
    assert survivor.taken == [] and lost.taken == []


def test_nothing_is_passed_on_from_another_step_count_another_worker_or_an_engine_that_shrank():
    first, second = Worker("first"), Worker("second")
    recovery = recovery_of([first, second])
    recovery.keep_local_state({0: StepResult(local_state=state(5, 0.0)), 1: StepResult(local_state=state(5, 1.0))})
    before = list(recovery.cluster.workers)

    new = recovery.cluster.workers[1] = Worker("new")
    recovery._pass_on_local_state({1}, before, applied=6)  # the lost worker's last report was a step behind
    assert new.taken == []

    other = recovery.cluster.workers[1] = Worker("other")
    recovery._pass_on_local_state({1}, [first, Worker("resized away")], applied=5)  # the slot's worker since
    assert other.taken == []

    recovery.cluster.workers = [first]  # an elastic engine went on with one worker: the indices moved
    recovery._pass_on_local_state({0}, before, applied=5)
    assert first.taken == []
    recovery.cluster.workers = [first, Worker("again")]
    recovery._pass_on_local_state({1}, before, applied=5)  # forgotten with the shrink
    assert recovery.cluster.workers[1].taken == []


def test_a_keras_trainer_replicas_metrics_and_joined_step_survive_the_round_trip_through_a_step_result():
    """A ``KerasTrainer`` replica's local state (its metric variables, float, and the step it joined the epoch at,
    an int64) comes out of a step as one flat float64 array and goes into another worker's replica as it was:
    the same metric state, bit for bit, and the same joined step (so a replacement of a replacement still says
    which steps its epoch lacks)."""
    from dsgd.integrations.keras_feed import DatasetStart
    from dsgd.integrations.keras_trainer import ReplicaCreator
    from dsgd_test_models import local_worker
    import keras_trainer_models as km

    creator = ReplicaCreator(km.build_binary, 1, DatasetStart(km.binary_replica_dataset, token=1))
    lost = local_worker(creator)  # built as if mid-epoch: it joins at its first step
    for step in range(3):
        result = lost.step(step, fetch_stats=False)
    replica = lost.models[0]
    assert result.local_state.applied_steps == 3 and replica.joined(3) == 0
    assert result.local_state.replicas[0].dtype == np.float64

    new = local_worker(creator)
    new.take_local_state(result.local_state)
    for got, expected in zip(new.models[0].metric_state().state, replica.metric_state().state):
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == expected.dtype
    assert new.models[0].joined(3) == 0
    assert new.models[0].metric_state().state[0] != 0  # the loss tracker's total: three steps counted

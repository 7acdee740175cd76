"""The engine's live topology: after a resize, a step waits for the new count's quorum, and its stats say so."""

import functools
import os

import pytest

import dsgd
from dsgd_test_models import Gate, GatedWorker1Net, assert_replicas_identical


def _step_with_worker_1_held(sgd, gate: Gate) -> dict:
    """One step while worker 1 is held before its batch (``Gate``); its stats, returned while it is still held."""
    gate.close()
    try:
        stats = sgd.step(fetch_stats=True)
        gate.wait_arrived()
        assert os.path.exists(gate.path), "the gate opened: worker 1 was not held"
        return stats
    finally:
        gate.open()


@pytest.mark.slow  # the suite's time budget (29 s); by default, test_features_together resizes a backup-worker engine
def test_after_a_resize_a_step_closes_on_the_new_count_without_the_held_worker(ray_session, tmp_path):
    gate = Gate(str(tmp_path / "gate"))
    creator = functools.partial(GatedWorker1Net, gate=gate)
    with dsgd.DistributedSGD(creator, num_workers=4, strategy="ps", backup_workers=1, grad_shard_bytes=40,
                             timeout_s=60) as sgd:
        sgd.step(fetch_stats=True)
        sgd.resize(3)
        stats = _step_with_worker_1_held(sgd, gate)
        assert (stats["num_replicas"], stats["dropped_gradients"]) == (2, 1)
        sgd.resize(5)  # waits for worker 1 to catch up
        stats = _step_with_worker_1_held(sgd, gate)
        assert (stats["num_replicas"], stats["dropped_gradients"]) == (4, 1)
        sgd.step(fetch_stats=True)
        assert_replicas_identical(sgd, 5)

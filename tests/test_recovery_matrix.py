"""Hot recovery under every strategy and with several devices per worker (test_reliability.py covers "ps", 2x1)."""

import logging

import pytest
import ray

import dsgd
from dsgd_test_models import (FixedDataMomentumNet, assert_replicas_identical, assert_weights_close, kill,
                              numpy_momentum_run, set_start_weights)


@pytest.mark.parametrize("strategy", ["simple", "ps"])
def test_worker_killed_with_two_devices_is_replaced_and_training_goes_on_exactly(ray_session, caplog, strategy):
    caplog.set_level(logging.WARNING, logger="dsgd")
    replicas = [(w, d) for w in range(2) for d in range(2)]
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, devices_per_worker=2, strategy=strategy) as sgd:
        start = set_start_weights(sgd)
        sgd.step()
        sgd.get_weights()  # step 0 applied everywhere
        old_pid = ray.get(sgd.workers[1].identity.remote(), timeout=30).pid
        kill(sgd.workers[1])
        sgd.step(fetch_stats=True)
        assert "worker 1 is dead" in caplog.text
        assert ray.get(sgd.workers[1].identity.remote(), timeout=30).pid != old_pid
        sgd.step()
        assert_replicas_identical(sgd, 4)
        # Momentum slots of both devices came along: the result equals an uninterrupted run.
        assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, replicas, 3))

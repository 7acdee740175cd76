"""Hot recovery under every strategy and with several devices per worker (test_reliability.py covers "ps", 2x1)."""

import logging

import numpy as np
import pytest
import ray

import dsgd
from dsgd.exchange import simple
from dsgd_test_models import (FixedDataMomentumNet, TanhNet, actor_pids, assert_replicas_identical,
                              assert_weights_close, batch, kill, numpy_forward, numpy_momentum_run, numpy_step,
                              set_start_weights)


# "simple" in the slow tier (the suite's time budget): the replacement is the same, "ps" re-plans servers too
@pytest.mark.parametrize("strategy", [pytest.param("simple", marks=pytest.mark.slow), "ps"])
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


def test_a_step_the_survivors_applied_before_a_worker_died_keeps_their_stats(ray_session, caplog, monkeypatch):
    """Worker 2 is killed once the driver holds every gradient of a "simple" step: the survivors apply that
    step, so recovery has nothing to re-run, and the step's stats are the survivors' (before: a NaN loss and
    no metrics)."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    with dsgd.DistributedSGD(TanhNet, num_workers=3, strategy="simple") as sgd:
        start = set_start_weights(sgd)
        normal = sgd.step(fetch_stats=True)
        victim, [pid] = sgd.workers[2], actor_pids(sgd.workers[2])
        average_into, killed = simple.average_into, []

        def kill_then_average(*args, **kwargs):
            if not killed:  # every gradient is in the driver's hands: the step can complete without worker 2
                kill(victim, pids=[pid])
                killed.append(pid)
            return average_into(*args, **kwargs)

        monkeypatch.setattr(simple, "average_into", kill_then_average)
        stats = sgd.step(fetch_stats=True)
        monkeypatch.undo()
        assert killed and "worker 2 is dead" in caplog.text
        assert "its stats are lost" not in caplog.text
        assert set(normal) <= set(stats) and stats["step"] == 1 and sgd.num_steps == 2
        # Step 1 applied once, the mean of all three gradients; its loss and error the survivors' mean.
        all_three, survivors = [(w, 0) for w in range(3)], [(0, 0), (1, 0)]
        before = numpy_step(start, all_three, 0)
        assert_weights_close(sgd.get_weights(), numpy_step(before, all_three, 1))
        forward = [numpy_forward(before, *batch(w, d, 1)) for w, d in survivors]
        assert stats["loss"] == pytest.approx(np.mean([loss for _, _, loss, _ in forward]), rel=1e-5)
        assert stats["abs_error"] == pytest.approx(np.mean([error for _, _, _, error in forward]), rel=1e-5)
        sgd.step()
        assert_replicas_identical(sgd, 3)

"""Elastic training: DistributedSGD.resize and num_workers=(min, max) engines (SPEC "Elastic training")."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import dsgd
from dsgd_test_models import (LR, MOMENTUM, FixedDataMomentumNet, actor_pids, assert_replicas_identical,
                              assert_weights_close, batch, numpy_gradients, set_start_weights)


def momentum_reference(weights: dict, sizes: list[tuple[int, int]], devices_per_worker: int = 1) -> dict:
    """Momentum SGD on FixedDataMomentumNet's batches; ``sizes``: (steps, workers), each step averaging its replicas."""
    accum = {k: np.zeros_like(v, dtype=np.float64) for k, v in weights.items()}
    for steps, workers in sizes:
        replicas = [(w, d) for w in range(workers) for d in range(devices_per_worker)]
        for _ in range(steps):
            grads = [numpy_gradients(weights, *batch(w, d, 0)) for w, d in replicas]
            for k in weights:
                accum[k] = MOMENTUM * accum[k] + np.mean([g[k] for g in grads], axis=0)
            weights = {k: weights[k] - LR * accum[k] for k in weights}
    return weights


def engine(num_workers=2, strategy="ps", **kwargs) -> dsgd.DistributedSGD:
    kwargs = {"timeout_s": 60, "startup_timeout_s": 60, **kwargs}
    return dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=num_workers, strategy=strategy, **kwargs)


def run_steps(sgd, steps: int) -> dict:
    for _ in range(steps):
        stats = sgd.step(fetch_stats=True)
    return stats


@pytest.mark.parametrize("strategy, use_ops", [("ps", None), ("ps", False), ("simple", None)])
def test_2_3_1_2_workers_match_the_mean_of_the_replicas_alive_at_each_step(ray_session, strategy, use_ops, caplog):
    caplog.set_level(logging.INFO, logger="dsgd")
    with engine(2, strategy, use_ops=use_ops) as sgd:
        start = set_start_weights(sgd)
        assert run_steps(sgd, 2)["num_replicas"] == 2
        pids = actor_pids(*sgd.workers)

        sgd.resize(3)
        assert sgd.num_workers == 3 and len(sgd.workers) == 3
        assert actor_pids(*sgd.workers[:2]) == pids
        assert_replicas_identical(sgd, 3)
        assert "grew from 2 to 3 workers" in caplog.text
        assert sgd.num_steps == 2 and sgd.foreach_worker(lambda w: w.runner.applied_steps) == [2, 2, 2]
        assert run_steps(sgd, 2)["num_replicas"] == 3

        sgd.resize(1)
        assert sgd.num_workers == 1 and actor_pids(*sgd.workers) == pids[:1]
        assert [r.levelname for r in caplog.records if "shrank from 3 to 1" in r.message] == ["WARNING"]
        assert run_steps(sgd, 1)["num_replicas"] == 1

        sgd.resize(2)
        assert actor_pids(sgd.workers[0]) == pids[:1]
        assert_replicas_identical(sgd, 2)
        assert run_steps(sgd, 2)["num_replicas"] == 2
        assert sgd.num_steps == 7
        assert_replicas_identical(sgd, 2)
        assert_weights_close(sgd.get_weights(), momentum_reference(start, [(2, 2), (2, 3), (1, 1), (2, 2)]))


def test_devices_per_worker_2_grows_and_shrinks(ray_session):
    with engine(1, "ps", devices_per_worker=2) as sgd:
        start = set_start_weights(sgd)
        run_steps(sgd, 1)
        sgd.resize(2)
        assert run_steps(sgd, 2)["num_replicas"] == 4
        assert_replicas_identical(sgd, 4)
        sgd.resize(1)
        run_steps(sgd, 1)
        assert_replicas_identical(sgd, 2)
        assert_weights_close(sgd.get_weights(), momentum_reference(start, [(1, 1), (2, 2), (1, 1)], 2))

"""The "ps" exchange through the workers' send scheduler: both worker paths hand their partitions to it, the
steps equal numpy's and the "simple" strategy's bit for bit, and a killed server is replaced without the workers
rebuilding anything. The policy is the default's ("streams", ``dsgd.config.DEFAULT_SEND_SCHEDULE``); the engine
tests of the default exchange run another when ``DSGD_SEND_SCHEDULE`` names it (docs/development.md)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

import dsgd
from dsgd_test_models import (REPLICAS_2x1, FixedDataMomentumNet, TanhNet, assert_replicas_identical,
                              assert_weights_close, kill, numpy_momentum_run, numpy_step, ps_actors, set_start_weights)

WORKERS, DEVICES = 2, 2
REPLICAS = [(w, d) for w in range(WORKERS) for d in range(DEVICES)]


def _scheduler_threads(worker) -> tuple[int, int]:
    """The worker's send scheduler's sender and reader threads alive."""
    names = [thread.name for thread in threading.enumerate()]
    return sum(n.startswith("dsgd sender") for n in names), sum(n.startswith("dsgd reader") for n in names)


@pytest.fixture(scope="module")
def engines(ray_session):
    """A 2x2 "ps" engine through the op library and one through Python, one "simple"."""
    built = {}
    try:
        built["simple"] = dsgd.DistributedSGD(TanhNet, num_workers=WORKERS, devices_per_worker=DEVICES,
                                              strategy="simple")
        for name, use_ops in (("ops", True), ("python", False)):
            built[name] = dsgd.DistributedSGD(TanhNet, num_workers=WORKERS, devices_per_worker=DEVICES, strategy="ps",
                                              grad_shard_bytes=24, use_ops=use_ops, num_parameter_servers=2)
        yield built
    finally:
        for sgd in built.values():
            sgd.shutdown()


@pytest.mark.parametrize("path", ["ops", "python"])
def test_the_scheduler_moves_every_partition_and_the_steps_equal_numpy_and_simple_bit_for_bit(engines, path):
    sgd, simple = engines[path], engines["simple"]
    assert sgd.foreach_worker(_scheduler_threads) == [(2, 2)] * WORKERS  # a sender and a reader a server
    expected = {k: v.astype(np.float64) for k, v in set_start_weights(sgd).items()}
    set_start_weights(simple)
    for step in range(3):
        sgd.step()
        simple.step()
        expected = numpy_step(expected, REPLICAS, step)
    assert_replicas_identical(sgd, len(REPLICAS))
    assert_weights_close(sgd.get_weights(), expected)
    for name, value in simple.get_weights().items():
        assert np.array_equal(sgd.get_weights()[name], value), name


def test_a_killed_server_is_replaced_and_the_workers_schedulers_take_the_new_one_up(ray_session, caplog):
    """Momentum on fixed batches: the step the kill failed runs again and the result is as if nothing happened."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="ps", grad_shard_bytes=24,
                             num_parameter_servers=2, max_failures=5) as sgd:
        start = set_start_weights(sgd)
        sgd.step()
        exchanges = sgd.foreach_worker(lambda worker: id(worker.exchange))
        kill(ps_actors(sgd)[1])
        sgd.step(fetch_stats=True)  # waits for the step: the recovery replaces the server and runs it again
        assert "parameter server 1 is dead" in caplog.text
        assert sgd.foreach_worker(lambda worker: id(worker.exchange)) == exchanges  # nothing rebuilt
        assert sgd.foreach_worker(_scheduler_threads) == [(2, 2)] * 2  # the old lanes' threads ended
        assert_replicas_identical(sgd, 2)
        assert_weights_close(sgd.get_weights(), numpy_momentum_run(start, REPLICAS_2x1, 2))

"""The parameter-server actor: averages in a fixed order, and a bad push fails the step, not hangs it."""

import numpy as np
import pytest
import ray

from dsgd import object_store
from dsgd.ps_actor import ParameterServer

SEGMENTS = [(0, 5), (16, 1000), (1024, 3)]  # (start, size): gaps between them stay zero
SIZE = 1027


def _server(num_workers):
    return ray.remote(ParameterServer).options(num_cpus=0).remote(0, num_workers, SIZE, "<f4", SEGMENTS)


def _pushed(rng):
    return [rng.standard_normal(n).astype(np.float32) for _, n in SEGMENTS]


def _mean(server, step):
    [ref] = ray.get(server.pull.remote(step), timeout=30)
    [mean] = object_store.join(ray.get(ref, timeout=30), [SIZE])
    return mean


def test_mean_is_summed_in_worker_order_whatever_the_arrival_order(ray_session):
    rng = np.random.default_rng(0)
    parts = [_pushed(rng) for _ in range(3)]
    expected = np.zeros(SIZE, np.float32)
    for k, (start, n) in enumerate(SEGMENTS):
        total = parts[0][k] + parts[1][k]  # the "simple" strategy's order: ((w0 + w1) + w2) / 3
        total += parts[2][k]
        expected[start:start + n] = total / np.float32(3)
    server = _server(3)
    for step, order in enumerate([(0, 1, 2), (2, 0, 1)]):
        ray.get([server.push.remote(step, w, object_store.put(parts[w])) for w in order], timeout=30)
        np.testing.assert_array_equal(_mean(server, step), expected)  # bit for bit
    ray.kill(server)


@pytest.mark.parametrize("bad, message", [
    ([np.zeros(5, np.float32), np.zeros(999, np.float32), np.zeros(3, np.float32)], "segments of sizes"),
    ([np.zeros(5, np.float64), np.zeros(1000, np.float64), np.zeros(3, np.float64)], "float64"),
])
def test_a_bad_push_fails_the_step_for_every_puller(ray_session, bad, message):
    server = _server(2)
    pull = server.pull.remote(0)  # waiting before the bad push arrives
    with pytest.raises(ValueError, match=message):
        ray.get(server.push.remote(0, 1, object_store.put(bad)), timeout=30)
    for ref in (pull, server.pull.remote(0)):
        with pytest.raises(ValueError, match=message):
            ray.get(ref, timeout=30)  # an error at once, not a wait for a sum that cannot come
    ray.kill(server)


def test_push_of_the_wrong_step_or_twice_is_refused(ray_session):
    server = _server(2)
    parts = _pushed(np.random.default_rng(1))
    ray.get(server.push.remote(0, 0, object_store.put(parts)), timeout=30)
    with pytest.raises(ValueError, match="pushed shard 0 of step 0 twice"):
        ray.get(server.push.remote(0, 0, object_store.put(parts)), timeout=30)
    with pytest.raises(ValueError, match="is summing step 0 but worker 1 pushed step 5"):
        ray.get(server.push.remote(5, 1, object_store.put(parts)), timeout=30)
    ray.kill(server)

"""The parameter-server actor: averages in a fixed order, and a bad push fails the step, not hangs it."""

import numpy as np
import pytest
import ray

from dsgd import object_store, ps_actor
from dsgd.errors import DSGDTimeoutError
from dsgd.ps_actor import StepAborted

SEGMENTS = [(0, 5), (16, 1000), (1024, 3)]  # (start, size): gaps between them stay zero
SIZE = 1027


def _server(num_workers, timeout_s=30.0):
    return ps_actor.start(0, num_workers, SIZE, "<f4", SEGMENTS, timeout_s)


def _pushed(rng):
    return [rng.standard_normal(n).astype(np.float32) for _, n in SEGMENTS]


def _mean(push):
    [ref] = ray.get(push, timeout=30)
    [mean] = object_store.join(ray.get(ref, timeout=30), [SIZE])
    return mean


def test_every_push_returns_the_mean_summed_in_worker_order_whatever_the_arrival_order(ray_session):
    rng = np.random.default_rng(0)
    parts = [_pushed(rng) for _ in range(3)]
    expected = np.zeros(SIZE, np.float32)
    for k, (start, n) in enumerate(SEGMENTS):
        total = parts[0][k] + parts[1][k]  # the "simple" strategy's order: ((w0 + w1) + w2) / 3
        total += parts[2][k]
        expected[start:start + n] = total / np.float32(3)
    server = _server(3)
    for step, order in enumerate([(0, 1, 2), (2, 0, 1)]):
        pushes = [server.push.remote(step, w, object_store.put(parts[w])) for w in order]
        for push in pushes:
            np.testing.assert_array_equal(_mean(push), expected)  # bit for bit, for every worker
        assert len({ray.get(push, timeout=30)[0] for push in pushes}) == 1  # one object, shared
    ray.kill(server)


def test_a_push_waits_for_every_worker(ray_session):
    server = _server(2)
    parts = _pushed(np.random.default_rng(2))
    first = server.push.remote(0, 0, object_store.put(parts))
    ready, _ = ray.wait([first], timeout=1.0)
    assert not ready  # worker 1 has not pushed yet
    np.testing.assert_array_equal(_mean(server.push.remote(0, 1, object_store.put(parts)))[:5], parts[0])
    np.testing.assert_array_equal(_mean(first)[:5], parts[0])
    ray.kill(server)


@pytest.mark.parametrize("bad, message", [
    ([np.zeros(5, np.float32), np.zeros(999, np.float32), np.zeros(3, np.float32)], "segments of sizes"),
    ([np.zeros(5, np.float64), np.zeros(1000, np.float64), np.zeros(3, np.float64)], "float64"),
])
def test_a_bad_push_fails_the_step_for_every_pusher(ray_session, bad, message):
    server = _server(3)
    waiting = server.push.remote(0, 0, object_store.put(_pushed(np.random.default_rng(3))))
    with pytest.raises(ValueError, match=message):
        ray.get(server.push.remote(0, 1, object_store.put(bad)), timeout=30)
    for ref in (waiting, server.push.remote(0, 2, object_store.put(_pushed(np.random.default_rng(4))))):
        with pytest.raises(ValueError, match=message):
            ray.get(ref, timeout=30)  # an error at once, not a wait for a sum that cannot come
    ray.kill(server)


def test_push_of_the_wrong_step_or_twice_is_refused(ray_session):
    server = _server(2)
    parts = _pushed(np.random.default_rng(1))
    waiting = server.push.remote(0, 0, object_store.put(parts))
    with pytest.raises(ValueError, match="pushed shard 0 of step 0 twice"):
        ray.get(server.push.remote(0, 0, object_store.put(parts)), timeout=30)
    with pytest.raises(ValueError, match="is summing step 0 but worker 1 pushed step 5"):
        ray.get(server.push.remote(5, 1, object_store.put(parts)), timeout=30)
    with pytest.raises(ValueError, match="twice"):
        ray.get(waiting, timeout=30)  # the step failed for its waiting push too
    ray.kill(server)


def test_abort_and_reset_release_a_waiting_push(ray_session):
    server = _server(2)
    parts = _pushed(np.random.default_rng(5))
    for release in ("abort", "reset"):
        waiting = server.push.remote(0, 0, object_store.put(parts))
        ray.wait([waiting], timeout=0.5)
        ray.get(server.abort.remote() if release == "abort" else server.reset.remote(0), timeout=30)
        with pytest.raises(StepAborted):
            ray.get(waiting, timeout=30)
        ray.get(server.reset.remote(0), timeout=30)
    pushes = [server.push.remote(0, w, object_store.put(parts)) for w in range(2)]  # usable again
    np.testing.assert_array_equal(_mean(pushes[1])[:5], parts[0])
    ray.kill(server)


def test_a_push_whose_peers_never_come_times_out_with_their_names(ray_session):
    server = _server(3, timeout_s=0.5)
    with pytest.raises(DSGDTimeoutError, match=r"workers \[1, 2\] to push shard 0 of step 0"):
        ray.get(server.push.remote(0, 0, object_store.put(_pushed(np.random.default_rng(6)))), timeout=30)
    ray.kill(server)

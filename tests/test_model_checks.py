"""Models dsgd must refuse before the first step, and models of unusual dtypes and sizes it must train exactly."""

import logging
import re

import numpy as np
import pytest

import dsgd
import model_check_models as mc
from dsgd_test_models import actors_started_since, assert_replicas_identical, known_actors, local_worker


REFUSED = [
    (mc.NonScalarLoss, 1, dsgd.ModelCreatorError,
     r"get_loss\(\) must return a scalar, got shape \(3,\) on worker 0, device 0"),
    (mc.KerasOptimizer, 1, dsgd.ModelCreatorError,
     r"get_optimizer\(\) must return a tf.compat.v1.train.Optimizer, got object on worker 0, device 0"),
    (mc.LossOnNoVariable, 1, dsgd.ModelCreatorError,
     r"the loss on worker 0, device 0 depends on none of the trainable variables"),
    (mc.UndefinedShape, 1, dsgd.ModelCreatorError, r"variable 'free' has a shape that is not fully defined: \(None,\)"),
    (mc.MetricsByDevice, 2, dsgd.WorkerMismatchError,
     r"replica 1 on worker 0 reports metric tensors \['abs_error', 'extra'\], replica 0 \['abs_error'\]"),
]


def model_id(p):
    return p.__name__ if isinstance(p, type) and issubclass(p, dsgd.Model) else None


@pytest.mark.parametrize("model, devices, error, message", REFUSED, ids=model_id)
def test_a_model_a_worker_cannot_train_is_refused_at_build_naming_why(model, devices, error, message):
    """The worker's own checks, on a worker built in this process as an actor builds it."""
    with pytest.raises(error, match=message):
        local_worker(model, devices_per_worker=devices)


@pytest.mark.parametrize("model, devices, error, message",
                         [r for r in REFUSED if r[0] in (mc.NonScalarLoss, mc.MetricsByDevice)], ids=model_id)
def test_the_engine_raises_a_workers_refusal_and_stops_the_worker(ray_session, model, devices, error, message):
    """One refusal of each kind of error, from a worker actor: the engine raises it, and the worker is gone."""
    before = known_actors()
    with pytest.raises(error, match=message):
        dsgd.DistributedSGD(model, num_workers=1, devices_per_worker=devices)
    assert [state for _, state in actors_started_since(before)] == ["DEAD"]  # the worker it started is gone


@pytest.fixture(scope="module")
def mixed_engines(ray_session):
    engines = {}
    try:
        for name, kwargs in {"ps": {}, "ps, no ops": {"use_ops": False}, "simple": {"strategy": "simple"}}.items():
            engines[name] = dsgd.DistributedSGD(mc.MixedDtypeNet, num_workers=2, devices_per_worker=2, **kwargs)
        yield engines
    finally:
        for sgd in engines.values():
            sgd.shutdown()


# Each dtype's absolute tolerance against float64 arithmetic, for weights of up to 0.025 after three
# steps: about 4x the error seen (float16 3e-5, bfloat16 4e-4); a lost or doubled gradient moves them ~1e-2.
TOLERANCE = {"f64": 1e-7, "f32": 1e-6, "f16": 1.5e-4, "bf16": 1.5e-3, "embedding": 1e-6}


def test_float64_float16_bfloat16_and_sparse_gradients_train_like_numpy_under_every_exchange(mixed_engines):
    replicas = [(w, d) for w in range(2) for d in range(2)]
    start = next(iter(mixed_engines.values())).get_weights()
    assert {k: v.dtype for k, v in start.items()} == {
        **{f"w_{n}": np.dtype(t) for n, t in mc.DTYPES.items()}, "embedding": np.dtype(np.float32)}
    for sgd in mixed_engines.values():
        sgd.set_weights(start)
    expected = {k: v.astype(np.float64) for k, v in start.items()}
    for step in range(3):
        for sgd in mixed_engines.values():
            sgd.step()
        expected = mc.mixed_numpy_step(expected, replicas, step)
    results = {name: sgd.get_weights() for name, sgd in mixed_engines.items()}
    for name, got in results.items():
        assert_replicas_identical(mixed_engines[name], 4)
        for var, value in got.items():
            assert value.dtype == start[var].dtype, (name, var)
            key = var[2:] if var.startswith("w_") else var
            np.testing.assert_allclose(value.astype(np.float64), expected[var], rtol=0, atol=TOLERANCE[key],
                                       err_msg=f"{name}: {var}")
    for var in results["ps"]:  # every exchange averages in the same order: bit-identical weights
        assert np.array_equal(results["ps"][var], results["simple"][var]), var
        assert np.array_equal(results["ps"][var], results["ps, no ops"][var]), var


def test_a_model_of_several_mib_is_split_over_partitions_and_servers_and_trains_like_numpy(ray_session, caplog):
    caplog.set_level(logging.INFO, logger="dsgd")
    with dsgd.DistributedSGD(mc.WideLinear, num_workers=2) as sgd:
        plan = re.search(r"strategy 'ps': (\d+) partitions of up to [0-9.]+ MiB on (\d+) parameter servers",
                         caplog.text)
        assert plan, caplog.text
        assert int(plan.group(1)) >= 2 and int(plan.group(2)) == 2
        weights = {k: v.astype(np.float64) for k, v in sgd.get_weights().items()}
        for step in range(3):
            sgd.step()
            weights = mc.wide_numpy_step(weights, [(0, 0), (1, 0)], step)
        got = sgd.get_weights()
        assert_replicas_identical(sgd, 2)
    for name, value in got.items():
        np.testing.assert_allclose(value, weights[name], rtol=1e-4, atol=1e-6, err_msg=name)

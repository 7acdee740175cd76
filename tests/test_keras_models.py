"""dsgd.KerasModel on tf_keras models as users write them: input shapes, the functional API,
subclassed and nested models, batch norm, dropout, regularizers, several inputs and outputs,
and tf_keras.applications models."""

import contextlib
import functools
import logging
from typing import Iterator

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dsgd
import keras_test_models as km
from dsgd.sgd_worker import SGDWorker
from dsgd_test_models import (REPLICAS_2x1, assert_all_identical, assert_replicas_identical, local_worker,
                              assert_warmup_and_a_skipped_step_change_nothing, assert_weights_close)

WORKERS = 2


def start_weights(sgd, seed: int = 5) -> dict:
    """Small random weights on every replica of ``sgd`` (an engine or an SGDWorker); moving variances positive."""
    rng = np.random.RandomState(seed)
    weights = {k: (np.abs if "moving_variance" in k else np.asarray)(0.3 * rng.randn(*v.shape)).astype(v.dtype)
               for k, v in sgd.get_weights().items()}
    sgd.set_weights(weights)
    return weights


@contextlib.contextmanager
def kind_worker(kind: str, devices: int) -> Iterator[SGDWorker]:
    """A dsgd worker of ``kind`` built in this process (``local_worker``): ``devices`` replicas, whose mean gradient
    the worker's own graph takes. Its session closed on exit."""
    tf_keras.backend.reset_uids()  # Keras's layer counters, at zero in a new worker process
    worker = local_worker(functools.partial(km.kind_creator, kind), devices_per_worker=devices)
    try:
        yield worker
    finally:
        worker.sess.close()


@pytest.mark.parametrize("kind", km.DETERMINISTIC)
def test_model_trains_like_an_eager_reference_applying_the_mean_gradient(kind):
    """Each kind on a worker built in this process with two replicas (the worker code is the same; the mean
    across worker processes: the next test)."""
    with kind_worker(kind, devices=2) as worker:
        start = start_weights(worker)
        stats = [worker.step(step, fetch_stats=True).floats() for step in range(km.STEPS)]
        got, replicas = worker.get_weights(), worker.runtime.replica_weights()
    expected, first_loss = km.eager_reference(kind, start, [(0, 0), (0, 1)], km.STEPS)
    assert got.keys() == expected.keys()
    assert_weights_close(got, expected)
    assert len(replicas) == 2
    assert_all_identical(replicas)
    # The step's loss is the replicas' mean loss before the step, regularization included once.
    assert stats[0]["loss"] == pytest.approx(first_loss, rel=1e-5)


def test_model_trains_like_an_eager_reference_applying_the_mean_gradient_of_two_workers(ray_session):
    """The same through the engine for one kind (a regularized one: its loss must count the regularization once
    in the mean over workers)."""
    kind = "regularized"
    with dsgd.DistributedSGD(functools.partial(km.kind_creator, kind), num_workers=WORKERS) as sgd:
        start = start_weights(sgd)
        stats = [sgd.step(fetch_stats=True) for _ in range(km.STEPS)]
        expected, first_loss = km.eager_reference(kind, start, REPLICAS_2x1, km.STEPS)
        assert sgd.get_weights().keys() == expected.keys()
        assert_weights_close(sgd.get_weights(), expected)
        assert_replicas_identical(sgd, WORKERS)
    assert stats[0]["loss"] == pytest.approx(first_loss, rel=1e-5)


@pytest.mark.parametrize("kind, bias_before_bn", [  # the first in the slow tier (the suite's time budget)
    pytest.param("sequential_input_layer_bn", "dense/bias", marks=pytest.mark.slow),
    ("functional_bn_dropout", "dense_1/bias")])
def test_model_with_batch_norm_trains_and_every_replica_keeps_identical_variables(ray_session, kind, bias_before_bn):
    with dsgd.DistributedSGD(functools.partial(km.kind_creator, kind), num_workers=WORKERS,
                             devices_per_worker=2) as sgd:
        start = start_weights(sgd)
        for _ in range(km.STEPS):
            sgd.step()
        got = sgd.get_weights()
        assert_replicas_identical(sgd, WORKERS * 2)
    moving = [name for name in got if "moving_" in name]
    assert len(moving) == 2
    # Everything trained, moving statistics included, but the bias of the layer before batch norm:
    # normalization subtracts the batch mean, so that bias has a zero gradient (in float32, zero up to rounding:
    # with dropout's random masks after the normalization, the rounding can leave ~1e-9 of it).
    unchanged = [name for name in got if np.allclose(got[name], start[name], rtol=0, atol=1e-6)]
    assert unchanged == [bias_before_bn]


def test_batch_norm_statistics_are_unchanged_by_a_warmup_and_a_skipped_step(ray_session, caplog):
    """The TF1 way's batch-norm updates run in the step's forward pass: on 2 workers x 2 devices with Adam, a
    warmup, and a step whose mean is NaN (a kernel set to NaN) skipped under nan_policy="skip", change no
    weight, moving statistic or optimizer variable of any replica; the steps after them train on, the replicas
    identical."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    with dsgd.DistributedSGD(functools.partial(km.kind_creator, "sequential_input_layer_bn", adam=True),
                             num_workers=WORKERS, devices_per_worker=2, strategy="ps", nan_policy="skip") as sgd:
        assert_warmup_and_a_skipped_step_change_nothing(sgd, lambda: caplog.text, WORKERS * 2)


# MobileNetV3Small by default (the most kinds of layer: depthwise convolutions, squeeze-and-excite, hard swish,
# rescaling); the other two are slow (the suite's time budget).
@pytest.mark.parametrize("kind", [k if k == "MobileNetV3Small" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in km.APPLICATIONS])
def test_application_model_with_batch_norm_trains_with_identical_replicas(ray_session, kind):
    with dsgd.DistributedSGD(functools.partial(km.kind_creator, kind), num_workers=WORKERS) as sgd:
        start = sgd.get_weights()
        losses = [sgd.step(fetch_stats=True)["loss"] for _ in range(2)]
        got = sgd.get_weights()
        assert_replicas_identical(sgd, WORKERS)
    assert all(np.isfinite(losses))
    moving = [name for name in got if name.endswith("moving_mean")]
    assert moving and not all(np.array_equal(got[name], start[name]) for name in moving)
    # Moving statistics move without any gradient applied: the kernels show the steps trained.
    kernels = [name for name in got if name.endswith("kernel")]
    assert kernels and all(not np.array_equal(got[name], start[name]) for name in kernels)


# ---- in-process: KerasModel built in a graph like a dsgd worker builds it, no Ray --------------

def build(kind: str, device_index: int = 0) -> dsgd.KerasModel:
    with tf.compat.v1.variable_scope(f"device_{device_index}"):
        return km.kind_creator(kind, 0, device_index)


def test_only_the_replicas_own_call_contributes_update_ops():
    with tf.Graph().as_default():
        model = build("sequential_input_layer_bn", device_index=1)
        # The model also holds the two updates of its build on its own Input layer, which nothing feeds.
        assert len(model.model.updates) == 4
        assert len(model.updates) == 2
        assert all(u.name.startswith("device_1/sequential/batch_normalization/AssignMovingAvg") for u in model.updates)
        assert tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS) == model.updates


def test_a_model_reading_a_placeholder_nobody_feeds_is_refused_naming_it():
    with tf.Graph().as_default():
        with tf.compat.v1.variable_scope("device_0"):
            with pytest.raises(ValueError, match=r"its loss reads placeholder 'device_0/scale' \(in layer "
                                                 r"'reads_outside_placeholder', op .*\), which dsgd never feeds"):
                dsgd.KerasModel(km.ReadsOutsidePlaceholder(), loss="mse",
                                optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR),
                                batches=km.replica_batches(0, 0))


def test_labels_must_match_the_outputs_and_losses_one_per_output():
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"has a dict of 2 outputs \(keys \['pair', 'value'\]\) but the "
                                             r"batches' labels are one output"):
            dsgd.KerasModel(km.BUILDERS["two_outputs"](), loss="mse",
                            optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR),
                            batches=km.replica_batches(0, 0))
        with pytest.raises(ValueError, match=r"loss is a dict with keys \['value'\]; expected one entry per "
                                             r"output: \['pair', 'value'\]"):
            dsgd.KerasModel(km.BUILDERS["two_outputs"](), loss={"value": "mse"},
                            optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR),
                            batches=[km.kind_batch("two_outputs", 0, 0, 0)])


def test_several_outputs_report_each_metric_per_output_and_dict_batches_name_their_keys():
    rng = np.random.RandomState(0)
    rows = {"x": rng.randn(4, km.IN).astype(np.float32), "v": rng.randn(4, 1).astype(np.float32),
            "p": rng.randn(4, 2).astype(np.float32)}
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        model = dsgd.KerasModel(km.BUILDERS["two_outputs"](), loss={"value": "mse", "pair": "mae"},
                                optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR), metrics=["mae"],
                                batches=[rows], features="x", label={"value": "v", "pair": "p"})
        assert sorted(model.get_metrics()) == ["pair_mae", "value_mae"]
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = model.get_feed_dict()
        loss, outputs = sess.run([model.loss, model.outputs], feed)
    expected = np.mean((outputs["value"] - rows["v"]) ** 2) + np.mean(np.abs(outputs["pair"] - rows["p"]))
    assert loss == pytest.approx(expected, rel=1e-5)


def test_predict_runs_batch_norm_in_inference_mode_with_the_moving_statistics():
    x = np.random.RandomState(1).randn(7, km.IN).astype(np.float32)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        model = build("sequential_input_layer_bn")
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.RandomState(2)
        for v in tf.compat.v1.global_variables():
            v.load(np.abs(rng.randn(*v.shape.as_list())).astype(np.float32) + 0.1, sess)
        weights = {v.name.split(":")[0].split("/", 1)[1]: sess.run(v) for v in tf.compat.v1.global_variables()}
        predicted = model.predict(x, batch_size=3)
        training = sess.run(model.outputs, {model.inputs: x})
    names = km.graph_variable_names("sequential_input_layer_bn")
    kernel, bias, gamma, beta, mean, variance, kernel_2, bias_2 = (weights[n] for n in names)
    h = x @ kernel + bias
    h = (h - mean) / np.sqrt(variance + 1e-3) * gamma + beta
    np.testing.assert_allclose(predicted, h @ kernel_2 + bias_2, rtol=1e-5, atol=1e-5)
    assert not np.allclose(training, predicted)  # training mode normalizes with the batch's statistics


def test_predict_outside_the_workers_session_says_where_to_call_it():
    with tf.Graph().as_default():
        model = build("functional")
        with pytest.raises(RuntimeError, match=r"predict runs in its worker's session: call it through "
                                               r"sgd.for_model"):
            model.predict(np.zeros((1, km.IN), np.float32))


def test_keras_variables_of_every_kind_strip_to_the_same_names_on_every_replica():
    for kind in ("sequential_input_layer_bn", "functional", "subclassed", "two_inputs"):
        with tf.Graph().as_default() as graph:
            for device in range(2):
                build(kind, device)
            names = [v.name.split(":")[0] for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)]
        stripped = [n.split("/", 1)[1] for n in names]
        assert stripped[:len(stripped) // 2] == stripped[len(stripped) // 2:] == km.graph_variable_names(kind), kind
        tf_keras.backend.reset_uids()


def test_dict_inputs_are_fed_from_dict_batches_through_a_dict_of_feature_keys():
    rng = np.random.RandomState(3)
    rows = {"first": rng.randn(4, km.IN).astype(np.float32), "second": rng.randn(4, 2).astype(np.float32),
            "target": rng.randn(4, 1).astype(np.float32)}
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        a, b = tf_keras.Input((km.IN,), name="a"), tf_keras.Input((2,), name="b")
        net = tf_keras.Model({"a": a, "b": b}, tf_keras.layers.Dense(1)(tf_keras.layers.Concatenate()([a, b])))
        model = dsgd.KerasModel(net, loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR),
                                batches=[rows], features={"a": "first", "b": "second"}, label="target")
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = model.get_feed_dict()
        assert set(model.inputs) == {"a", "b"}
        np.testing.assert_array_equal(feed[model.inputs["a"]], rows["first"])
        np.testing.assert_array_equal(feed[model.inputs["b"]], rows["second"])
        kernel, bias = sess.run(net.trainable_variables)
        loss = sess.run(model.loss, feed)
    pred = np.concatenate([rows["first"], rows["second"]], axis=1) @ kernel + bias
    assert loss == pytest.approx(np.mean((pred - rows["target"]) ** 2), rel=1e-5)

"""dsgd.KerasModel (tf_keras) and tf.data input: the same semantics as hand-written graph models."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import dsgd
import keras_test_models as km
from dsgd_test_models import assert_replicas_identical, local_worker, modules_a_user_imports

WORKERS, DEVICES = 2, 2
REPLICAS = [(w, d) for w in range(WORKERS) for d in range(DEVICES)]


def start_weights(sgd, seed: int = 3) -> dict:
    """Fixed random weights on every replica."""
    rng = np.random.RandomState(seed)
    weights = {k: (0.5 * rng.randn(*v.shape)).astype(v.dtype) for k, v in sgd.get_weights().items()}
    sgd.set_weights(weights)
    return weights


def assert_close(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def dense_engines(ray_session):
    built = {}
    try:
        for strategy in ("simple", "ps"):
            built[strategy] = dsgd.DistributedSGD(km.dense_creator, num_workers=WORKERS, devices_per_worker=DEVICES,
                                                  strategy=strategy)
        yield built
    finally:
        for sgd in built.values():
            sgd.shutdown()


def test_weights_are_named_like_the_keras_variables_without_the_replica_scope(dense_engines):
    graph = tf.Graph()
    with graph.as_default():
        net = km.dense_net()
        net(tf.compat.v1.placeholder(tf.float32, [None, km.IN]))
        keras_names = {v.name.split(":")[0] for v in net.variables}
    assert keras_names == set(km.DENSE.values())
    for sgd in dense_engines.values():
        assert set(sgd.get_weights()) == keras_names
        assert_replicas_identical(sgd, WORKERS * DEVICES)


def test_dense_model_trains_like_sgd_on_the_union_of_batches_under_both_strategies(dense_engines):
    # Other tests may have stepped these engines: start from the batch the replicas are at.
    read = {m for sgd in dense_engines.values() for m in sgd.foreach_model(lambda m: m.batches_read)}
    assert len(read) == 1
    first = read.pop()
    start = None
    for sgd in dense_engines.values():
        start = start_weights(sgd)
    expected = {k: v.astype(np.float64) for k, v in start.items()}
    x0 = {(w, d): km.batch(w, d, first % km.STEPS) for w, d in REPLICAS}
    per_replica = [km.dense_forward(expected, x0[r][0])[1] - x0[r][1] for r in REPLICAS]
    for step in range(first, first + km.STEPS + 1):  # past the end of the data: the batches start over
        stats = [sgd.step(fetch_stats=(step == first)) for sgd in dense_engines.values()]
        expected = km.dense_sgd_step(expected, REPLICAS, step % km.STEPS)
        for sgd in dense_engines.values():
            assert_close(sgd.get_weights(), expected)
            assert_replicas_identical(sgd, WORKERS * DEVICES)
        if step == first:
            for s in stats:  # metrics by name and by callable, means over the replicas, before the step
                assert s["loss"] == pytest.approx(np.mean([np.mean(e ** 2) for e in per_replica]), rel=1e-5)
                assert s["mae"] == pytest.approx(np.mean([np.mean(np.abs(e)) for e in per_replica]), rel=1e-5)
                assert s["max_abs_error"] == pytest.approx(np.mean([np.abs(e).max() for e in per_replica]), rel=1e-5)
    simple, ps = (sgd.get_weights() for sgd in dense_engines.values())
    for name in simple:
        assert np.array_equal(simple[name], ps[name]), name
    epochs = (first + km.STEPS) // km.STEPS  # epochs started after the first
    assert dense_engines["ps"].foreach_model(lambda m: m.epoch) == [epochs] * len(REPLICAS)


def test_batch_norm_moving_statistics_are_the_mean_update_on_every_replica(ray_session):
    with dsgd.DistributedSGD(km.bn_creator, num_workers=WORKERS, devices_per_worker=DEVICES, strategy="ps") as sgd:
        start = start_weights(sgd)
        bn = "sequential/batch_normalization/"
        start[bn + "moving_variance"] = np.abs(start[bn + "moving_variance"]) + 0.5
        sgd.set_weights(start)
        sgd.step()
        got = sgd.get_weights()
        assert_replicas_identical(sgd, WORKERS * DEVICES)
    means, variances = [], []
    for w, d in REPLICAS:
        x, _ = km.batch(w, d, 0)
        h = x.astype(np.float64) @ start["sequential/dense/kernel"] + start["sequential/dense/bias"]
        means.append(h.mean(0))
        variances.append(h.var(0))
    m = km.BN_MOMENTUM
    np.testing.assert_allclose(got[bn + "moving_mean"], m * start[bn + "moving_mean"] + (1 - m) * np.mean(means, 0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[bn + "moving_variance"],
                               m * start[bn + "moving_variance"] + (1 - m) * np.mean(variances, 0), rtol=1e-5, atol=1e-6)
    # The step trained the other variables too.
    assert not np.allclose(got["sequential/dense_1/kernel"], start["sequential/dense_1/kernel"])


def test_keras_model_reading_a_tf_data_dataset_in_the_graph_trains_without_a_feed(ray_session):
    with dsgd.DistributedSGD(km.dense_dataset_creator, num_workers=WORKERS, devices_per_worker=DEVICES,
                             strategy="ps") as sgd:
        start = start_weights(sgd)
        assert sgd.foreach_model(lambda m: m.get_feed_dict()) == [{}] * len(REPLICAS)
        expected = {k: v.astype(np.float64) for k, v in start.items()}
        for step in range(2):
            sgd.step()
            expected = km.dense_sgd_step(expected, REPLICAS, step)
        assert_close(sgd.get_weights(), expected)
        assert_replicas_identical(sgd, WORKERS * DEVICES)


def test_plain_model_with_a_one_shot_tf_data_iterator_trains_and_replicas_stay_identical(ray_session):
    with dsgd.DistributedSGD(km.TFDataRegression, num_workers=WORKERS, devices_per_worker=1, strategy="ps") as sgd:
        w = np.array([0.5, -1.0, 2.0], np.float32)
        sgd.set_weights({"w": w})
        expected = w.astype(np.float64)
        for step in range(2):
            sgd.step()
            grads = []
            for worker in range(WORKERS):
                x, y = km.batch(worker, 0, step)
                grads.append(2 * x.T @ (x @ expected - y[:, 0]) / len(y))
            expected = expected - km.LR * np.mean(grads, 0)
        np.testing.assert_allclose(sgd.get_weights()["w"], expected, rtol=1e-5, atol=1e-6)
        assert_replicas_identical(sgd, WORKERS)


def test_keras3_model_with_a_tf1_optimizer_is_refused_naming_the_keras3_one():
    """In a worker built in this process (``SGDWorker.setup``); test_tf2 sends this refusal through an engine."""
    with pytest.raises(dsgd.ModelCreatorError, match="needs a Keras 3 optimizer.*use keras.optimizers.SGD"):
        local_worker(km.keras3_creator)


# ---- in-process: KerasModel built in a graph like a dsgd worker builds it, no Ray --------------

def build_replica(device_index: int, net=None, **kwargs) -> dsgd.KerasModel:
    """A KerasModel under the device's variable scope, in the current default graph."""
    with tf.compat.v1.variable_scope(f"device_{device_index}"):
        args = dict(loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(km.LR),
                    batches=km.replica_batches(0, device_index))
        args.update(kwargs)
        return dsgd.KerasModel(km.dense_net() if net is None else net, **args)


def test_model_built_before_model_creator_is_refused():
    net = km.dense_net()
    net(np.zeros((1, km.IN), np.float32))  # built eagerly, as in the driver
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="outside this replica's graph.*build the tf_keras model inside model_creator"):
            build_replica(0, net)


def test_model_shared_between_replicas_is_refused():
    with tf.Graph().as_default():
        first = build_replica(0)
        with pytest.raises(ValueError, match="outside this replica's variable scope 'device_1'.*inside model_creator"):
            build_replica(1, first.model)


def test_non_keras_model_and_stateful_metric_are_refused():
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="must be a tf_keras.Model, got function"):
            build_replica(0, km.dense_net)
        with pytest.raises(TypeError, match="stateful keras Metric object"):
            build_replica(0, metrics=[tf_keras.metrics.AUC()])
        with pytest.raises(TypeError, match="tf.compat.v1.train.Optimizer"):
            build_replica(0, optimizer=tf_keras.optimizers.SGD())


def test_every_replica_of_a_graph_gets_the_same_variable_names():
    with tf.Graph().as_default() as graph:
        for device in range(2):
            build_replica(device)
        names = [v.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)]
    assert sorted(names) == sorted(f"device_{d}/{n}:0" for d in range(2) for n in km.DENSE.values())


def test_dict_batches_name_the_missing_key_and_the_keys_there_are():
    batches = [{"image": np.zeros((2, km.IN), np.float32), "y": np.zeros((2, 1), np.float32)}]
    with tf.Graph().as_default():
        with pytest.raises(KeyError, match=r"no key 'x' .*their keys: \['image', 'y'\]"):
            build_replica(0, batches=batches, features="x", label="y")
        with pytest.raises(ValueError, match=r"dicts with keys \['image', 'y'\]; pass features= and label="):
            build_replica(0, batches=batches)
        with pytest.raises(ValueError, match="both features= and label="):
            build_replica(0, batches=batches, features="image")


def test_iterable_batches_start_a_new_epoch_and_a_one_pass_iterator_says_it_ran_out():
    with tf.Graph().as_default():
        listed = build_replica(0)
        firsts = [listed.get_feed_dict()[listed.labels] for _ in range(km.STEPS + 1)]
        assert listed.epoch == 1
        assert np.array_equal(firsts[-1], firsts[0]) and not np.array_equal(firsts[1], firsts[0])
        once = build_replica(1, batches=iter(km.replica_batches(0, 1)))
        for _ in range(km.STEPS):
            once.get_feed_dict()
        with pytest.raises(RuntimeError, match=f"ran out after {km.STEPS} batches.*one-pass iterator"):
            once.get_feed_dict()


def test_importing_dsgd_does_not_import_tf_keras():
    modules = modules_a_user_imports()  # after reading dsgd.KerasModel's module too
    assert "dsgd.integrations.keras" in modules and "tf_keras" not in modules


def test_accuracy_of_int_labels_against_one_sigmoid_output_compares_them_as_keras_does():
    """IMDB's shapes: int32 labels 0/1 of shape (N,), an output of shape (N, 1)."""
    from dsgd.integrations import keras_outputs

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        correct = keras_outputs._accuracy(tf.constant([0, 1, 1], tf.int32), tf.constant([[0.2], [0.9], [0.4]]))
        assert sess.run(correct).tolist() == [1.0, 1.0, 0.0]

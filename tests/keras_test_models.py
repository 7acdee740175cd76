"""tf_keras models and tf.data input for tests/test_keras.py, with numpy twins.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

import dsgd

IN, HIDDEN, BATCH, LR, STEPS = 3, 4, 5, 0.1, 3
BN_MOMENTUM = 0.5


def batch(worker_index: int, device_index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch replica (worker, device) sees at a given step: x (BATCH, IN), y (BATCH, 1)."""
    rng = np.random.RandomState(1000 * step + 10 * worker_index + device_index)
    return rng.randn(BATCH, IN).astype(np.float32), rng.randn(BATCH, 1).astype(np.float32)


def replica_batches(worker_index: int, device_index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [batch(worker_index, device_index, step) for step in range(STEPS)]


def dense_net() -> tf_keras.Model:
    return tf_keras.Sequential([tf_keras.layers.Dense(HIDDEN, activation="tanh"), tf_keras.layers.Dense(1)])


def max_abs_error(y_true, y_pred):
    return tf.reduce_max(tf.abs(y_pred - y_true))


def dense_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    return dsgd.KerasModel(dense_net(), loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           metrics=["mae", max_abs_error], batches=replica_batches(worker_index, device_index))


def dense_dataset_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    """The same model and batches, read in the graph from a tf.data.Dataset."""
    xs, ys = zip(*replica_batches(worker_index, device_index))
    dataset = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys))).repeat()
    return dsgd.KerasModel(dense_net(), loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=dataset)


class TFDataRegression(dsgd.Model):
    """A plain graph model whose batches come from a one-shot tf.data iterator: no feed dict."""

    def __init__(self, worker_index: int, device_index: int):
        xs, ys = zip(*replica_batches(worker_index, device_index))
        dataset = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)[..., 0])).repeat()
        x, y = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        w = tf.compat.v1.get_variable("w", [IN])
        self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)


def bn_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    """Dense, BatchNormalization, Dense; dict batches read through features/label."""
    net = tf_keras.Sequential([tf_keras.layers.Dense(HIDDEN), tf_keras.layers.BatchNormalization(momentum=BN_MOMENTUM),
                               tf_keras.layers.Dense(1)])
    batches = [{"x": x, "y": y, "unused": np.zeros(len(x))} for x, y in replica_batches(worker_index, device_index)]
    return dsgd.KerasModel(net, loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=batches, features="x", label="y")


def keras3_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    import keras  # Keras 3, the package tensorflow depends on

    net = keras.Sequential([keras.layers.Dense(1)])
    return dsgd.KerasModel(net, loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=replica_batches(worker_index, device_index))


# ---- numpy twins -------------------------------------------------------------

DENSE = {"w1": "sequential/dense/kernel", "b1": "sequential/dense/bias",
         "w2": "sequential/dense_1/kernel", "b2": "sequential/dense_1/bias"}


def dense_forward(weights: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x @ weights[DENSE["w1"]] + weights[DENSE["b1"]])
    return h, h @ weights[DENSE["w2"]] + weights[DENSE["b2"]]


def dense_gradients(weights: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """Gradients of mean((pred - y)^2)."""
    h, pred = dense_forward(weights, x)
    dpred = 2 * (pred - y) / pred.size
    dh = dpred @ weights[DENSE["w2"]].T * (1 - h ** 2)
    return {DENSE["w1"]: x.T @ dh, DENSE["b1"]: dh.sum(0), DENSE["w2"]: h.T @ dpred, DENSE["b2"]: dpred.sum(0)}


def dense_sgd_step(weights: dict, replicas: list[tuple[int, int]], step: int) -> dict:
    """One plain SGD step on the union of the replicas' batches (float64)."""
    x = np.concatenate([batch(w, d, step)[0] for w, d in replicas]).astype(np.float64)
    y = np.concatenate([batch(w, d, step)[1] for w, d in replicas]).astype(np.float64)
    grads = dense_gradients(weights, x, y)
    return {k: weights[k] - LR * grads[k] for k in weights}

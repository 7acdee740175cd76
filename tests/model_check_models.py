"""Models the engine must refuse at build time, and models of unusual dtypes and sizes it must train.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import dsgd
from dsgd_test_models import TanhNet

LR = 0.1


class NonScalarLoss(TanhNet):
    def get_loss(self):
        return tf.square(self.loss) * tf.ones([3])


class KerasOptimizer(TanhNet):
    def get_optimizer(self):
        return object()


class LossOnNoVariable(TanhNet):
    """Has trainable variables, but the loss reads none of them."""

    def get_loss(self):
        return tf.reduce_mean(tf.square(self.y))


class UndefinedShape(TanhNet):
    def __init__(self, worker_index: int, device_index: int):
        super().__init__(worker_index, device_index)
        free = tf.Variable(tf.zeros([2]), shape=tf.TensorShape([None]), name="free")
        self.loss = self.loss + tf.reduce_sum(free)


class MetricsByDevice(TanhNet):
    """Device 1 reports a metric device 0 does not."""

    def get_metrics(self):
        metrics = super().get_metrics()
        if self.device_index == 1:
            metrics["extra"] = self.loss
        return metrics


# ---- dtypes and sparse gradients: trained against numpy ------------------------

DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": tf.bfloat16.as_numpy_dtype}
MIXED_IN, EMBED_ROWS, EMBED_DIM, MIXED_BATCH = 4, 10, 3, 6


def mixed_batch(worker_index: int, device_index: int, step: int):
    rng = np.random.RandomState(100 * step + 10 * worker_index + device_index)
    return (rng.randn(MIXED_BATCH, MIXED_IN).astype(np.float32), rng.randint(0, EMBED_ROWS, MIXED_BATCH),
            rng.randn(MIXED_BATCH).astype(np.float32))


class MixedDtypeNet(dsgd.Model):
    """One regression per float dtype (float64, float32, float16, bfloat16: x . w_dtype computed in
    that dtype) and one through an embedding table, whose gradient is sparse (tf.IndexedSlices).

    The loss is the sum of their squared errors: each weight's gradient depends on that weight
    alone, so a 16-bit weight's rounding does not leak into the others' reference.
    """

    def __init__(self, worker_index: int, device_index: int):
        self.replica, self.step = (worker_index, device_index), 0
        self.x = tf.compat.v1.placeholder(tf.float32, [None, MIXED_IN])
        self.ids = tf.compat.v1.placeholder(tf.int32, [None])
        self.y = tf.compat.v1.placeholder(tf.float32, [None])
        preds = []
        for name, dtype in DTYPES.items():
            w = tf.compat.v1.get_variable(f"w_{name}", [MIXED_IN], dtype=tf.as_dtype(dtype),
                                          initializer=tf.compat.v1.zeros_initializer())
            preds.append(tf.cast(tf.linalg.matvec(tf.cast(self.x, w.dtype), w), tf.float32))
        table = tf.compat.v1.get_variable("embedding", [EMBED_ROWS, EMBED_DIM])
        preds.append(tf.reduce_sum(tf.nn.embedding_lookup(table, self.ids), axis=1))
        self.loss = tf.add_n([tf.reduce_mean(tf.square(pred - self.y)) for pred in preds])

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_feed_dict(self):
        x, ids, y = mixed_batch(*self.replica, self.step)
        self.step += 1
        return {self.x: x, self.ids: ids, self.y: y}


def mixed_numpy_step(weights: dict, replicas: list[tuple[int, int]], step: int) -> dict:
    """One plain SGD step with the replicas' mean gradient, in float64."""
    grads = []
    for w, d in replicas:
        x, ids, y = mixed_batch(w, d, step)
        g = {f"w_{n}": x.T @ (2 * (x @ weights[f"w_{n}"] - y) / len(y)) for n in DTYPES}
        dpred = 2 * (weights["embedding"][ids].sum(1) - y) / len(y)
        g["embedding"] = np.zeros_like(weights["embedding"])
        np.add.at(g["embedding"], ids, np.repeat(dpred[:, None], EMBED_DIM, axis=1))
        grads.append(g)
    return {k: weights[k] - LR * np.mean([g[k] for g in grads], axis=0) for k in weights}


# ---- a model of several MiB: the default partitioning ---------------------------

WIDE_IN, WIDE_OUT, WIDE_BATCH = 512, 1536, 8  # 3 MiB of float32 in "wide/w", more in "wide/v"


def wide_batch(worker_index: int, device_index: int, step: int):
    rng = np.random.RandomState(100 * step + 10 * worker_index + device_index)
    return rng.randn(WIDE_BATCH, WIDE_IN).astype(np.float32), rng.randn(WIDE_BATCH, WIDE_OUT).astype(np.float32)


class WideLinear(dsgd.Model):
    """y = x W + v: 786k + 1.5k float32 weights, and a second 786k-float matrix used through its transpose."""

    def __init__(self, worker_index: int, device_index: int):
        self.replica, self.step = (worker_index, device_index), 0
        self.x = tf.compat.v1.placeholder(tf.float32, [None, WIDE_IN])
        self.y = tf.compat.v1.placeholder(tf.float32, [None, WIDE_OUT])
        w = tf.compat.v1.get_variable("wide/w", [WIDE_IN, WIDE_OUT], initializer=tf.compat.v1.zeros_initializer())
        u = tf.compat.v1.get_variable("wide/u", [WIDE_OUT, WIDE_IN], initializer=tf.compat.v1.zeros_initializer())
        v = tf.compat.v1.get_variable("wide/v", [WIDE_OUT], initializer=tf.compat.v1.zeros_initializer())
        pred = tf.matmul(self.x, w) + tf.matmul(self.x, u, transpose_b=True) + v
        self.loss = tf.reduce_mean(tf.square(pred - self.y))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_feed_dict(self):
        x, y = wide_batch(*self.replica, self.step)
        self.step += 1
        return {self.x: x, self.y: y}


def wide_numpy_step(weights: dict, replicas: list[tuple[int, int]], step: int) -> dict:
    grads = []
    for w, d in replicas:
        x, y = wide_batch(w, d, step)
        x, y = x.astype(np.float64), y.astype(np.float64)
        pred = x @ weights["wide/w"] + x @ weights["wide/u"].T + weights["wide/v"]
        dpred = 2 * (pred - y) / pred.size
        grads.append({"wide/w": x.T @ dpred, "wide/u": dpred.T @ x, "wide/v": dpred.sum(0)})
    return {k: weights[k] - LR * np.mean([g[k] for g in grads], axis=0) for k in weights}

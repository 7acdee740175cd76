"""Models written the way Ray 0.6's DistributedSGD users wrote them (for test_ray06_compat).

The patterns: the batch cached on the device in a local variable, a
``tf.compat.v1.metrics`` accuracy (local counters), a flat-weights helper
built from the default session inside ``model_creator``, and a
``get_metrics()`` that evaluates its metrics itself with ``Tensor.eval()``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import dsgd

IN, CLASSES, BATCH, LR = 6, 3, 8, 0.5
TEACHER = np.random.RandomState(0).randn(IN, CLASSES).astype(np.float32)


def labelled(seed: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and the labels a fixed linear teacher gives them."""
    x = np.random.RandomState(seed).randn(rows, IN).astype(np.float32)
    return x, np.argmax(x @ TEACHER, axis=1).astype(np.int64)


TEST_X, TEST_Y = labelled(999, 64)


class FlatVariables:
    """Reads and writes a replica's trainable variables as one flat vector, through a session it keeps.

    Built inside ``model_creator`` from ``tf.compat.v1.get_default_session()``,
    as Ray 0.6's ``TensorFlowVariables`` helper was.
    """

    def __init__(self, variables: list, session: tf.compat.v1.Session):
        if session is None:
            raise ValueError("no default session while the model is built")
        self.session = session
        self.variables = variables
        self.flat = tf.compat.v1.placeholder(tf.float32, [sum(int(np.prod(v.shape)) for v in variables)])
        parts, start = [], 0
        for v in variables:
            size = int(np.prod(v.shape))
            parts.append(v.assign(tf.reshape(self.flat[start:start + size], v.shape)))
            start += size
        self.assign = tf.group(*parts)

    def get_flat(self) -> np.ndarray:
        return np.concatenate([np.ravel(a) for a in self.session.run(self.variables)])

    def set_flat(self, values: np.ndarray) -> None:
        self.session.run(self.assign, feed_dict={self.flat: values})


class CachedBatchNet(dsgd.Model):
    """Softmax regression on a batch cached in a local variable; a tf.compat.v1.metrics accuracy."""

    def __init__(self, worker_index: int, device_index: int):
        x, y = labelled(10 * worker_index + device_index, BATCH)
        self.cached = tf.compat.v1.Variable(
            tf.constant(x), trainable=False, name="cached_batch",
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        labels = tf.constant(y)
        w = tf.compat.v1.get_variable("dense/w", [IN, CLASSES])
        b = tf.compat.v1.get_variable("dense/b", [CLASSES], initializer=tf.compat.v1.zeros_initializer())
        logits = tf.matmul(self.cached, w) + b
        self.loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        _, self.accuracy = tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1), name="train_accuracy")
        scope = tf.compat.v1.get_variable_scope().name
        self.count = tf.compat.v1.local_variables(scope=f"{scope}/train_accuracy/count")[0]
        self.test_x = tf.compat.v1.placeholder(tf.float32, [None, IN])
        self.test_y = tf.compat.v1.placeholder(tf.int64, [None])
        predicted = tf.argmax(tf.matmul(self.test_x, w) + b, 1)
        self.test_accuracy = tf.reduce_mean(tf.cast(tf.equal(predicted, self.test_y), tf.float32))
        self.variables = FlatVariables([w, b], tf.compat.v1.get_default_session())

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_metrics(self):
        return {"accuracy": self.accuracy}

    # Ray 0.6's optional hooks; dsgd does not call them.
    def get_weights(self):
        return self.variables.get_flat()

    def set_weights(self, weights):
        self.variables.set_flat(weights)

    def metric_counts(self) -> float:
        """This replica's tf.compat.v1.metrics count: predictions it has seen."""
        return float(self.count.eval())


class EvaluatedMetricsNet(CachedBatchNet):
    """get_metrics() evaluates its accuracy on a test set and returns a number (Ray 0.6's mnist_example)."""

    def get_metrics(self):
        accuracy = self.test_accuracy.eval(feed_dict={self.test_x: TEST_X, self.test_y: TEST_Y})
        return {"test_accuracy": accuracy}


class MixedMetricsNet(CachedBatchNet):
    """One metric a tensor (part of the stats), one a number the model evaluated."""

    def get_metrics(self):
        evaluated = self.test_accuracy.eval(feed_dict={self.test_x: TEST_X, self.test_y: TEST_Y})
        return {"accuracy": self.accuracy, "test_accuracy": evaluated}


class StringMetricNet(CachedBatchNet):
    def get_metrics(self):
        return {"accuracy": "high"}


class ListMetricsNet(CachedBatchNet):
    def get_metrics(self):
        return [self.accuracy]


SLOPE = np.arange(1, 5, dtype=np.float32)


class LateWeightNormNet(dsgd.Model):
    """loss = sum(slope * w), plain SGD; its metric "weight_sum" reads w itself (off the gradients' path), and
    only after a chain of matrix products, so an apply that did not wait for it would have written w by then:
    step k's weight_sum must be the weights' before step k, ``sum(w0) - k * LR * sum(slope)``."""

    W0 = np.ones(4, np.float32)

    def __init__(self, worker_index: int, device_index: int):
        self.w = tf.compat.v1.get_variable("w", initializer=self.W0)
        self.loss = tf.reduce_sum(self.w * SLOPE)
        busy = tf.ones([256, 256]) / 256.0
        for _ in range(30):
            busy = tf.matmul(busy, busy)
        with tf.control_dependencies([busy]):
            self.weight_sum = tf.reduce_sum(self.w.read_value())

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_metrics(self):
        return {"weight_sum": self.weight_sum}

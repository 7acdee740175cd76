"""The interface a user implements to train a model with dsgd."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Model:
    """One replica of the user's model, built in tf.compat.v1 graph mode.

    dsgd calls ``model_creator(worker_index, device_index)`` once per device
    of every worker, inside ``tf.device(...)`` and
    ``tf.compat.v1.variable_scope("device_<i>")``. Build the whole forward
    pass in ``__init__``: create variables with ``tf.compat.v1.get_variable``
    (or ``tf.Variable``) and keep the tensors that the methods below return.
    Do not open your own device scope; dsgd places the replica.

    Every replica must create the same variables (names, shapes, dtypes).
    Initial values need not agree: dsgd broadcasts worker 0, replica 0's
    weights to every replica before the first step.

    The weights are the global variables ``model_creator`` creates. Local
    variables (``tf.compat.v1.GraphKeys.LOCAL_VARIABLES``: a batch cached on
    the device, ``tf.compat.v1.metrics`` counters) and lookup tables are
    initialized with them but stay each replica's own: never averaged,
    broadcast or checkpointed. While ``model_creator`` runs, the worker's
    session is TensorFlow's default session.

    A model may also define ``get_weights()`` / ``set_weights()`` (Ray 0.6's
    optional hooks); dsgd never calls them.

    Example::

        class Linear(dsgd.Model):
            def __init__(self, worker_index, device_index):
                self.x = tf.compat.v1.placeholder(tf.float32, [None, 3])
                self.y = tf.compat.v1.placeholder(tf.float32, [None])
                w = tf.compat.v1.get_variable("w", [3, 1])
                pred = tf.squeeze(tf.matmul(self.x, w), 1)
                self.loss = tf.reduce_mean(tf.square(pred - self.y))
                self.data = make_batches(worker_index, device_index)

            def get_loss(self):
                return self.loss

            def get_optimizer(self):
                return tf.compat.v1.train.GradientDescentOptimizer(0.1)

            def get_feed_dict(self):
                x, y = next(self.data)
                return {self.x: x, self.y: y}
    """

    def get_loss(self) -> tf.Tensor:
        """The scalar loss tensor whose gradients are averaged and applied."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_loss()")

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        """A ``tf.compat.v1.train.Optimizer``; one per replica, never shared."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_optimizer()")

    def get_metrics(self) -> dict[str, tf.Tensor | float]:
        """Metrics by name: scalar tensors, or numbers the model evaluates itself.

        dsgd calls it once, after the graph is built and its variables
        initialized. Tensors are fetched with every step and averaged over
        replicas by ``step(fetch_stats=True)``. Numbers (as Ray 0.6 models
        return, e.g. ``self.accuracy.eval(feed_dict=...)``; the worker's
        session is the default) are not part of the step's stats: read them
        with ``foreach_model(lambda m: m.get_metrics())``.
        """
        return {}

    def get_feed_dict(self) -> dict[Any, Any]:
        """The feed_dict for this replica's next batch; called once per step."""
        return {}

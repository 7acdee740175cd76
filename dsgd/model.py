"""The interface a user implements to train a model with dsgd."""

from __future__ import annotations

from typing import Any

import numpy as np
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

    It is TF1 graph code: made while TensorFlow executes eagerly (outside
    ``model_creator``, or where a TF2 model was built), it raises.

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

    def __new__(cls, *args: Any, **kwargs: Any):
        if tf.executing_eagerly():
            raise TF1ModelOutsideGraph(
                f"{cls.__name__} is a TF1 dsgd.Model, made while TensorFlow executes eagerly: dsgd builds it in a "
                "graph inside model_creator (elsewhere, make it under tf.Graph().as_default()); for eager code "
                "subclass dsgd.TF2Model")
        return super().__new__(cls)

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


class TF2ModelInGraph(Exception):
    """A ``TF2Model`` was made in a TF1 graph: the worker builds its replicas eagerly instead (internal)."""


class TF1ModelOutsideGraph(TypeError):
    """A TF1 ``dsgd.Model`` was made while TensorFlow executes eagerly."""


class TF2Model:
    """One replica of a model trained by a TF2 function: eager variables, a Keras 3 optimizer, a loss.

    dsgd calls ``model_creator(worker_index, device_index)`` once per device
    of every worker, eagerly, under ``tf.device(...)``. Create the variables
    in ``__init__``. dsgd traces one step in a ``tf.function``: each
    replica's ``get_loss(batch)`` under a ``GradientTape``, the mean of every
    replica's gradients over all workers, applied by each replica's
    optimizer. ``dsgd.KerasModel`` given a Keras 3 model is a ``TF2Model``.

    Every replica must create the same variables (shapes, dtypes, in the
    same order). Initial values need not agree: dsgd broadcasts worker 0,
    replica 0's weights before the first step. The weights are keyed by the
    variables' paths as worker 0's first replica names them.

    Example::

        class Regression(dsgd.TF2Model):
            def __init__(self, worker_index, device_index):
                self.w = tf.Variable(tf.zeros([3]))
                self.opt = keras.optimizers.SGD(0.1)
                self.data = make_batches(worker_index, device_index)

            def get_variables(self):
                return [self.w]

            def get_optimizer(self):
                return self.opt

            def get_batch(self):
                x, y = next(self.data)
                return {"x": x, "y": y}

            def get_loss(self, batch):
                err = tf.linalg.matvec(batch["x"], self.w) - batch["y"]
                return tf.reduce_mean(err ** 2), {"mae": tf.reduce_mean(tf.abs(err))}
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if not tf.executing_eagerly():
            raise TF2ModelInGraph(cls.__name__)
        return super().__new__(cls)

    def get_variables(self) -> list:
        """The trainable variables (``tf.Variable`` or Keras variables), in a fixed order."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_variables()")

    def get_optimizer(self) -> Any:
        """A Keras 3 optimizer (``keras.optimizers.Optimizer``); one per replica, never shared."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_optimizer()")

    def get_batch(self) -> Any:
        """This replica's next batch: a numpy array, or a tuple, list or dict of them; called once per step.

        Every batch has the first batch's structure and dtypes; its first
        dimension (the batch size) may change.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement get_batch()")

    def get_loss(self, batch: Any) -> Any:
        """The scalar loss of ``batch`` (tensors, structured as ``get_batch()`` returns them), or
        ``(loss, {name: scalar})`` with metrics, which ``step(fetch_stats=True)`` averages over replicas.

        dsgd traces it once in a ``tf.function`` (autograph converts its
        Python control flow), so it must build its result from ``batch`` and
        the variables alone.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement get_loss(batch)")

    def get_state_variables(self) -> list:
        """Non-trainable float variables the step writes (as batch normalization writes its moving
        statistics): averaged over all replicas after every step, like the gradients. Default: none."""
        return []

    def _dsgd_weights(self) -> list:
        """The variables ``get_weights`` and checkpoints hold: ``get_variables()`` then
        ``get_state_variables()`` (a Keras model's: all its weights)."""
        return [*self.get_variables(), *self.get_state_variables()]

    def _dsgd_local_state(self) -> list:
        """Variables this replica keeps to itself, exchanged with no one (a Keras model's metrics over an epoch),
        read after every step: the driver keeps each worker's latest, and a replacement for a lost worker starts
        from its predecessor's (``_dsgd_take_local_state``). Default: none."""
        return []

    def _dsgd_take_local_state(self, flat: np.ndarray, applied_steps: int) -> None:
        """Start from ``flat``, a lost replica's ``_dsgd_local_state()`` after its first ``applied_steps`` steps
        (the engine goes on from there): its variables flattened in order into one float64 array, as the engine
        reads them."""
        offset = 0
        for variable in self._dsgd_local_state():
            shape = tuple(variable.shape)
            size = int(np.prod(shape))
            variable.assign(tf.cast(np.reshape(flat[offset:offset + size], shape), variable.dtype))
            offset += size

    def _dsgd_seek(self, step: int) -> bool:
        """Called before every step's ``get_batch`` with the number of steps the engine applied before it: an
        input that follows the engine's step count (so that a step run again after a fault, or by a replacement
        worker, reads the same batch) moves to that step and says so (True). By default the input goes on as
        it is (False)."""
        return False

"""``dsgd.KerasModel`` given a Keras 3 model: a ``TF2Model`` on the TensorFlow backend.

``KerasModel(model, ...)`` with a model of the ``keras`` package (Keras 3,
which ``tf.keras`` is since TensorFlow 2.16) makes a ``Keras3Model``: the
same arguments as for tf_keras, a Keras 3 optimizer, and the step traced
in a ``tf.function`` by the TF2 runtime (``dsgd.worker.tf2``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from dsgd.integrations import keras_outputs
from dsgd.integrations.keras_batches import Batches
from dsgd.model import TF2Model

# tf.compat.v1 (and tf_keras) optimizers and the Keras 3 optimizer to use instead.
_KERAS3_OPTIMIZER = {"GradientDescentOptimizer": "keras.optimizers.SGD(learning_rate)",
                     "MomentumOptimizer": "keras.optimizers.SGD(learning_rate, momentum=...)",
                     "AdamOptimizer": "keras.optimizers.Adam", "RMSPropOptimizer": "keras.optimizers.RMSprop",
                     "AdagradOptimizer": "keras.optimizers.Adagrad"}


def import_keras():
    """The ``keras`` package (Keras 3), checked to run on TensorFlow in this process."""
    try:
        import keras
    except ImportError as e:  # e.g. KERAS_BACKEND=jax without jax installed
        raise ImportError(f"Keras 3 failed to import ({e}). {_backend_advice(os.environ.get('KERAS_BACKEND'))}") from e
    if keras.config.backend() != "tensorflow":
        raise RuntimeError(_backend_advice(keras.config.backend()))
    return keras


def _backend_advice(backend: str | None) -> str:
    return (f"The workers' Keras backend is {backend!r}; dsgd trains Keras 3 on TensorFlow: set "
            "KERAS_BACKEND=tensorflow in the workers' environment (ray.init(runtime_env={'env_vars': "
            "{'KERAS_BACKEND': 'tensorflow'}}))")


def check_optimizer(optimizer: Any, who: str) -> None:
    """Refuse an optimizer that is not a Keras 3 one, naming the one to use instead."""
    keras = import_keras()
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return
    name = type(optimizer).__name__
    instead = _KERAS3_OPTIMIZER.get(name, "a keras.optimizers.Optimizer (keras.optimizers.SGD, Adam, ...)")
    raise TypeError(f"{who} needs a Keras 3 optimizer, got {type(optimizer).__module__}.{name}; use {instead}")


class Keras3Model(TF2Model):
    """A Keras 3 model as one replica: what ``dsgd.KerasModel(model, ...)`` makes of a Keras 3 model.

    The arguments are ``KerasModel``'s, except ``optimizer``: a Keras 3
    optimizer, and ``batches``: an iterable of batches (a
    ``tf.data.Dataset`` is read as numpy). The model is called once here, on
    the first batch in training mode: an unbuilt model is built, and the
    non-trainable float weights that call writes (batch normalization's
    moving statistics) are the state averaged over replicas after every step
    (their values are put back after the call).
    """

    def __init__(self, model: Any, loss: Any, optimizer: Any,
                 metrics: Sequence[str | Callable] | Mapping[str, Any] = (), batches: Any = None,
                 features: Any = None, label: Any = None):
        keras = import_keras()
        if not isinstance(model, keras.Model):
            raise TypeError(f"KerasModel model must be a keras.Model, got {type(model).__name__}")
        check_optimizer(optimizer, "KerasModel with a Keras 3 model")
        if (features is None) != (label is None):
            raise ValueError(f"KerasModel needs both features= and label= for dict batches, or neither; "
                             f"got features={features!r}, label={label!r}")
        if batches is None:
            raise ValueError("KerasModel needs batches=: an iterable of (x, y) tuples or of dicts of numpy arrays")
        if isinstance(batches, tf.data.Dataset):
            batches = _NumpyPasses(batches)
        self.model = model
        self.optimizer = optimizer
        self._batches = Batches(batches, features, label)
        x, y = self._batches.first
        self._state = self._find_state(x)
        keras_outputs.check_labels(y, self._outputs)
        names = keras_outputs.output_names(self._outputs, model)
        self._losses = keras_outputs.loss_functions(loss, self._outputs, names, keras)
        self._metrics = keras_outputs.metric_functions(metrics, self._outputs, names, keras)

    def _find_state(self, x: Any) -> list:
        """The non-trainable float weights a call on ``x`` in training mode writes (put back as they were);
        an unbuilt model is built first, by a call in inference mode."""
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        if not self.model.built:
            self.model(x, training=False)  # builds it; in inference mode, no statistic moves
        candidates = [v for v in self.model.non_trainable_weights if tf.as_dtype(v.dtype).is_floating]
        before = [v.numpy() for v in candidates]
        outputs = self.model(x, training=True)
        self._outputs = tf.nest.map_structure(lambda t: None, outputs)  # their structure
        written = [v for v, old in zip(candidates, before) if not np.array_equal(v.numpy(), old)]
        for v, old in zip(candidates, before):
            v.assign(old)
        return written

    # ---- dsgd.TF2Model ----------------------------------------------------------------

    def get_variables(self) -> list:
        return list(self.model.trainable_weights)

    def get_state_variables(self) -> list:
        return list(self._state)

    def _dsgd_weights(self) -> list:
        """Every weight of the model (``model.weights``, frozen ones too): what ``get_weights`` and checkpoints
        hold."""
        return list(self.model.weights)

    def get_optimizer(self) -> Any:
        return self.optimizer

    def get_batch(self) -> tuple[Any, Any]:
        return self._batches.next()

    def get_loss(self, batch: tuple[Any, Any]) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        x, y = batch
        outputs = self.model(x, training=True)
        loss = keras_outputs.total_loss(self._losses, y, outputs)
        regularization = [tf.cast(l, loss.dtype) for l in self.model.losses]
        if regularization:
            loss = tf.add_n([loss, *regularization])
        return loss, keras_outputs.build_metrics(self._metrics, y, outputs)

    # ---- input and inference ------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Passes over ``batches`` started before the current one."""
        return self._batches.epoch

    @property
    def batches_read(self) -> int:
        """Batches taken from ``batches`` so far: the first at build (read for the step's input signature; the
        first step trains on it), then one per step after the first."""
        return self._batches.read

    def predict(self, x: Any, batch_size: int | None = None) -> Any:
        """The model's outputs for ``x`` in inference mode (``keras.Model.predict``), as numpy; call it on a
        replica, e.g. ``sgd.for_model(lambda m: m.predict(x_test))``."""
        return self.model.predict(x, batch_size=batch_size, verbose=0)


class _NumpyPasses:
    """A ``tf.data.Dataset`` read as numpy, each iteration a new pass."""

    def __init__(self, dataset: tf.data.Dataset):
        self.dataset = dataset

    def __iter__(self):
        return self.dataset.as_numpy_iterator()

"""``dsgd.KerasModel`` given a Keras 3 model: a ``TF2Model`` on the TensorFlow backend.

``KerasModel(model, ...)`` with a model of the ``keras`` package (Keras 3,
which ``tf.keras`` is since TensorFlow 2.16) makes a ``Keras3Model``: the
same arguments as for tf_keras, a Keras 3 optimizer, and the step traced
in a ``tf.function`` by the TF2 runtime (``dsgd.worker.tf2``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from dsgd.integrations.keras_backend import check_optimizer, import_keras
from dsgd.integrations.keras_batches import Batches
from dsgd.integrations.keras_compiled import CompiledReplica, check_compiled


class Keras3Model(CompiledReplica):
    """A Keras 3 model as one replica: what ``dsgd.KerasModel(model, ...)`` makes of a Keras 3 model.

    The arguments are ``KerasModel``'s, except ``optimizer``: a Keras 3
    optimizer, and ``batches``: an iterable of batches (a
    ``tf.data.Dataset`` is read as numpy). The model is compiled here with
    ``loss``, ``optimizer`` and ``metrics`` (Keras's own ``compile``: any
    loss or metric name or object, one per output or per output name), and
    stepped by Keras's compile machinery (``CompiledReplica``); the step's
    stats hold each metric's value on that step's batch. The model is
    called once here, on the first batch in training mode: an unbuilt model
    is built, and the non-trainable float weights that call writes
    (batch normalization's moving statistics) are the state averaged over
    replicas after every step.
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
        if isinstance(metrics, str) or callable(metrics):
            raise TypeError(f"KerasModel metrics must be a list or dict of metrics, got {metrics!r}")
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics or None)
        check_compiled(model, "KerasModel")
        self._batch_source = Batches(batches, features, label)
        super().__init__(model, self._batch_source, per_step_metrics=True)

    @property
    def epoch(self) -> int:
        """Passes over ``batches`` started before the current one."""
        return self._batch_source.epoch

    @property
    def batches_read(self) -> int:
        """Batches taken from ``batches`` so far: the first at build (read for the step's input signature; the
        first step trains on it), then one per step after the first."""
        return self._batch_source.read


class _NumpyPasses:
    """A ``tf.data.Dataset`` read as numpy, each iteration a new pass."""

    def __init__(self, dataset: tf.data.Dataset):
        self.dataset = dataset

    def __iter__(self):
        return self.dataset.as_numpy_iterator()

"""Keras 3 in a dsgd process: the ``keras`` package checked to run on TensorFlow, and its optimizers."""

from __future__ import annotations

import os
from typing import Any

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

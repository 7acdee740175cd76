"""Keras 3's SGD and Adam variable updates as TensorFlow's fused training kernels.

Keras 3 updates each variable with separate element-wise ops: plain SGD
writes ``gradient * learning_rate`` to a temporary before subtracting it,
Adam makes about ten passes over a variable's bytes. TensorFlow's training
kernels (``ResourceApplyGradientDescent``, ``ResourceApplyKerasMomentum``,
``ResourceApplyAdam``, the ones the TF1 way's ``tf.compat.v1.train``
optimizers run) do the same arithmetic in one pass. ``fuse_updates`` swaps
an optimizer's per-variable ``update_step`` for the kernel where both
compute the same thing: exactly ``keras.optimizers.SGD`` (with or without
momentum, Nesterov or not) or ``keras.optimizers.Adam`` without ``amsgrad``
(a subclass may override ``update_step``: it keeps Keras's), dense
gradients. Everything around the update stays Keras's own: clipping, weight
decay, loss scaling, gradient accumulation, EMA, constraints, the iteration
count, and the optimizer's variables, which ``save`` and ``restore`` carry.

SGD's kernels give the same bits as Keras's ops. Adam's kernel computes
``1 - beta`` in the variable's dtype where Keras computes it in Python
floats first, so its values agree with Keras's to that rounding (a relative
1e-7 in float32), as ``tf.compat.v1.train.AdamOptimizer``'s do.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


def fuse_updates(optimizer: Any) -> bool:
    """Make ``optimizer`` update each variable with TensorFlow's fused kernel, where that computes what its own
    ``update_step`` does; whether it did."""
    kind = type(optimizer)
    if kind is keras.optimizers.SGD:
        fused = _sgd
    elif kind is keras.optimizers.Adam and not optimizer.amsgrad:
        fused = _adam
    else:
        return False
    keras_update = optimizer.update_step

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> None:
        if isinstance(gradient, tf.IndexedSlices):
            keras_update(gradient, variable, learning_rate)
        else:
            fused(optimizer, tf.cast(gradient, variable.dtype), variable, tf.cast(learning_rate, variable.dtype))

    optimizer.update_step = update_step
    return True


def _handle(variable: Any) -> tf.Tensor:
    """The resource handle of a TensorFlow variable or of a Keras variable's."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def _slot(optimizer: Any, slots: list, variable: Any) -> tf.Tensor:
    return _handle(slots[optimizer._get_variable_index(variable)])


def _sgd(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: tf.Tensor) -> None:
    if optimizer.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(var=_handle(variable), alpha=learning_rate, delta=gradient)
    else:
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=_handle(variable), accum=_slot(optimizer, optimizer.momentums, variable), lr=learning_rate,
            grad=gradient, momentum=tf.cast(optimizer.momentum, variable.dtype), use_nesterov=optimizer.nesterov)


def _adam(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: tf.Tensor) -> None:
    dtype = variable.dtype
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1, beta_2 = tf.cast(optimizer.beta_1, dtype), tf.cast(optimizer.beta_2, dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable), m=_slot(optimizer, optimizer._momentums, variable),
        v=_slot(optimizer, optimizer._velocities, variable),
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step), lr=learning_rate,
        beta1=beta_1, beta2=beta_2, epsilon=tf.cast(optimizer.epsilon, dtype), grad=gradient)


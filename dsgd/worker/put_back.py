"""The state variables a step's forward pass writes (batch-norm moving statistics), put back as they were.

A replica's forward pass writes its state variables from its own batch (a
Keras layer assigns its statistics in its call; a TF1 graph runs its
``UPDATE_OPS``). Both runtimes read them at the step's start (``read``),
read what the forward pass wrote (the values exchanged and averaged), and
put the start values back before anything is exchanged or checked
(``exchanged_after_put_back``): a step not applied (skipped or raised under
``nan_policy``) and a warmup leave every replica's state as it was; an
applied step assigns the mean values. TensorFlow ops, built into a TF1
graph or traced in a ``tf.function``; the variables are resource
variables, whose writes leave a value read before them alone.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def read(variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
    """Each variable's value where the read runs, read afresh (never a cached value); later writes to the
    variable leave it as it is."""
    return [v.read_value() for v in variables]


def exchanged_after_put_back(variables: Sequence[tf.Variable], start: Sequence[tf.Tensor],
                             written: Sequence[tf.Tensor], exchanged: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``exchanged`` as tensors that wait for every variable to be assigned its ``start`` value again, which
    waits for ``written`` (the forward pass's values) to be read: whatever fails on them comes after it."""
    with tf.control_dependencies(written):
        assigns = [v.assign(value, read_value=False) for v, value in zip(variables, start, strict=True)]
    with tf.control_dependencies(assigns):
        return [tf.identity(t) for t in exchanged]

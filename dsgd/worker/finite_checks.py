"""The apply's non-finite checks: TensorFlow ops, built into a TF1 graph or traced in a tf.function.

A check fails the step's run with ``dsgd.worker.nonfinite.message``, naming
the variable whose mean is not finite; the runtime turns that into a raised
error or a skipped step. Under nan_policy "ignore" there are none.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.wire import partitions
from dsgd.worker import nonfinite

FINITE_SCOPE = "nonfinite_check"  # the name scope of the apply's non-finite checks (a step's trace counts them)
SMALL_CHECK_ELEMENTS = 1 << 12  # tensors this small get a CheckNumerics op, larger ones a vectorized check


def finite_tensors(tensors: Sequence[tf.Tensor], names: Sequence[str], kind: str,
                   config: WorkerConfig) -> list[tf.Operation]:
    """Checks that fail the run, naming a non-finite variable, unless nan_policy is "ignore".

    ``kind``: "gradient" or "value". A large tensor gets a vectorized
    ``is_finite`` reduction, and one assert covers them all; a small one
    (``SMALL_CHECK_ELEMENTS`` or fewer) a ``CheckNumerics`` op, whose scalar
    element loop costs little there and which is one op, not two. A
    ``CheckNumerics`` on every tensor took 3x as long on ResNet-101's
    tensors (benchmarks/finite_check.py).
    """
    if config.nan_policy == "ignore":
        return []
    checks, large = [], []
    with tf.name_scope(f"{FINITE_SCOPE}_{kind}s"):
        for t, name in zip(tensors, names):
            message = nonfinite.message(kind, name)
            with tf.compat.v1.colocate_with(t.op):
                if t.shape.is_fully_defined() and t.shape.num_elements() <= SMALL_CHECK_ELEMENTS:
                    checks.append(tf.debugging.check_numerics(t, message).op)
                else:
                    large.append((tf.reduce_all(tf.math.is_finite(t)), message))
        if large:
            finite = tf.stack([ok for ok, _ in large])
            messages = tf.constant([message for _, message in large])
            first_bad = tf.gather(messages, tf.reshape(tf.where(tf.logical_not(finite)), [-1])[:1])
            checks.append(tf.debugging.Assert(tf.reduce_all(finite), [first_bad]))
    return checks


def finite_partitions(received: Sequence[tf.Tensor], layout: Sequence[partitions.Partition],
                      exchange: Sequence[partitions.VarSpec], n_train: int, config: WorkerConfig) -> list[tf.Operation]:
    """Checks that fail the run, naming a non-finite variable, of the ``received`` partitions (one flat tensor
    per partition of ``layout``) instead of every variable's mean; none under nan_policy "ignore".

    ``n_train``: how many of the ``exchange`` tensors are gradients (the rest
    are values). A partition costs one vectorized ``is_finite`` reduction,
    however many variables it holds: for a model of thousands of small
    tensors that is a few ops a step instead of thousands. Only if it finds a
    non-finite element does a second pass (a ``tf.cond`` branch) find the
    first one in a piece, not in the alignment gaps between pieces (whose
    bytes no worker writes), and fail naming its variable, as
    ``finite_tensors``'s messages do.
    """
    if config.nan_policy == "ignore":
        return []
    checks = []
    with tf.name_scope(f"{FINITE_SCOPE}_partitions"):
        for tensor, partition in zip(received, layout):
            if not np.issubdtype(partition.dtype, np.floating):
                continue  # integers are always finite
            messages = [nonfinite.message("gradient" if p.var_index < n_train else "value", exchange[p.var_index].name)
                        for p in partition.pieces]
            starts = [p.partition_offset for p in partition.pieces]
            ends = [p.partition_offset + p.size for p in partition.pieces]
            with tf.compat.v1.colocate_with(tensor.op):
                finite = tf.reduce_all(tf.math.is_finite(tensor))
                checks.append(tf.cond(finite, lambda: tf.constant(True),
                                      lambda t=tensor, m=messages, s=starts, e=ends: _first_non_finite(t, m, s, e)).op)
    return checks


def _first_non_finite(partition: tf.Tensor, messages: list[str], starts: list[int], ends: list[int]) -> tf.Tensor:
    """An assert that fails with ``messages[k]`` of the first piece ``[starts[k], ends[k])`` of ``partition``
    holding a non-finite element, and passes if there is none (the non-finite bytes were between pieces).
    Built once per partition, so kept to a few ops."""
    bad = tf.reshape(tf.where(tf.logical_not(tf.math.is_finite(partition))), [-1])  # not empty in this branch
    starts_t, ends_t = tf.constant(starts, tf.int64), tf.constant(ends, tf.int64)
    piece = tf.maximum(tf.searchsorted(starts_t, bad, side="right") - 1, 0)
    inside = tf.logical_and(bad >= tf.gather(starts_t, piece), bad < tf.gather(ends_t, piece))
    first = tf.gather(piece, tf.argmax(tf.cast(inside, tf.int32)))
    with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(tf.reduce_any(inside)),
                                                      [tf.gather(tf.constant(messages), first)])]):
        return tf.constant(True)

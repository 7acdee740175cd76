"""The applies in a worker's TF1 graph: the given means applied on every replica once their checks pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError
from dsgd.ops import owned_copy
from dsgd.wire import partitions
from dsgd.worker.finite_checks import finite_tensors
from dsgd.worker.replica_names import apply_scope, device

if TYPE_CHECKING:
    from dsgd.worker.tf1.worker_graph import Replica, WorkerGraph


def apply_ops(replicas: Sequence[Replica], means_per_replica: Sequence[Sequence[tf.Tensor]],
              exchange: Sequence[partitions.VarSpec], config: WorkerConfig,
              checks: Sequence[tf.Operation] | None = None, after: Sequence[tf.Tensor] = ()) -> tf.Operation:
    """Apply on every replica, only once every check has passed (never partly): ``checks`` if given, else
    one per mean (``finite_tensors``). The gradients' apply waits for the values' checks too: a non-finite
    moving statistic must not let it run before the step fails (or is skipped) on every replica. It waits
    for the tensors ``after`` too (a step's stats, computed from the weights before it)."""
    n_train = len(replicas[0].train_vars)
    if checks is None:
        names = [s.name for s in exchange]
        means = means_per_replica[0]
        checks = (finite_tensors(means[:n_train], names[:n_train], "gradient", config)
                  + finite_tensors(means[n_train:], names[n_train:], "value", config))
    ops = []
    for r, means in zip(replicas, means_per_replica):
        with tf.device(device(r.index, config.gpu)), tf.name_scope(apply_scope(r.index)), \
                tf.control_dependencies([*checks, *after]):
            ops.append(r.optimizer.apply_gradients(list(zip(means[:n_train], r.train_vars))))
            ops += [v.assign(owned_copy(m)) for v, m in zip(r.state_vars, means[n_train:])]
    return tf.group(*ops)


def build_apply(built: WorkerGraph, means_per_replica: Sequence[Sequence[tf.Tensor]],
                config: WorkerConfig, checks: Sequence[tf.Operation] | None = None,
                after: Sequence[tf.Tensor] = ()) -> tf.Operation:
    """One more apply of ``means_per_replica`` on every replica (a step's own), into the default graph,
    once ``checks`` pass (default: a check per mean, ``finite_tensors``) and ``after`` is computed.

    The optimizer's state already exists (``worker_graph.build``'s apply made
    it), so this must create no variable: they would be left uninitialized.
    """
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
    apply = apply_ops(built.replicas, means_per_replica, built.signature.exchange, config, checks, after)
    if len(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)) != before:
        raise DSGDError("building the exchange created variables; the optimizer's slots must "
                        "exist after its first apply_gradients")
    return apply

"""A worker's TensorFlow graph: one replica of the model per device, built once.

``build`` runs the user's ``model_creator`` once per device, each call under
its own ``tf.device`` and ``variable_scope("device_<i>")``, checks what it
returns, and adds: every replica's gradients, their mean over the worker's
devices (the local allreduce) and an apply of means fed from Python (which
makes the optimizer's slots; checked only if a step runs it,
``WorkerConfig.applies_fed``). It returns a frozen ``WorkerGraph``; the ops
that write the weights and optimizer state (``StateAssigns``) are built on
first use (``dsgd.worker.tf1.state``). A step that applies another way adds
its own apply (``dsgd.worker.tf1.applies``); the worker's runtime
(``dsgd.worker.tf1.runtime``) runs them.

What is exchanged between workers is the list of *exchange tensors*: the
averaged gradient of every trainable variable and, for models with
``UPDATE_OPS`` (batch norm), the updated value of every non-trainable float
variable, so that moving statistics stay identical on every replica too.
The update ops write those *state variables* from the replica's own batch:
they are read before the update ops' writes and put back once the updated
values are read, before anything is exchanged or checked
(``dsgd.worker.put_back``), so a step not applied (skipped or raised under
``nan_policy``) and a warmup leave them as they were; an applied step
assigns their mean.

Variables are named ``device_<i>/<name>`` in the graph and ``<name>`` to the
user (``dsgd.worker.replica_names``).

A replica's *weights* are the global variables (``GLOBAL_VARIABLES``) its
``model_creator`` call created: only they are broadcast, averaged (through
their gradients or, for batch-norm statistics, their values), read by
``get_weights`` and checkpointed. Local variables (``LOCAL_VARIABLES``: a
batch cached on the device, ``tf.compat.v1.metrics`` counters) and lookup
tables are per-replica state: initialized with the weights, then left to
each replica, never made identical across replicas.

Calling the user's model and sorting what ``get_metrics()`` returns is
``dsgd.worker.user_model``'s.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.errors import ModelCreatorError, WorkerMismatchError
from dsgd.model import Model, TF2ModelInGraph
from dsgd.wire import partitions
from dsgd.worker import put_back, user_model
from dsgd.worker.replica_names import device, replica_scope, strip_scope
from dsgd.worker.signature import WorkerSignature
from dsgd.worker.tf1.applies import apply_ops
from dsgd.worker.tf1.state import StateAssigns, initialize, optimizer_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    """One replica's graph pieces; ``exchange`` is in the order of the exchange tensors."""

    index: int
    model: Model
    weights: dict[str, tf.Variable]  # every variable it created, by its name without the scope
    optimizer: tf.compat.v1.train.Optimizer
    loss: tf.Tensor
    metrics: dict[str, tf.Tensor]  # the tensors get_metrics() returned; numbers are left out
    train_vars: tuple[tf.Variable, ...]  # exchange order: back-propagation's, last layers first
    state_vars: tuple[tf.Variable, ...]  # batch-norm statistics and the like (with UPDATE_OPS)
    exchange: tuple[tf.Tensor, ...]  # gradients of train_vars, then updated values of state_vars


@dataclass(frozen=True)
class WorkerGraph:
    """Everything the worker runs, built once by ``build``."""

    replicas: tuple[Replica, ...]
    signature: WorkerSignature
    replica_means: tuple[tuple[tf.Tensor, ...], ...]  # per replica: the worker's mean of each exchange tensor
    mean_inputs: tuple[tf.Tensor, ...]  # placeholders for the global means ("simple", Python "ps")
    apply_fed: tf.Operation | None  # applies mean_inputs on every replica; None unless config.applies_fed
    state_vars: dict[str, tuple[dict[str, tf.Variable], ...]]  # group -> per replica, name -> variable
    state_assigns: StateAssigns  # writes a group's variables on every replica (built on first use)

    @property
    def models(self) -> list[Model]:
        return [r.model for r in self.replicas]

    @property
    def local_means(self) -> tuple[tf.Tensor, ...]:
        """The worker's mean of each exchange tensor (replica 0's copy)."""
        return self.replica_means[0]

def build(worker_index: int, config: WorkerConfig, model_creator: Callable[[int, int], Model],
          session: tf.compat.v1.Session, state: dict | None = None) -> WorkerGraph:
    """Build the worker's graph into the default graph, initialize it in ``session``, ask the metrics.

    The worker opens the graph and the session and makes them the defaults,
    so user code can evaluate tensors (``Tensor.eval()``) while it runs.
    With ``state`` (``SGDWorker.get_state()``'s weights and optimizer
    groups) every replica's weights and optimizer state start from it
    instead of their initializers (``state.initialize``).
    """
    graph = tf.compat.v1.get_default_graph()
    replicas = tuple(_build_replica(graph, worker_index, config, model_creator, i)
                     for i in range(config.devices_per_worker))
    _check_replicas_agree(replicas, worker_index)
    weights, exchange = _specs(replicas[0])
    means = _local_allreduce(replicas, config)
    mean_inputs = tuple(tf.compat.v1.placeholder(s.dtype, s.shape, name=f"mean_{k}") for k, s in enumerate(exchange))
    # The optimizer's slots exist once its apply ops do; later applies (``applies.build_apply``) reuse them. A fed
    # apply no step runs is built for them alone, unchecked and not kept ("ps" through the ops).
    apply_fed = apply_ops(replicas, [mean_inputs] * len(replicas), exchange, config,
                          None if config.applies_fed else [])
    optimizer_vars = tuple(optimizer_state(r.optimizer, r.index) for r in replicas)
    state_vars = {"weights": tuple(r.weights for r in replicas), "optimizer": optimizer_vars}
    optimizer = tuple(_var_spec(n, v) for n, v in sorted(optimizer_vars[0].items()))
    state_assigns = StateAssigns(graph, state_vars)
    initialize(session, graph, state_assigns, state)
    replicas = tuple(replace(r, metrics=user_model.ask_metrics(graph, session, r.model, worker_index, r.index))
                     for r in replicas)
    _check_metrics_agree(replicas, worker_index)
    return WorkerGraph(
        replicas=replicas,
        signature=WorkerSignature(weights, exchange, optimizer, tuple(sorted(replicas[0].metrics))),
        replica_means=tuple(tuple(m) for m in means),
        mean_inputs=mean_inputs,
        apply_fed=apply_fed if config.applies_fed else None,
        state_vars=state_vars,
        state_assigns=state_assigns)


def _build_replica(graph: tf.Graph, worker_index: int, config: WorkerConfig,
                   model_creator: Callable[[int, int], Model], i: int) -> Replica:
    where = f"worker {worker_index}, device {i}"
    before = set(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
    with tf.device(device(i, config.gpu)), tf.compat.v1.variable_scope(replica_scope(i)):
        try:
            model = model_creator(worker_index, i)
        except TF2ModelInGraph:
            if i == 0:
                raise  # a TF2 model: the worker builds it with the TF2 runtime
            raise ModelCreatorError(f"model_creator returned a TF1 dsgd.Model on device 0 and a TF2 model on {where}: "
                                    "build one kind of model in an engine") from None
        except Exception as e:
            raise ModelCreatorError(
                f"model_creator raised on {where}: {type(e).__name__}: {e}\n"
                f"{traceback.format_exc()}") from e
        if not isinstance(model, Model):
            raise ModelCreatorError(
                f"model_creator must return a dsgd.Model, got {type(model).__name__} on {where}")
        created = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v not in before]
        weights = {strip_scope(v.name, i): v for v in created}
        return _build_gradients(graph, model, weights, i, where, log_missing=(worker_index, i) == (0, 0))


def _build_gradients(graph: tf.Graph, model: Model, weights: dict[str, tf.Variable], index: int,
                     where: str, log_missing: bool) -> Replica:
    """The replica's loss and optimizer, checked; its gradients and updated state (metrics come later)."""
    loss = user_model.call_user(model, "get_loss", where)
    if not isinstance(loss, tf.Tensor) or loss.graph is not graph:
        raise ModelCreatorError(f"get_loss() must return a tensor of the replica's graph, got {loss!r} on {where}")
    if loss.shape.rank not in (None, 0):
        raise ModelCreatorError(f"get_loss() must return a scalar, got shape {loss.shape} on {where}")
    optimizer = user_model.call_user(model, "get_optimizer", where)
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ModelCreatorError(
            f"get_optimizer() must return a tf.compat.v1.train.Optimizer, got {type(optimizer).__name__} on {where}")
    trainable = set(graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
    train_vars = [v for v in weights.values() if v in trainable]
    if not train_vars:
        raise ModelCreatorError(
            f"the model built on {where} has no trainable variables; "
            "create them inside model_creator with tf.compat.v1.get_variable or tf.Variable")
    grads = optimizer.compute_gradients(loss, var_list=train_vars, colocate_gradients_with_ops=True)
    missing = [strip_scope(v.name, index) for g, v in grads if g is None]
    if missing and log_missing:
        logger.warning("variables with no gradient are not trained: %s", ", ".join(missing))
    grads = [(tf.convert_to_tensor(g), v) for g, v in grads if g is not None]
    if not grads:
        raise ModelCreatorError(f"the loss on {where} depends on none of the trainable variables")
    grads.reverse()  # back-propagation yields the last layers first: exchange them first
    exchange = [g for g, _ in grads]
    update_ops = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, scope=replica_scope(index) + "/")
    state_vars = [v for v in weights.values() if v not in trainable and v.dtype.is_floating] if update_ops else []
    if state_vars:
        start = put_back.read(state_vars)
        for write in _state_writes(update_ops, state_vars):
            write._add_control_inputs([t.op for t in start])  # no public API orders an op built already
        with tf.control_dependencies(update_ops):
            written = put_back.read(state_vars)
        exchange = put_back.exchanged_after_put_back(state_vars, start, written, exchange + written)
    return Replica(index, model, weights, optimizer, loss, metrics={},
                   train_vars=tuple(v for _, v in grads), state_vars=tuple(state_vars), exchange=tuple(exchange))


def _state_writes(update_ops: Sequence[tf.Operation | tf.Tensor],
                  state_vars: Sequence[tf.Variable]) -> list[tf.Operation]:
    """The ops that write a state variable among the update ops and every op they wait for: what the step's
    start values must be read before."""
    handles = {v.op for v in state_vars}
    seen: set[tf.Operation] = set()
    todo = [u if isinstance(u, tf.Operation) else u.op for u in update_ops]
    writes = []
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type != "ReadVariableOp" and any(t.op in handles for t in op.inputs):
            writes.append(op)
        todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return writes


def _var_spec(name: str, tensor: tf.Tensor | tf.Variable) -> partitions.VarSpec:
    if not tensor.shape.is_fully_defined():
        raise ModelCreatorError(f"variable {name!r} has a shape that is not fully defined: {tensor.shape}")
    return partitions.VarSpec(name, tuple(tensor.shape.as_list()), np.dtype(tensor.dtype.as_numpy_dtype))


def _specs(r: Replica) -> tuple[tuple[partitions.VarSpec, ...], tuple[partitions.VarSpec, ...]]:
    """The replica's weights (by name) and exchange tensors (in exchange order)."""
    weights = tuple(sorted((_var_spec(n, v) for n, v in r.weights.items()), key=lambda s: s.name))
    exchange = tuple(_var_spec(strip_scope(v.name, r.index), v) for v in r.train_vars + r.state_vars)
    return weights, exchange


def _check_replicas_agree(replicas: Sequence[Replica], worker_index: int) -> None:
    first = replicas[0]
    expected = _specs(first)
    for r in replicas[1:]:
        got = _specs(r)
        if got != expected:
            raise WorkerMismatchError(
                f"replica {r.index} on worker {worker_index} built different variables than replica 0: "
                f"{partitions.spec_difference(sum(got, ()), sum(expected, ()))}")


def _check_metrics_agree(replicas: Sequence[Replica], worker_index: int) -> None:
    first = replicas[0]
    for r in replicas[1:]:
        if sorted(r.metrics) != sorted(first.metrics):
            raise WorkerMismatchError(f"replica {r.index} on worker {worker_index} reports metric tensors "
                                      f"{sorted(r.metrics)}, replica 0 {sorted(first.metrics)}")


def _local_allreduce(replicas: Sequence[Replica], config: WorkerConfig) -> list[Sequence[tf.Tensor]]:
    """Mean of every exchange tensor over this worker's replicas, per replica."""
    n = len(replicas)
    if n == 1:
        return [replicas[0].exchange]
    per_tensor = list(zip(*(r.exchange for r in replicas)))
    if config.all_reduce_alg == "nccl":
        from tensorflow.python.ops import nccl_ops  # no public NCCL all-sum in TF; GPU only, not run on CPU CI
        summed = [nccl_ops.all_sum(list(ts)) for ts in per_tensor]
        return [[s[r] / n for s in summed] for r in range(n)]
    with tf.device(device(0, config.gpu)):
        means = [tf.add_n(list(ts)) / n for ts in per_tensor]
    return [means] * n

"""A worker's TensorFlow graph: one replica of the model per device, built once.

``build`` runs the user's ``model_creator`` once per device, each call under
its own ``tf.device`` and ``variable_scope("device_<i>")``, checks what it
returns, and adds: every replica's gradients, their mean over the worker's
devices (the local allreduce) and an apply of means fed from Python (which
makes the optimizer's slots; checked only if a step runs it,
``WorkerConfig.applies_fed``). It returns a frozen ``WorkerGraph``; the ops
that write the weights and optimizer state (``StateAssigns``) are built on
first use. An exchange that applies another way (``dsgd.exchange``) adds its own apply with
``build_apply``; the worker actor (``dsgd.sgd_worker``) runs them.

What is exchanged between workers is the list of *exchange tensors*: the
averaged gradient of every trainable variable and, for models with
``UPDATE_OPS`` (batch norm), the updated value of every non-trainable float
variable, so that moving statistics stay identical on every replica too.

Variables are named ``device_<i>/<name>`` in the graph and ``<name>`` to the
user; the helpers at the top of this module are the only place that knows
the scope names.

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

import collections
import logging
import re
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.wire import partitions
from dsgd.worker import user_model
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError, ModelCreatorError, WorkerMismatchError
from dsgd.model import Model

logger = logging.getLogger(__name__)

RECEIVE_THREADS = 2  # inter-op threads beyond the compute's: a receive waiting for its mean holds one
FINITE_SCOPE = "nonfinite_check"  # the name scope of the apply's non-finite checks (a step's trace counts them)
SMALL_CHECK_ELEMENTS = 1 << 12  # tensors this small get a CheckNumerics op, larger ones a vectorized check

_REPLICA_PREFIX = re.compile(r"^device_\d+(_apply)?/")


# ---- names ---------------------------------------------------------------

def replica_scope(device_index: int) -> str:
    """The variable scope of a replica: 'device_1'."""
    return f"device_{device_index}"


def apply_scope(device_index: int) -> str:
    """The name scope of a replica's apply ops (and the optimizer's slots made there)."""
    return f"{replica_scope(device_index)}_apply"


def strip_scope(name: str, device_index: int) -> str:
    """'device_1/dense/kernel:0' -> 'dense/kernel'; a variable outside the replica's scope is an error."""
    prefix = replica_scope(device_index) + "/"
    name = name.split(":")[0]
    if not name.startswith(prefix):
        raise ModelCreatorError(
            f"variable {name!r} of replica {device_index} was created outside its "
            f"variable scope {prefix!r}; create variables inside model_creator "
            "without opening an absolute scope")
    return name[len(prefix):]


def strip_any_scope(name: str) -> str:
    """'device_0_apply/w/Momentum:0' -> 'w/Momentum': an optimizer variable's name to the user."""
    return _REPLICA_PREFIX.sub("", name.split(":")[0])


def device(index: int, gpu: bool) -> str:
    return f"/gpu:{index}" if gpu else f"/cpu:{index}"


# ---- what is built -------------------------------------------------------

@dataclass(frozen=True)
class WorkerSignature:
    """What a worker built; the driver checks all workers agree."""

    weights: tuple[partitions.VarSpec, ...]
    exchange: tuple[partitions.VarSpec, ...]
    optimizer: tuple[partitions.VarSpec, ...]
    metrics: tuple[str, ...]


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


def session_config(config: WorkerConfig) -> tf.compat.v1.ConfigProto:
    """A session with one device per replica and the worker's CPUs as threads."""
    threads = max(1, config.cpus_per_worker)
    proto = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads,
        inter_op_parallelism_threads=max(2, threads) + RECEIVE_THREADS,
        allow_soft_placement=False)
    # Place (and optimize) only the subgraph a run needs, not the whole graph: a worker's graph
    # holds ops no single run uses (state assigns, other exchanges' applies), and without this
    # the first run of every new subgraph (initializer, weights, step) costs in proportion to
    # the whole graph (seconds at 2000 variables). TensorFlow keeps stateful ops' placement
    # fixed across subgraphs.
    proto.graph_options.place_pruned_graph = True
    # Threads with nothing to run sleep at once instead of spinning: a worker shares its node's cores
    # with the parameter servers (which reserve no CPU), the other workers and its own receives, which
    # wait in threads of the pool. On the 2-core machine, 2-worker "ps" steps took 5-7 % less time
    # (MNIST 5.02 -> 4.69 ms, 4 M floats in 300 variables 28.8 -> 27.4 ms, ResNet-101 at 64 px
    # 26.0 -> 26.7 images/s; README "Performance").
    proto.experimental.disable_thread_spinning = True
    if config.gpu:
        proto.gpu_options.allow_growth = True
    else:
        proto.device_count["CPU"] = config.devices_per_worker
        proto.device_count["GPU"] = 0
    return proto


# ---- building --------------------------------------------------------------

def build(worker_index: int, config: WorkerConfig, model_creator: Callable[[int, int], Model],
          session: tf.compat.v1.Session, state: dict | None = None) -> WorkerGraph:
    """Build the worker's graph into the default graph, initialize it in ``session``, ask the metrics.

    The worker opens the graph and the session and makes them the defaults,
    so user code can evaluate tensors (``Tensor.eval()``) while it runs.
    With ``state`` (``SGDWorker.get_state()``'s weights and optimizer
    groups) every replica's weights and optimizer state start from it
    instead of their initializers (``_initialize``).
    """
    graph = tf.compat.v1.get_default_graph()
    replicas = tuple(_build_replica(graph, worker_index, config, model_creator, i)
                     for i in range(config.devices_per_worker))
    _check_replicas_agree(replicas, worker_index)
    weights, exchange = _specs(replicas[0])
    means = _local_allreduce(replicas, config)
    mean_inputs = tuple(tf.compat.v1.placeholder(s.dtype, s.shape, name=f"mean_{k}") for k, s in enumerate(exchange))
    # The optimizer's slots exist once its apply ops do; later applies (``build_apply``) reuse them. A fed
    # apply no step runs is built for them alone, unchecked and not kept ("ps" through the ops).
    apply_fed = _apply_ops(replicas, [mean_inputs] * len(replicas), exchange, config,
                           None if config.applies_fed else [])
    optimizer_vars = tuple(_optimizer_state(r) for r in replicas)
    state_vars = {"weights": tuple(r.weights for r in replicas), "optimizer": optimizer_vars}
    optimizer = tuple(_var_spec(n, v) for n, v in sorted(optimizer_vars[0].items()))
    state_assigns = StateAssigns(graph, state_vars)
    _initialize(session, graph, state_assigns, state)
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


def _initialize(session: tf.compat.v1.Session, graph: tf.Graph, state_assigns: StateAssigns,
                state: dict | None) -> None:
    """Initialize every variable of ``graph``: the global ones, then local variables and tables.

    Local variables and tables come second because their initial values may
    read a weight (e.g. a cached copy of one). With ``state``, the global
    initializer is fed ``state``'s value as each state variable's initial
    value: the variables start from it in the same run, with no random
    initial values drawn and no assign ops built. A variable whose
    initializer cannot be fed so (its initial value shared with another
    variable, or an initializer of another kind) is assigned afterwards.
    """
    feeds, assigned_after = state_assigns.initial_feeds(state) if state is not None else ({}, {})
    with graph.as_default():
        session.run(tf.compat.v1.global_variables_initializer(), feed_dict=feeds)
        for group, values in assigned_after.items():
            state_assigns.run(session, group, values)
        session.run(tf.group(tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()))


def _initial_value_input(variable: tf.Variable) -> tf.Tensor | None:
    """The tensor ``variable``'s initializer assigns (feeding it sets the initial value), None if not a plain
    assign."""
    init = variable.initializer
    if init.type in ("AssignVariableOp", "Assign") and len(init.inputs) == 2:
        return init.inputs[1]
    return None


def _build_replica(graph: tf.Graph, worker_index: int, config: WorkerConfig,
                   model_creator: Callable[[int, int], Model], i: int) -> Replica:
    where = f"worker {worker_index}, device {i}"
    before = set(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
    with tf.device(device(i, config.gpu)), tf.compat.v1.variable_scope(replica_scope(i)):
        try:
            model = model_creator(worker_index, i)
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
    update_ops = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, scope=replica_scope(index) + "/")
    state_vars = [v for v in weights.values() if v not in trainable and v.dtype.is_floating] if update_ops else []
    with tf.control_dependencies(update_ops):
        state_values = [tf.identity(v.read_value()) for v in state_vars]
    grads.reverse()  # back-propagation yields the last layers first: exchange them first
    return Replica(index, model, weights, optimizer, loss, metrics={},
                   train_vars=tuple(v for _, v in grads), state_vars=tuple(state_vars),
                   exchange=tuple(g for g, _ in grads) + tuple(state_values))


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


def _finite(tensors: Sequence[tf.Tensor], names: Sequence[str], what: str, config: WorkerConfig) -> list[tf.Operation]:
    """Checks that fail the run, naming a non-finite variable, unless nan_policy is "ignore".

    A large tensor gets a vectorized ``is_finite`` reduction, and one assert
    covers them all; a small one (``SMALL_CHECK_ELEMENTS`` or fewer) a
    ``CheckNumerics`` op, whose scalar element loop costs little there and
    which is one op, not two. Both messages carry ``step_runner._NONFINITE``'s
    text. A ``CheckNumerics`` on every tensor took 3x as long on ResNet-101's
    tensors (benchmarks/finite_check.py).
    """
    if config.nan_policy == "ignore":
        return []
    checks, large = [], []
    with tf.name_scope(f"{FINITE_SCOPE}_{what}s"):
        for t, name in zip(tensors, names):
            message = f"dsgd: non-finite {what} of '{name}'"
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


def finite_partitions(partitions: Sequence[tf.Tensor], layout: Sequence[partitions.Partition],
                      exchange: Sequence[partitions.VarSpec], n_train: int, config: WorkerConfig) -> list[tf.Operation]:
    """Checks that fail the run, naming a non-finite variable, of the received ``partitions`` (one flat tensor
    per partition of ``layout``) instead of every variable's mean; none under nan_policy "ignore".

    A partition costs one vectorized ``is_finite`` reduction, however many
    variables it holds: for a model of thousands of small tensors that is a
    few ops a step instead of thousands. Only if it finds a non-finite
    element does a second pass (a ``tf.cond`` branch) find the first one in
    a piece, not in the alignment gaps between pieces (whose bytes no worker
    writes), and fail naming its variable, as ``_finite``'s messages do.
    """
    if config.nan_policy == "ignore":
        return []
    checks = []
    with tf.name_scope(f"{FINITE_SCOPE}_partitions"):
        for tensor, partition in zip(partitions, layout):
            if not np.issubdtype(partition.dtype, np.floating):
                continue  # integers are always finite
            messages = [f"dsgd: non-finite {'gradient' if p.var_index < n_train else 'value'} of "
                        f"'{exchange[p.var_index].name}'" for p in partition.pieces]
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


def _apply_ops(replicas: Sequence[Replica], means_per_replica: Sequence[Sequence[tf.Tensor]],
               exchange: Sequence[partitions.VarSpec], config: WorkerConfig,
               checks: Sequence[tf.Operation] | None = None) -> tf.Operation:
    """Apply on every replica, only once every check has passed (never partly): ``checks`` if given, else
    one per mean (``_finite``). The gradients' apply waits for the values' checks too: a non-finite
    moving statistic must not let it run before the step fails (or is skipped) on every replica."""
    n_train = len(replicas[0].train_vars)
    if checks is None:
        names = [s.name for s in exchange]
        means = means_per_replica[0]
        checks = (_finite(means[:n_train], names[:n_train], "gradient", config)
                  + _finite(means[n_train:], names[n_train:], "value", config))
    ops = []
    for r, means in zip(replicas, means_per_replica):
        with tf.device(device(r.index, config.gpu)), tf.name_scope(apply_scope(r.index)), \
                tf.control_dependencies(checks):
            ops.append(r.optimizer.apply_gradients(list(zip(means[:n_train], r.train_vars))))
            ops += [v.assign(m) for v, m in zip(r.state_vars, means[n_train:])]
    return tf.group(*ops)


def _optimizer_state(r: Replica) -> dict[str, tf.Variable]:
    """The optimizer's slots and counters, keyed like 'w/Momentum', 'beta1_power'."""
    state = {}
    for v in r.optimizer.variables():
        name = strip_any_scope(v.name)
        if name in state:
            raise ModelCreatorError(f"two optimizer variables of replica {r.index} are both named {name!r}")
        state[name] = v
    return state


class StateAssigns:
    """Writes state groups onto every replica: per variable, a placeholder and its assigns, built on first use.

    Only loading state runs them (``set_weights``, a restore, a recovery's
    copy, a new worker's initial weights when they differ), never a step, so
    they are not built with the graph; a worker that never loads state never
    builds them. A worker built from a state loads it without them, through
    its initializers (``initial_feeds``).
    """

    def __init__(self, graph: tf.Graph, state_vars: dict[str, tuple[dict[str, tf.Variable], ...]]):
        self._graph = graph
        self._state_vars = state_vars
        self._built: dict[tuple[str, str], tuple[tf.Tensor, list[tf.Operation]]] = {}  # (group, name) -> ...

    def run(self, session: tf.compat.v1.Session, group: str, values: dict[str, np.ndarray]) -> None:
        """Assign ``values`` (name -> array) of ``group`` on every replica, in one session run."""
        if not values:
            return
        feeds, targets = {}, []
        for name, value in values.items():
            placeholder, assigns = self._assigns(group, name)
            feeds[placeholder] = value
            targets += assigns
        session.run(targets, feed_dict=feeds)

    def initial_feeds(self, state: dict) -> tuple[dict[tf.Tensor, np.ndarray], dict[str, dict[str, np.ndarray]]]:
        """Feeds of the initializers' value inputs that load ``state`` (``get_state()``'s groups) onto every
        replica as the variables are initialized, and the values (by group, then name) that must be assigned
        (``run``) after initializing instead."""
        inputs: dict[str, list[tuple[tf.Tensor | None, str, np.ndarray]]] = {}
        for group, per_replica in self._state_vars.items():
            values = state[group]
            missing, unknown = sorted(set(per_replica[0]) - set(values)), sorted(set(values) - set(per_replica[0]))
            if missing or unknown:
                raise DSGDError(f"the state to start from is of another model: its {group} lack {missing} and have "
                                f"{unknown}, which this model does not")
            inputs[group] = [(_initial_value_input(variable), name, values[name])
                             for variables in per_replica for name, variable in variables.items()]
        counts = collections.Counter(tensor for entries in inputs.values() for tensor, _, _ in entries)
        feeds, assigned_after = {}, {}
        for group, entries in inputs.items():
            for tensor, name, value in entries:
                if tensor is not None and counts[tensor] == 1:
                    feeds[tensor] = value
                else:
                    assigned_after.setdefault(group, {})[name] = value
        return feeds, assigned_after

    def _assigns(self, group: str, name: str) -> tuple[tf.Tensor, list[tf.Operation]]:
        key = group, name
        if key not in self._built:
            per_replica = self._state_vars[group]
            first = per_replica[0][name]
            with self._graph.as_default(), tf.compat.v1.name_scope(f"set_{group}/"):  # the one scope, reentered
                placeholder = tf.compat.v1.placeholder(first.dtype.base_dtype, first.shape)
                self._built[key] = placeholder, [variables[name].assign(placeholder).op for variables in per_replica]
        return self._built[key]


def build_apply(built: WorkerGraph, means_per_replica: Sequence[Sequence[tf.Tensor]],
                config: WorkerConfig, checks: Sequence[tf.Operation] | None = None) -> tf.Operation:
    """One more apply of ``means_per_replica`` on every replica (an exchange's own), into the default graph,
    once ``checks`` pass (default: a check per mean, ``_finite``).

    The optimizer's state already exists (``build``'s apply made it), so this
    must create no variable: they would be left uninitialized.
    """
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
    apply = _apply_ops(built.replicas, means_per_replica, built.signature.exchange, config, checks)
    if len(graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)) != before:
        raise DSGDError("building the exchange created variables; the optimizer's slots must "
                        "exist after its first apply_gradients")
    return apply

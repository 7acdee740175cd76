"""The worker actor: one TF graph holding a replica of the model per device.

A worker builds ``devices_per_worker`` replicas, each under its own
``tf.device`` and ``variable_scope("device_<i>")``, computes every replica's
gradients, averages them across the worker's devices (the local allreduce),
and applies the averaged result on every replica. How averaged gradients of
different workers are combined is the driver's strategy: the worker offers
one method per strategy (``step_local``, ``compute_gradients`` +
``apply_gradients``, ``step_ps``).

What is exchanged between workers is the worker's list of *exchange tensors*:
the averaged gradient of every trainable variable and, for models with
``UPDATE_OPS`` (batch norm), the updated value of every non-trainable float
variable, so that moving statistics stay identical on every replica too.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import ray
import tensorflow as tf

from dsgd import timeline
from dsgd import shards as shard_layout
from dsgd.ps_client import ParameterServerClient
from dsgd.errors import DSGDError, ModelCreatorError, NonFiniteGradientError, WorkerMismatchError
from dsgd.model import Model

logger = logging.getLogger(__name__)

ALL_REDUCE_ALGS = ("simple", "nccl")
RECEIVE_THREADS = 2
NAN_POLICIES = ("raise", "skip", "ignore")
_NONFINITE = re.compile(r"dsgd: non-finite (gradient|value) of '([^']+)'")
_SCOPE_PREFIX = re.compile(r"^device_\d+(_apply)?/")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its graph, fixed at construction."""

    num_workers: int
    devices_per_worker: int
    gpu: bool
    all_reduce_alg: str
    cpus_per_worker: int
    timeout_s: float
    nan_policy: str = "raise"
    use_ops: bool = False  # "ps" exchange through the in-graph C++ ops (dsgd.ops)


@dataclass(frozen=True)
class WorkerSignature:
    """What a worker built; the driver checks all workers agree."""

    weights: tuple[shard_layout.VarSpec, ...]
    exchange: tuple[shard_layout.VarSpec, ...]
    optimizer: tuple[shard_layout.VarSpec, ...]
    metrics: tuple[str, ...]


def replica_scope(device_index: int) -> str:
    return f"device_{device_index}"


def strip_scope(name: str, device_index: int) -> str:
    """'device_1/dense/kernel:0' -> 'dense/kernel'."""
    prefix = replica_scope(device_index) + "/"
    name = name.split(":")[0]
    if not name.startswith(prefix):
        raise ModelCreatorError(
            f"variable {name!r} of replica {device_index} was created outside its "
            f"variable scope {prefix!r}; create variables inside model_creator "
            "without opening an absolute scope")
    return name[len(prefix):]


def _var_spec(name: str, tensor: tf.Tensor | tf.Variable) -> shard_layout.VarSpec:
    if not tensor.shape.is_fully_defined():
        raise ModelCreatorError(f"variable {name!r} has a shape that is not fully defined: {tensor.shape}")
    return shard_layout.VarSpec(name, tuple(tensor.shape.as_list()), np.dtype(tensor.dtype.as_numpy_dtype))


class Replica:
    """The graph pieces of one replica, in the order of its exchange tensors."""

    def __init__(self, index: int, model: Model, weights: dict[str, tf.Variable]):
        self.index = index
        self.model = model
        self.weights = weights
        self.optimizer: tf.compat.v1.train.Optimizer | None = None
        self.loss: tf.Tensor | None = None
        self.metrics: dict[str, tf.Tensor] = {}
        self.train_vars: list[tf.Variable] = []
        self.state_vars: list[tf.Variable] = []
        self.exchange: list[tf.Tensor] = []


class SGDWorker:
    """Runs as a Ray actor; the driver calls ``setup`` first, then steps."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        self.worker_index = worker_index
        self.config = config
        self.graph: tf.Graph | None = None
        self.sess: tf.compat.v1.Session | None = None
        self.models: list[Model] = []
        self.replicas: list[Replica] = []
        self.client: ParameterServerClient | None = None  # "ps" with several workers, set by connect
        self.applied_steps = 0
        self._callback_error: BaseException | None = None
        self._trace: timeline.Recorder | None = None
        self._phase_s: dict[str, float] = {}  # this step's phases, reported with its stats
        self.exchange_specs: list[shard_layout.VarSpec] = []  # set by setup, in exchange order
        self.layout: list[shard_layout.Shard] = []  # the partitions, set by connect

    # ---- set-up -----------------------------------------------------------

    def setup(self, model_creator: Callable[[int, int], Model]) -> WorkerSignature:
        """Build the replicas, the allreduce and apply ops; initialize variables."""
        cfg = self.config
        self.graph = tf.Graph()
        with self.graph.as_default():
            for i in range(cfg.devices_per_worker):
                self.replicas.append(self._build_replica(model_creator, i))
            self.models = [r.model for r in self.replicas]
            self._check_replicas_agree()
            self.exchange_specs = list(self._specs(self.replicas[0])[1])
            local_means = self._build_local_allreduce()
            self._build_apply(local_means)
            self._build_state_io()
            init = tf.compat.v1.global_variables_initializer()
        self.sess = tf.compat.v1.Session(graph=self.graph, config=self._session_config())
        self.sess.run(init)
        # The graph's Python objects live as long as the worker: keep the cyclic
        # garbage collector from walking them on every full collection.
        gc.freeze()
        return self.signature()

    def _session_config(self) -> tf.compat.v1.ConfigProto:
        cfg = self.config
        threads = max(1, cfg.cpus_per_worker)
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=threads,
            # Two more than the compute needs: a receive waiting for its mean holds one.
            inter_op_parallelism_threads=max(2, threads) + RECEIVE_THREADS,
            allow_soft_placement=False)
        if cfg.gpu:
            config.gpu_options.allow_growth = True
        else:
            config.device_count["CPU"] = cfg.devices_per_worker
            config.device_count["GPU"] = 0
        return config

    def _device(self, i: int) -> str:
        return f"/gpu:{i}" if self.config.gpu else f"/cpu:{i}"

    def _build_replica(self, model_creator, i: int) -> Replica:
        where = f"worker {self.worker_index}, device {i}"
        before = set(self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
        with tf.device(self._device(i)), tf.compat.v1.variable_scope(replica_scope(i)):
            try:
                model = model_creator(self.worker_index, i)
            except Exception as e:
                raise ModelCreatorError(
                    f"model_creator raised on {where}: {type(e).__name__}: {e}\n"
                    f"{traceback.format_exc()}") from e
            if not isinstance(model, Model):
                raise ModelCreatorError(
                    f"model_creator must return a dsgd.Model, got {type(model).__name__} on {where}")
            created = [v for v in self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                       if v not in before]
            weights = {strip_scope(v.name, i): v for v in created}
            replica = Replica(i, model, weights)
            self._build_gradients(replica, where)
        return replica

    def _call_user(self, replica: Replica, method: str, where: str):
        try:
            return getattr(replica.model, method)()
        except Exception as e:
            raise ModelCreatorError(
                f"{type(replica.model).__name__}.{method}() raised on {where}: "
                f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from e

    def _build_gradients(self, replica: Replica, where: str) -> None:
        """Per-replica gradients and updated model state, in exchange order."""
        loss = self._call_user(replica, "get_loss", where)
        if not isinstance(loss, tf.Tensor) or loss.graph is not self.graph:
            raise ModelCreatorError(f"get_loss() must return a tensor of the replica's graph, got {loss!r} on {where}")
        if loss.shape.rank not in (None, 0):
            raise ModelCreatorError(f"get_loss() must return a scalar, got shape {loss.shape} on {where}")
        optimizer = self._call_user(replica, "get_optimizer", where)
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise ModelCreatorError(
                f"get_optimizer() must return a tf.compat.v1.train.Optimizer, got {type(optimizer).__name__} on {where}")
        metrics = self._call_user(replica, "get_metrics", where) or {}
        if not isinstance(metrics, dict):
            raise ModelCreatorError(f"get_metrics() must return a dict of scalar tensors, got {type(metrics).__name__}")
        trainable = set(self.graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES))
        train_vars = [v for v in replica.weights.values() if v in trainable]
        if not train_vars:
            raise ModelCreatorError(
                f"the model built on {where} has no trainable variables; "
                "create them inside model_creator with tf.compat.v1.get_variable or tf.Variable")
        grads = optimizer.compute_gradients(loss, var_list=train_vars, colocate_gradients_with_ops=True)
        missing = [strip_scope(v.name, replica.index) for g, v in grads if g is None]
        if missing and replica.index == 0 and self.worker_index == 0:
            logger.warning("variables with no gradient are not trained: %s", ", ".join(missing))
        grads = [(tf.convert_to_tensor(g), v) for g, v in grads if g is not None]
        if not grads:
            raise ModelCreatorError(f"the loss on {where} depends on none of the trainable variables")
        update_ops = self.graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, scope=replica_scope(replica.index) + "/")
        state_vars = []
        if update_ops:
            state_vars = [v for v in replica.weights.values() if v not in trainable and v.dtype.is_floating]
        with tf.control_dependencies(update_ops):
            state_values = [tf.identity(v.read_value()) for v in state_vars]
        # Back-propagation yields the last layers first: exchange them first.
        grads.reverse()
        replica.optimizer = optimizer
        replica.loss = loss
        replica.metrics = metrics
        replica.train_vars = [v for _, v in grads]
        replica.state_vars = state_vars
        replica.exchange = [g for g, _ in grads] + state_values

    def _check_replicas_agree(self) -> None:
        first = self.replicas[0]
        expected = self._specs(first)
        for r in self.replicas[1:]:
            got = self._specs(r)
            if got != expected:
                diff = sorted(set(map(str, got)) ^ set(map(str, expected)))
                raise WorkerMismatchError(
                    f"replica {r.index} on worker {self.worker_index} built different variables "
                    f"than replica 0: {'; '.join(diff[:6])}")
            if sorted(r.metrics) != sorted(first.metrics):
                raise WorkerMismatchError(f"replica {r.index} reports metrics {sorted(r.metrics)}, replica 0 {sorted(first.metrics)}")

    def _specs(self, r: Replica) -> tuple:
        weights = tuple(sorted((_var_spec(n, v) for n, v in r.weights.items()), key=lambda s: s.name))
        exchange = tuple(_var_spec(strip_scope(v.name, r.index), v) for v in r.train_vars + r.state_vars)
        return weights, exchange

    def signature(self) -> WorkerSignature:
        weights, exchange = self._specs(self.replicas[0])
        optimizer = tuple(_var_spec(n, v) for n, v in sorted(self._optimizer_vars[0].items()))
        return WorkerSignature(weights, exchange, optimizer, tuple(sorted(self.replicas[0].metrics)))

    def _build_local_allreduce(self) -> list[list[tf.Tensor]]:
        """Mean of every exchange tensor over this worker's replicas, per replica."""
        n = len(self.replicas)
        per_tensor = list(zip(*(r.exchange for r in self.replicas)))
        if n == 1:
            return [list(self.replicas[0].exchange)]
        if self.config.all_reduce_alg == "nccl":
            from tensorflow.python.ops import nccl_ops  # GPU only; not exercised on CPU CI
            summed = [nccl_ops.all_sum(list(ts)) for ts in per_tensor]
            return [[s[r] / n for s in summed] for r in range(n)]
        with tf.device(self._device(0)):
            means = [tf.add_n(list(ts)) / n for ts in per_tensor]
        return [means] * n

    def _build_apply(self, local_means: list[list[tf.Tensor]]) -> None:
        """Two apply paths: from the local means (one worker), or from fed global means."""
        specs = self.exchange_specs
        self._local_means = local_means[0]
        self._mean_inputs = [tf.compat.v1.placeholder(s.dtype, s.shape, name=f"mean_{k}")
                             for k, s in enumerate(specs)]
        self._apply_local = self._apply_ops(local_means)
        self._apply_fed = self._apply_ops([self._mean_inputs] * len(self.replicas))

    def _finite(self, tensors: Sequence[tf.Tensor], what: str) -> list[tf.Operation]:
        """Checks that fail the run, naming the variable, unless nan_policy is "ignore"."""
        if self.config.nan_policy == "ignore":
            return []
        names = [s.name for s in self.exchange_specs]
        offset = 0 if what == "gradient" else len(self.replicas[0].train_vars)
        return [tf.debugging.assert_all_finite(t, f"dsgd: non-finite {what} of '{names[offset + k]}'").op
                for k, t in enumerate(tensors)]

    def _apply_ops(self, means_per_replica: Sequence[Sequence[tf.Tensor]]) -> tf.Operation:
        """Apply on every replica, only once every check has passed (never partly)."""
        n_train = len(self.replicas[0].train_vars)
        means = means_per_replica[0]
        grad_checks = self._finite(means[:n_train], "gradient")
        state_checks = self._finite(means[n_train:], "value")
        ops = []
        for r, means in zip(self.replicas, means_per_replica):
            with tf.device(self._device(r.index)), tf.name_scope(f"{replica_scope(r.index)}_apply"):
                with tf.control_dependencies(grad_checks):
                    ops.append(r.optimizer.apply_gradients(list(zip(means[:n_train], r.train_vars))))
                with tf.control_dependencies(state_checks):
                    ops += [v.assign(m) for v, m in zip(r.state_vars, means[n_train:])]
        return tf.group(*ops)

    def _build_ops_exchange(self) -> None:
        """The pipelined "ps" exchange, inside the graph (see dsgd/ops).

        Each partition is sent to its parameter server as soon as its
        gradients exist, while back-propagation of earlier layers goes on,
        and received as soon as it is sent. Sends run in layout order (each
        after the previous one) and receive k waits for send k, so a worker
        blocks only on partitions that every worker with a longer run of
        sends has already sent: whichever worker has sent the least always
        gets its means, and no thread budget can deadlock. Means are read
        without a copy; the apply runs once every partition has arrived.
        """
        from dsgd import ops

        with self.graph.as_default():
            self._step_input = tf.compat.v1.placeholder(tf.int64, [], name="step_id")
            received, previous = [], []
            for shard in self.layout:
                with tf.control_dependencies(previous):
                    sent = ops.build_send(self._local_means, shard, self._send_shard, [self._step_input])
                with tf.control_dependencies([sent]):
                    received.append(ops.receive_shard(functools.partial(self._receive_shard, shard), shard,
                                                      [self._step_input]))
                previous = [sent]
            means = ops.unpack(received, self.layout, self.exchange_specs)
            self._apply_received = self._apply_ops([means] * len(self.replicas))

    @contextlib.contextmanager
    def _callback(self, span: str):
        """The body of a graph callback: traced, and its error kept for ``_step_ps_ops`` (TF wraps it)."""
        try:
            with timeline.maybe_span(self._trace, span, "exchange"):
                yield
        except BaseException as e:
            self._callback_error = e
            raise

    def _send_shard(self, shard: shard_layout.Shard, arrays: list[np.ndarray], step: np.ndarray) -> None:
        with self._callback(f"send partition {shard.index}"):
            self.client.send(shard, int(step), arrays)

    def _receive_shard(self, shard: shard_layout.Shard, step: np.ndarray) -> np.ndarray:
        with self._callback(f"receive partition {shard.index}"):
            return self.client.receive(shard, int(step))

    def _build_state_io(self) -> None:
        """Placeholders and assign ops for the weights and the optimizer state."""
        self._optimizer_vars = [self._optimizer_state(r) for r in self.replicas]
        groups = {"weights": [r.weights for r in self.replicas], "optimizer": self._optimizer_vars}
        self._state_inputs, self._set_state_ops = {}, {}
        for group, per_replica in groups.items():
            inputs = {name: tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape, name=f"set_{group}_{k}")
                      for k, (name, v) in enumerate(sorted(per_replica[0].items()))}
            self._state_inputs[group] = inputs
            self._set_state_ops[group] = tf.group(*[
                v.assign(inputs[name]) for variables in per_replica for name, v in variables.items()])

    def _optimizer_state(self, r: Replica) -> dict[str, tf.Variable]:
        """The optimizer's slots and counters, keyed like 'w/Momentum', 'beta1_power'."""
        state = {}
        for v in r.optimizer.variables():
            name = _SCOPE_PREFIX.sub("", v.name.split(":")[0])
            if name in state:
                raise ModelCreatorError(f"two optimizer variables of replica {r.index} are both named {name!r}")
            state[name] = v
        return state

    # ---- ps wiring --------------------------------------------------------

    def connect(self, layout: list[shard_layout.Shard], placement: list[int], servers: list,
                timeout_s: float) -> int:
        """Exchange ``layout``'s partitions with ``servers`` (``placement[j]`` sums partition j).

        The first call builds the in-graph exchange (with the op library);
        later calls, after a server or worker was replaced, only re-attach.
        Returns how many servers are reached through shared memory.
        """
        if self.client is None:
            self.layout = list(layout)
            self.client = ParameterServerClient(self.worker_index, layout, placement, self.config.timeout_s)
            if self.config.use_ops:
                before = len(self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES))
                self._build_ops_exchange()
                if len(self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)) != before:
                    raise DSGDError("building the exchange created variables; the optimizer's slots must "
                                    "exist after its first apply_gradients")
        elif [s.index for s in layout] != [s.index for s in self.layout] or placement != self.client.placement:
            raise DSGDError(f"worker {self.worker_index} was connected with another partition layout")
        return self.client.connect(servers, timeout_s)

    # ---- stepping ---------------------------------------------------------

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the step for its stats (``<name>_s``) and, if tracing, the timeline."""
        start = time.perf_counter()
        try:
            with timeline.maybe_span(self._trace, name):
                yield
        finally:
            key = name.replace(",", "").replace(" ", "_") + "_s"
            self._phase_s[key] = self._phase_s.get(key, 0.0) + time.perf_counter() - start

    def _run(self, fetches, feed_dict: dict, phase: str):
        """session.run; while tracing, with TensorFlow's per-op step stats."""
        trace = self._trace
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE) if trace else None
        metadata = tf.compat.v1.RunMetadata() if trace else None
        try:
            with self._phase(phase):
                return self.sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        finally:
            if trace:
                trace.events += timeline.from_step_stats(metadata.step_stats)

    def start_trace(self) -> None:
        """Record a timeline of the calls until ``collect_trace``."""
        self._trace = timeline.Recorder()

    def collect_trace(self) -> list[timeline.Event]:
        events, self._trace = (self._trace.events if self._trace else []), None
        return events

    def _feed_dict(self) -> dict:
        self._phase_s = {}  # every step starts by asking for its batches
        with self._phase("get_feed_dict"):
            return self._collect_feeds()

    def _collect_feeds(self) -> dict:
        feed: dict = {}
        for r in self.replicas:
            where = f"worker {self.worker_index}, device {r.index}"
            part = self._call_user(r, "get_feed_dict", where) or {}
            if not isinstance(part, dict):
                raise DSGDError(f"get_feed_dict() must return a dict, got {type(part).__name__} on {where}")
            for key in part:
                self._check_feed_key(key, where)
            feed.update(part)
        return feed

    def _check_feed_key(self, key, where: str) -> None:
        if isinstance(key, (tf.Tensor, tf.Operation)) and key.graph is self.graph:
            return
        if isinstance(key, str):
            try:
                self.graph.as_graph_element(key)
                return
            except (KeyError, ValueError) as e:
                raise DSGDError(f"get_feed_dict() on {where} names {key!r}, which is not a tensor of the model's graph: {e}") from e
        raise DSGDError(
            f"get_feed_dict() on {where} returned key {key!r}, which is not a tensor of the replica's graph; "
            "use placeholders created in the model's __init__")

    def _stats_fetches(self, fetch_stats: bool) -> dict:
        if not fetch_stats:
            return {}
        return {"loss": [r.loss for r in self.replicas],
                "metrics": {k: [r.metrics[k] for r in self.replicas] for k in self.replicas[0].metrics}}

    @staticmethod
    def _reduce_stats(out: dict) -> dict[str, float]:
        if not out:
            return {}
        stats = {"loss": float(np.mean(out["loss"]))}
        stats.update({k: float(np.mean(v)) for k, v in out["metrics"].items()})
        return stats

    def _apply(self, fetches: dict, feed_dict: dict, phase: str = "apply") -> dict:
        """Run an apply; a non-finite mean raises or skips the step on every replica.

        Every worker applies the same global mean, so every worker makes the
        same choice and replicas stay identical. Returns the run's outputs
        and, under "skipped", the variable that made the step skip.
        """
        try:
            out = self._run(fetches, feed_dict, phase)
        except tf.errors.InvalidArgumentError as e:
            found = _NONFINITE.search(e.message)
            if not found:
                raise
            what = f"non-finite {found.group(1)} of variable '{found.group(2)}' in step {self.applied_steps}"
            if self.config.nan_policy == "raise":
                raise NonFiniteGradientError(
                    f"{what}; no replica applied it (nan_policy='skip' skips such steps)") from None
            self.applied_steps += 1
            return {"skipped": what}
        self.applied_steps += 1
        return out

    def _result(self, out: dict) -> dict:
        result = self._reduce_stats(out.get("stats", {}))
        if "stats" in out and out["stats"]:
            result.update(self._phase_s)
        if "skipped" in out:
            result["skipped"] = out["skipped"]
        return result

    def step_local(self, fetch_stats: bool) -> dict:
        """One worker alone: average over local replicas and apply, one run."""
        return self._result(self._apply(
            {"apply": self._apply_local, "stats": self._stats_fetches(fetch_stats)}, self._feed_dict(),
            "compute and apply"))

    def compute_gradients(self, fetch_stats: bool) -> tuple[list[np.ndarray], dict[str, float]]:
        """The worker's averaged exchange tensors (for the "simple" strategy)."""
        out = self._run({"means": self._local_means, "stats": self._stats_fetches(fetch_stats)},
                        self._feed_dict(), "compute")
        stats = self._reduce_stats(out["stats"])
        return out["means"], {**stats, **self._phase_s} if stats else stats

    def apply_gradients(self, means: Sequence[np.ndarray], stats: dict | None = None) -> dict:
        """Apply the global mean of the exchange tensors on every replica; ``stats`` come back with the result."""
        applied = self._result(self._apply({"apply": self._apply_fed}, dict(zip(self._mean_inputs, means))))
        return {**(stats or {}), **applied}

    def step_ps(self, step_id: int, fetch_stats: bool) -> dict:
        """Compute, push partitions to the parameter servers, receive their means, apply."""
        if self.config.use_ops:
            return self._step_ps_ops(step_id, fetch_stats)
        out = self._run({"means": self._local_means, "stats": self._stats_fetches(fetch_stats)},
                        self._feed_dict(), "compute")
        try:
            with self._phase("pack and send"):
                for shard in self.layout:
                    self.client.send_gradients(shard, step_id, out["means"])
            with self._phase("receive"):
                shard_means = [self.client.receive(shard, step_id) for shard in self.layout]
        except BaseException:
            self.client.forget_pushes()
            raise
        applied = self.apply_gradients(shard_layout.unpack(shard_means, self.layout, self.exchange_specs))
        stats = self._reduce_stats(out["stats"])
        return {**stats, **(self._phase_s if stats else {}), **applied}

    def _step_ps_ops(self, step_id: int, fetch_stats: bool) -> dict:
        """One session run: compute, send, receive and apply all happen in the graph."""
        from dsgd import ops

        feed = self._feed_dict()
        feed[self._step_input] = step_id
        self._callback_error = None
        try:
            out = self._apply({"apply": self._apply_received, "stats": self._stats_fetches(fetch_stats)}, feed,
                              "compute, exchange and apply")
        except tf.errors.OpError:
            ops.discard_unclaimed()
            self.client.forget_pushes()
            if self._callback_error is not None:
                raise self._callback_error from None  # e.g. a dead parameter server: the driver recovers
            raise
        finally:
            ops.drain_released()
        return self._result(out)

    def warmup(self) -> None:
        """Run the gradient computation once without applying it (no weight change)."""
        self.sess.run(self._local_means, feed_dict=self._feed_dict())

    # ---- weights and user callbacks --------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.sess.run(dict(self.replicas[0].weights))

    def get_replica_weights(self) -> list[dict[str, np.ndarray]]:
        """Every replica's weights, device order (for checks and tests)."""
        return self.sess.run([dict(r.weights) for r in self.replicas])

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._set_state("weights", weights)

    def _set_state(self, group: str, values: dict[str, np.ndarray]) -> None:
        inputs = self._state_inputs[group]
        if inputs:
            self.sess.run(self._set_state_ops[group], feed_dict={inputs[k]: v for k, v in values.items()})

    def get_state(self) -> dict:
        """Weights, optimizer state and step count: all a replica needs to go on."""
        weights, optimizer = self.sess.run([dict(self.replicas[0].weights), dict(self._optimizer_vars[0])])
        return {"weights": weights, "optimizer": optimizer, "applied_steps": self.applied_steps}

    def set_state(self, state: dict) -> None:
        """Load get_state()'s result onto every replica."""
        self._set_state("weights", state["weights"])
        self._set_state("optimizer", state["optimizer"])
        self.applied_steps = state["applied_steps"]

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> int:
        return self.worker_index

    def applied_steps_count(self) -> int:
        return self.applied_steps

    def apply_fn(self, fn: Callable[["SGDWorker"], Any]) -> Any:
        return fn(self)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        return [fn(m) for m in self.models]

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

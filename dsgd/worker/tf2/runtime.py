"""The TF2 replica runtime: eager replicas (``dsgd.TF2Model``, Keras 3), stepped by traced ``tf.function``s.

``build`` sets up the process (``process``) and builds the replicas eagerly
(``replicas``). A step calls a traced function's
``ConcreteFunction`` with every replica's batch: ``compute`` and ``apply``
("simple", the Python "ps", a backup worker's catch-up: every replica's
loss and gradients under a ``GradientTape`` and their local mean, then the
apply of the means) or a ``Tf2FusedStep``
whose function also holds the exchange (``InStepExchange``: "ps" through
the op library, sends leaving as back-propagation makes the gradients) and
the apply. Each is traced on its first use (the user's loss is checked
then). The apply runs only once every check passed, on every replica:
each replica's Keras optimizer applies the mean gradients, and the state
variables (batch-norm statistics) take the mean values. The forward pass
writes the state variables (a Keras layer assigns its statistics in its
call): once read, they are put back as they were, before anything is
exchanged or checked (``dsgd.worker.put_back``, as the TF1 way does), so a
step not applied (skipped or raised under ``nan_policy``, a warmup) leaves
every variable as it was.

dsgd's own code is traced as it is (autograph off); the user's ``get_loss``
is converted by autograph, as ``tf.function`` would.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from dsgd import ops
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError, ModelCreatorError
from dsgd.worker import inputs, put_back
from dsgd.worker.finite_checks import finite_tensors
from dsgd.common.results import Means, Value
from dsgd.worker.runtime import FusedStep, InStepExchange, ReplicaRuntime
from dsgd.worker.signature import WorkerSignature
from dsgd.worker.tf2 import process, replicas as replica_builds
from dsgd.worker.tf2.replicas import Names, Tf2Replica, tf_variable

logger = logging.getLogger(__name__)

STEP_ID = tf.TensorSpec([], tf.int64, name="step_id")


class Tf2Runtime(ReplicaRuntime):
    """The replicas and their traced step functions, made by ``build``."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        super().__init__(worker_index, config)
        self.replicas: list[Tf2Replica] = []
        self.names: Names | None = None  # the first build's replica 0 names: kept by later builds
        self._signature: WorkerSignature | None = None
        self._structure: list = []  # per replica: its batch's structure
        self._batch_specs: list[tf.TensorSpec] = []  # the flat batches' specs, every replica's in device order
        self._losses: list[Callable] = []  # per replica: get_loss, converted by autograph
        self._keeps_local_state = False  # whether a replica keeps local state (TF2Model._dsgd_local_state)
        self._compute: Any = None  # ConcreteFunction: flat batches -> local means, losses, metrics
        self._apply: Any = None  # ConcreteFunction: means -> (), checked
        self._pending: list | None = None  # the replicas' first batches, for the first step
        self._stepped = False
        self._evaluations: dict[tuple, Any] = {}  # (replica, batch structure and specs) -> its loss and metrics, traced

    # ---- building -----------------------------------------------------------

    def build(self, model_creator: Callable[[int, int], Any], state: dict | None = None) -> WorkerSignature:
        process.configure(self.config)
        ops.load()  # eagerly: never inside a trace
        built = replica_builds.build(self.worker_index, self.config.devices_per_worker, self.config.gpu,
                                     model_creator)
        self.replicas = built
        self.names = self.names or Names.of(built[0])
        self._structure = [r.first_batch for r in built]
        self._pending = [r.first_batch for r in built]
        self._batch_specs = [_spec(a, self.worker_index, r.index)
                             for r in built for a in tf.nest.flatten(r.first_batch)]
        self._losses = [_converted(r.model.get_loss) for r in built]
        self._keeps_local_state = any(r.model._dsgd_local_state() for r in built)
        self._compute = self._apply = None  # traced on first use, like a fused step
        self._evaluations = {}
        weights, exchange, optimizer = replica_builds.specs(built[0], self.names)
        # The metrics' names are known once a step is traced: the signature leaves them out.
        self._signature = WorkerSignature(tuple(sorted(weights, key=lambda s: s.name)), exchange,
                                          tuple(sorted(optimizer, key=lambda s: s.name)), (), runtime="tf2")
        if state is not None:
            self.set_state(state)
        return self._signature

    @property
    def is_built(self) -> bool:
        return bool(self.replicas)

    @property
    def signature(self) -> WorkerSignature:
        return self._signature

    @property
    def trainable_count(self) -> int:
        return len(self.replicas[0].train_vars)

    @property
    def models(self) -> list:
        return [r.model for r in self.replicas]

    def user_context(self) -> contextlib.nullcontext:
        """User code runs eagerly, as it is."""
        return contextlib.nullcontext()

    # ---- the traced bodies ---------------------------------------------------------

    def _trace(self, body: Callable, specs: Sequence[tf.TensorSpec]) -> Any:
        """``body`` traced once (autograph off: dsgd's code as it is) for ``specs``: its ConcreteFunction."""
        try:
            return tf.function(body, autograph=False).get_concrete_function(*specs)
        except (ModelCreatorError, DSGDError):
            raise
        except Exception as e:
            raise ModelCreatorError(f"tracing worker {self.worker_index}'s step failed: {type(e).__name__}: {e}") from e

    def _forward(self, flat: Sequence[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor, dict[str, tf.Tensor]]:
        """Every replica's loss and gradients, and the local mean of each exchange tensor (on device 0); the
        replicas' losses and metrics, stacked."""
        batches = self._unflatten(flat)
        exchanged, losses, metrics = [], [], []
        for r, batch, user_loss in zip(self.replicas, batches, self._losses):
            where = f"worker {self.worker_index}, device {r.index}"
            with tf.device(r.device):
                state_vars = [tf_variable(v) for v in r.state_vars]
                start = put_back.read(state_vars)  # before the forward's writes
                with tf.GradientTape() as tape:
                    loss, replica_metrics = _loss_and_metrics(user_loss(batch), where)
                    scaled = r.optimizer.scale_loss(loss)  # the optimizer's loss scale; its apply unscales
                written = put_back.read(state_vars)  # after them
                grads = tape.gradient(scaled, list(r.train_vars))
                exchanged.append(put_back.exchanged_after_put_back(
                    state_vars, start, written, _gradients(grads, r.train_vars, where, self.names) + written))
            losses.append(tf.cast(loss, tf.float32))
            metrics.append(replica_metrics)
        names = sorted(metrics[0])
        for r, m in zip(self.replicas[1:], metrics[1:]):
            if sorted(m) != names:
                raise ModelCreatorError(f"get_loss on worker {self.worker_index}, device {r.index} returns metrics "
                                        f"{sorted(m)}, device 0 {names}")
        n = len(self.replicas)
        if n == 1:
            means = exchanged[0]
        else:
            with tf.device(self.replicas[0].device):
                means = [tf.add_n(list(ts)) / n for ts in zip(*exchanged)]
        stacked = {k: tf.stack([tf.cast(m[k], tf.float32) for m in metrics]) for k in names}
        return means, tf.stack(losses), stacked

    def _apply_all(self, means: Sequence[tf.Tensor], checks: Sequence[Any]) -> None:
        """Once every check passed: each replica's optimizer applies the mean gradients, and its state variables
        take the mean values (owned copies: a received mean's buffer must not become a variable's)."""
        n_train = self.trainable_count
        with tf.control_dependencies(checks):
            for r in self.replicas:
                with tf.device(r.device):
                    r.optimizer.apply(list(means[:n_train]), list(r.train_vars))
                    for v, m in zip(r.state_vars, means[n_train:]):
                        v.assign(ops.owned_copy(m))

    def _checks(self, means: Sequence[tf.Tensor]) -> list:
        """The non-finite checks of the means. A loss-scale optimizer checks the gradients itself (a non-finite
        one skips the step and lowers the scale, on every replica alike): only the state values are checked."""
        n_train = self.trainable_count
        names = self.names.exchange
        gradient_checks = ([] if _scales_loss_dynamically(self.replicas[0].optimizer)
                           else finite_tensors(means[:n_train], names[:n_train], "gradient", self.config))
        return gradient_checks + finite_tensors(means[n_train:], names[n_train:], "value", self.config)

    def _local_state_reads(self) -> list[tf.Tensor]:
        """Every replica's local state (``TF2Model._dsgd_local_state``) as the step leaves it, its variables
        flattened into one float64 tensor (exact for floats of 64 bits or fewer, and integers below 2**53), device
        order."""
        reads = []
        for r in self.replicas:
            with tf.device(r.device):
                parts = [tf.reshape(tf.cast(tf_variable(v).read_value(), tf.float64), [-1])
                         for v in r.model._dsgd_local_state()]
                reads.append(tf.concat(parts, 0) if parts else tf.zeros([0], tf.float64))
        return reads

    def _compute_body(self, *flat: tf.Tensor):
        means, losses, metrics = self._forward(flat)
        return list(means), losses, metrics, self._local_state_reads()

    def _apply_body(self, *means: tf.Tensor):
        self._apply_all(means, self._checks(means))
        return tf.constant(True)

    def fused_body(self, exchange: InStepExchange | None) -> Callable:
        """The body of a fused step: forward, the exchange (or the local mean alone), checks, apply."""
        def body(*flat_and_step: tf.Tensor):
            flat, step_id = flat_and_step[:-1], flat_and_step[-1]
            means, losses, metrics = self._forward(flat)
            if exchange is None:
                checks = self._checks(means)
            else:
                means, checks = exchange(means, step_id)
            self._apply_all(means, checks)
            return losses, metrics, self._local_state_reads()
        return body

    # ---- stepping -------------------------------------------------------------

    def batches(self) -> list[tf.Tensor]:
        """Every replica's next batch, flat (device order); starts the step (its phase timings)."""
        self.start_step()
        with self.phase("get_batch"):
            # A replica whose input follows the step count reads this step's batch, wherever its input was.
            follow = [r.model._dsgd_seek(self.applied_steps) for r in self.replicas]
            if self._pending is not None and not any(follow):
                batches, self._pending = self._pending, None
            else:
                self._pending = None
                batches = self.each_replica(lambda r: _next_batch(r, self.worker_index), self.replicas)
            flat = []
            for r, structure, batch in zip(self.replicas, self._structure, batches):
                try:
                    tf.nest.assert_same_structure(structure, batch)
                except (TypeError, ValueError) as e:
                    raise DSGDError(f"get_batch() on worker {self.worker_index}, device {r.index} changed "
                                    f"structure from its first batch: {e}") from None
                flat += tf.nest.flatten(batch)
            self._stepped = True
            return [_tensor(a, spec, self.worker_index) for a, spec in zip(flat, self._batch_specs)]

    def compute(self, fetch_stats: bool) -> tuple[list[np.ndarray], dict[str, Value]]:
        flat = self.batches()
        with self.phase("compute"):
            means, losses, metrics, local = self._traced_compute()(*flat)
            self.keep_local_state(local)
            local_means = [m.numpy() for m in means]
        return local_means, (self.stats_values(losses, metrics) if fetch_stats else {})

    def apply(self, means: Sequence[np.ndarray]) -> dict:
        with self.phase("apply"):
            apply = self._traced_apply()
            return self.checked_call(lambda: apply(*[tf.constant(m) for m in means]))[1]

    def checked_call(self, call: Callable[[], Any]) -> tuple[Any, dict]:
        """Run an apply: its outputs and {}; or (None, {"skipped": why}) if a non-finite check failed it."""
        try:
            out = call()
        except tf.errors.InvalidArgumentError as e:
            skipped = self.skipped(e.message)
            if skipped is None:
                raise
            return None, skipped
        self.applied_steps += 1
        return out, {}

    def stats_values(self, losses: tf.Tensor, metrics: dict[str, tf.Tensor]) -> dict[str, Value]:
        return self.replica_stats(losses.numpy(), {k: v.numpy() for k, v in metrics.items()})

    def keep_local_state(self, local: list[tf.Tensor]) -> None:
        """The replicas' local state after the step (``_local_state_reads``), for its result, if they keep any."""
        if self._keeps_local_state:
            self.local_state = [t.numpy() for t in local]

    def fused_step(self, exchange: InStepExchange | None = None) -> Tf2FusedStep:
        return Tf2FusedStep(self, exchange)

    def drop_batches(self) -> None:
        self.batches()


    def warmup(self) -> None:
        self._traced_compute()(*self.batches())

    def _traced_compute(self) -> Any:
        if self._compute is None:
            self._compute = self._trace(self._compute_body, self._batch_specs)
        return self._compute

    def _traced_apply(self) -> Any:
        if self._apply is None:
            first = self.replicas[0]
            self._apply = self._trace(self._apply_body, [tf.TensorSpec(v.shape, v.dtype)
                                                         for v in first.train_vars + first.state_vars])
        return self._apply

    @property
    def feed_names(self) -> tuple[str, ...] | None:
        """A TF2 step is planned for the replicas' batch structure, known from the build: () once built."""
        return () if self.replicas else None

    # ---- evaluation ---------------------------------------------------------------

    def evaluate_loss(self, device_index: int, batches: Iterator[Any]) -> Means:
        """Replica ``device_index``'s ``get_loss`` over ``batches``: the loss and each metric, means over the rows
        (each batch's value weighted by its rows), traced once per batch structure; its state variables put back
        after each batch, so nothing changes."""
        values: list[Means] = []
        for batch in batches:
            flat = [np.asarray(a) for a in tf.nest.flatten(batch)]
            specs = tuple(_spec(a, self.worker_index, device_index) for a in flat)
            key = (device_index, repr(tf.nest.map_structure(lambda _: 0, batch)), specs)
            evaluation = self._evaluations.get(key)
            if evaluation is None:
                evaluation = self._evaluations[key] = self._trace(
                    functools.partial(self._evaluation_body, self.replicas[device_index], batch), specs)
            logs = evaluation(*[tf.constant(a) for a in flat])
            rows = len(flat[0]) if flat and flat[0].ndim else 1
            values.append(Means({name: Value.repeated(float(v.numpy()), rows) for name, v in logs.items()}))
        return Means.reduce(values) if values else Means({})

    def _evaluation_body(self, replica: Tf2Replica, structure: Any, *flat: tf.Tensor) -> dict[str, tf.Tensor]:
        where = f"worker {self.worker_index}, device {replica.index}"
        with tf.device(replica.device):
            state_vars = [tf_variable(v) for v in replica.state_vars]
            start = put_back.read(state_vars)
            loss, metrics = _loss_and_metrics(self._losses[replica.index](tf.nest.pack_sequence_as(structure, flat)),
                                              where)
            if "loss" in metrics:
                raise ModelCreatorError(f"get_loss on {where} returns a metric named 'loss', the loss's own name")
            logs = {"loss": loss, **metrics}
            names = sorted(logs)
            after = put_back.exchanged_after_put_back(state_vars, start, put_back.read(state_vars),
                                                      [tf.cast(logs[k], tf.float32) for k in names])
        return dict(zip(names, after))

    # ---- state --------------------------------------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        return dict(zip(self.names.weights, (v.numpy() for v in self.replicas[0].weights)))

    def replica_weights(self) -> list[dict[str, np.ndarray]]:
        return [dict(zip(self.names.weights, (v.numpy() for v in r.weights))) for r in self.replicas]

    def set_group(self, group: str, values: dict[str, np.ndarray]) -> None:
        names = self.names.weights if group == "weights" else self.names.optimizer
        position = {n: i for i, n in enumerate(names)}
        for r in self.replicas:
            variables = r.weights if group == "weights" else r.optimizer_vars
            for name, value in values.items():
                variables[position[name]].assign(value)

    def get_groups(self) -> dict[str, dict[str, np.ndarray]]:
        first = self.replicas[0]
        return {"weights": self.get_weights(),
                "optimizer": dict(zip(self.names.optimizer, (v.numpy() for v in first.optimizer_vars)))}

    def _unflatten(self, flat: Sequence[tf.Tensor]) -> list:
        batches, start = [], 0
        for structure in self._structure:
            count = len(tf.nest.flatten(structure))
            batches.append(tf.nest.pack_sequence_as(structure, list(flat[start:start + count])))
            start += count
        return batches


class Tf2FusedStep(FusedStep):
    """One call: compute, the in-step exchange if any (given the step id), and the apply; traced on first use
    (or ahead, by ``prepare``)."""

    def __init__(self, runtime: Tf2Runtime, exchange: InStepExchange | None):
        self.runtime = runtime
        self.exchange = exchange
        self.phase = "compute and apply" if exchange is None else "compute, exchange and apply"
        self._function: Any = None

    def run(self, step_id: int, fetch_stats: bool) -> tuple[dict[str, Value], dict]:
        runtime = self.runtime
        flat = runtime.batches()
        self.prepare(fetch_stats, ())
        with runtime.phase(self.phase):
            out, applied = runtime.checked_call(lambda: self._function(*flat, tf.constant(step_id, tf.int64)))
            if out is None:
                return {}, applied
            losses, metrics, local = out
            runtime.keep_local_state(local)
            stats = runtime.stats_values(losses, metrics) if fetch_stats else {}
        return stats, applied

    def prepare(self, fetch_stats: bool, feed_names: Sequence[str]) -> None:
        if self._function is None:
            runtime = self.runtime
            self._function = runtime._trace(runtime.fused_body(self.exchange), [*runtime._batch_specs, STEP_ID])


def _scales_loss_dynamically(optimizer: Any) -> bool:
    """Whether ``optimizer`` is Keras's ``LossScaleOptimizer`` (which ``compile`` wraps around the optimizer
    under the "mixed_float16" policy)."""
    from dsgd.integrations.keras_backend import import_keras  # Keras only where a TF2 model is built

    return isinstance(optimizer, import_keras().optimizers.LossScaleOptimizer)


def _converted(fn: Callable) -> Callable:
    """``fn`` converted by autograph (Python control flow on tensors), as ``tf.function`` converts user code;
    ``fn`` itself when its source cannot be read (defined interactively)."""
    try:
        if inspect.ismethod(fn):  # autograph converts the function; the method is bound again here
            return functools.partial(tf.autograph.to_graph(fn.__func__), fn.__self__)
        return tf.autograph.to_graph(fn)
    except Exception as e:  # autograph's conversion errors have no common public base class
        logger.debug("get_loss runs without autograph: %s", e)
        return fn


def _loss_and_metrics(result: Any, where: str) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
    """``get_loss``'s result: a scalar, or ``(scalar, {name: scalar})``, checked."""
    loss, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise ModelCreatorError(f"get_loss(batch) on {where} must return a scalar or (scalar, {{name: scalar}}), "
                                f"got metrics {metrics!r}")
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank != 0:
        raise ModelCreatorError(f"get_loss(batch) on {where} must return a scalar loss, got shape {loss.shape}")
    if not loss.dtype.is_floating:
        raise ModelCreatorError(f"get_loss(batch) on {where} must return a float loss, got {loss.dtype.name}")
    metrics = {k: tf.reduce_mean(tf.convert_to_tensor(v)) for k, v in metrics.items()}
    return loss, metrics


def _gradients(grads: Sequence[Any], variables: Sequence[Any], where: str, names: Names) -> list[tf.Tensor]:
    """Dense gradients; a variable the loss does not reach gets zeros (logged), none reached is an error."""
    missing = [names.exchange[k] for k, g in enumerate(grads) if g is None]
    if len(missing) == len(grads):
        raise ModelCreatorError(f"the loss on {where} depends on none of the variables get_variables() returns")
    if missing and where.endswith("device 0"):
        logger.warning("variables with no gradient are not trained: %s", ", ".join(missing))
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]


def _next_batch(replica: Tf2Replica, worker_index: int) -> Any:
    try:
        return replica.model.get_batch()
    except Exception as e:
        raise DSGDError(f"get_batch() raised on worker {worker_index}, device {replica.index}: "
                        f"{type(e).__name__}: {e}") from e


def _spec(value: Any, worker_index: int, device_index: int) -> tf.TensorSpec:
    """A batch array's spec, its first dimension (the batch size) left free."""
    array = np.asarray(value)
    dtype = _dtype(array)
    if dtype is None:
        raise ModelCreatorError(f"get_batch() on worker {worker_index}, device {device_index} returned an array "
                                f"of dtype {array.dtype}; expected numbers or strings")
    shape = [None, *array.shape[1:]] if array.ndim else []
    return tf.TensorSpec(shape, dtype)


def _dtype(array: np.ndarray) -> tf.DType | None:
    """The TensorFlow dtype of a batch array: its own for numbers, ``tf.string`` for text (``str`` or ``bytes``,
    in a fixed-width or an object array); None for anything else."""
    if array.dtype.kind in "biuf":
        return tf.as_dtype(array.dtype)
    return tf.string if inputs.is_text(array) else None


def _tensor(value: Any, spec: tf.TensorSpec, worker_index: int) -> tf.Tensor:
    array = np.asarray(value)
    dtype = _dtype(array)
    if dtype is None or not spec.is_compatible_with(tf.TensorSpec(array.shape, dtype)):
        raise DSGDError(f"get_batch() on worker {worker_index} returned an array of shape {array.shape} and "
                        f"dtype {array.dtype}, where its first batch had {spec.shape} and {spec.dtype.name}")
    return tf.constant(array)

"""The replica runtime: what an exchange (``dsgd.exchange``) asks of the worker's replicas, in numpy.

A worker holds one replica of the model per device. Its ``ReplicaRuntime``
builds them and runs their steps; an exchange combines the worker's
gradients with the other workers' and talks only to the runtime, never to
TensorFlow's sessions, graphs or feeds, so every exchange serves every
runtime (``dsgd.worker.tf1.runtime`` for TF1 graphs).

A step is one of:

- ``compute`` (the replicas' local mean and the step's stats, as numpy),
  then ``apply`` of the global means the exchange got for them;
- a ``FusedStep`` (``fused_step``): compute and apply in one go (one
  session run in TF1). With an ``InStepExchange`` the exchange's sends and
  receives are built into that step (through the op library, ``dsgd.ops``),
  so each partition leaves while back-propagation goes on. A fused step can
  be planned ahead (``FusedStep.prepare``).

Every apply checks the means (``dsgd.worker.finite_checks``): a non-finite
one raises or skips the step on every replica, by ``nan_policy``
(``dsgd.worker.nonfinite``). A step's result (``result``, a
``dsgd.common.results.StepResult``) holds, when stats were fetched, the loss
and metrics (means over replicas, as total and count), the time of each
phase (``<phase>_s``, from ``phase``) and ``sent_bytes`` (this worker's, one
contribution each to their means over the workers), why the apply
skipped the step if it did, and the replicas' local state after it (what a
replica keeps to itself and a replacement should start from, e.g. a Keras
model's metrics over an epoch). The driver reduces the workers' results
once, and keeps each worker's latest local state.
"""

from __future__ import annotations

import abc
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from dsgd.common import timeline
from dsgd.common.results import Evaluation, LocalState, StepResult, Value
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError
from dsgd.worker import nonfinite
from dsgd.worker.signature import WorkerSignature

if TYPE_CHECKING:
    from dsgd.model import Model  # imports TensorFlow, which an exchange driving a runtime needs not
    from dsgd.worker.inputs import InputSource

# Builds an exchange into a fused step: given the step's local means (one tensor per exchange tensor) and its
# step id (an int64 scalar tensor), it sends and receives every partition and returns the global means (one
# tensor per exchange tensor) and the checks that must pass before they are applied. Traced by the runtime:
# into the TF1 graph, or inside a tf.function.
InStepExchange = Callable[[Sequence[Any], Any], tuple[list[Any], list[Any]]]

RECEIVE_THREADS = 2  # inter-op threads beyond the compute's: a receive waiting for its mean holds one


@runtime_checkable
class Evaluates(Protocol):
    """A replica that evaluates itself (a compiled Keras model: its compiled loss and metrics)."""

    def evaluate_batches(self, batches: Iterator[Any]) -> Evaluation:
        """Its evaluation of ``batches``, its weights and state left as they were."""

    def evaluation_logs(self, evaluation: Evaluation) -> dict[str, Any]:
        """The logs of ``evaluation`` (every replica's, reduced)."""


@runtime_checkable
class Predicts(Protocol):
    """A replica that predicts (a Keras model: its outputs in inference mode)."""

    def predict_batches(self, batches: Iterator[Any]) -> Any:
        """Its outputs for ``batches``, rows concatenated in order (None if there were none)."""


def thread_counts(config: WorkerConfig) -> tuple[int, int]:
    """(intra-op, inter-op) threads of a worker's TensorFlow, whichever runtime: its CPUs for each op, and as many
    ops at once (at least 2) plus ``RECEIVE_THREADS`` for the in-step receives that wait for their means."""
    threads = max(1, config.cpus_per_worker)
    return threads, max(2, threads) + RECEIVE_THREADS


class FusedStep(abc.ABC):
    """A step that computes, exchanges in-step (if built with an ``InStepExchange``) and applies, in one go."""

    @abc.abstractmethod
    def run(self, step_id: int, fetch_stats: bool) -> tuple[dict[str, Value], dict]:
        """Start a step (``ReplicaRuntime.start_step``) and run it: its loss and metrics ({} without
        ``fetch_stats``) and the apply's outcome ({} or {"skipped": why})."""

    @abc.abstractmethod
    def prepare(self, fetch_stats: bool, feed_names: Sequence[str]) -> None:
        """Plan the step for the inputs ``feed_names`` now, off the step's path, unless planned already."""


class ReplicaRuntime(abc.ABC):
    """A worker's replicas, one per device: built once, stepped, their state read and written.

    ``applied_steps`` counts the steps applied (skipped ones too); ``trace``
    is the timeline recorded while one is (``None`` otherwise), which phases
    and the exchanges' spans go to.
    """

    sess: Any = None  # the TF1 runtime's session; None for a runtime without one (``SGDWorker.sess``)

    def __init__(self, worker_index: int, config: WorkerConfig):
        self.worker_index = worker_index
        self.config = config
        self.applied_steps = 0
        self.trace: timeline.Recorder | None = None
        self._phase_s: dict[str, float] = {}  # this step's phases, reported with its stats
        self.local_state: list | None = None  # the replicas' local state after this step, if they keep any (LocalState)
        # One thread per replica to ask for batches, with Ray Data input: a
        # streaming split starts an epoch only once every replica has asked.
        self._batch_pool = (ThreadPoolExecutor(config.devices_per_worker, thread_name_prefix="dsgd-batches")
                            if config.feed_concurrently and config.devices_per_worker > 1 else None)

    def each_replica(self, ask: Callable[[Any], Any], replicas: Sequence[Any]) -> list:
        """``ask(replica)`` for every replica, in order; in threads of their own with Ray Data input
        (``WorkerConfig.feed_concurrently``), where each replica's next batch may wait for the others' asks."""
        return list(self._batch_pool.map(ask, replicas) if self._batch_pool else map(ask, replicas))

    # ---- building ---------------------------------------------------------

    @abc.abstractmethod
    def build(self, model_creator: Callable[[int, int], Model], state: dict | None = None) -> WorkerSignature:
        """Build the replicas (anew if built before), starting from ``state`` (``get_state()``'s) if given."""

    @property
    @abc.abstractmethod
    def is_built(self) -> bool:
        """Whether ``build`` ran."""

    @property
    @abc.abstractmethod
    def signature(self) -> WorkerSignature:
        """What ``build`` built."""

    @property
    @abc.abstractmethod
    def trainable_count(self) -> int:
        """How many of the exchange tensors are gradients; the rest are state values."""

    @property
    @abc.abstractmethod
    def models(self) -> list[Model]:
        """The user's replicas, in device order."""

    @abc.abstractmethod
    def user_context(self) -> ContextManager:
        """Where user code runs (for TF1: with the worker's graph and session as the defaults)."""

    # ---- stepping -----------------------------------------------------------

    @abc.abstractmethod
    def compute(self, fetch_stats: bool) -> tuple[list[np.ndarray], dict[str, Value]]:
        """Start a step (``start_step``), ask every replica for its batch and compute: the local means (one array
        per exchange tensor, in ``signature.exchange`` order) and the loss and metrics ({} without
        ``fetch_stats``)."""

    @abc.abstractmethod
    def apply(self, means: Sequence[np.ndarray]) -> dict:
        """Apply ``means`` (the global means, one per exchange tensor) on every replica, checked: {} or
        {"skipped": why}; a non-finite mean raises under nan_policy "raise"."""

    @abc.abstractmethod
    def drop_batches(self) -> None:
        """Start a step (``start_step``) and ask every replica for its batch, without computing: a backup worker
        catching up on a step with Ray Data input, whose splits start an epoch only once every replica has read
        as many batches as the others."""

    @abc.abstractmethod
    def fused_step(self, exchange: InStepExchange | None = None) -> FusedStep:
        """A new step that computes and applies in one go: the worker's own mean alone, or with ``exchange``
        built in, the global means it receives."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Compute a step without applying it (no weight changes)."""

    @property
    @abc.abstractmethod
    def feed_names(self) -> tuple[str, ...] | None:
        """The inputs the last step fed, sorted (None before the first): what a step is planned for."""

    # ---- phases, stats and the checked apply --------------------------------

    def start_step(self) -> None:
        """A step begins: its phase timings start anew, and its local state is not read yet."""
        self._phase_s = {}
        self.local_state = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase of the step for its stats (``<name>_s``) and, if tracing, the timeline."""
        start = time.perf_counter()
        try:
            with timeline.maybe_span(self.trace, name):
                yield
        finally:
            key = name.replace(",", "").replace(" ", "_") + "_s"
            self._phase_s[key] = self._phase_s.get(key, 0.0) + time.perf_counter() - start

    def result(self, values: dict[str, Value], applied: dict, sent_bytes: int) -> StepResult:
        """A step's result: ``values`` (loss and metrics) with its phase times and ``sent_bytes`` (what this
        worker pushed to the servers or the driver), each this worker's one contribution to its mean over the
        workers (no values if ``values`` has none: no stats fetched); why if the apply skipped it; the replicas'
        local state after it, if they keep any and it was read."""
        own = {**self._phase_s, "sent_bytes": float(sent_bytes)} if values else {}
        local_state = None if self.local_state is None else LocalState(self.applied_steps, self.local_state)
        return StepResult({**values, **{name: Value.mean([figure]) for name, figure in own.items()}},
                          applied.get("skipped"), local_state=local_state)

    def take_local_state(self, state: LocalState) -> None:
        """A replacement's replicas start from the local state its lost predecessor's held (``state``)."""
        for model, flat in zip(self.models, state.replicas):
            model._dsgd_take_local_state(flat, state.applied_steps)

    def skipped(self, error_text: str) -> dict | None:
        """The outcome of an apply whose run failed with ``error_text``: {"skipped": why} (counted as applied) if
        a non-finite check failed it under nan_policy "skip", None if it is not a check's failure (re-raise it);
        under nan_policy "raise", raises ``NonFiniteGradientError``."""
        why = nonfinite.outcome(error_text, self.applied_steps, self.config.nan_policy)
        if why is None:
            return None
        self.applied_steps += 1
        return {"skipped": why}

    @staticmethod
    def replica_stats(losses: Sequence[float], metrics: dict[str, Sequence[float]]) -> dict[str, Value]:
        """Loss and metrics: means over the replicas, one contribution each."""
        return {"loss": Value.mean(losses), **{k: Value.mean(v) for k, v in metrics.items()}}

    # ---- evaluation and prediction ----------------------------------------------

    def evaluate(self, source: InputSource) -> list[Evaluation]:
        """Every replica's evaluation of its batches from ``source``, device order; no weight or state changes."""
        models = self.models
        evaluations = []
        for i, model in enumerate(models):
            batches = source.batches(self.worker_index, i, len(models))
            evaluations.append(model.evaluate_batches(batches) if isinstance(model, Evaluates)
                               else self.evaluate_loss(i, batches))
        return evaluations

    def evaluate_loss(self, device_index: int, batches: Iterator[Any]) -> Evaluation:
        """Replica ``device_index``'s evaluation of ``batches`` by its own loss and metrics."""
        raise DSGDError(f"evaluate needs a TF2 model (a dsgd.TF2Model, a Keras 3 dsgd.KerasModel) or a model that "
                        f"evaluates itself; {type(self.models[device_index]).__name__} is a TF1 dsgd.Model: "
                        "evaluate it in its session with sgd.foreach_model(...)")

    def evaluation_logs(self, evaluation: Evaluation) -> dict[str, Any]:
        """The logs of ``evaluation`` (every replica's, reduced), by replica 0."""
        model = self.models[0]
        return model.evaluation_logs(evaluation) if isinstance(model, Evaluates) else evaluation.logs()

    def predict(self, source: InputSource) -> list[Any]:
        """Every replica's outputs for its batches from ``source`` (None where it had none), device order."""
        models = self.models
        for model in models:
            if not isinstance(model, Predicts):
                raise DSGDError(f"predict needs a model with outputs: {type(model).__name__} has no "
                                "predict_batches(batches) (a Keras model has; a dsgd.TF2Model may define it)")
        return [model.predict_batches(source.batches(self.worker_index, i, len(models)))
                for i, model in enumerate(models)]

    # ---- state ------------------------------------------------------------

    @abc.abstractmethod
    def get_weights(self) -> dict[str, np.ndarray]:
        """Replica 0's weights, keyed by name without the replica scope."""

    @abc.abstractmethod
    def replica_weights(self) -> list[dict[str, np.ndarray]]:
        """Every replica's weights, device order."""

    @abc.abstractmethod
    def set_group(self, group: str, values: dict[str, np.ndarray]) -> None:
        """Write ``values`` (name -> array) of state group ``group`` ("weights" or "optimizer") on every
        replica."""

    @abc.abstractmethod
    def get_groups(self) -> dict[str, dict[str, np.ndarray]]:
        """Replica 0's "weights" and "optimizer" groups."""

    def get_state(self) -> dict:
        """Weights, optimizer state and step count: all a replica needs to go on."""
        return {**self.get_groups(), "applied_steps": self.applied_steps}

    def set_state(self, state: dict) -> None:
        """Load ``get_state()``'s result onto every replica."""
        self.set_group("weights", state["weights"])
        self.set_group("optimizer", state["optimizer"])
        self.applied_steps = state["applied_steps"]

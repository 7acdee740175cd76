"""A compiled Keras 3 model as one dsgd replica, its loss and metrics computed by Keras's own compile machinery.

Both Keras 3 front ends train through ``CompiledReplica``: ``dsgd.KerasModel``
(which compiles the model it is given, ``dsgd.integrations.keras3``) and
``dsgd.KerasTrainer`` (whose ``build()`` returns a compiled model). The
step's forward pass is the first half of Keras's own ``train_step``: the
model in training mode, ``compute_loss`` (the compiled losses, their
weights, ``sample_weight``, masks, regularizers, a user's override), the
loss tracker and ``compute_metrics`` (Keras's stateful metrics, chosen the
way ``compile`` chooses them). The runtime takes the gradients of
``optimizer.scale_loss(loss)`` and applies their mean with the optimizer,
which unscales them (``dsgd.worker.tf2.runtime``).

The metrics' state lives on each replica. ``KerasModel`` reports per-step
values (the state is reset at every step, as its step stats are per step);
``KerasTrainer`` lets the state accumulate over an epoch and sums it across
the replicas on the driver (``dsgd.integrations.metric_states``). A step
the engine runs again after a fault counts its batch in that state once
(``CountedOnce``). Both evaluate with Keras's own ``test_step`` and predict
with Keras's own ``predict`` on the batches the runtime gives them
(``dsgd.worker.runtime.Evaluates``, ``Predicts``).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any, Iterator, Protocol

import numpy as np
import tensorflow as tf

from dsgd.integrations import metric_states
from dsgd.integrations.keras_backend import check_optimizer, import_keras
from dsgd.integrations.metric_states import MetricState
from dsgd.model import TF2Model
from dsgd.worker import inputs

# A step's batch: (x, y) or (x, y, sample_weight), numpy structures.
Batch = tuple


class BatchSource(Protocol):
    """Where a replica's training batches come from."""

    def next(self) -> Batch:
        """The next batch: ``(x, y)`` or ``(x, y, sample_weight)``."""


def check_compiled(model: Any, who: str) -> None:
    """Refuse, by name, what dsgd cannot train through Keras's compile machinery."""
    keras = import_keras()
    if not isinstance(model, keras.Model):
        raise TypeError(f"{who} needs a keras.Model (Keras 3), got {type(model).__module__}.{type(model).__name__}")
    if not model.compiled or model.optimizer is None:
        raise ValueError(f"{who}: the model is not compiled; call model.compile(optimizer=..., loss=..., "
                         "metrics=...) before returning it")
    if type(model).train_step is not keras.Model.train_step:
        raise TypeError(f"{who}: {type(model).__name__} overrides train_step, which dsgd does not run (it computes "
                        "the step itself, to exchange the gradients): override compute_loss (and compute_metrics) "
                        "instead, which dsgd calls")
    synchronized = [layer.name for layer in model._flatten_layers(include_self=False)
                    if getattr(layer, "synchronized", False)]
    if synchronized:
        raise ValueError(f"{who}: BatchNormalization(synchronized=True) in layer(s) {', '.join(synchronized)}: dsgd "
                         "normalises each replica by its own batch and averages the moving statistics after every "
                         "step; use synchronized=False")
    check_optimizer(model.optimizer, who)


class CompiledReplica(TF2Model):
    """A compiled Keras 3 model as a replica (``TF2Model``), stepped with Keras's own loss and metrics.

    Args:
        model: the compiled model, built in ``model_creator`` for this replica.
        batches: its training batches.
        per_step_metrics: report each step's metric values (the state reset
            at every step), else none (the state accumulates until
            ``reset_metrics``, each step counted once however often it is run).
    """

    def __init__(self, model: Any, batches: BatchSource, per_step_metrics: bool):
        self.model = model
        self.optimizer = model.optimizer
        self._batches = batches
        self._per_step_metrics = per_step_metrics
        self._first = _carried(batches.next())
        x, y, sample_weight = _unpack(self._first)
        self._state = self._find_state(x)
        # Keras's own build of the compiled losses and metrics (their variables), from the batch's specs.
        try:
            model._symbolic_build(data_batch=text_as_tensors((x, y, sample_weight)))
        except ValueError as e:
            raise ValueError(f"Keras could not build the compiled loss and metrics for the model's outputs and the "
                             f"batches' labels: {e} (Keras pairs a list of losses or metrics with the outputs: give "
                             "one per output, or a dict keyed by output name)") from e
        model.reset_metrics()
        self._counted_once = None if per_step_metrics else CountedOnce(model.metrics_variables)
        self._test_step = tf.function(model.test_step)  # traced once for each batch shape

    def _find_state(self, x: Any) -> list:
        """The non-trainable float weights a call on ``x`` in training mode writes (put back as they were);
        an unbuilt model is built first, by a call in inference mode."""
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        if not self.model.built:
            self.model(x, training=False)  # builds it; in inference mode, no statistic moves
        candidates = [v for v in self.model.non_trainable_weights if tf.as_dtype(v.dtype).is_floating]
        before = [v.numpy() for v in candidates]
        self.model(x, training=True)
        written = [v for v, old in zip(candidates, before) if not np.array_equal(v.numpy(), old)]
        for v, old in zip(candidates, before):
            v.assign(old)
        return written

    # ---- dsgd.TF2Model ----------------------------------------------------------------

    def get_variables(self) -> list:
        return list(self.model.trainable_weights)

    def get_state_variables(self) -> list:
        return list(self._state)

    def _dsgd_weights(self) -> list:
        """Every weight of the model (``model.weights``, frozen ones too): what ``get_weights`` and checkpoints
        hold."""
        return list(self.model.weights)

    def get_optimizer(self) -> Any:
        return self.optimizer

    def _dsgd_seek(self, step: int) -> bool:
        if self._counted_once is not None:
            self._counted_once.begin(step)
        return False

    def get_batch(self) -> Batch:
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        return _carried(self._batches.next())

    def get_loss(self, batch: Batch) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        x, y, sample_weight = _unpack(batch)
        model = self.model
        if self._per_step_metrics:
            model.reset_metrics()  # before the loss: it tracks each output's loss as a metric
        else:
            self._counted_once.before_updates()
        y_pred = model(x, training=True)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        model._loss_tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        results = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if not self._per_step_metrics:
            return loss, {}
        return loss, {name: value for name, value in results.items() if name != "loss"}

    # ---- metric state, evaluation and inference ------------------------------------------

    def metric_state(self) -> MetricState:
        """The compiled metrics' variables (``model.metrics_variables``) now."""
        return MetricState.of(self.model)

    def reset_metrics(self) -> None:
        self.model.reset_metrics()

    def evaluate_batches(self, batches: Iterator[Batch]) -> MetricState:
        """Keras's own ``test_step`` on each of a stream of batches ``(x, y, sample_weight)``: the metrics' state
        it leaves (nothing counted if the stream is empty), to be reduced with the other replicas'. The metrics
        hold what they held before, after it. A batch without labels goes to Keras as ``(x,)``, the form its
        data takes for a model whose own ``compute_loss`` needs none.

        The step is traced for each batch shape (``_test_step``), as Keras's ``evaluate`` of arrays traces it:
        Keras's ``evaluate`` of a generator (unknown batch size) counts each output's loss of a model with
        several outputs once a batch, not once a sample, so its ``<output>_loss`` differ from one process's."""
        kept = self.metric_state()
        self.model.reset_metrics()
        for batch in batches:
            self._test_step(_for_keras(batch))
        evaluated = self.metric_state()
        self._set_metric_state(kept)
        return evaluated

    def evaluation_logs(self, evaluation: MetricState) -> dict[str, Any]:
        """Keras's results of ``evaluation`` (every replica's state, reduced), the metrics left as they were."""
        kept = self.metric_state()
        logs = metric_states.results(self.model, evaluation.state)
        self._set_metric_state(kept)
        return logs

    def _set_metric_state(self, state: MetricState) -> None:
        for variable, value in zip(self.model.metrics_variables, state.state):
            variable.assign(value)

    def predict_batches(self, batches: Iterator[Any]) -> Any:
        """Keras's own ``predict`` of a stream of input batches: the outputs as numpy, rows in order (None if the
        stream is empty)."""
        first = next(batches, None)
        if first is None:
            return None
        with _stream_ends_the_call():
            return self.model.predict(((text_as_tensors(x),) for x in itertools.chain([first], batches)), verbose=0)

    def predict(self, x: Any, batch_size: int | None = None) -> Any:
        """The model's outputs for ``x`` in inference mode (``keras.Model.predict``), as numpy; call it on a
        replica, e.g. ``sgd.for_model(lambda m: m.predict(x_test))``."""
        return self.model.predict(x, batch_size=batch_size, verbose=0)


class CountedOnce:
    """Metric state that counts each of the engine's steps once, however often a replica computes it.

    After a fault the engine runs again the step no worker applied, and a
    surviving replica computes its batch a second time. Before each step's
    metric updates (``before_updates``, traced into the step) the state is
    saved, tagged with the step (``begin``, called before the step's batch
    is read); a step computed again starts from the state saved before its
    first run. Copies of a few small variables, inside the step.
    """

    def __init__(self, variables: list):
        self._variables = list(variables)
        self._saved = [tf.Variable(tf.zeros_like(v.value), trainable=False) for v in self._variables]
        self._saved_step = tf.Variable(-1, dtype=tf.int64, trainable=False)  # the step the saved state precedes
        self._step = tf.Variable(-1, dtype=tf.int64, trainable=False)  # the step being computed

    def begin(self, step: int) -> None:
        """The engine's step (its count of applied steps) that the replica computes next."""
        self._step.assign(step)

    def before_updates(self) -> None:
        """Traced before the step's metric updates: the state saved before this step's first run if it ran
        before, else the state now saved."""
        again = tf.equal(self._saved_step, self._step)
        for variable, saved in zip(self._variables, self._saved):
            variable.assign(tf.where(again, saved, variable.value))
            saved.assign(variable.value)
        self._saved_step.assign(self._step)


def text_as_tensors(batch: Any) -> Any:
    """``batch`` with text (numpy arrays of str or bytes, which have no Keras dtype) as ``tf.string`` tensors, the
    rest as it is: what Keras's build and its generator input take."""
    return tf.nest.map_structure(lambda a: tf.constant(a) if a is not None and inputs.is_text(a) else a, batch)


@contextlib.contextmanager
def _stream_ends_the_call() -> Iterator[None]:
    """Keras's ``predict`` of a stream whose end is the call's end (every batch it gives is read):
    without Keras's warning that the input "ran out of data", which it gives for any input of unknown length."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        yield


def _carried(batch: Batch) -> Batch:
    """``batch`` as the runtime carries it, arrays only: no labels (``y`` None, e.g. a model whose own
    ``compute_loss`` needs none) as an empty structure, which ``_unpack`` reads back as None."""
    if len(batch) == 3 and batch[1] is None:
        return batch[0], (), batch[2]
    return batch


def _for_keras(batch: Batch) -> Batch:
    """``batch`` as Keras's ``test_step`` takes it: ``(x,)`` if it has no labels; text as tensors."""
    x, y, sample_weight = _unpack(batch)
    return text_as_tensors((x,) if y is None else batch)


def _unpack(batch: Batch) -> tuple[Any, Any, Any]:
    if len(batch) == 3:
        x, y, sample_weight = batch
        return x, None if isinstance(y, tuple) and not y else y, sample_weight
    x, y = batch
    return x, y, None

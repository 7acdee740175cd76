"""The loss and metrics of a tf_keras dsgd.KerasModel (the TF1 way), over one output or several.

(A Keras 3 model's are Keras's own compile machinery's: ``dsgd.integrations.keras_compiled``.)

A model's outputs are one tensor, a list of tensors or a dict of tensors
(a functional model with several heads). Its labels have the same
structure. The loss is summed over the outputs, as Keras's ``compile``
does: one loss for every output, or a list or dict of losses, one per
output. Metrics are reported per output under ``<output>_<metric>`` when
there are several outputs.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable

import tensorflow as tf

# Keys of step(fetch_stats=True)'s result that a metric must not shadow.
RESERVED_METRIC_NAMES = ("loss", "step", "step_time_s", "samples_per_s", "skipped",
                         "num_replicas", "dropped_gradients", "sent_bytes", "node_sent_bytes")


def output_names(outputs: Any, model: Any) -> list[str]:
    """One name per output, in ``tf.nest.flatten`` order: dict keys, else Keras's output names."""
    if isinstance(outputs, collections.abc.Mapping):
        return [str(k) for k in sorted(outputs)]
    flat = tf.nest.flatten(outputs)
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == len(flat) else [f"output_{i}" for i in range(len(flat))]


def check_labels(labels: Any, outputs: Any) -> None:
    """Labels must come in the outputs' structure: one array per output."""
    try:
        tf.nest.assert_same_structure(labels, outputs, check_types=False)
    except (TypeError, ValueError):
        raise ValueError(
            f"KerasModel: the model has {_describe(outputs)} but the batches' labels are {_describe(labels)}; "
            "give one label array per output, in the same structure (for dict batches, label= may be a key, "
            "a list of keys or a dict of keys)") from None


def loss_functions(loss: Any, outputs: Any, names: list[str], keras_module) -> list[Callable]:
    """One loss function per output (``outputs``: the outputs or their structure), resolved now: names
    through ``keras_module`` (tf_keras or Keras 3)."""
    return [_resolve_loss(fn, keras_module) for fn in _per_output(loss, outputs, names, "loss")]


def total_loss(functions: list[Callable], labels: Any, outputs: Any) -> tf.Tensor:
    """The sum over outputs of each output's loss (a scalar: a non-scalar loss is averaged)."""
    terms = [scalar(fn(y, out)) for fn, y, out in zip(functions, tf.nest.flatten(labels), tf.nest.flatten(outputs))]
    return terms[0] if len(terms) == 1 else tf.add_n([tf.cast(t, terms[0].dtype) for t in terms])


def metric_functions(metrics: Any, outputs: Any, names: list[str], keras_module) -> dict[str, tuple[int, Callable]]:
    """``{name: (output index, function)}``: every metric on every output (or per output, for a dict), resolved
    now (a Keras 3 name makes a stateful object, which cannot be made inside a traced step)."""
    if isinstance(metrics, str) or callable(metrics):
        raise TypeError(f"KerasModel metrics must be a list of names or callables, got {metrics!r}")
    several = len(names) > 1
    per_output = (_per_output(metrics, outputs, names, "metrics")
                  if isinstance(metrics, collections.abc.Mapping) else [metrics] * len(names))
    resolved: dict[str, tuple[int, Callable]] = {}
    for index, (output, wanted) in enumerate(zip(names, per_output)):
        for metric in [wanted] if isinstance(wanted, str) or callable(wanted) else wanted:
            name, fn = _resolve_metric(metric, keras_module)
            name = f"{output}_{name}" if several else name
            if name in resolved or name in RESERVED_METRIC_NAMES:
                raise ValueError(f"KerasModel metric name {name!r} is used twice or is reserved "
                                 f"({', '.join(RESERVED_METRIC_NAMES)})")
            resolved[name] = index, fn
    return resolved


def build_metrics(functions: dict[str, tuple[int, Callable]], labels: Any, outputs: Any) -> dict[str, tf.Tensor]:
    """``{name: scalar tensor}`` of ``metric_functions``'s metrics."""
    flat_labels, flat_outputs = tf.nest.flatten(labels), tf.nest.flatten(outputs)
    return {name: scalar(fn(flat_labels[i], flat_outputs[i])) for name, (i, fn) in functions.items()}


def scalar(value: Any) -> tf.Tensor:
    value = tf.convert_to_tensor(value)
    return value if value.shape.rank == 0 else tf.reduce_mean(value)


def _describe(structure: Any) -> str:
    if isinstance(structure, collections.abc.Mapping):
        return f"a dict of {len(structure)} outputs (keys {sorted(structure)})"
    if isinstance(structure, (list, tuple)):
        return f"a list of {len(structure)}"
    return "one output"


def _per_output(value: Any, outputs: Any, names: list[str], what: str) -> list:
    """``value`` for each output: as it is for all, or from a list or dict with one entry per output."""
    if isinstance(value, collections.abc.Mapping):
        keys = sorted(outputs) if isinstance(outputs, collections.abc.Mapping) else names
        if sorted(map(str, value)) != sorted(map(str, keys)):
            raise ValueError(f"KerasModel {what} is a dict with keys {sorted(value)}; expected one entry per "
                             f"output: {sorted(keys)}")
        return [value[k] for k in keys]
    if what == "loss" and isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(f"KerasModel loss is a list of {len(value)}; the model has {len(names)} outputs "
                             f"({', '.join(names)}): give one loss, or one per output")
        return list(value)
    return [value] * len(names)


def _resolve_loss(loss: Any, tf_keras) -> Callable:
    if isinstance(loss, str):
        try:
            return tf_keras.losses.get(loss)
        except ValueError as e:
            raise ValueError(f"KerasModel loss {loss!r} is not a Keras loss name: {e}") from e
    if not callable(loss):
        raise TypeError(f"KerasModel loss must be a Keras loss, a loss name or a callable "
                        f"(y_true, y_pred) -> tensor, got {type(loss).__name__}")
    return loss


def _resolve_metric(metric: str | Callable, keras_module) -> tuple[str, Callable]:
    """A metric's name in the stats and its function ``(y_true, y_pred) -> tensor`` (``keras_module``: tf_keras
    or Keras 3, whose ``metrics.get`` gives stateful objects for names a function exists for)."""
    if isinstance(metric, keras_module.metrics.Metric):
        raise TypeError(
            f"KerasModel metric {metric.name!r} is a stateful keras Metric object, whose running totals "
            "dsgd does not average; pass its name or a function (y_true, y_pred) -> tensor")
    if isinstance(metric, str):
        if metric in ("accuracy", "acc"):
            return metric, _accuracy
        fn = _metric_function(metric, keras_module)
        if fn is None:
            raise TypeError(f"KerasModel metric {metric!r} names only a stateful keras Metric; "
                            "pass a function (y_true, y_pred) -> tensor instead")
        return metric, fn
    if callable(metric):
        name = getattr(metric, "__name__", None) or getattr(metric, "name", None)
        if not name or name == "<lambda>":
            raise ValueError(f"KerasModel metric {metric!r} has no name; use a def'd function "
                             "(its __name__ is the name in the step's stats)")
        return name, metric
    raise TypeError(f"KerasModel metrics must be names or callables, got {metric!r}")


def _metric_function(name: str, keras_module) -> Callable | None:
    """The stateless function ``name`` names: a metric function, or a loss function ("mae", "mse"); None if the
    name is known only as a stateful Metric."""
    try:
        fn = keras_module.metrics.get(name)
    except ValueError as e:
        raise ValueError(f"KerasModel metric {name!r} is not a Keras metric name: {e}") from e
    if not isinstance(fn, keras_module.metrics.Metric):
        return fn
    candidates = [getattr(keras_module.metrics, name, None)]
    try:
        candidates.append(keras_module.losses.get(name))
    except ValueError:
        pass
    return next((f for f in candidates if callable(f) and not isinstance(f, type)
                 and not isinstance(f, keras_module.metrics.Metric)), None)


def _accuracy(labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """Keras's choice for "accuracy": binary, one-hot or sparse, from the shapes."""
    if outputs.shape[-1] == 1:  # labels of any dtype (int 0/1 as IMDB's), compared as Keras compares them
        return tf.cast(tf.equal(tf.cast(tf.cast(labels, tf.float32) > 0.5, tf.float32),
                                tf.cast(tf.reshape(outputs, tf.shape(labels)) > 0.5, tf.float32)), tf.float32)
    predicted = tf.argmax(outputs, axis=-1)
    if labels.shape.rank == outputs.shape.rank and labels.shape[-1] != 1:
        return tf.cast(tf.equal(tf.argmax(labels, axis=-1), predicted), tf.float32)  # one-hot labels
    labels = tf.reshape(labels, tf.shape(predicted))
    return tf.cast(tf.equal(tf.cast(labels, tf.int64), predicted), tf.float32)


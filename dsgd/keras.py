"""dsgd.KerasModel: a tf_keras (Keras 2) model as one dsgd replica.

Keras 3 (the ``keras`` package, and ``tf.keras`` on TensorFlow 2.16+) does
not build in ``tf.compat.v1`` graph mode; ``tf_keras`` does. Install it with
``pip install dsgd[keras]``. This module imports ``tf_keras`` only when a
KerasModel is built, so ``import dsgd`` does not need it.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.model import Model

# Keys of step(fetch_stats=True)'s result that a metric must not shadow.
_RESERVED_METRIC_NAMES = ("loss", "step", "step_time_s", "samples_per_s", "skipped")

_BUILD_INSIDE = ("build the tf_keras model inside model_creator, e.g. "
                 "model_creator = lambda w, d: dsgd.KerasModel(tf_keras.Sequential([...]), ...)")


def _import_tf_keras():
    try:
        import tf_keras
    except ImportError as e:
        raise ImportError(
            "dsgd.KerasModel needs tf_keras (Keras 2, which builds in graph mode): "
            "pip install 'dsgd[keras]'") from e
    return tf_keras


def _is_keras3(obj: Any) -> bool:
    """True for objects of the ``keras`` package (Keras 3), which is not ``tf_keras``."""
    return any(cls.__module__.split(".")[0] == "keras" for cls in type(obj).__mro__)


class KerasModel(Model):
    """A ``tf_keras`` model trained by dsgd, one replica per device.

    Create it inside ``model_creator``, together with the tf_keras model::

        def create(worker_index, device_index):
            net = tf_keras.Sequential([tf_keras.layers.Dense(64, activation="relu"),
                                       tf_keras.layers.Dense(10)])
            return dsgd.KerasModel(
                net,
                loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                metrics=["accuracy"],
                batches=my_batches(worker_index, device_index))

    Args:
        model: a ``tf_keras.Model`` (Sequential, functional or subclassed),
            built here: its variables are created by this call, in the
            replica's variable scope. Its regularization losses (``model.losses``)
            are added to the loss, and its update ops (batch normalization's
            moving statistics) go to ``UPDATE_OPS``, which dsgd averages
            over all replicas after every step.
        loss: a tf_keras loss object, a loss name (``"mse"``,
            ``"sparse_categorical_crossentropy"``, ...) or a callable
            ``(y_true, y_pred) -> tensor``; a non-scalar result is averaged.
        optimizer: a ``tf.compat.v1.train.Optimizer`` (Keras optimizers do
            not fit dsgd's graph-mode apply).
        metrics: names (``"accuracy"``, ``"mae"``, any name
            ``tf_keras.metrics.get`` knows as a function) or callables
            ``(y_true, y_pred) -> tensor``, reported under their name (a
            callable's ``__name__``) as the mean over the batch.
            Stateful ``tf_keras.metrics.Metric`` objects are refused.
        batches: this replica's input, one of
            - an iterable of ``(x, y)`` tuples or of dicts of numpy arrays
              (read through ``features`` and ``label``), e.g.
              ``dsgd.get_dataset_shard("train").iter_batches(batch_format="numpy")``.
              ``x`` may also be a list or dict of arrays for a model with
              several inputs. Each step feeds the next batch. When the
              iterable runs out, iterating it again starts the next epoch
              (a list, a Ray ``DataIterator.iter_batches(...)`` result);
              a one-pass iterator (a generator) raises an error instead.
            - a ``tf.data.Dataset`` created inside ``model_creator``: read in
              the graph through a one-shot iterator, with no feed (call
              ``.repeat()`` on it to train for more than one pass).
            - an ``(x, y)`` pair of tensors of the replica's graph (e.g. from
              your own ``tf.data`` iterator): no feed either.
        features: the key (or a list of keys, for several inputs) of ``x``
            in dict batches.
        label: the key of ``y`` in dict batches.
    """

    def __init__(self, model: Any, loss: Any, optimizer: tf.compat.v1.train.Optimizer,
                 metrics: Sequence[str | Callable] = (), batches: Any = None,
                 features: str | Sequence[str] | None = None, label: str | None = None):
        tf_keras = _import_tf_keras()
        _check_model(model, tf_keras)
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise TypeError(
                f"KerasModel optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
                f"tf.compat.v1.train.GradientDescentOptimizer(0.1)), got {type(optimizer).__name__}")
        if (features is None) != (label is None):
            raise ValueError(f"KerasModel needs both features= and label= for dict batches, or neither; "
                             f"got features={features!r}, label={label!r}")
        self.model = model
        self.optimizer = optimizer
        self.features, self.label = features, label
        self.epoch = 0  # epochs of `batches` started before the current one (Python input only)
        self.batches_read = 0  # batches fed so far (Python input only)
        self._batches: Iterable | None = None
        self._iterator: collections.abc.Iterator | None = None
        self._pending: tuple[Any, Any] | None = None
        self.inputs, self.labels = self._build_inputs(batches)

        self.outputs = model(self.inputs, training=True)
        self.loss = _scalar(_resolve_loss(loss, tf_keras)(self.labels, self.outputs))
        if model.losses:
            self.loss = tf.add_n([self.loss] + [tf.cast(l, self.loss.dtype) for l in model.losses])
        self.metrics = _build_metrics(metrics, self.labels, self.outputs, tf_keras)
        for op in model.updates:
            if op not in tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS):
                tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, op)
        # Keras names layers uniquely per graph ("dense", then "dense_1" in the next
        # replica). Resetting its counters here lets the next replica's layers, made by
        # the same model_creator, get this replica's names, so that every replica's
        # variables strip to the same names ("sequential/dense/kernel").
        tf_keras.backend.reset_uids()

    # ---- dsgd.Model --------------------------------------------------------

    def get_loss(self) -> tf.Tensor:
        return self.loss

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return self.optimizer

    def get_metrics(self) -> dict[str, tf.Tensor]:
        return dict(self.metrics)

    def get_feed_dict(self) -> dict:
        """The next batch of ``batches``; empty when the input is read in the graph."""
        if self._batches is None:
            return {}
        x, y = self._next_batch()
        feed = dict(zip(tf.nest.flatten(self.inputs), _flatten_like(self.inputs, x, "x")))
        feed[self.labels] = y
        self.batches_read += 1
        return feed

    # ---- input -------------------------------------------------------------

    def _build_inputs(self, batches: Any) -> tuple[Any, tf.Tensor]:
        """Placeholders shaped like the first batch, or the tensors the graph reads."""
        if batches is None:
            raise ValueError(
                "KerasModel needs batches=: an iterable of (x, y) tuples or of dicts of numpy arrays, "
                "a tf.data.Dataset, or an (x, y) pair of tensors")
        if isinstance(batches, tf.data.Dataset):
            iterator = tf.compat.v1.data.make_one_shot_iterator(batches)
            return self._split(iterator.get_next(), "the tf.data.Dataset's elements")
        if isinstance(batches, (tuple, list)) and len(batches) == 2 and all(
                isinstance(t, tf.Tensor) for t in tf.nest.flatten(batches)):
            x, y = batches
            graph = tf.compat.v1.get_default_graph()
            for t in tf.nest.flatten(batches):
                if t.graph is not graph:
                    raise ValueError(f"KerasModel batches tensor {t.name} is in another graph; "
                                     "create it inside model_creator")
            return x, y
        if not isinstance(batches, collections.abc.Iterable) or isinstance(batches, (str, bytes, dict)):
            raise TypeError(
                f"KerasModel batches must be an iterable of batches, a tf.data.Dataset or an (x, y) pair of "
                f"tensors, got {type(batches).__name__}")
        self._batches = batches
        self._iterator = iter(batches)
        self._pending = self._next_batch()  # read now for its shapes; fed by the first get_feed_dict
        x, y = self._pending
        inputs = tf.nest.map_structure(lambda a: _placeholder(a, "input"), x)
        return inputs, _placeholder(y, "label")

    def _split(self, element: Any, what: str) -> tuple[Any, Any]:
        """(x, y) from one batch: a pair, or a dict read through features/label."""
        if isinstance(element, collections.abc.Mapping):
            if self.features is None:
                raise ValueError(f"{what} are dicts with keys {sorted(element)}; pass features= and label= "
                                 "to name the model's input and the label among them")
            keys = [self.features] if isinstance(self.features, str) else list(self.features)
            missing = [k for k in keys + [self.label] if k not in element]
            if missing:
                raise KeyError(f"{what} have no key {missing[0]!r} (features={self.features!r}, "
                               f"label={self.label!r}); their keys: {sorted(element)}")
            x = element[self.features] if isinstance(self.features, str) else [element[k] for k in keys]
            return x, element[self.label]
        if isinstance(element, (tuple, list)) and len(element) == 2:
            if self.features is not None:
                raise ValueError(f"{what} are (x, y) pairs: features= and label= only apply to dict batches")
            return element[0], element[1]
        raise TypeError(f"{what} must be (x, y) pairs or dicts of arrays, got {type(element).__name__}")

    def _next_batch(self) -> tuple[Any, Any]:
        """The next (x, y); at the end of the iterable, the first batch of a new pass over it."""
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        try:
            element = next(self._iterator)
        except StopIteration:
            if self._iterator is self._batches:
                raise RuntimeError(
                    f"KerasModel batches ran out after {self.batches_read} batches and cannot start another "
                    "epoch: it is a one-pass iterator. Pass an iterable that can be iterated again (a list, "
                    "a Ray DataIterator's iter_batches(...)) or an endless generator") from None
            self._iterator = iter(self._batches)
            self.epoch += 1
            try:
                element = next(self._iterator)
            except StopIteration:
                raise RuntimeError("KerasModel batches yielded no batch in a new pass over it") from None
        x, y = self._split(element, "KerasModel batches")
        return tf.nest.map_structure(np.asarray, x), np.asarray(y)


def _check_model(model: Any, tf_keras) -> None:
    """Refuse Keras 3 models and models whose variables were made outside this replica."""
    if _is_keras3(model):
        raise TypeError(
            f"KerasModel got a Keras 3 model ({type(model).__module__}.{type(model).__name__}); Keras 3 "
            f"does not build in tf.compat.v1 graph mode. Use tf_keras (pip install 'dsgd[keras]') and "
            f"{_BUILD_INSIDE}")
    if not isinstance(model, tf_keras.Model):
        raise TypeError(f"KerasModel model must be a tf_keras.Model, got {type(model).__name__}; {_BUILD_INSIDE}")
    graph = tf.compat.v1.get_default_graph()
    scope = tf.compat.v1.get_variable_scope().name
    for v in model.variables if model.built else ():
        try:
            in_graph = v.graph is graph
        except AttributeError:  # an eager variable
            in_graph = False
        if not in_graph:
            raise ValueError(
                f"the tf_keras model's variable {v.name} was created outside this replica's graph (the model "
                f"was built before model_creator ran, e.g. in the driver); {_BUILD_INSIDE}")
        if scope and not v.name.startswith(scope + "/"):
            raise ValueError(
                f"the tf_keras model's variable {v.name} was created outside this replica's variable scope "
                f"{scope!r} (a model built once and shared between replicas?); {_BUILD_INSIDE}, once per call")


def _placeholder(value: Any, what: str) -> tf.Tensor:
    array = np.asarray(value)
    if array.ndim == 0:
        raise ValueError(f"KerasModel batches: the {what} is a scalar; expected an array with a batch dimension")
    if array.dtype.kind not in "biuf":
        raise TypeError(f"KerasModel batches: the {what} has dtype {array.dtype}; expected numbers")
    return tf.compat.v1.placeholder(tf.as_dtype(array.dtype), [None, *array.shape[1:]], name=what)


def _flatten_like(structure: Any, value: Any, what: str) -> list:
    try:
        tf.nest.assert_same_structure(structure, value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"KerasModel batches: {what} changed structure from the first batch: {e}") from e
    return tf.nest.flatten(value)


def _scalar(value: Any) -> tf.Tensor:
    value = tf.convert_to_tensor(value)
    return value if value.shape.rank == 0 else tf.reduce_mean(value)


def _resolve_loss(loss: Any, tf_keras) -> Callable:
    if isinstance(loss, str):
        try:
            return tf_keras.losses.get(loss)
        except ValueError as e:
            raise ValueError(f"KerasModel loss {loss!r} is not a tf_keras loss name: {e}") from e
    if not callable(loss):
        raise TypeError(f"KerasModel loss must be a tf_keras loss, a loss name or a callable "
                        f"(y_true, y_pred) -> tensor, got {type(loss).__name__}")
    return loss


def _accuracy(labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """Keras's choice for "accuracy": binary, one-hot or sparse, from the shapes."""
    if outputs.shape[-1] == 1:
        return tf.cast(tf.equal(tf.cast(labels > 0.5, tf.float32),
                                tf.cast(tf.reshape(outputs, tf.shape(labels)) > 0.5, tf.float32)), tf.float32)
    predicted = tf.argmax(outputs, axis=-1)
    if labels.shape.rank == outputs.shape.rank and labels.shape[-1] != 1:
        return tf.cast(tf.equal(tf.argmax(labels, axis=-1), predicted), tf.float32)  # one-hot labels
    labels = tf.reshape(labels, tf.shape(predicted))
    return tf.cast(tf.equal(tf.cast(labels, tf.int64), predicted), tf.float32)


def _build_metrics(metrics: Sequence[str | Callable], labels: tf.Tensor, outputs: Any,
                   tf_keras) -> dict[str, tf.Tensor]:
    if isinstance(metrics, (str, collections.abc.Mapping)) or callable(metrics):
        raise TypeError(f"KerasModel metrics must be a list of names or callables, got {metrics!r}")
    built: dict[str, tf.Tensor] = {}
    for metric in metrics:
        if isinstance(metric, tf_keras.metrics.Metric):
            raise TypeError(
                f"KerasModel metric {metric.name!r} is a stateful tf_keras.metrics.Metric, whose running totals "
                "dsgd does not average; pass its name or a function (y_true, y_pred) -> tensor")
        if isinstance(metric, str):
            name = metric
            if metric in ("accuracy", "acc"):
                fn = _accuracy
            else:
                try:
                    fn = tf_keras.metrics.get(metric)
                except ValueError as e:
                    raise ValueError(f"KerasModel metric {metric!r} is not a tf_keras metric name: {e}") from e
                if isinstance(fn, tf_keras.metrics.Metric):
                    raise TypeError(f"KerasModel metric {metric!r} names a stateful tf_keras.metrics.Metric; "
                                    "pass a function (y_true, y_pred) -> tensor instead")
        elif callable(metric):
            fn = metric
            name = getattr(metric, "__name__", None) or getattr(metric, "name", None)
            if not name or name == "<lambda>":
                raise ValueError(f"KerasModel metric {metric!r} has no name; use a def'd function "
                                 "(its __name__ is the name in the step's stats)")
        else:
            raise TypeError(f"KerasModel metrics must be names or callables, got {metric!r}")
        if name in built or name in _RESERVED_METRIC_NAMES:
            raise ValueError(f"KerasModel metric name {name!r} is used twice or is reserved "
                             f"({', '.join(_RESERVED_METRIC_NAMES)})")
        built[name] = _scalar(fn(labels, outputs))
    return built

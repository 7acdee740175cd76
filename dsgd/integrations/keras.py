"""dsgd.KerasModel: a Keras model as one dsgd replica.

Given a Keras 3 model (the ``keras`` package, and ``tf.keras`` on
TensorFlow 2.16+), ``KerasModel(...)`` makes a ``Keras3Model``
(``dsgd.integrations.keras3``), trained the TF2 way. Given a ``tf_keras``
(Keras 2) model, it is the ``dsgd.Model`` built here, in
``tf.compat.v1`` graph mode (``pip install dsgd[keras]``). This module
imports ``tf_keras`` only when such a model is built, so ``import dsgd``
does not need it.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from dsgd.integrations import keras_outputs
from dsgd.integrations.keras_batches import Batches, split
from dsgd.model import Model
from dsgd.worker import inputs

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
    """A Keras model trained by dsgd, one replica per device.

    Given a Keras 3 model (``import keras``; ``tf.keras`` on TensorFlow
    2.16+), with a Keras optimizer, it makes a ``dsgd.TF2Model`` that dsgd
    trains the TF2 way (``dsgd.integrations.keras3.Keras3Model``: the same
    arguments, ``optimizer`` a ``keras.optimizers.Optimizer``)::

        def create(worker_index, device_index):
            net = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                                    keras.layers.Dense(10)])
            return dsgd.KerasModel(
                net,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(1e-3),
                metrics=["accuracy"],
                batches=my_batches(worker_index, device_index))

    Given a ``tf_keras`` (Keras 2) model, it is a ``dsgd.Model``, trained the
    TF1 graph way, with a ``tf.compat.v1`` optimizer; the arguments below
    describe this case. Create it inside ``model_creator``, together with
    the tf_keras model::

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
        model: a ``tf_keras.Model`` (Sequential with or without an input
            shape, functional, subclassed, nested), made in ``model_creator``
            for this replica. It is called once here, in training mode, on
            the replica's inputs; the regularization losses and update ops
            (batch normalization's moving statistics) of that call are added
            to the loss and to ``UPDATE_OPS`` (which dsgd averages over all
            replicas after every step).
        loss: a tf_keras loss object, a loss name (``"mse"``,
            ``"sparse_categorical_crossentropy"``, ...) or a callable
            ``(y_true, y_pred) -> tensor``; a non-scalar result is averaged.
            For a model with several outputs (a list or dict), one loss for
            every output or a list or dict of losses, one per output; the
            step's loss is their sum.
        optimizer: a ``tf.compat.v1.train.Optimizer`` (Keras optimizers do
            not fit dsgd's graph-mode apply).
        metrics: names (``"accuracy"``, ``"mae"``, any name
            ``tf_keras.metrics.get`` knows as a function) or callables
            ``(y_true, y_pred) -> tensor``, reported under their name (a
            callable's ``__name__``) as the mean over the batch. With several
            outputs each is reported per output, as ``<output>_<name>``, or
            given per output as a dict ``{output: [metrics]}``. Stateful
            ``tf_keras.metrics.Metric`` objects are refused.
        batches: this replica's input, one of
            - an iterable of ``(x, y)`` tuples or of dicts of numpy arrays
              (read through ``features`` and ``label``), e.g.
              ``dsgd.get_dataset_shard("train").iter_batches(batch_format="numpy")``.
              ``x`` (``y``) may also be a list or dict of arrays for a model
              with several inputs (outputs). Each step feeds the next batch.
              When the iterable runs out, iterating it again starts the next epoch
              (a list, a Ray ``DataIterator.iter_batches(...)`` result);
              a one-pass iterator (a generator) raises an error instead.
            - a ``tf.data.Dataset`` created inside ``model_creator``: read in
              the graph through a one-shot iterator, with no feed (call
              ``.repeat()`` on it to train for more than one pass).
            - an ``(x, y)`` pair of tensors of the replica's graph (e.g. from
              your own ``tf.data`` iterator): no feed either.
        features: the key of ``x`` in dict batches, or a list or dict of
            keys for a model with several inputs.
        label: the key of ``y`` in dict batches, or a list or dict of keys
            for a model with several outputs (the outputs' structure).
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any):
        if _is_keras3(model):  # the TF2 way: a Keras3Model, which is not a dsgd.Model
            from dsgd.integrations.keras3 import Keras3Model

            return Keras3Model(model, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: Any, loss: Any, optimizer: tf.compat.v1.train.Optimizer,
                 metrics: Sequence[str | Callable] | Mapping[str, Any] = (), batches: Any = None,
                 features: Any = None, label: Any = None):
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
        self._batches: Batches | None = None  # Python input; None when the graph reads it
        self.inputs, self.labels = self._build_inputs(batches)
        self._build_training_step(loss, metrics, tf_keras)
        self._inference_outputs: Any = None
        # Keras names layers uniquely per graph ("dense", then "dense_1" in the next
        # replica). Resetting its counters here lets the next replica's layers, made by
        # the same model_creator, get this replica's names, so that every replica's
        # variables strip to the same names ("sequential/dense/kernel").
        tf_keras.backend.reset_uids()

    def _build_training_step(self, loss: Any, metrics: Any, tf_keras) -> None:
        """The model called on this replica's inputs in training mode: outputs, loss, metrics, updates.

        Only what this call makes counts: a model built on its own ``Input``
        (an input shape, the functional API) also holds the batch-norm updates
        and activity losses of that build, which read its ``Input``
        placeholder. Weight regularization is made anew on each read of
        ``model.losses``, so it counts once.
        """
        graph = tf.compat.v1.get_default_graph()
        earlier = set(graph.get_operations())
        self.outputs = self.model(self.inputs, training=True)
        names = keras_outputs.output_names(self.outputs, self.model)
        keras_outputs.check_labels(self.labels, self.outputs)
        self.loss = keras_outputs.total_loss(keras_outputs.loss_functions(loss, self.outputs, names, tf_keras),
                                             self.labels, self.outputs)
        regularization = [l for l in self.model.losses if _op(l) not in earlier]
        if regularization:
            self.loss = tf.add_n([self.loss] + [tf.cast(l, self.loss.dtype) for l in regularization])
        self.metrics = keras_outputs.build_metrics(
            keras_outputs.metric_functions(metrics, self.outputs, names, tf_keras), self.labels, self.outputs)
        self.updates = [u for u in self.model.updates if _op(u) not in earlier]
        _check_feeds(self.model, fed=tf.nest.flatten(self.inputs) + tf.nest.flatten(self.labels),
                     fetches={"loss": self.loss, **{f"metric {k!r}": v for k, v in self.metrics.items()},
                              **{f"update {_op(u).name}": u for u in self.updates}})
        for update in self.updates:
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        self._scope = graph.get_name_scope()
        self._device = _op(tf.nest.flatten(self.outputs)[0]).device

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
        x, y = self._batches.next()
        feed = dict(zip(tf.nest.flatten(self.inputs), _flatten_like(self.inputs, x, "x")))
        feed.update(zip(tf.nest.flatten(self.labels), _flatten_like(self.labels, y, "y")))
        return feed

    @property
    def epoch(self) -> int:
        """Passes over ``batches`` started before the current one (0 when the graph reads the input)."""
        return self._batches.epoch if self._batches is not None else 0

    @property
    def batches_read(self) -> int:
        """Batches fed so far (0 when the graph reads the input)."""
        return self._batches.read if self._batches is not None else 0

    # ---- inference -----------------------------------------------------------

    def predict(self, x: Any, batch_size: int | None = None) -> Any:
        """The model's outputs for ``x`` in inference mode, in the worker's session.

        ``training=False``: batch normalization uses its moving statistics and
        dropout is off (``step()`` runs the model in training mode). ``x`` is
        structured like the batches' inputs (an array, or a list or dict of
        arrays); the result like the model's outputs. Call it on a replica,
        e.g. ``sgd.for_model(lambda m: m.predict(x_test))``. The inference
        graph is built on the first call.
        """
        sess = tf.compat.v1.get_default_session()
        if sess is None or sess.graph is not _op(self.loss).graph:
            raise RuntimeError("KerasModel.predict runs in its worker's session: call it through "
                               "sgd.for_model(fn) or sgd.foreach_model(fn)")
        if self._inference_outputs is None:
            with sess.graph.as_default(), tf.device(self._device), tf.compat.v1.name_scope(
                    f"{self._scope}/inference/" if self._scope else "inference/"):
                self._inference_outputs = self.model(self.inputs, training=False)
        arrays = [np.asarray(a) for a in _flatten_like(self.inputs, x, "x")]
        size = len(arrays[0])
        if size == 0:
            raise ValueError("KerasModel.predict got no rows: x needs at least one")
        step = batch_size or size
        parts = [sess.run(self._inference_outputs, dict(zip(tf.nest.flatten(self.inputs),
                                                            [a[i:i + step] for a in arrays])))
                 for i in range(0, size, step)]
        return inputs.concatenate(parts)

    # ---- input -------------------------------------------------------------

    def _build_inputs(self, batches: Any) -> tuple[Any, tf.Tensor]:
        """Placeholders shaped like the first batch, or the tensors the graph reads."""
        if batches is None:
            raise ValueError(
                "KerasModel needs batches=: an iterable of (x, y) tuples or of dicts of numpy arrays, "
                "a tf.data.Dataset, or an (x, y) pair of tensors")
        if isinstance(batches, tf.data.Dataset):
            iterator = tf.compat.v1.data.make_one_shot_iterator(batches)
            return split(iterator.get_next(), self.features, self.label, "the tf.data.Dataset's elements")
        if isinstance(batches, (tuple, list)) and len(batches) == 2 and all(
                isinstance(t, tf.Tensor) for t in tf.nest.flatten(batches)):
            x, y = batches
            graph = tf.compat.v1.get_default_graph()
            for t in tf.nest.flatten(batches):
                if t.graph is not graph:
                    raise ValueError(f"KerasModel batches tensor {t.name} is in another graph; "
                                     "create it inside model_creator")
            return x, y
        self._batches = Batches(batches, self.features, self.label)
        x, y = self._batches.first  # fed by the first get_feed_dict
        inputs = tf.nest.map_structure(lambda a: _placeholder(a, "input"), x)
        return inputs, tf.nest.map_structure(lambda a: _placeholder(a, "label"), y)


def _check_model(model: Any, tf_keras) -> None:
    """Refuse models that are not tf_keras's and models whose variables were made outside this replica."""
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


def _op(tensor_or_op: tf.Tensor | tf.Operation) -> tf.Operation:
    return tensor_or_op if isinstance(tensor_or_op, tf.Operation) else tensor_or_op.op


def _check_feeds(model: Any, fed: list[tf.Tensor], fetches: dict[str, Any]) -> None:
    """Refuse a model whose step would read a placeholder that dsgd does not feed.

    Walks the graph back from every fetch of the step; the first placeholder
    that is not one of the batch's inputs or labels is named, with the layer
    that reads it, instead of TensorFlow's feed error at the first step.
    """
    fed_ops = {_op(t) for t in fed}
    reached: dict[tf.Operation, tuple[str, tf.Operation | None]] = {}  # op -> (fetch, the op that reads it)
    queue = collections.deque()
    for what, fetch in fetches.items():
        if _op(fetch) not in reached:
            reached[_op(fetch)] = (what, None)
            queue.append(_op(fetch))
    while queue:
        op = queue.popleft()
        what, reader = reached[op]
        if op.type == "Placeholder" and op not in fed_ops:
            layer = _layer_of(reader or op, model)
            raise ValueError(
                f"KerasModel cannot train this model: its {what} reads placeholder {op.name!r}"
                f"{f' (in layer {layer!r}, op {reader.name})' if layer and reader else ''}, which dsgd never "
                "feeds: a step feeds only the batch's inputs and labels. Build every loss, update and output "
                "from the model's call on its inputs (a layer must not use a tensor or placeholder made "
                "outside that call)")
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in reached:
                reached[parent] = (what, op)
                queue.append(parent)


def _layer_of(op: tf.Operation, model: Any) -> str | None:
    """The innermost Keras layer whose name scope holds ``op``, if any."""
    names = {getattr(m, "name", None) for m in model.submodules} | {model.name}
    return next((part for part in reversed(op.name.split("/")[:-1]) if part in names), None)

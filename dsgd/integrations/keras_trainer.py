"""``dsgd.KerasTrainer``: a Keras 3 program (compile, fit, evaluate, predict, callbacks) on a dsgd engine.

The driver keeps a model of its own (``trainer.model``, from ``build()``),
which Keras's callbacks see; the engine (``trainer.engine``, a
``DistributedSGD`` started by the first ``fit`` or ``evaluate``) holds one
replica per device, each built by ``build()`` and stepped with Keras's
compile machinery (``dsgd.integrations.keras_compiled``). What passes
between them, and when:

- the data: put in the object store once per call; every replica reads
  its own part of each global batch (``dsgd.integrations.keras_feed``);
- the metrics: each replica's Keras metrics accumulate over the epoch;
  their state is summed across replicas as each variable declares
  (``dsgd.integrations.metric_states``) and read by the driver's metrics:
  at every epoch's end, for batch callbacks at every batch's end, for the
  progress bar at most every ``PROGRESS_INTERVAL_S``;
- the weights: the engine's reach ``trainer.model`` whenever a callback
  may read them (every epoch's end; every batch's end if a callback uses
  batches), and weights or a learning rate that a callback or the user
  set on ``trainer.model`` reach every replica before the next step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from dsgd.integrations import keras_reader, metric_states
from dsgd.integrations.keras_backend import import_keras
from dsgd.integrations.keras_compiled import CompiledReplica, check_compiled, text_as_tensors
from dsgd.integrations.keras_feed import (DATASET, ArraysStart, Columns, DatasetStart, EpochPlan, EpochStart, Feed,
                                          RayDataStart, with_weights)
from dsgd.integrations.metric_states import MetricState
from dsgd.model import TF2ModelInGraph
from dsgd.worker import inputs, tf_logs
from dsgd.worker.inputs import ArrayParts, InputSource, num_rows, take

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 1.0  # the progress bar's logs are fetched at most this often (every batch for batch callbacks)
_NO_ENGINE = ("the engine starts with the first fit or evaluate: call trainer.fit(...) (or evaluate) first")


class TrainerReplica(CompiledReplica):
    """One device's replica of ``build()``'s model: its metrics accumulate until the trainer resets them, its
    batches come from a ``Feed`` at the epoch the trainer began; an array feed reads each step's rows by the
    engine's step count (so a step run again after a fault, or by a replacement worker, reads the same rows).
    Its local state (``_dsgd_local_state``) is the epoch's metric state and the step it joined the epoch at, so a
    replacement for a lost worker goes on with the epoch's metrics where the lost one left them."""

    def __init__(self, model: Any, feed: Feed):
        super().__init__(model, feed, per_step_metrics=False)
        # Built while an epoch was under way (a replacement for a lost worker), so its metrics hold none of the
        # epoch's earlier steps, until it begins an epoch with the others (``begin_epoch``) or takes its lost
        # predecessor's metrics (``_dsgd_take_local_state``).
        self._built_mid_epoch = True
        self.joined_at: int | None = None  # the engine's step it first computed, if built mid-epoch
        self._joined = tf.Variable(-1, dtype=tf.int64, trainable=False)  # joined_at, -1 for None: local state
        self._next: tuple | None = None  # (step, begin_epoch's arguments): the epoch it begins as that step begins
        self._ended: tuple[int, MetricState, int | None] | None = None  # (step, state, joined) at the epoch's end

    @property
    def feed(self) -> Feed:
        return self._batches

    @feed.setter
    def feed(self, feed: Feed) -> None:
        self._batches = feed

    def begin_epoch(self, start: EpochStart, worker_index: int, device_index: int, devices: int) -> None:
        """Metrics reset, the feed at ``start``'s epoch, with every other replica."""
        self.reset_metrics()
        self.feed = start.feed(self.feed, worker_index, device_index, devices)
        self._next = None
        self._set_joined(False, None)

    def _set_joined(self, built_mid_epoch: bool, joined_at: int | None) -> None:
        self._built_mid_epoch, self.joined_at = built_mid_epoch, joined_at
        self._joined.assign(-1 if joined_at is None else joined_at)

    def _dsgd_local_state(self) -> list:
        return [*self.model.metrics_variables, self._joined]

    def _dsgd_take_local_state(self, flat: np.ndarray, applied_steps: int) -> None:
        super()._dsgd_take_local_state(flat, applied_steps)
        joined = int(flat[-1])
        self._set_joined(joined >= 0, joined if joined >= 0 else None)

    def begin_epoch_at(self, step: int, start: EpochStart, worker_index: int, device_index: int,
                       devices: int) -> None:
        """``begin_epoch`` as step ``step`` (the engine's count of applied steps) begins: a step before it, run
        again after a fault, still reads and counts in the epoch before, whose end is kept for ``ended_at``."""
        self._next = step, (start, worker_index, device_index, devices)

    def joined(self, step: int) -> int | None:
        """The step at which this replica joined the epoch under way, if it was built during it (the first step
        it computed, or ``step``, the next, if none yet); None if it began the epoch with the others."""
        if not self._built_mid_epoch:
            return None
        return step if self.joined_at is None else self.joined_at

    def ended_at(self, step: int) -> tuple[MetricState, int | None]:
        """The metric state of the epoch that ended as step ``step`` began (``begin_epoch_at``), and the step at
        which this replica had joined it (``joined``); a replica built since counted none of it."""
        if self._ended is not None and self._ended[0] == step:
            return self._ended[1], self._ended[2]
        return self.metric_state(), step

    def _dsgd_seek(self, step: int) -> bool:
        if self._next is not None and step >= self._next[0]:
            # Before the step's metric state is saved (CountedOnce), so a step run again counts in the new epoch.
            self._ended = self._next[0], self.metric_state(), self.joined(step)
            self.begin_epoch(*self._next[1])
        super()._dsgd_seek(step)
        if self._built_mid_epoch and self.joined_at is None:
            self._set_joined(True, step)
        return self.feed.seek(step)


class ReplicaCreator:
    """The engine's ``model_creator``: ``build()``'s model on a device, reading the epoch the trainer began last
    (``start``, set on the driver before each epoch, so a worker built mid-epoch joins it), and beginning the
    next at its first step if the trainer queued it already (``following``: that step and the epoch's start)."""

    def __init__(self, build: Callable[[], Any], devices_per_worker: int, start: EpochStart):
        self.build, self.devices_per_worker, self.start = build, devices_per_worker, start
        self.following: tuple[int, EpochStart] | None = None

    def __call__(self, worker_index: int, device_index: int) -> TrainerReplica:
        if not tf.executing_eagerly():  # the worker's first try, in a TF1 graph: a Keras 3 model is built eagerly
            raise TF2ModelInGraph(type(self).__name__)
        model = self.build()
        check_compiled(model, "KerasTrainer's build()")
        replica = TrainerReplica(model, self.start.feed(None, worker_index, device_index, self.devices_per_worker))
        if self.following is not None:
            replica.begin_epoch_at(*self.following, worker_index, device_index, self.devices_per_worker)
        return replica


class KerasTrainer:
    """A compiled Keras 3 model trained by dsgd with Keras's own ``fit``, ``evaluate`` and ``predict``.

    Example:
        ```python
        def build():
            model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(1, activation="sigmoid")])
            model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC()])
            return model

        trainer = dsgd.KerasTrainer(build, num_workers=2)
        history = trainer.fit(x, y, batch_size=256, epochs=10, validation_data=(xv, yv),
                              callbacks=[keras.callbacks.EarlyStopping(monitor="val_auc", mode="max")])
        trainer.evaluate(x_test, y_test, return_dict=True)
        ```

    Args:
        build: returns a compiled Keras 3 model (TensorFlow backend); called
            once here (``trainer.model``) and once for every replica.
        **engine_options: ``DistributedSGD``'s arguments (``num_workers``,
            ``devices_per_worker``, ``strategy``, ``compression``, ...).
    """

    def __init__(self, build: Callable[[], Any], **engine_options: Any):
        if not callable(build):
            raise TypeError(f"KerasTrainer needs build: a function returning a compiled keras.Model, got {build!r}")
        if "model_creator" in engine_options:
            raise TypeError("KerasTrainer builds the engine's replicas with build(): pass no model_creator")
        if "datasets" in engine_options:
            raise TypeError("KerasTrainer reads a Ray Dataset given to fit: pass it as fit(ds, label_columns=...), "
                            "not datasets=")
        import_keras()  # on TensorFlow, else an error naming the backend, before build() runs on another
        self._build = build
        with tf_logs.start_up_lines_hidden():  # TensorFlow's context may start here: CUDA's probe, as in a worker
            self.model = build()
        check_compiled(self.model, "KerasTrainer's build()")
        self._options = engine_options
        self._engine: Any = None
        self._dataset: Any = None  # the Ray Dataset the engine reads (its datasets=), if fit gave one
        self._batches: str | None = None  # the batches the engine's step is built for (_batch_specs)
        self._reading: keras_reader.DriverEpochs | None = None  # fit's input read on the driver, during a fit
        self._creator: ReplicaCreator | None = None
        self._names: list[str] = []  # the engine's weight names, model.weights order
        self._optimizer_names: list[str] = []  # the engine's optimizer variable names, optimizer.variables order
        self._synced: list[np.ndarray] = []  # the weights trainer.model and the engine last agreed on
        self._synced_optimizer: list[np.ndarray] = []  # and its optimizer's variables

    @property
    def engine(self) -> Any:
        """The ``DistributedSGD`` underneath (resize, save, restore, step), once the first fit or evaluate
        started it."""
        if self._engine is None:
            raise RuntimeError(f"KerasTrainer.engine: {_NO_ENGINE}")
        return self._engine

    @property
    def replicas(self) -> int:
        """The engine's replicas now: ``num_workers * devices_per_worker``."""
        return self.engine.num_workers * self.engine.devices_per_worker

    def shutdown(self) -> None:
        """Stop the engine's actors (the trainer can start a new engine with the next fit)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def __enter__(self) -> "KerasTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- fit ------------------------------------------------------------------------------

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", callbacks: list | None = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool = True, class_weight: dict | None = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, *, label_columns: str | list[str] | None = None,
            feature_columns: str | list[str] | None = None) -> Any:
        """``keras.Model.fit`` across the engine's replicas; returns Keras's ``History``.

        ``x`` is numpy arrays (or a dict or list of them), with ``y``:
        ``batch_size`` (default 32) is the global batch, each step one
        synchronous step over it, each replica taking an equal contiguous
        part. With ``shuffle=False`` step i trains on samples ``[i*B,
        (i+1)*B)``, as one-process ``fit`` does. Or ``x`` is a function
        ``(worker_index, device_index) -> tf.data.Dataset`` of that
        replica's batches (``(x, y)`` or ``(x, y, sample_weight)``), with
        ``steps_per_epoch``. Or ``x`` is a ``tf.data.Dataset``, a Keras
        ``PyDataset`` or a generator of global batches, read on the driver
        by Keras's own iterator an epoch at a time, each replica training on
        an equal part of each batch (``dsgd.integrations.keras_reader``).
        Or ``x`` is a Ray Dataset, ``label_columns``
        naming its labels (``feature_columns`` its features: by default
        every other column; a name gives an array, a list a dict), split
        over the replicas as ``DistributedSGD(datasets=)`` splits one (an
        epoch is a pass over it, or ``steps_per_epoch`` steps; ``shuffle``
        does not apply: shuffle the dataset). ``validation_data`` may be a
        Ray Dataset of the same columns.
        """
        keras = import_keras()
        from keras.src.trainers.data_adapters import array_slicing

        columns = None
        if inputs.is_ray_dataset(x):
            if y is not None or sample_weight is not None or validation_split:
                raise ValueError("x is a Ray Dataset: its labels are columns (label_columns=), so give no y, "
                                 "sample_weight or validation_split (validation_data may be another Ray Dataset)")
            columns = Columns.of(x, label_columns, feature_columns, class_weight)
        elif keras_reader.is_driver_input(x):
            if y is not None or sample_weight is not None or validation_split:
                raise ValueError(f"x is a {type(x).__name__}, whose batches hold the labels (and weights): give no "
                                 "y, sample_weight or validation_split (as keras.Model.fit), and validation_data "
                                 "for validation")
        elif (label_columns is not None or feature_columns is not None) and not inputs.is_ray_dataset(validation_data):
            raise ValueError("label_columns and feature_columns name the columns of a Ray Dataset x or "
                             f"validation_data; x is {type(x).__name__}")
        elif validation_split and validation_data is None and not callable(x):
            (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
        steps, epoch_start = self._training_input(x, y, batch_size or 32, shuffle, class_weight, sample_weight,
                                                  steps_per_epoch, columns)
        verbose = 1 if verbose == "auto" else verbose
        callback_list = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                                     verbose=verbose, epochs=epochs, steps=steps,
                                                     model=self.model)
        # Keras's History, progress bar and CSVLogger read only the logs: without another callback nothing reads
        # trainer.model, or changes it, until fit ends, so the weights come to it once, at the end.
        model_callbacks = _model_callbacks(callback_list, keras)
        batch_callbacks = _act_at_batches(model_callbacks, keras)
        validation = None if validation_data is None else self._evaluation(
            *_validation_arrays(validation_data), validation_batch_size or batch_size or 32, validation_steps,
            label_columns, feature_columns)  # prepared once, evaluated at the epochs validation_freq names
        self.model.stop_training = False
        callback_list.on_train_begin()
        initial_epoch = self.model._initial_epoch or initial_epoch  # as Keras: BackupAndRestore's resumed epoch
        try:
            epoch_logs: dict = {}
            positioned = None  # (the epoch start the workers are at, the step count then), if fit put them there
            ahead = False  # the epoch's first step was submitted as the epoch before ended (``_end_ahead``)
            for epoch in range(initial_epoch, epochs):
                if not ahead:
                    start = epoch_start(epoch)
                    # No epoch queued to begin later, even if a fit was cut short while one was.
                    self._creator.start, self._creator.following = start, None
                    if positioned != (start, self.engine.num_steps):
                        self.engine.foreach_worker(functools.partial(_begin_epoch, start))
                callback_list.on_epoch_begin(epoch)
                if self._reading is not None and epoch + 1 < epochs:
                    self._reading.read_ahead()  # the next epoch, read on the driver while this one trains
                # What the user or a callback set on trainer.model before this epoch (load_weights before fit, a
                # scheduled learning rate, restored weights) reaches every replica before its first step.
                if epoch == initial_epoch or model_callbacks:
                    self._push_changes()
                logs, fetched, begun = {}, time.monotonic(), (self.engine.num_steps - ahead, self.engine.failures)
                for step in range(start.plan.steps if isinstance(start, ArraysStart) else steps):
                    callback_list.on_train_batch_begin(step)
                    if batch_callbacks:
                        self._push_changes()
                    if not (ahead and step == 0):
                        self.engine.step()
                    if batch_callbacks or (verbose == 1 and time.monotonic() - fetched >= PROGRESS_INTERVAL_S):
                        logs, fetched = self._logs(), time.monotonic()
                    if batch_callbacks:
                        self._pull_state()
                    callback_list.on_train_batch_end(step, logs)
                    if self.model.stop_training:
                        break
                following = epoch_start(epoch + 1) if epoch + 1 < epochs and not self.model.stop_training else None
                validating = validation is not None and self.model._should_eval(epoch, validation_freq)
                # Nothing reads or changes trainer.model between the epochs: the next epoch's first step need not
                # wait for this epoch's logs.
                ahead = (following is not None and not model_callbacks and not validating
                         and not self.engine.options.elastic)
                if ahead:
                    epoch_logs = self._end_ahead(epoch, begun, following)
                    start = following
                else:
                    epoch_logs = self._finish_epoch(epoch, begun, following,
                                                    pull=bool(model_callbacks) or following is None)
                positioned = None if following is None else (following, self.engine.num_steps)
                if validating:
                    val_logs = self._evaluate(validation, verbose=0, callbacks=callback_list, return_dict=True,
                                              push=bool(model_callbacks))
                    epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
                callback_list.on_epoch_end(epoch, epoch_logs)
                if self.model.stop_training:
                    break
        finally:
            self._stop_reading()
        if getattr(self.model.optimizer, "use_ema", False):
            self.engine.foreach_model(_finalize_ema)
            self._pull_state()
        callback_list.on_train_end(logs=epoch_logs)
        self._push_changes()  # e.g. EarlyStopping's restore_best_weights, at the end of training
        return self.model.history

    def _training_input(self, x: Any, y: Any, batch_size: int, shuffle: bool, class_weight: dict | None,
                        sample_weight: Any, steps_per_epoch: int | None,
                        columns: Columns | None) -> tuple[int, Callable[[int], EpochStart]]:
        """The engine started for ``fit``'s input; the steps of an epoch, and where each epoch's input is."""
        if self._engine is not None and (self._dataset is not None or columns is not None) and x is not self._dataset:
            reads = ("reads the Ray Dataset the fit that started it gave (as its datasets=): fit again with that "
                     "dataset" if self._dataset is not None else "was started for other input than a Ray Dataset")
            raise ValueError(f"this trainer's engine {reads}; to train on other input, call trainer.shutdown() "
                             "first: the next fit starts an engine for it, from trainer.model's weights and "
                             "optimizer state")
        if columns is not None:
            return self._ray_data_input(x, batch_size, steps_per_epoch, columns)
        if callable(x):
            if steps_per_epoch is None:
                raise ValueError("fit with a dataset function x=(worker_index, device_index) -> tf.data.Dataset needs "
                                 "steps_per_epoch: the steps of an epoch")
            start = DatasetStart(x, token=int(np.random.default_rng().integers(2 ** 62)))
            self._start(_first_batch(x), start)
            return steps_per_epoch, lambda epoch: start
        if keras_reader.is_driver_input(x):
            return self._driver_input(x, class_weight, shuffle, steps_per_epoch)
        return self._arrays_input(_arrays(x, y, sample_weight, class_weight), batch_size, shuffle, steps_per_epoch)

    def _arrays_input(self, arrays: Any, batch_size: int, shuffle: bool,
                      steps_per_epoch: int | None) -> tuple[int, Callable[[int], ArraysStart]]:
        """``fit``'s arrays, put in the object store once: an epoch is a pass over them, or ``steps_per_epoch``
        steps of one, the next epoch going on where it stopped (``EpochPlan.following``), as in Keras; the fit's
        first epoch (the first asked for) begins a pass."""
        ref = _put(arrays)
        self._start(take(arrays, slice(0, 1)), ArraysStart(ref, EpochPlan(num_rows(arrays), 1, 1), 0, 0))
        plan = EpochPlan(num_rows(arrays), batch_size, self.replicas, shuffle, int(np.random.randint(2 ** 31)),
                         steps_per_epoch)
        if steps_per_epoch is not None and plan.batches % steps_per_epoch:
            warnings.warn(f"steps_per_epoch={steps_per_epoch} does not divide the {plan.batches} batches of "
                          f"{batch_size} a pass over the data makes: as in keras.Model.fit, each epoch goes on where "
                          "the last one stopped, one that reaches the end of the data stops there, with fewer "
                          "steps, and the next begins a new pass", stacklevel=4)

        first: list[int] = []  # the fit's first epoch, once asked for

        def epoch_start(epoch: int) -> ArraysStart:  # the engine may have been resized since the last epoch
            if not first:
                first.append(epoch)
            epoch_plan, pass_number = dataclasses.replace(plan, replicas=self.replicas), 0
            for _ in range(epoch - first[0]):
                epoch_plan, new_pass = epoch_plan.following()
                pass_number += new_pass
            return ArraysStart(ref, epoch_plan, pass_number, self.engine.num_steps)
        return plan.steps, epoch_start

    def _driver_input(self, x: Any, class_weight: dict | None, shuffle: bool,
                      steps_per_epoch: int | None) -> tuple[int, Callable[[int], EpochStart]]:
        """``fit``'s input from a dataset, ``PyDataset`` or generator on the driver (``keras_reader``): read an
        epoch at a time (the first now, which starts the engine; ``self._reading`` reads the others, each while
        the one before trains, until fit ends), each epoch's batches put in the object store as it begins; the
        steps of the first epoch."""
        epochs = self._reading = keras_reader.DriverEpochs(x, steps_per_epoch, class_weight,
                                                           shuffle and not isinstance(x, tf.data.Dataset))
        first = epochs.read()
        unnumbered = [(_put(first.arrays), first)]  # epochs read and put, not yet given a number
        self._start(take(first.arrays, slice(0, 1)), ArraysStart(unnumbered[0][0], EpochPlan(1, 1, 1), 0, 0))
        held: dict[int, tuple[Any, tuple[int, ...]]] = {}  # epoch -> (its arrays' reference, its batches' edges)

        def epoch_start(epoch: int) -> ArraysStart:  # asked for at the epoch before's end, and as it begins
            if epoch not in held:
                if unnumbered:
                    ref, read = unnumbered.pop()
                else:
                    read = epochs.read()
                    ref = _put(read.arrays)
                keras_reader.warn_left_out(read, self.replicas)
                for done in [k for k in held if k < epoch - 1]:
                    del held[done]
                held[epoch] = ref, read.edges
            ref, edges = held[epoch]
            return ArraysStart(ref, EpochPlan(edges[-1], 1, self.replicas, edges=edges), epoch,
                               self.engine.num_steps)
        return EpochPlan(first.rows, 1, self.replicas, edges=first.edges).steps, epoch_start

    def _stop_reading(self) -> None:
        """The end of a fit that read its input on the driver: an epoch read ahead and not trained on dropped."""
        if self._reading is not None:
            self._reading.close()
            self._reading = None

    def _ray_data_input(self, dataset: Any, batch_size: int, steps_per_epoch: int | None,
                        columns: Columns) -> tuple[int, Callable[[int], EpochStart]]:
        """``fit``'s input from a Ray Dataset: the engine started reading it (or reading it already)."""
        if self._engine is None:
            replicas = self._options.get("num_workers", 1) * self._options.get("devices_per_worker", 1)
            self._start(columns.first(dataset), RayDataStart(columns, _part(batch_size, replicas)),
                        datasets={DATASET: dataset})
            self._dataset = dataset
        if steps_per_epoch is None:  # a pass over every replica's split (each as long: an equal split)
            steps_per_epoch = -(-(dataset.count() // self.replicas) // _part(batch_size, self.replicas))
        return steps_per_epoch, lambda epoch: RayDataStart(columns, _part(batch_size, self.replicas))

    # ---- evaluate and predict -------------------------------------------------------------

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: str | int = "auto",
                 sample_weight: Any = None, steps: int | None = None, callbacks: list | None = None,
                 return_dict: bool = False, *, label_columns: str | list[str] | None = None,
                 feature_columns: str | list[str] | None = None) -> Any:
        """``keras.Model.evaluate`` across the engine's replicas: each evaluates a contiguous part of the data
        with Keras's own ``evaluate``, and their metric states are summed, so the result equals one process's
        ``evaluate`` of the same weights on the same data. Returns what Keras returns. ``x`` may be a Ray Dataset
        (its columns named as for ``fit``): each worker evaluates a split of it, streaming."""
        evaluation = self._evaluation(x, y, sample_weight, batch_size or 32, steps, label_columns, feature_columns)
        return self._evaluate(evaluation, verbose, callbacks, return_dict)

    def _evaluation(self, x: Any, y: Any, sample_weight: Any, batch_size: int, steps: int | None,
                    label_columns: Any, feature_columns: Any) -> Callable[[], InputSource]:
        """The data to evaluate, prepared once (the engine started if not yet): arrays put in the object store, a
        Ray Dataset and its columns, or a function ``(worker_index, device_index) -> tf.data.Dataset``. Each call
        of the result gives the input source of one evaluation, for the replicas there are then."""
        if (label_columns is not None or feature_columns is not None) and not inputs.is_ray_dataset(x):
            raise ValueError("label_columns and feature_columns name the columns of a Ray Dataset x; x is "
                             f"{type(x).__name__}")
        if inputs.is_ray_dataset(x) or callable(x):
            columns = Columns.of(x, label_columns, feature_columns, None) if inputs.is_ray_dataset(x) else None
            if self._engine is None:
                first = _first_batch(x) if columns is None else columns.first(x)
                self._start(first, ArraysStart(_put(first), EpochPlan(1, 1, 1), 0, 0), training=False)
            return lambda: inputs.source(x, batch_size, steps, self.engine.num_workers,
                                         self.engine.devices_per_worker, None if columns is None else columns.batch)
        if keras_reader.is_driver_input(x):
            if y is not None or sample_weight is not None:
                raise ValueError(f"x is a {type(x).__name__}, whose batches hold the labels (and weights): give no "
                                 "y or sample_weight (as keras.Model.evaluate)")
            epoch = keras_reader.DriverEpochs(x, steps).read()
            arrays, batch_size = epoch.arrays, epoch.edges[1]
        else:
            arrays = _arrays(x, y, sample_weight, None)
            if steps is not None:
                arrays = take(arrays, slice(0, steps * batch_size))
        ref, rows = _put(arrays), num_rows(arrays)
        self._start(take(arrays, slice(0, 1)), ArraysStart(ref, EpochPlan(rows, 1, 1), 0, 0), training=False)
        return lambda: ArrayParts.of(ref, rows, self.replicas, batch_size)

    def _evaluate(self, evaluation: Callable[[], InputSource], verbose: str | int, callbacks: Any,
                  return_dict: bool, push: bool = True) -> Any:
        """One evaluation of ``evaluation``'s data (``_evaluation``'s) on the workers, between the callbacks'
        ``on_test_begin`` and ``on_test_end`` (``callbacks``: a list, or fit's ``CallbackList`` for validation, as
        Keras's fit passes its own): Keras's logs. Unless ``push`` is false (fit's validation with no callback that
        could have changed it), what was set on ``trainer.model`` reaches every replica after ``on_test_begin``
        (``SwapEMAWeights`` swaps in the averages there) and again after ``on_test_end``."""
        keras = import_keras()
        verbose = 1 if verbose == "auto" else verbose
        callback_list = callbacks if isinstance(callbacks, keras.callbacks.CallbackList) else \
            keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1, steps=1,
                                         model=self.model)
        callback_list.on_test_begin()
        if push:
            self._push_changes()
        callback_list.on_test_batch_begin(0)
        logs = self._results([self.engine._evaluate(evaluation())])
        callback_list.on_test_batch_end(0, logs)
        callback_list.on_test_end(logs)
        if push:
            self._push_changes()
        if return_dict:
            return logs
        return self.model._flatten_metrics_in_order(logs)

    def predict(self, x: Any, batch_size: int | None = None, verbose: str | int = "auto",
                steps: int | None = None, callbacks: list | None = None) -> Any:
        """``keras.Model.predict`` across the engine's replicas (each predicts a contiguous part), the rows in
        input order. Before the first fit or evaluate started the engine, it runs on ``trainer.model``."""
        if inputs.is_ray_dataset(x):
            raise TypeError("KerasTrainer.predict takes arrays (its rows come back in input order); for a Ray "
                            "Dataset, predict with trainer.model inside the dataset's map_batches")
        if keras_reader.is_driver_input(x):
            epoch = keras_reader.DriverEpochs(x, steps).read()
            x, batch_size = epoch.arrays[0], batch_size or epoch.edges[1]
        elif steps is not None:
            x = take(x, slice(0, steps * (batch_size or 32)))
        batch_size = batch_size or 32
        if self._engine is None:
            return self.model.predict(x, batch_size=batch_size, verbose=0, callbacks=callbacks)
        callback_list = import_keras().callbacks.CallbackList(callbacks, model=self.model)
        callback_list.on_predict_begin()
        self._push_changes()  # after on_predict_begin: what a callback set there (SwapEMAWeights) predicts
        outputs = self.engine.predict(x, batch_size)
        callback_list.on_predict_end()
        self._push_changes()
        return outputs

    # ---- the engine and the driver's model ----------------------------------------------------

    def _start(self, first: tuple, start: EpochStart, datasets: dict | None = None, training: bool = True) -> None:
        """Start the engine (unless started), its replicas reading ``start``'s input until the first epoch
        begins, from ``trainer.model``'s weights; build the driver model's metrics for ``first``, a batch. For
        ``training`` input, ``first`` is checked against the batches the engine's step was built for."""
        if self._engine is not None:
            if training and _batch_specs(first) != self._batches:
                raise ValueError(
                    f"this fit's batches (x, y, sample_weight) are {_batch_specs(first)}, but the engine's step was "
                    f"built for {self._batches}, the batches of the call that started it: give arrays of those "
                    "shapes and dtypes, or call trainer.shutdown() first (the next fit starts an engine for its "
                    "input, from trainer.model's weights and optimizer state)")
            return
        self._batches = _batch_specs(first)
        from dsgd.distributed_sgd import DistributedSGD, _init_ray_if_needed

        self.model._symbolic_build(data_batch=text_as_tensors(first))
        _init_ray_if_needed()
        self._creator = ReplicaCreator(self._build, self._options.get("devices_per_worker", 1), start)
        self._engine = DistributedSGD(self._creator, **self._options, datasets=datasets)
        built = self._replica_state()
        self._names, self._optimizer_names = list(built["weights"]), list(built["optimizer"])  # in their order
        # What the replicas built: the next _push_changes sends what trainer.model holds that differs from it (all
        # the weights if build() is not seeded, those loaded before fit), so the engine starts from trainer.model,
        # and state restored onto the engine meanwhile (dsgd.tune's trials) is not overwritten by the same build's.
        self._synced, self._synced_optimizer = list(built["weights"].values()), list(built["optimizer"].values())

    def _finish_epoch(self, epoch: int, begun: tuple[int, int], following: EpochStart | None, pull: bool) -> dict:
        """One call on the workers, after the epoch's last step, ends epoch ``epoch`` (begun at the engine's step
        count and failure count ``begun``): its logs, worker 0's weights onto ``trainer.model`` if ``pull``, and,
        if another epoch follows, every replica beginning ``following`` with the next step (a replacement built
        from here on joins that epoch too). A worker lost during the call is replaced and the call made again."""
        step = self.engine.num_steps
        self._creator.following = None if following is None else (step, following)
        ended = self.engine._on_workers("apply_fn", functools.partial(_end_epoch, step, following, pull),
                                        what="the epoch's end")
        self._creator.start, self._creator.following = following or self._creator.start, None
        if pull:
            self._set_pulled(ended[0].state)
        return self._epoch_logs(epoch, begun, ended)

    def _end_ahead(self, epoch: int, begun: tuple[int, int], following: EpochStart) -> dict:
        """Epoch ``epoch``'s end with the next epoch's first step submitted before its logs are read: a call
        queued behind the epoch's last step reads the metrics' state and has every replica begin ``following``
        as that first step begins; the first step is submitted; the logs are computed while it runs. After a
        fault meanwhile (the call may have run before a step run again, or on a lost worker), the logs are read
        from the state each replica kept as it began the next epoch, once that first step is done."""
        step = self.engine.num_steps
        self._creator.following = step, following
        queued = self.engine._queue_on_workers(functools.partial(_end_epoch, step, following, False),
                                               what="the epoch's end")
        self.engine.step()
        ended = self.engine._queued_answers(queued)
        if ended is None:
            ended = self.engine._on_workers("apply_fn", functools.partial(_ended_at, step), what="the epoch's end")
        self._creator.start, self._creator.following = following, None
        return self._epoch_logs(epoch, begun, ended)

    def _epoch_logs(self, epoch: int, begun: tuple[int, int], ended: list[EpochEnd]) -> dict:
        """Epoch ``epoch``'s logs from what each worker reported at its end (``ended``). A replacement that joined
        the epoch late without its lost predecessor's metrics (``TrainerReplica._dsgd_take_local_state``) is
        named in a warning: the logs leave out what that worker had computed."""
        first_step, failures = begun
        late = {w: end.joined_at - first_step for w, end in enumerate(ended)
                if end.joined_at is not None and end.joined_at > first_step}
        if late and self.engine.failures > failures:  # replacements (a worker grown mid-epoch lost nothing)
            logger.warning("epoch %d's metrics leave out %s: a replacement's metrics start empty where the lost "
                           "worker's last step did not report them (an elastic engine that went on with fewer, a "
                           "backup worker behind); the weights are exact", epoch + 1,
                           ", ".join(f"worker {w}'s first {n} steps" for w, n in late.items()))
        return self._results([state for end in ended for state in end.states])

    def _logs(self) -> dict:
        """The epoch's metrics so far, over every replica's samples, by Keras's own results."""
        return self._results([state for worker in self.engine.foreach_worker(_metric_states) for state in worker])

    def _results(self, states: list[MetricState]) -> dict:
        """Keras's results of the metrics whose state the replicas give (``states``, one a replica), reduced once."""
        return metric_states.results(self.model, MetricState.reduce(states).state)

    def _replica_state(self) -> dict:
        """Worker 0's weights and optimizer state (``get_state()``), after the steps in flight."""
        return self.engine._on_worker_0("get_state", what="worker 0's weights and optimizer state")

    def _pull_state(self) -> None:
        """The engine's weights and optimizer state onto ``trainer.model``."""
        self._set_pulled(self._replica_state())

    def _set_pulled(self, state: dict) -> None:
        """``state``, a replica's (``get_state()``: weights and optimizer variables by name, in the model's and
        the optimizer's order), onto ``trainer.model``: what a callback saving it (``ModelCheckpoint``,
        ``BackupAndRestore``) writes."""
        weights, optimizer = list(state["weights"].values()), list(state["optimizer"].values())
        self.model.set_weights(weights)
        for variable, value in zip(self._optimizer_variables(len(optimizer)), optimizer):
            variable.assign(value)
        self._synced, self._synced_optimizer = weights, optimizer

    def _optimizer_variables(self, expected: int) -> list:
        """``trainer.model``'s optimizer's variables (built if it was not), as many as the replicas' (``expected``)."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        variables = list(optimizer.variables)
        if len(variables) != expected:
            raise ValueError(f"the replicas' optimizer has {expected} variables, trainer.model's {len(variables)}: "
                             "build() must compile the same optimizer every time it is called")
        return variables

    def _push_changes(self) -> None:
        """Weights or optimizer variables set on ``trainer.model`` since the engine and it last agreed
        (``load_weights``, a learning rate or weights a callback sets, ``BackupAndRestore``'s restored state): onto
        every replica."""
        weights = self.model.get_weights()
        optimizer = [np.asarray(v.numpy()) for v in self._optimizer_variables(len(self._optimizer_names))]
        changed = {"weights": _changed(self._names, weights, self._synced),
                   "optimizer": _changed(self._optimizer_names, optimizer, self._synced_optimizer)}
        if changed["weights"] or changed["optimizer"]:
            self.engine._restore_state({**changed, "applied_steps": self.engine.num_steps})
            self._synced, self._synced_optimizer = weights, optimizer


# ---- what runs on the workers (foreach_worker / foreach_model) -------------------------------------------------

def _begin_epoch(start: EpochStart, worker: Any) -> None:
    """Every replica of ``worker``: its metrics reset, its feed at ``start``'s epoch."""
    for device, replica in enumerate(worker.models):
        replica.begin_epoch(start, worker.worker_index, device, len(worker.models))


@dataclasses.dataclass
class EpochEnd:
    """What a worker reports at an epoch's end."""

    states: list[MetricState]  # its replicas' metric states, device order
    state: dict | None  # worker 0's weights and optimizer state (get_state()), if asked for (None from the others)
    joined_at: int | None  # the step at which it joined the epoch, if it was built during it (TrainerReplica.joined)


def _end_epoch(step: int, following: EpochStart | None, pull: bool, worker: Any) -> EpochEnd:
    """An epoch's end on ``worker``, after its last step (step ``step`` comes next): what it reports (worker 0's
    weights and optimizer state too if ``pull``); every replica begins ``following``, if another epoch follows,
    as step ``step`` begins. Made again before that step, it reports the same."""
    ended = EpochEnd(_metric_states(worker), worker.get_state() if pull and worker.worker_index == 0 else None,
                     worker.models[0].joined(step))
    if following is not None:
        for device, replica in enumerate(worker.models):
            replica.begin_epoch_at(step, following, worker.worker_index, device, len(worker.models))
    return ended


def _ended_at(step: int, worker: Any) -> EpochEnd:
    """What ``worker`` reports of the epoch that ended as step ``step`` began, from what its replicas kept."""
    ends = [replica.ended_at(step) for replica in worker.models]
    return EpochEnd([state for state, _ in ends], None, ends[0][1])


def _metric_states(worker: Any) -> list[MetricState]:
    """The worker's replicas' metric states, device order."""
    return [m.metric_state() for m in worker.models]


def _finalize_ema(replica: TrainerReplica) -> None:
    replica.optimizer.finalize_variable_values(replica.model.trainable_weights)


# ---- arguments ----------------------------------------------------------------------------------

def _arrays(x: Any, y: Any, sample_weight: Any, class_weight: dict | None) -> tuple:
    """(x, y, sample_weight) as numpy, the weights from ``sample_weight`` or ``class_weight`` (Keras's own
    conversion), ones if neither."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    if x is None:
        raise ValueError("KerasTrainer needs x: numpy arrays, or a dict or list of them")
    x = tf.nest.map_structure(np.asarray, x)
    y = None if y is None else tf.nest.map_structure(np.asarray, y)
    if sample_weight is not None and class_weight is not None:
        raise ValueError("give sample_weight or class_weight, not both (as keras.Model.fit)")
    if class_weight is not None:
        if len(tf.nest.flatten(y)) != 1:
            raise ValueError("class_weight is for a model with one output (as keras.Model.fit); give "
                             "sample_weight for several")
        sample_weight = data_adapter_utils.class_weight_to_sample_weights(tf.nest.flatten(y)[0], class_weight)
    if sample_weight is None:
        sample_weight = np.ones(len(tf.nest.flatten(x)[0]), np.float32)
    arrays = (x, y, np.asarray(sample_weight, np.float32))
    num_rows(arrays)
    return arrays


def _first_batch(dataset_fn: Callable[[int, int], Any]) -> tuple:
    """The first batch of worker 0, device 0's dataset, as ``(x, y, sample_weight)``: its shapes build the driver's
    metrics."""
    dataset = inputs.replica_dataset(dataset_fn, 0, 0)
    return with_weights(next(dataset.take(1).as_numpy_iterator()))


def _validation_arrays(validation_data: Any) -> tuple:
    """``validation_data`` as (x, y, sample_weight), as Keras unpacks it."""
    if inputs.is_ray_dataset(validation_data) or keras_reader.is_driver_input(validation_data):
        return validation_data, None, None
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError("validation_data must be (x_val, y_val) or (x_val, y_val, sample_weight_val) of arrays, "
                         "a tf.data.Dataset, a keras PyDataset, a generator or a Ray Dataset, got "
                         f"{type(validation_data).__name__}")
    return tuple(validation_data) + (None,) * (3 - len(validation_data))


def _batch_specs(batch: tuple) -> str:
    """A batch's structure, with each array's dtype and shape past the rows: what the engine's step is traced for."""
    def spec(a: Any) -> str:
        return f"{'string' if inputs.is_text(a) else np.asarray(a).dtype.name}{list(np.shape(a)[1:])}"
    return repr(tf.nest.map_structure(spec, batch))


def _part(batch_size: int, replicas: int) -> int:
    """A replica's part of the global batch (which the replicas must divide)."""
    EpochPlan(replicas, batch_size, replicas)  # checks it, naming the replica count
    return batch_size // replicas


def _put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _model_callbacks(callback_list: Any, keras: Any) -> list:
    """The callbacks other than Keras's History, progress bar and CSVLogger (which read only the logs, and
    ``stop_training``): those that may read or change ``trainer.model``."""
    logs_only = (keras.callbacks.History, keras.callbacks.ProgbarLogger, keras.callbacks.CSVLogger)
    return [cb for cb in callback_list.callbacks if not isinstance(cb, logs_only)]


def _act_at_batches(callbacks: list, keras: Any) -> bool:
    """Whether one of ``callbacks`` acts at batch ends or beginnings: has a batch hook of its own (from its class,
    or set on it, as ``LambdaCallback`` sets them), unless it is one of Keras's callbacks set to act at epochs
    only (``ModelCheckpoint(save_freq="epoch")``, ``TensorBoard(update_freq="epoch")``: their batch hooks then
    read neither the logs nor the weights)."""
    base = keras.callbacks.Callback
    epochs_only = {keras.callbacks.ModelCheckpoint: lambda cb: cb.save_freq == "epoch",
                   keras.callbacks.TensorBoard: lambda cb: cb.update_freq == "epoch" and not cb.write_steps_per_second}

    hooks = ("on_train_batch_end", "on_batch_end", "on_train_batch_begin", "on_batch_begin")

    def acts(cb: Any) -> bool:
        if type(cb) in epochs_only and epochs_only[type(cb)](cb):
            return False
        own = [getattr(cb, hook) for hook in hooks]  # bound methods, or functions set on the instance
        return any(getattr(method, "__func__", method) is not getattr(base, hook) for method, hook in zip(own, hooks))
    return any(acts(cb) for cb in callbacks)


def _changed(names: list[str], values: list[np.ndarray], synced: list[np.ndarray]) -> dict[str, np.ndarray]:
    """The ``values`` (by name) that differ from ``synced``, the values last agreed on (all, if none were)."""
    if len(synced) != len(values):
        return dict(zip(names, values))
    return {name: value for name, value, old in zip(names, values, synced) if not np.array_equal(value, old)}

"""``KerasTrainer``'s input that only the driver can read: a ``tf.data.Dataset`` made there, a Keras ``PyDataset``,
a Python generator.

Keras's own epoch iterator (``TFEpochIterator``, the one ``model.fit``
uses on TensorFlow) reads it on the driver, an epoch at a time, as
``model.fit`` reads it: an epoch is a pass (a new iterator, so a shuffle
draws a new order) or ``steps_per_epoch`` batches of an iterator that goes
on across epochs; ``class_weight`` is applied by Keras's data adapter, a
``PyDataset``'s epoch hooks are called. The epoch's batches become one set
of arrays with the batches' edges (``Epoch``); the trainer puts them in the
object store and the replicas read their parts of each batch as of any
arrays (``keras_feed.EpochPlan`` with ``edges``). So every replica reads the
driver's one order, exactly the batches one process would train on, and a
step run again after a fault reads the same rows. While an epoch trains,
the next is read in the background (``read_ahead``), so the driver's
pipeline overlaps the steps; a ``fit`` stopped early (``EarlyStopping``)
has read the epoch that would have come next. An epoch is held in the
driver's memory and the object store while it trains, with the next one
being read: input larger than that is better given as a function
``(worker_index, device_index) -> tf.data.Dataset`` that each replica
reads itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import logging
from typing import Any

import numpy as np
import tensorflow as tf

from dsgd.integrations.keras_backend import import_keras
from dsgd.worker import inputs

logger = logging.getLogger(__name__)


def is_driver_input(x: Any) -> bool:
    """Whether ``x`` is input only the driver can read: a ``tf.data.Dataset``, a Keras ``PyDataset``, a generator."""
    return (isinstance(x, tf.data.Dataset) or isinstance(x, import_keras().utils.PyDataset)
            or inspect.isgenerator(x))


@dataclasses.dataclass(frozen=True)
class Epoch:
    """An epoch's batches as one set of arrays, ``(x, y, sample_weight)`` (``y`` None if the input has none;
    weights of 1 where it gives none), batch k being rows ``[edges[k], edges[k + 1])``."""

    arrays: tuple
    edges: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.edges[-1]


class DriverEpochs:
    """``x``'s epochs, read on the driver by Keras's ``TFEpochIterator``: ``class_weight`` applied, a
    ``PyDataset``'s batches in a new order each epoch if ``shuffle`` (a dataset is shuffled by its own pipeline), at
    most ``steps`` batches an epoch (``steps_per_epoch``, or ``evaluate``'s and ``predict``'s ``steps``)."""

    def __init__(self, x: Any, steps: int | None = None, class_weight: dict | None = None, shuffle: bool = False):
        from keras.src.backend.tensorflow.trainer import TFEpochIterator

        if steps is None and (inspect.isgenerator(x) or _repeats_forever(x)):
            kind = ("a generator, which has no length" if inspect.isgenerator(x)
                    else "a dataset that repeats without end")
            raise ValueError(f"the input is {kind}: give steps_per_epoch, the batches of an epoch (for "
                             "validation_data, validation_steps; for evaluate and predict, steps)")
        self._iterator = TFEpochIterator(tf.distribute.get_strategy(), x, steps_per_epoch=steps, shuffle=shuffle,
                                         class_weight=class_weight)
        self._ahead: concurrent.futures.Future | None = None  # the next epoch, read in the background
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None

    def read(self) -> Epoch:
        """The next epoch's batches, as ``model.fit`` on TensorFlow iterates them (the one read ahead, if any)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return ahead.result()
        return self._read()

    def read_ahead(self) -> None:
        """Start reading the next epoch in the background, while this one trains; ``read`` returns it."""
        if self._ahead is None:
            self._reader = self._reader or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsgd-input")
            self._ahead = self._reader.submit(self._read)

    def close(self) -> None:
        """Wait for an epoch read ahead that no step will train on (the input is the caller's again), and drop it."""
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = self._ahead = None

    def _read(self) -> Epoch:
        batches = []
        with self._iterator.catch_stop_iteration():
            for _, _, iterator in self._iterator:
                batches.append(tf.nest.map_structure(np.asarray, next(iterator)))
        if not batches:
            raise ValueError("the input gave no batch for this epoch (a generator read to its end, or an empty "
                             "dataset): give input with a batch for every epoch, e.g. a dataset with repeat() and "
                             "steps_per_epoch")
        return _as_epoch(batches)


def _as_epoch(batches: list) -> Epoch:
    unpack = import_keras().utils.unpack_x_y_sample_weight
    parts = [unpack(b) for b in batches]
    sizes = [len(tf.nest.flatten(x)[0]) for x, _, _ in parts]
    try:
        x = inputs.concatenate([p[0] for p in parts])  # numpy: _read made every leaf an array
        y = None if parts[0][1] is None else inputs.concatenate([p[1] for p in parts])
        weights = [np.ones(n, np.float32) if p[2] is None else np.asarray(p[2], np.float32)
                   for p, n in zip(parts, sizes)]
    except (ValueError, TypeError) as e:
        raise ValueError(f"the input's batches differ in structure or shape beyond their rows, so they cannot be "
                         f"read as one set of arrays: {e}") from None
    return Epoch((x, y, np.concatenate(weights)), tuple(int(e) for e in np.cumsum([0] + sizes)))


def _repeats_forever(x: Any) -> bool:
    return isinstance(x, tf.data.Dataset) and int(x.cardinality()) == int(tf.data.INFINITE_CARDINALITY)


def warn_left_out(epoch: Epoch, replicas: int) -> None:
    """Say how many rows of ``epoch`` no step reads, if a batch other than the last lost any: each batch is cut to
    a multiple of the engine's ``replicas`` (a batch with fewer rows is left out whole)."""
    sizes = np.diff(epoch.edges)
    lost = sizes % replicas  # all of a batch with fewer rows than replicas
    if lost[:-1].any():
        logger.warning("x's batches of %s rows do not divide over the engine's %d replicas: each is cut to a "
                       "multiple of %d, leaving out %d of the epoch's %d rows; batch it by a multiple of %d",
                       sorted(set(int(s) for s in sizes[:-1])), replicas, replicas, int(lost.sum()),
                       epoch.rows, replicas)

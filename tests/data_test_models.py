"""Models that read their batches from ``dsgd.get_dataset_shard``, for tests/test_data.py.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import numpy as np
import tensorflow as tf

import dsgd
from dsgd_test_models import Gate

BATCH = 10
LR = 0.1


class RowIdSplit:
    """A replica's split of ``ray.data.range(rows)``, read batch by batch, a new epoch after the last batch; records
    the ids read, per epoch. Reads lazily: the first batch is asked for by the first step, not by ``model_creator``
    (``KerasModel`` shows the other way)."""

    def __init__(self, rows: int, before_new_epoch: Callable[[], None] = lambda: None):
        self.rows = rows
        self.before_new_epoch = before_new_epoch  # called before every epoch but the first
        self.batches = dsgd.get_dataset_shard("train").iter_batches(batch_size=BATCH, batch_format="numpy")
        self.iterator = None
        self.seen: list[list[int]] = []  # ids read, one list per epoch started

    def next_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch's inputs ([u, 1] rows, u the row id / rows) and targets 2u - 1."""
        batch = next(self.iterator, None) if self.iterator is not None else None
        if batch is None:  # the first step, or the end of an epoch: a new pass
            if self.iterator is not None:
                self.before_new_epoch()
            self.iterator = iter(self.batches)
            self.seen.append([])
            batch = next(self.iterator)
        ids = batch["id"]
        self.seen[-1].extend(int(i) for i in ids)
        u = ids.astype(np.float32) / self.rows
        return np.stack([u, np.ones_like(u)], axis=1), 2.0 * u - 1.0


class RowIdRegression(dsgd.Model):
    """Linear regression on the row ids of ``ray.data.range(rows)`` (``RowIdSplit``); worker 2 passes ``held`` (a
    ``Gate``), if given, after reading each batch."""

    def __init__(self, worker_index: int, device_index: int, rows: int, die_flag: str | None = None,
                 held: Gate | None = None):
        self.worker_index = worker_index
        self.die_flag = die_flag
        self.held = held if worker_index == 2 else None
        self.split = RowIdSplit(rows, self._die_once if worker_index == 1 and die_flag else lambda: None)
        self.x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        self.y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        w = tf.compat.v1.get_variable("w", [2], initializer=tf.compat.v1.zeros_initializer())
        self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(self.x, w) - self.y))

    @property
    def seen(self) -> list[list[int]]:
        return self.split.seen

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_feed_dict(self) -> dict:
        x, y = self.split.next_inputs()
        if self.held is not None:  # after reading: the splits' epoch starts only once every replica asked
            self.held.pass_through()
        return {self.x: x, self.y: y}

    def _die_once(self) -> None:
        """Exit the worker process before asking for the second epoch, the first time only (``die_flag``)."""
        if not os.path.exists(self.die_flag):
            open(self.die_flag, "w").close()
            os._exit(1)


class RowIdTF2Regression(dsgd.TF2Model):
    """``RowIdRegression`` the TF2 way: ``get_batch`` reads the replica's ``RowIdSplit``."""

    def __init__(self, worker_index: int, device_index: int, rows: int):
        import keras

        self.split = RowIdSplit(rows)
        self.w = tf.Variable(tf.zeros([2]), name="w")
        self.opt = keras.optimizers.SGD(LR)

    def get_variables(self):
        return [self.w]

    def get_optimizer(self):
        return self.opt

    def get_batch(self) -> dict:
        x, y = self.split.next_inputs()
        return {"x": x, "y": y}

    def get_loss(self, batch):
        return tf.reduce_mean(tf.square(tf.linalg.matvec(batch["x"], self.w) - batch["y"]))


def row_id_creator(rows: int, die_flag: str | None = None, held: Gate | None = None):
    """RowIdRegression replicas; with ``die_flag`` (a path), worker 1 dies once, at its second epoch's start; with
    ``held``, worker 2 waits at that gate after reading each batch while it is closed."""
    return lambda worker_index, device_index: RowIdRegression(worker_index, device_index, rows, die_flag, held)


def row_id_tf2_creator(rows: int):
    """RowIdTF2Regression replicas."""
    return lambda worker_index, device_index: RowIdTF2Regression(worker_index, device_index, rows)


def numpy_step(w: np.ndarray, replica_ids: list[list[int]], rows: int) -> np.ndarray:
    """One engine step of RowIdRegression from ``w``: the mean of the replicas' gradients on their row ids."""
    grads = []
    for ids in replica_ids:
        u = np.asarray(ids, np.float64) / rows
        x = np.stack([u, np.ones_like(u)], axis=1)
        grads.append(2.0 / len(u) * x.T @ (x @ w - (2.0 * u - 1.0)))
    return w - LR * np.mean(grads, axis=0)


def assert_disjoint_equal_cover(epoch_rows: list[list[int]], rows: int):
    """One epoch of every replica: equal counts, no row twice, all rows but fewer than `replicas` read."""
    replicas = len(epoch_rows)
    assert len({len(r) for r in epoch_rows}) == 1, [len(r) for r in epoch_rows]
    read = [i for r in epoch_rows for i in r]
    assert len(read) == len(set(read)), "a row was read by two replicas (or twice)"
    assert set(read) <= set(range(rows))
    assert rows - len(read) < replicas


class FirstBatchNaN:
    """Batches as ``KerasModel`` takes them (iterable again for each epoch): ``batches``'s, the features of the
    very first one NaN."""

    def __init__(self, batches):
        self.batches = batches
        self.poisoned = False

    def __iter__(self):
        for batch in self.batches:
            if not self.poisoned:
                self.poisoned = True
                batch = {**batch, "x": np.full_like(batch["x"], np.nan)}
            yield batch


class RecordedRows:
    """Batches as ``KerasModel`` takes them (iterable again for each epoch): ``batches``'s, the "id" of every row
    given recorded, one list per pass begun (``seen``)."""

    def __init__(self, batches):
        self.batches = batches
        self.seen: list[list[int]] = []

    def __iter__(self):
        self.seen.append([])
        for batch in self.batches:
            self.seen[-1].extend(int(i) for i in batch["id"])
            yield batch


def xy_batches(first_batch_nan: bool = False) -> tuple[RecordedRows, Iterable]:
    """This replica's batches of dataset "train" (``xy_dataset``'s columns), its rows recorded; the batches a
    KerasModel reads (with ``first_batch_nan``, through ``FirstBatchNaN``)."""
    rows = RecordedRows(dsgd.get_dataset_shard("train").iter_batches(batch_size=BATCH, batch_format="numpy"))
    return rows, FirstBatchNaN(rows) if first_batch_nan else rows


def keras_creator(worker_index: int, device_index: int, first_batch_nan: bool = False):
    """A tf_keras classifier on the "x"/"y" columns of this replica's split (reads its first batch here); the
    rows it read per epoch in ``model.rows.seen``."""
    import tf_keras

    net = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu"), tf_keras.layers.Dense(2)])
    rows, batches = xy_batches(first_batch_nan)
    model = dsgd.KerasModel(
        net, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.5), metrics=["accuracy"],
        batches=batches, features="x", label="y")
    model.rows = rows
    return model


def keras3_creator(worker_index: int, device_index: int, first_batch_nan: bool = False):
    """``keras_creator``'s classifier in Keras 3 (the TF2 way)."""
    import keras

    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    _, batches = xy_batches(first_batch_nan)
    return dsgd.KerasModel(
        net, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=keras.optimizers.SGD(0.5),
        metrics=["accuracy"], batches=batches, features="x", label="y")


def xy_dataset(rows: int = 240):
    """``rows`` rows of 4 features "x" and a class "y" (whether x0 + x1 > 0), and the row's "id" (0 to rows - 1),
    as a Ray Dataset."""
    import ray.data

    x = np.random.RandomState(0).randn(rows, 4).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return ray.data.from_items([{"id": i, "x": xi, "y": yi} for i, (xi, yi) in enumerate(zip(x, y))])


def asks_for(name: str):
    """A model creator that asks for dataset ``name`` (to see the error when it is not there)."""
    def create(worker_index: int, device_index: int):
        dsgd.get_dataset_shard(name)
        raise AssertionError("get_dataset_shard should have raised")
    return create


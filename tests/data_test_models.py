"""Models that read their batches from ``dsgd.get_dataset_shard``, for tests/test_data.py.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

import dsgd

BATCH = 10
LR = 0.1


class RowIdRegression(dsgd.Model):
    """Linear regression on the row ids of ``ray.data.range(rows)``; records the ids read, per epoch.

    Reads lazily: the first batch is asked for by the first step, not by
    ``model_creator`` (``KerasModel`` shows the other way).
    """

    def __init__(self, worker_index: int, device_index: int, rows: int, die_flag: str | None = None):
        self.rows = rows
        self.worker_index = worker_index
        self.die_flag = die_flag
        self.batches = dsgd.get_dataset_shard("train").iter_batches(batch_size=BATCH, batch_format="numpy")
        self.iterator = None
        self.seen: list[list[int]] = []  # ids read, one list per epoch started
        self.x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        self.y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        w = tf.compat.v1.get_variable("w", [2], initializer=tf.compat.v1.zeros_initializer())
        self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(self.x, w) - self.y))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_feed_dict(self) -> dict:
        batch = next(self.iterator, None) if self.iterator is not None else None
        if batch is None:  # the first step, or the end of an epoch: a new pass
            if self.iterator is not None and self.worker_index == 1 and self.die_flag:
                self._die_once()
            self.iterator = iter(self.batches)
            self.seen.append([])
            batch = next(self.iterator)
        ids = batch["id"]
        self.seen[-1].extend(int(i) for i in ids)
        u = ids.astype(np.float32) / self.rows
        return {self.x: np.stack([u, np.ones_like(u)], axis=1), self.y: 2.0 * u - 1.0}

    def _die_once(self) -> None:
        """Exit the worker process before asking for the second epoch, the first time only (``die_flag``)."""
        if not os.path.exists(self.die_flag):
            open(self.die_flag, "w").close()
            os._exit(1)


def row_id_creator(rows: int, die_flag: str | None = None):
    """RowIdRegression replicas; with ``die_flag`` (a path), worker 1 dies once, at its second epoch's start."""
    return lambda worker_index, device_index: RowIdRegression(worker_index, device_index, rows, die_flag)


def numpy_step(w: np.ndarray, replica_ids: list[list[int]], rows: int) -> np.ndarray:
    """One engine step of RowIdRegression from ``w``: the mean of the replicas' gradients on their row ids."""
    grads = []
    for ids in replica_ids:
        u = np.asarray(ids, np.float64) / rows
        x = np.stack([u, np.ones_like(u)], axis=1)
        grads.append(2.0 / len(u) * x.T @ (x @ w - (2.0 * u - 1.0)))
    return w - LR * np.mean(grads, axis=0)


def keras_creator(worker_index: int, device_index: int):
    """A tf_keras classifier on the "x"/"y" columns of this replica's split (reads its first batch here)."""
    import tf_keras

    net = tf_keras.Sequential([tf_keras.layers.Dense(16, activation="relu"), tf_keras.layers.Dense(2)])
    return dsgd.KerasModel(
        net, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.5), metrics=["accuracy"],
        batches=dsgd.get_dataset_shard("train").iter_batches(batch_size=BATCH, batch_format="numpy"),
        features="x", label="y")


def asks_for(name: str):
    """A model creator that asks for dataset ``name`` (to see the error when it is not there)."""
    def create(worker_index: int, device_index: int):
        dsgd.get_dataset_shard(name)
        raise AssertionError("get_dataset_shard should have raised")
    return create

"""TF2 models for the tests (Keras 3 and dsgd.TF2Model), their data, and an eager single-process reference.

Workers import this module by name (the tests' directory is on their
PYTHONPATH). Every replica (worker w, device d) reads its own deterministic
batches (``batch``), so the reference can replay a run: each step, every
replica's loss and gradients from the same weights, their mean applied with
the same Keras optimizer, the batch-norm statistics set to the replicas'
mean (``reference_run``).
"""

from __future__ import annotations

from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import dsgd

FEATURES, CLASSES, BATCH = 6, 3, 8


def batch(worker_index: int, device_index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + 10 * worker_index + device_index)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    return x, (np.abs(x[:, :CLASSES]).argmax(1)).astype(np.int64)


def batches(worker_index: int, device_index: int, fixed: bool = False):
    """The replica's batches, step after step; ``fixed``: its first batch every step (a new or replaced worker
    then reads what the old ones do)."""
    step = 0
    while True:
        yield batch(worker_index, device_index, step)
        step += 0 if fixed else 1


def sequential() -> keras.Model:
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(CLASSES)])


def functional() -> keras.Model:
    """Two heads over a shared trunk, an L2 regularizer: several outputs, the regularization counted once."""
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(12, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01))(x)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(x, [keras.layers.Dense(CLASSES, name="a")(h), keras.layers.Dense(CLASSES, name="b")(h)])


class Subclassed(keras.Model):
    """A subclassed model holding a nested Sequential, built on its first call."""

    def __init__(self):
        super().__init__()
        self.trunk = keras.Sequential([keras.layers.Dense(10, activation="relu"), keras.layers.BatchNormalization()])
        self.head = keras.layers.Dense(CLASSES)

    def call(self, x, training=False):
        return self.head(self.trunk(x, training=training))


NETS: dict[str, Callable[[], keras.Model]] = {"sequential": sequential, "functional": functional,
                                              "subclassed": Subclassed}


def optimizer(name: str) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01) if name == "adam" else keras.optimizers.SGD(0.1, momentum=0.9)


def loss_of(net_name: str):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return [loss, loss] if net_name == "functional" else loss


def metrics_of(net_name: str) -> list:
    """"accuracy" on every output (Keras pairs a list of metrics with the outputs)."""
    return [["accuracy"], ["accuracy"]] if net_name == "functional" else ["accuracy"]


def labels_of(net_name: str, y: np.ndarray):
    return (y, y) if net_name == "functional" else y


def keras_creator(net_name: str = "sequential", optimizer_name: str = "sgd", fixed: bool = False) -> Callable:
    """A model_creator of KerasModel replicas of ``NETS[net_name]`` reading ``batches`` (``fixed`` or not)."""
    def create(worker_index: int, device_index: int):
        data = ((x, labels_of(net_name, y)) for x, y in batches(worker_index, device_index, fixed))
        return dsgd.KerasModel(NETS[net_name](), loss=loss_of(net_name), optimizer=optimizer(optimizer_name),
                               metrics=metrics_of(net_name), batches=data)
    return create


class Regression(dsgd.TF2Model):
    """A custom training function: linear regression on plain tf.Variables, with a metric."""

    def __init__(self, worker_index: int, device_index: int):
        self.w = tf.Variable(tf.zeros([FEATURES]), name="w")
        self.b = tf.Variable(0.0, name="b")
        self.opt = keras.optimizers.SGD(0.05)
        self.worker_index, self.device_index = worker_index, device_index
        self.data = batches(worker_index, device_index)

    def get_variables(self):
        return [self.w, self.b]

    def get_optimizer(self):
        return self.opt

    def get_batch(self):
        x, y = next(self.data)
        return {"x": x, "y": y.astype(np.float32)}

    def get_loss(self, batch):
        err = tf.linalg.matvec(batch["x"], self.w) + self.b - batch["y"]
        return tf.reduce_mean(err ** 2), {"mae": tf.reduce_mean(tf.abs(err))}


class FixedRegression(Regression):
    """``Regression`` on one batch per replica, every step: a replaced or new worker reads what the old one
    would have."""

    def get_batch(self):
        x, y = batch(self.worker_index, self.device_index, 0)
        return {"x": x, "y": y.astype(np.float32)}


SIZES = (BATCH, BATCH, 5, BATCH, 3, 7)  # SizedRegression's batch size, step after step


class SizedRegression(Regression):
    """``Regression`` whose step s reads the first ``SIZES[s]`` rows of its batch: a batch size that changes."""

    def __init__(self, worker_index: int, device_index: int):
        super().__init__(worker_index, device_index)
        self.step = 0

    def get_batch(self):
        x, y = batch(self.worker_index, self.device_index, self.step)
        size, self.step = SIZES[self.step], self.step + 1
        return {"x": x[:size], "y": y[:size].astype(np.float32)}


def regression_reference(weights: dict, reps: list[tuple[int, int]], steps: int, fixed: bool = False,
                         sizes: tuple[int, ...] | None = None, first_step: int = 0) -> dict:
    """``Regression`` (``FixedRegression`` if ``fixed``, ``SizedRegression`` given ``SIZES``) trained by plain SGD
    on the mean of the replicas' gradients, in numpy (float64), the replicas reading the batches of steps
    ``first_step`` on."""
    w, b = weights["w"].astype(np.float64), float(weights["b"])
    for step in range(first_step, first_step + steps):
        gw, gb = np.zeros_like(w), 0.0
        for wi, d in reps:
            x, y = batch(wi, d, 0 if fixed else step)
            if sizes is not None:
                x, y = x[:sizes[step]], y[:sizes[step]]
            err = x @ w + b - y
            gw += 2 * x.T @ err / len(err)
            gb += 2 * err.mean()
        w, b = w - 0.05 * gw / len(reps), b - 0.05 * gb / len(reps)
    return {"w": w, "b": np.float64(b)}


def regression_stats(weights: dict, reps: list[tuple[int, int]], step: int) -> dict[str, float]:
    """``Regression``'s loss and mae at ``weights`` on the replicas' batches of ``step``, the mean over replicas (as
    a step's stats report them), in numpy."""
    errors = [x @ weights["w"].astype(np.float64) + float(weights["b"]) - y
              for x, y in (batch(wi, d, step) for wi, d in reps)]
    return {"loss": float(np.mean([np.mean(e ** 2) for e in errors])),
            "mae": float(np.mean([np.mean(np.abs(e)) for e in errors]))}


def reference_run(net_name: str, optimizer_name: str, weights: dict[str, np.ndarray], replicas: list[tuple[int, int]],
                  steps: int, first_step: int = 0) -> tuple[dict[str, np.ndarray], list[float]]:
    """The weights after ``steps`` synchronous steps from ``weights`` (keyed as the engine keys them, by
    position) and a new optimizer, the replicas reading the batches of steps ``first_step`` on, and each step's
    mean replica loss: eager, one process."""
    return reference_stages(net_name, optimizer_name, weights, [(steps, replicas)], first_step=first_step)


def reference_stages(net_name: str, optimizer_name: str, weights: dict[str, np.ndarray],
                     stages: list[tuple[int, list[tuple[int, int]]]], fixed: bool = False,
                     first_step: int = 0) -> tuple[dict[str, np.ndarray], list[float]]:
    """``reference_run`` in stages of (steps, the replicas each step averages), the optimizer's state carried from
    stage to stage (a resized engine); ``fixed``: every replica reads its first batch every step."""
    net = NETS[net_name]()
    x0, y0 = batch(0, 0, 0)
    net(x0, training=False)  # built
    for v, value in zip(net.weights, weights.values()):
        v.assign(value)
    opt = optimizer(optimizer_name)
    opt.build(net.trainable_weights)
    loss_fn = loss_of(net_name)
    state = [v for v in net.non_trainable_weights]
    losses = []
    schedule = [replicas for count, replicas in stages for _ in range(count)]  # each step's replicas
    for step, replicas in enumerate(schedule):
        old = [v.numpy() for v in state]
        grads, new_state, step_losses = [], [], []
        for w, d in replicas:
            for v, value in zip(state, old):
                v.assign(value)
            x, y = batch(w, d, 0 if fixed else first_step + step)
            with tf.GradientTape() as tape:
                out = net(x, training=True)
                targets = labels_of(net_name, y)
                loss = (tf.add_n([loss_fn[0](targets[0], out[0]), loss_fn[1](targets[1], out[1])])
                        if net_name == "functional" else loss_fn(targets, out))
                loss = tf.add_n([loss, *net.losses]) if net.losses else loss
            grads.append(tape.gradient(loss, net.trainable_weights))
            new_state.append([v.numpy() for v in state])
            step_losses.append(float(loss))
        opt.apply([tf.add_n(list(g)) / len(replicas) for g in zip(*grads)], net.trainable_weights)
        for k, v in enumerate(state):
            v.assign(np.mean([s[k] for s in new_state], axis=0))
        losses.append(float(np.mean(step_losses)))
    return dict(zip(weights, (v.numpy() for v in net.weights))), losses


class NaNOnCue(FixedRegression):
    """``FixedRegression`` whose next batch has a NaN target once ``nan_next`` is set (by a test, between steps,
    on the replicas it picks); the batches after it are finite again. It counts the steps it computes in a
    variable of its own (``computed``), its local state."""

    nan_next = False

    def __init__(self, worker_index: int, device_index: int):
        super().__init__(worker_index, device_index)
        self.computed = tf.Variable(0.0, trainable=False, name="computed")

    def _dsgd_local_state(self):
        return [self.computed]

    def get_loss(self, batch):
        self.computed.assign_add(1.0)
        return super().get_loss(batch)

    def get_batch(self):
        b = super().get_batch()
        if self.nan_next:
            b["y"] = np.full_like(b["y"], np.nan)
            self.nan_next = False
        return b


def regression_creator(config: dict):
    """A Tune config -> a model_creator of ``Regression`` replicas with the config's learning rate."""
    def create(worker_index: int, device_index: int) -> Regression:
        model = Regression(worker_index, device_index)
        model.opt = keras.optimizers.SGD(config["lr"])
        return model
    return create


def application_creator(name: str) -> Callable:
    """A model_creator of ``keras.applications.<name>`` replicas (weights=None, 32 px, 10 classes) on random
    images."""
    def create(worker_index: int, device_index: int):
        kwargs = {"MobileNetV2": {"alpha": 0.35}}.get(name, {})
        net = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10, **kwargs)
        rng = np.random.default_rng(10 * worker_index + device_index)
        images = ((rng.normal(size=(4, 32, 32, 3)).astype(np.float32), rng.integers(0, 10, 4)) for _ in iter(int, 1))
        return dsgd.KerasModel(net, loss="sparse_categorical_crossentropy", optimizer=keras.optimizers.SGD(0.01),
                               batches=images)
    return create


def tf_data_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    """A Keras 3 model whose batches come from a ``tf.data`` iterator made before the model: eager-only code,
    which raises in the TF1 graph a worker tries first."""
    x = np.random.default_rng(10 * worker_index + device_index).normal(size=(64, FEATURES)).astype(np.float32)
    y = x[:, :1] - 2 * x[:, 1:2]
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().as_numpy_iterator()
    net = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    return dsgd.KerasModel(net, loss="mse", optimizer=keras.optimizers.SGD(0.1), batches=batches)


def raises_in_graph_and_eagerly(worker_index: int, device_index: int):
    raise ValueError("eager-only bug" if tf.executing_eagerly() else "graph-only bug")


class BrokenTF1(dsgd.Model):
    """A TF1 model whose ``__init__`` raises: the graph's error is the user's."""

    def __init__(self, worker_index: int, device_index: int):
        raise KeyError("the user's TF1 bug")

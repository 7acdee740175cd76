"""Keras 3 programs as Keras users write them, for dsgd.KerasTrainer and the Keras 3 KerasModel's tests.

Each ``build_*`` returns a compiled model whose weights are the same on
every call (Keras's global seed set first), so a one-process Keras run of
the same build is the reference. Workers import this module by name (the
tests' directory is on their PYTHONPATH).
"""

from __future__ import annotations

import functools

import keras
import numpy as np

FEATURES, SAMPLES, CLASSES = 8, 512, 3
VOCAB, LENGTH = 20, 6


def binary_data(samples: int = SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features and int32 labels 0/1 of shape (N,), as IMDB's are."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.normal(size=samples) > 0).astype(np.int32)
    return x, y


def binary_build_for(config: dict):
    """A Tune trial's ``build``: ``build_binary`` at the trial's learning rate."""
    return functools.partial(build_binary, config["lr"])


def binary_replica_dataset(worker_index: int, device_index: int, batch: int = 32, replicas: int = 2):
    """A ``tf.data.Dataset`` of worker ``worker_index``'s batches (one device a worker): its part of each global
    batch of ``binary_data()``, as the arrays' plan splits them without shuffling."""
    import tensorflow as tf

    x, y = binary_data()
    steps = len(x) // (batch * replicas)
    part = lambda a: a[:steps * batch * replicas].reshape(steps, replicas, batch, *a.shape[1:])[:, worker_index]
    return tf.data.Dataset.from_tensor_slices((part(x), part(y)))  # elements: whole batches


def classes_data(samples: int = SAMPLES, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Features and sparse int labels of ``CLASSES`` classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype(np.float32)
    return x, np.abs(x[:, :CLASSES]).argmax(1).astype(np.int64)


def build_binary(lr: float = 0.1) -> keras.Model:
    """A binary classifier with plain SGD: a sigmoid output of shape (N, 1), int labels of shape (N,), a loss name,
    "accuracy" and stateful metrics."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision")])
    return model


def build_classes() -> keras.Model:
    """Three classes, sparse int labels and Adam."""
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")])
    return model


def sequence_data(samples: int = 64, seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Token ids padded with zeros (each row 2 to LENGTH tokens long) and a class per token."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(samples, LENGTH))
    lengths = rng.integers(2, LENGTH + 1, size=samples)
    x[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return x.astype(np.int32), (x % CLASSES).astype(np.int32)


def build_masked() -> keras.Model:
    """Embedding(mask_zero=True): the padding left out of the loss and of "accuracy"."""
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((LENGTH,), dtype="int32"), keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def build_two_outputs() -> keras.Model:
    """Two named outputs, a loss and a metric list per output, loss weights."""
    keras.utils.set_random_seed(10)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(12, activation="relu")(x)
    model = keras.Model(x, {"value": keras.layers.Dense(1, name="value")(h),
                            "label": keras.layers.Dense(1, activation="sigmoid", name="label")(h)})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"value": "mse", "label": "binary_crossentropy"}, loss_weights={"value": 0.5, "label": 2.0},
                  metrics={"value": ["mae"], "label": ["accuracy"]})
    return model


def two_outputs_labels(x: np.ndarray, y: np.ndarray) -> dict:
    return {"value": (x[:, 0] - x[:, 1]).astype(np.float32)[:, None], "label": y}


def build_cosine() -> keras.Model:
    """"cosine_similarity" as a metric: its sign is the metric's (+1 for the same direction), not the loss's."""
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["cosine_similarity"])
    return model


def build_scaled(kind: str) -> keras.Model:
    """A regression whose optimizer scales the loss: ``loss_scale_factor=128``, a ``LossScaleOptimizer``, or the
    "mixed_float16" policy (under which ``compile`` wraps the optimizer)."""
    keras.utils.set_random_seed(12)
    policy = "mixed_float16" if kind == "mixed_float16" else "float32"
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu", dtype=policy),
                              keras.layers.Dense(1, dtype="float32")])
    optimizer = {"loss_scale_factor": keras.optimizers.SGD(0.05, loss_scale_factor=128.0),
                 "loss_scale_optimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
                 "mixed_float16": keras.optimizers.SGD(0.05)}[kind]
    model.compile(optimizer=optimizer, loss="mse")
    return model


def build_ema() -> keras.Model:
    """Adam with ``use_ema=True``: the trained weights are the moving averages, once finalized."""
    keras.utils.set_random_seed(13)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5), loss="mse")
    return model


class OwnLoss(keras.Model):
    """A subclassed model that overrides ``compute_loss`` (an extra L1 term on its outputs)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return base + 0.1 * keras.ops.mean(keras.ops.abs(y_pred))


def build_own_loss() -> keras.Model:
    keras.utils.set_random_seed(14)
    model = OwnLoss()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model(np.zeros((1, FEATURES), np.float32))
    return model


class Reconstruct(keras.Model):
    """A model trained without labels: its own ``compute_loss`` compares the outputs with the inputs."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(FEATURES)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred - x))


WORDS = ("good", "bad", "great", "awful", "fine", "poor", "the", "a", "movie", "plot")


def text_data(samples: int = 256, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Five-word reviews as a numpy array of str, shape (N,), and int32 labels 0/1 (more kind words than unkind)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, len(WORDS), size=(samples, 5))
    x = np.array([" ".join(WORDS[w] for w in row) for row in words], dtype=object)
    y = (np.isin(words, [0, 2, 4]).sum(1) > np.isin(words, [1, 3, 5]).sum(1)).astype(np.int32)
    return x, y


def text_net() -> keras.Model:
    """Text in: a TextVectorization of a fixed vocabulary is the model's first layer, as in keras-io's end-to-end
    text classifiers; an embedding, averaged; a sigmoid out."""
    keras.utils.set_random_seed(16)
    inputs = keras.Input(shape=(), dtype="string")
    tokens = keras.layers.TextVectorization(vocabulary=list(WORDS), output_sequence_length=5)(inputs)
    features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(len(WORDS) + 2, 8)(tokens))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(features))


def build_text() -> keras.Model:
    """``text_net``, compiled: plain SGD, binary cross-entropy, accuracy and AUC."""
    model = text_net()
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")])
    return model


def build_reconstruct() -> keras.Model:
    keras.utils.set_random_seed(15)
    model = Reconstruct()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model(np.zeros((1, FEATURES), np.float32))
    return model


class OwnTrainStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def build_own_train_step() -> keras.Model:
    model = OwnTrainStep([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def build_synchronized() -> keras.Model:
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(synchronized=True, name="synced_bn")])
    model.compile(optimizer="sgd", loss="mse")
    return model


def build_uncompiled() -> keras.Model:
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])


class LabelPowerSum(keras.metrics.Metric):
    """The sum of the labels seen, each to ``power``: a stateful metric whose state sums across replicas, so an
    epoch's value says which rows it saw."""

    def __init__(self, power: int = 1, name: str = "label_sum", **kwargs):
        super().__init__(name=name, **kwargs)
        self.power = power
        self.total = self.add_variable((), initializer="zeros", aggregation="sum", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.cast(y_true, self.dtype) ** self.power))

    def result(self):
        return self.total

    def get_config(self) -> dict:
        return {**super().get_config(), "power": self.power}


def rows_data(samples: int = SAMPLES, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Features and a regression label that names the row: row i's label is i / samples."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(samples, FEATURES)).astype(np.float32), np.arange(samples, dtype=np.float32) / samples


def build_rows() -> keras.Model:
    """A linear regression with plain SGD, whose metrics sum the labels seen and their squares."""
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  metrics=[LabelPowerSum(1, "label_sum"), LabelPowerSum(2, "label_squares")])
    return model

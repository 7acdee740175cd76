"""tf_keras models and tf.data input for tests/test_keras.py, with numpy twins.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

import dsgd

IN, HIDDEN, BATCH, LR, STEPS = 3, 4, 5, 0.1, 3
BN_MOMENTUM = 0.5


def batch(worker_index: int, device_index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch replica (worker, device) sees at a given step: x (BATCH, IN), y (BATCH, 1)."""
    rng = np.random.RandomState(1000 * step + 10 * worker_index + device_index)
    return rng.randn(BATCH, IN).astype(np.float32), rng.randn(BATCH, 1).astype(np.float32)


def replica_batches(worker_index: int, device_index: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [batch(worker_index, device_index, step) for step in range(STEPS)]


def dense_net() -> tf_keras.Model:
    return tf_keras.Sequential([tf_keras.layers.Dense(HIDDEN, activation="tanh"), tf_keras.layers.Dense(1)])


def max_abs_error(y_true, y_pred):
    return tf.reduce_max(tf.abs(y_pred - y_true))


def dense_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    return dsgd.KerasModel(dense_net(), loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           metrics=["mae", max_abs_error], batches=replica_batches(worker_index, device_index))


def dense_dataset_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    """The same model and batches, read in the graph from a tf.data.Dataset."""
    xs, ys = zip(*replica_batches(worker_index, device_index))
    dataset = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys))).repeat()
    return dsgd.KerasModel(dense_net(), loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=dataset)


class TFDataRegression(dsgd.Model):
    """A plain graph model whose batches come from a one-shot tf.data iterator: no feed dict."""

    def __init__(self, worker_index: int, device_index: int):
        xs, ys = zip(*replica_batches(worker_index, device_index))
        dataset = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)[..., 0])).repeat()
        x, y = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        w = tf.compat.v1.get_variable("w", [IN])
        self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)


def bn_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    """Dense, BatchNormalization, Dense; dict batches read through features/label."""
    net = tf_keras.Sequential([tf_keras.layers.Dense(HIDDEN), tf_keras.layers.BatchNormalization(momentum=BN_MOMENTUM),
                               tf_keras.layers.Dense(1)])
    batches = [{"x": x, "y": y, "unused": np.zeros(len(x))} for x, y in replica_batches(worker_index, device_index)]
    return dsgd.KerasModel(net, loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=batches, features="x", label="y")


def keras3_creator(worker_index: int, device_index: int) -> dsgd.KerasModel:
    import keras  # Keras 3, the package tensorflow depends on

    net = keras.Sequential([keras.layers.Dense(1)])
    return dsgd.KerasModel(net, loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(LR),
                           batches=replica_batches(worker_index, device_index))


# ---- numpy twins -------------------------------------------------------------

DENSE = {"w1": "sequential/dense/kernel", "b1": "sequential/dense/bias",
         "w2": "sequential/dense_1/kernel", "b2": "sequential/dense_1/bias"}


def dense_forward(weights: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.tanh(x @ weights[DENSE["w1"]] + weights[DENSE["b1"]])
    return h, h @ weights[DENSE["w2"]] + weights[DENSE["b2"]]


def dense_gradients(weights: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """Gradients of mean((pred - y)^2)."""
    h, pred = dense_forward(weights, x)
    dpred = 2 * (pred - y) / pred.size
    dh = dpred @ weights[DENSE["w2"]].T * (1 - h ** 2)
    return {DENSE["w1"]: x.T @ dh, DENSE["b1"]: dh.sum(0), DENSE["w2"]: h.T @ dpred, DENSE["b2"]: dpred.sum(0)}


def dense_sgd_step(weights: dict, replicas: list[tuple[int, int]], step: int) -> dict:
    """One plain SGD step on the union of the replicas' batches (float64)."""
    x = np.concatenate([batch(w, d, step)[0] for w, d in replicas]).astype(np.float64)
    y = np.concatenate([batch(w, d, step)[1] for w, d in replicas]).astype(np.float64)
    grads = dense_gradients(weights, x, y)
    return {k: weights[k] - LR * grads[k] for k in weights}


# ---- models as users write them (tests/test_keras_models.py) -----------------
#
# Each kind: a builder of a fresh tf_keras model, the batch a replica sees at a
# step (x and y structured as the model's inputs and outputs) and the loss.
# Kinds without batch norm or dropout are checked against eager_reference.

REG = 0.01  # regularization factor of the regularized kind
IMAGE = 32  # application models' input size


class Subclassed(tf_keras.Model):
    """A subclassed model: layers as attributes, computation in call."""

    def __init__(self):
        super().__init__()
        self.hidden = tf_keras.layers.Dense(HIDDEN, activation="tanh")
        self.out = tf_keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.out(self.hidden(x))


class ReadsOutsidePlaceholder(tf_keras.Model):
    """A model whose call uses a placeholder made outside it, which dsgd never feeds."""

    def __init__(self):
        super().__init__()
        self.dense = tf_keras.layers.Dense(1)
        self.scale = tf.compat.v1.placeholder(tf.float32, [], name="scale")

    def call(self, x, training=None):
        return self.dense(x) * self.scale


def _functional(hidden) -> tf_keras.Model:
    x = tf_keras.Input((IN,))
    return tf_keras.Model(x, tf_keras.layers.Dense(1)(hidden(x)))


def _application(name: str) -> tf_keras.Model:
    kwargs = dict(weights=None, input_shape=(IMAGE, IMAGE, 3), classes=10)
    if name == "MobileNetV2":  # nested: the application inside a Sequential, with a head
        base = tf_keras.applications.MobileNetV2(alpha=0.35, include_top=False, **kwargs)
        return tf_keras.Sequential([base, tf_keras.layers.GlobalAveragePooling2D(), tf_keras.layers.Dense(10)])
    if name == "MobileNet":
        return tf_keras.applications.MobileNet(alpha=0.25, classifier_activation=None, **kwargs)
    if name == "MobileNetV3Small":
        return tf_keras.applications.MobileNetV3Small(alpha=0.75, minimalistic=True, classifier_activation=None,
                                                      **kwargs)
    raise ValueError(name)


BUILDERS = {
    "sequential_input_shape": lambda: tf_keras.Sequential([
        tf_keras.layers.Dense(HIDDEN, activation="tanh", input_shape=(IN,)), tf_keras.layers.Dense(1)]),
    "sequential_input_layer_bn": lambda: tf_keras.Sequential([
        tf_keras.layers.InputLayer((IN,)), tf_keras.layers.Dense(HIDDEN), tf_keras.layers.BatchNormalization(),
        tf_keras.layers.Dense(1)]),
    "functional": lambda: _functional(tf_keras.layers.Dense(HIDDEN, activation="tanh")),
    "functional_bn_dropout": lambda: _functional(lambda x: tf_keras.layers.Dropout(0.5)(
        tf_keras.layers.BatchNormalization()(tf_keras.layers.Dense(HIDDEN)(x)))),
    "subclassed": Subclassed,
    "regularized": lambda: _functional(tf_keras.layers.Dense(
        HIDDEN, activation="tanh", kernel_regularizer=tf_keras.regularizers.L2(REG),
        bias_regularizer=tf_keras.regularizers.L1(REG), activity_regularizer=tf_keras.regularizers.L1(REG))),
    "two_inputs": lambda: _two_inputs(),
    "two_outputs": lambda: _two_outputs(),
    "MobileNetV2": lambda: _application("MobileNetV2"),
    "MobileNet": lambda: _application("MobileNet"),
    "MobileNetV3Small": lambda: _application("MobileNetV3Small"),
}
APPLICATIONS = ("MobileNetV2", "MobileNet", "MobileNetV3Small")
# Kinds with no batch norm or dropout: their training equals the eager reference.
DETERMINISTIC = ("sequential_input_shape", "functional", "subclassed", "regularized", "two_inputs", "two_outputs")


def _two_inputs() -> tf_keras.Model:
    a, b = tf_keras.Input((IN,), name="a"), tf_keras.Input((2,), name="b")
    h = tf_keras.layers.Dense(HIDDEN, activation="tanh")(tf_keras.layers.Concatenate()([a, b]))
    return tf_keras.Model([a, b], tf_keras.layers.Dense(1)(h))


def _two_outputs() -> tf_keras.Model:
    x = tf_keras.Input((IN,))
    h = tf_keras.layers.Dense(HIDDEN, activation="tanh")(x)
    return tf_keras.Model(x, {"value": tf_keras.layers.Dense(1)(h), "pair": tf_keras.layers.Dense(2)(h)})


def kind_batch(kind: str, worker_index: int, device_index: int, step: int):
    """The (x, y) replica (worker, device) of ``kind`` sees at ``step``, structured for the model."""
    rng = np.random.RandomState(1000 * step + 10 * worker_index + device_index + 7)
    if kind in APPLICATIONS:
        return rng.rand(BATCH, IMAGE, IMAGE, 3).astype(np.float32), rng.randint(0, 10, BATCH)
    x, y = rng.randn(BATCH, IN).astype(np.float32), rng.randn(BATCH, 1).astype(np.float32)
    if kind == "two_inputs":
        return [x, rng.randn(BATCH, 2).astype(np.float32)], y
    if kind == "two_outputs":
        return x, {"value": y, "pair": rng.randn(BATCH, 2).astype(np.float32)}
    return x, y


def kind_loss(kind: str):
    if kind in APPLICATIONS:
        return tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return "mse"


def kind_creator(kind: str, worker_index: int, device_index: int, adam: bool = False) -> dsgd.KerasModel:
    """model_creator body for ``functools.partial(kind_creator, kind)``; plain SGD, or Adam (optimizer state)."""
    batches = [kind_batch(kind, worker_index, device_index, step) for step in range(STEPS)]
    optimizer = tf.compat.v1.train.AdamOptimizer(LR) if adam else tf.compat.v1.train.GradientDescentOptimizer(LR)
    return dsgd.KerasModel(BUILDERS[kind](), loss=kind_loss(kind), optimizer=optimizer, batches=batches)


def graph_variable_names(kind: str) -> list[str]:
    """The model's variable names as dsgd reports them, in the model's own variable order."""
    with tf.Graph().as_default():
        tf_keras.backend.reset_uids()
        model = kind_creator(kind, 0, 0).model
        names = [v.name.split(":")[0] for v in model.variables]
        tf_keras.backend.reset_uids()
    return names


def eager_reference(kind: str, start: dict, replicas: list[tuple[int, int]], steps: int) -> tuple[dict, float]:
    """Weights after ``steps`` plain SGD steps applying the mean of the replicas' gradients, computed
    eagerly with tf.GradientTape (float32), and the mean loss over the replicas before the first step."""
    names = graph_variable_names(kind)
    model = BUILDERS[kind]()
    model(kind_batch(kind, 0, 0, 0)[0])  # builds it
    assert len(model.variables) == len(names)
    for variable, name in zip(model.variables, names):
        variable.assign(start[name])
    loss_fn = tf_keras.losses.get(kind_loss(kind)) if isinstance(kind_loss(kind), str) else kind_loss(kind)
    first_loss = None
    for step in range(steps):
        grads, losses = [], []
        for w, d in replicas:
            x, y = kind_batch(kind, w, d, step % STEPS)
            with tf.GradientTape() as tape:
                outputs = model(x, training=True)
                loss = tf.add_n([tf.reduce_mean(loss_fn(t, o)) for t, o in
                                 zip(tf.nest.flatten(y), tf.nest.flatten(outputs))] + model.losses)
            grads.append(tape.gradient(loss, model.trainable_variables))
            losses.append(float(loss))
        for i, variable in enumerate(model.trainable_variables):
            variable.assign_sub(LR * tf.add_n([g[i] for g in grads]) / len(grads))
        first_loss = np.mean(losses) if first_loss is None else first_loss
    return {name: v.numpy() for name, v in zip(names, model.variables)}, first_loss

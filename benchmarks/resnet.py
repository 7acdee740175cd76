"""ResNet v1 with bottleneck blocks, built from raw TensorFlow ops.

One graph-building function, `resnet_v1`, serves every benchmarked system.
It never creates variables itself: it asks a *variable getter* for them, so
the same code runs in tf.compat.v1 graph mode (`v1_get_variable`, used by the
single-process baseline and by dsgd's TF1 way) and in TF2 style (a store of
`tf.Variable`s, `benchmarks.peers.VariableStore`, used by the Ray Train peer
and by dsgd's TF2 way).

Layout is NHWC (the fast layout on CPU). Batch norm uses
`tf.compat.v1.nn.fused_batch_norm`. In training mode each batch-norm layer
creates two ops that move its non-trainable `moving_mean`/`moving_variance`
towards the batch statistics and adds them to the `UPDATE_OPS` collection:
- graph mode: whoever builds the train op runs them (the baseline wraps its
  train op in `tf.control_dependencies(UPDATE_OPS)`; dsgd collects each
  replica's `UPDATE_OPS` itself and averages the moving statistics);
- inside a `tf.function`: automatic control dependencies run every stateful
  op, so the updates run with the step without further wiring.

This is the original v1 unit (the stride sits on the first 1x1 convolution)
with "SAME" padding everywhere and no weight decay: a throughput benchmark,
not a recipe for accuracy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import tensorflow as tf

if TYPE_CHECKING:
    import keras

BLOCKS_PER_STAGE = {
    "resnet50": (3, 4, 6, 3),
    "resnet101": (3, 4, 23, 3),
    "resnet152": (3, 8, 36, 3),
}
NUM_CLASSES = 1000
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5
LEARNING_RATE = 0.1
MOMENTUM = 0.9

Initializer = Callable[..., tf.Tensor]
_CONV_INIT = tf.compat.v1.variance_scaling_initializer(scale=2.0, distribution="truncated_normal")
_FC_INIT = tf.compat.v1.variance_scaling_initializer(scale=1.0, distribution="truncated_normal")
_ZEROS = tf.compat.v1.zeros_initializer()
_ONES = tf.compat.v1.ones_initializer()


class VariableGetter(Protocol):
    """Returns the float32 variable `name`, creating it on first use."""

    def __call__(self, name: str, shape: list[int], initializer: Initializer,
                 trainable: bool) -> tf.Variable: ...


def v1_get_variable(name: str, shape: list[int], initializer: Initializer,
                    trainable: bool) -> tf.Variable:
    """Variable getter for tf.compat.v1 graph mode (honours variable scopes)."""
    return tf.compat.v1.get_variable(name, shape, tf.float32, initializer=initializer,
                                     trainable=trainable)


def _conv(x: tf.Tensor, get_variable: VariableGetter, name: str, filters: int,
          kernel: int, stride: int) -> tf.Tensor:
    weights = get_variable(f"{name}/weights", [kernel, kernel, x.shape[-1], filters],
                           _CONV_INIT, True)
    return tf.nn.conv2d(x, weights, strides=stride, padding="SAME", data_format="NHWC")


def _batch_norm(x: tf.Tensor, get_variable: VariableGetter, name: str, training: bool,
                relu: bool) -> tf.Tensor:
    channels = [x.shape[-1]]
    gamma = get_variable(f"{name}/gamma", channels, _ONES, True)
    beta = get_variable(f"{name}/beta", channels, _ZEROS, True)
    moving_mean = get_variable(f"{name}/moving_mean", channels, _ZEROS, False)
    moving_var = get_variable(f"{name}/moving_variance", channels, _ONES, False)
    if training:
        y, batch_mean, batch_var = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, epsilon=BN_EPSILON, data_format="NHWC", is_training=True)
        for moving, batch in ((moving_mean, batch_mean), (moving_var, batch_var)):
            update = moving.assign_sub((moving - batch) * (1.0 - BN_MOMENTUM))
            tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
    else:
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            x, gamma, beta, moving_mean, moving_var, epsilon=BN_EPSILON,
            data_format="NHWC", is_training=False)
    return tf.nn.relu(y) if relu else y


def _bottleneck(x: tf.Tensor, get_variable: VariableGetter, name: str, width: int,
                stride: int, training: bool) -> tf.Tensor:
    out_channels = 4 * width
    shortcut = x
    if stride != 1 or x.shape[-1] != out_channels:
        shortcut = _conv(x, get_variable, f"{name}/shortcut", out_channels, 1, stride)
        shortcut = _batch_norm(shortcut, get_variable, f"{name}/shortcut_bn", training, relu=False)
    y = _conv(x, get_variable, f"{name}/conv1", width, 1, stride)
    y = _batch_norm(y, get_variable, f"{name}/bn1", training, relu=True)
    y = _conv(y, get_variable, f"{name}/conv2", width, 3, 1)
    y = _batch_norm(y, get_variable, f"{name}/bn2", training, relu=True)
    y = _conv(y, get_variable, f"{name}/conv3", out_channels, 1, 1)
    y = _batch_norm(y, get_variable, f"{name}/bn3", training, relu=False)
    return tf.nn.relu(y + shortcut)


def resnet_v1(images: tf.Tensor, model: str, get_variable: VariableGetter,
              training: bool = True) -> tf.Tensor:
    """Logits [batch, NUM_CLASSES] of ResNet v1 `model` for NHWC float images."""
    if model not in BLOCKS_PER_STAGE:
        raise ValueError(f"model must be one of {sorted(BLOCKS_PER_STAGE)}, got {model!r}")
    x = _conv(images, get_variable, "conv1", 64, 7, 2)
    x = _batch_norm(x, get_variable, "bn1", training, relu=True)
    x = tf.nn.max_pool2d(x, ksize=3, strides=2, padding="SAME", data_format="NHWC")
    for stage, (units, width) in enumerate(zip(BLOCKS_PER_STAGE[model], (64, 128, 256, 512)), 1):
        for unit in range(1, units + 1):
            stride = 2 if unit == 1 and stage > 1 else 1
            x = _bottleneck(x, get_variable, f"stage{stage}/unit{unit}", width, stride, training)
    x = tf.reduce_mean(x, axis=[1, 2])
    weights = get_variable("fc/weights", [x.shape[-1], NUM_CLASSES], _FC_INIT, True)
    bias = get_variable("fc/bias", [NUM_CLASSES], _ZEROS, True)
    return tf.matmul(x, weights) + bias


def synthetic_imagenet(batch_size: int, image_size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """A fresh random batch made in the graph: NHWC images in [0, 1), labels in [0, 1000)."""
    images = tf.random.uniform([batch_size, image_size, image_size, 3], dtype=tf.float32)
    labels = tf.random.uniform([batch_size], 0, NUM_CLASSES, dtype=tf.int32)
    return images, labels


def loss_and_accuracy(logits: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean softmax cross-entropy and top-1 accuracy."""
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    hits = tf.equal(tf.argmax(logits, axis=1, output_type=tf.int32), labels)
    return loss, tf.reduce_mean(tf.cast(hits, tf.float32))


def make_optimizer() -> tf.compat.v1.train.Optimizer:
    """Momentum SGD, learning rate 0.1, as in every benchmarked system."""
    return tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)


def make_keras_optimizer() -> keras.optimizers.SGD:
    """``make_optimizer``'s momentum SGD as a Keras 3 optimizer, for the TF2 way: the same learning rate and
    momentum, the same update while the learning rate stays constant."""
    import keras  # only where a TF2 model is built

    return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)


def build_v1_replica(model: str, batch_size: int, image_size: int,
                     get_variable: VariableGetter = v1_get_variable) -> tuple[tf.Tensor, tf.Tensor]:
    """A training replica: synthetic batch -> ResNet -> (loss, accuracy), its variables from ``get_variable``
    (default: graph mode's, in the current scopes)."""
    images, labels = synthetic_imagenet(batch_size, image_size)
    logits = resnet_v1(images, model, get_variable, training=True)
    return loss_and_accuracy(logits, labels)

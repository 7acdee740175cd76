"""Keras 3's SGD and Adam updates through TensorFlow's fused kernels compute what Keras's own ops compute."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest
import tensorflow as tf

from dsgd.worker.tf2.fused_updates import fuse_updates

SHAPES = [(3, 5), (5,), (2, 2, 4)]
STEPS = 4


def gradients(step: int) -> list[tf.Tensor]:
    rng = np.random.default_rng(step)
    return [tf.constant(rng.normal(size=s), tf.float32) for s in SHAPES]


def trained(make_optimizer, fused: bool, traced: bool) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """The variables and optimizer variables after ``STEPS`` applies, and whether the kernels were used."""
    rng = np.random.default_rng(100)
    variables = [tf.Variable(rng.normal(size=s).astype(np.float32)) for s in SHAPES]
    optimizer = make_optimizer()
    optimizer.build(variables)
    used = fuse_updates(optimizer) if fused else False
    apply = (tf.function(optimizer.apply, autograph=False) if traced else optimizer.apply)
    for step in range(STEPS):
        apply(gradients(step), variables)
    return [v.numpy() for v in variables], [v.numpy() for v in optimizer.variables], used


SGD_KINDS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "sgd-clipnorm-weight-decay": lambda: keras.optimizers.SGD(0.1, momentum=0.5, clipnorm=0.5, weight_decay=0.01),
    "sgd-schedule": lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)),
}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", list(SGD_KINDS))
def test_sgd_kernels_give_kerass_bits(kind, traced):
    expected, expected_slots, _ = trained(SGD_KINDS[kind], fused=False, traced=traced)
    got, got_slots, used = trained(SGD_KINDS[kind], fused=True, traced=traced)
    assert used
    for g, e in zip(got + got_slots, expected + expected_slots):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_adam_kernel_agrees_with_keras_to_the_rounding_of_one_minus_beta(traced):
    make = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    expected, expected_slots, _ = trained(make, fused=False, traced=traced)
    got, got_slots, used = trained(make, fused=True, traced=traced)
    assert used
    for g, e in zip(got + got_slots, expected + expected_slots):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert expected_slots[0] == got_slots[0] == STEPS  # the iteration count stays Keras's


class MySGD(keras.optimizers.SGD):
    def update_step(self, gradient, variable, learning_rate):
        self.assign_sub(variable, gradient * learning_rate * 2.0)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adam(0.01, amsgrad=True), lambda: MySGD(0.1),
                                  lambda: keras.optimizers.RMSprop(0.01)], ids=["amsgrad", "subclass", "rmsprop"])
def test_other_optimizers_keep_their_own_update(make):
    expected, _, _ = trained(make, fused=False, traced=False)
    got, _, used = trained(make, fused=True, traced=False)
    assert not used
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_sparse_gradients_take_kerass_update():
    variable = tf.Variable(np.ones((4, 2), np.float32))
    optimizer = keras.optimizers.SGD(0.5, momentum=0.9)
    optimizer.build([variable])
    assert fuse_updates(optimizer)
    optimizer.apply([tf.IndexedSlices(tf.ones((1, 2)), tf.constant([2]), tf.constant([4, 2]))], [variable])
    np.testing.assert_array_equal(variable.numpy(), [[1, 1], [1, 1], [0.5, 0.5], [1, 1]])

"""Train a tf_keras (Keras 2) convnet on handwritten digits with dsgd, reading a Ray Dataset.

    python examples/mnist_tf_keras.py

examples/mnist_keras.py with a ``tf_keras`` network and a ``tf.compat.v1``
optimizer, which dsgd trains the TF1 graph way; the data, flags and loop
are that example's. Needs ``pip install 'dsgd[keras,data,examples]'``.
"""

from __future__ import annotations

import argparse

import numpy as np

import dsgd  # before tensorflow: dsgd keeps TensorFlow's start-up lines out of the output
import tensorflow as tf
import mnist_keras  # examples/mnist_keras.py, next to this file: its data, flags and training loop


def make_model_creator(args: argparse.Namespace, image_shape: tuple[int, ...],
                       train: dict[str, np.ndarray] | None = None):
    """model_creator for DistributedSGD: one tf_keras convnet per replica, fed from its split of "train".

    The convnet is written as Keras code usually is: an input shape, batch
    normalization and dropout (both in training mode during steps; see
    ``test_accuracy`` for inference). With ``train`` (arrays; ``--input
    numpy``) each replica is fed its slice of them instead, from a list of
    batches: the feed_dict baseline.
    """
    def create(worker_index: int, device_index: int) -> dsgd.KerasModel:
        import tf_keras

        layers = tf_keras.layers
        net = tf_keras.Sequential([
            layers.InputLayer(image_shape),
            layers.Conv2D(32, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
            layers.Conv2D(64, 3, strides=2, padding="same", use_bias=False), layers.BatchNormalization(),
            layers.ReLU(),
            layers.Flatten(),
            layers.Dropout(0.25),
            layers.Dense(10),
        ])
        return dsgd.KerasModel(
            net, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=tf.compat.v1.train.AdamOptimizer(args.lr), metrics=["accuracy"],
            batches=mnist_keras.replica_batches(args, worker_index, device_index, train), features="image", label="label")
    return create



if __name__ == "__main__":
    mnist_keras.main(model_creator=make_model_creator)

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
    """model_creator for DistributedSGD: examples/mnist_keras.py's convnet in tf_keras per replica, fed from its
    split of "train" (or, with ``train``, its slice of those arrays: the feed_dict baseline)."""
    def create(worker_index: int, device_index: int) -> dsgd.KerasModel:
        import tf_keras

        return dsgd.KerasModel(
            mnist_keras.convnet(tf_keras, image_shape),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=tf.compat.v1.train.AdamOptimizer(args.lr), metrics=["accuracy"],
            batches=mnist_keras.replica_batches(args, worker_index, device_index, train),
            features="image", label="label")
    return create

if __name__ == "__main__":
    mnist_keras.main(model_creator=make_model_creator)

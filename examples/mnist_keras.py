"""Train a Keras convnet on handwritten digits with dsgd, reading a Ray Dataset.

    python examples/mnist_keras.py                  # 2 workers, "ps", local Ray
    python examples/mnist_keras.py --address auto   # on a running Ray cluster

The model is a Keras 3 network (``import keras``: the Keras TensorFlow
ships as ``tf.keras``) wrapped in ``dsgd.KerasModel``, with a Keras
optimizer; dsgd trains it the TF2 way (examples/mnist_tf_keras.py is the
same with tf_keras, the TF1 graph way). The
training images are a ``ray.data.Dataset`` passed as
``DistributedSGD(datasets={"train": ...})``, which every replica reads its
own equal part of through ``dsgd.get_dataset_shard("train")``. Same data as
examples/mnist.py (its loader): MNIST if it is on this machine, else the
8x8 digits set that scikit-learn ships. Needs ``pip install 'dsgd[data,examples]'``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray
import ray.data

import dsgd  # before tensorflow: dsgd keeps TensorFlow's start-up lines out of the output
import mnist  # examples/mnist.py, next to this file: its data, flags and training loop


def make_model_creator(args: argparse.Namespace, image_shape: tuple[int, ...],
                       train: dict[str, np.ndarray] | None = None):
    """model_creator for DistributedSGD: one Keras 3 convnet per replica, fed from its split of "train".

    The convnet is written as Keras code usually is: an input shape, batch
    normalization and dropout (both in training mode during steps; see
    ``test_accuracy`` for inference). With ``train`` (arrays; ``--input
    numpy``) each replica is fed its slice of them instead, from a list of
    batches.
    """
    def create(worker_index: int, device_index: int) -> dsgd.KerasModel:
        import keras

        return dsgd.KerasModel(
            convnet(keras, image_shape), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(args.lr), metrics=["accuracy"],
            batches=replica_batches(args, worker_index, device_index, train), features="image", label="label")
    return create


def convnet(keras_module, image_shape: tuple[int, ...]):
    """The convnet, in ``keras_module``: Keras 3 (``keras``) or Keras 2 (``tf_keras``)."""
    layers = keras_module.layers
    return keras_module.Sequential([
        keras_module.Input(image_shape),
        layers.Conv2D(32, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(64, 3, strides=2, padding="same", use_bias=False), layers.BatchNormalization(),
        layers.ReLU(),
        layers.Flatten(),
        layers.Dropout(0.25),
        layers.Dense(10),
    ])


def replica_batches(args: argparse.Namespace, worker_index: int, device_index: int,
                    train: dict[str, np.ndarray] | None):
    """This replica's batches: its split of the "train" Ray Dataset, or (with ``train``) its slice of the
    arrays, as a list of batches."""
    if train is None:
        return dsgd.get_dataset_shard("train").iter_batches(
            batch_size=args.batch_size, batch_format="numpy", drop_last=True)
    replica = worker_index * args.devices_per_worker + device_index
    replicas = args.num_workers * args.devices_per_worker
    x, y = train["image"][replica::replicas], train["label"][replica::replicas]
    return [{"image": x[i:i + args.batch_size], "label": y[i:i + args.batch_size]}
            for i in range(0, len(y) - args.batch_size + 1, args.batch_size)]


def test_accuracy(model: dsgd.KerasModel, images: np.ndarray, labels: np.ndarray) -> float:
    """Accuracy of one replica on the test set, in inference mode (batch norm's moving statistics, no dropout).

    Runs on the replica's worker, through ``sgd.for_model``.
    """
    logits = model.predict(images, batch_size=1000)
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = mnist.common_parser(__doc__)
    p.add_argument("--input", choices=["ray-data", "numpy"], default="ray-data",
                   help="ray-data: a Ray Dataset split by dsgd (default); numpy: each replica fed its slice "
                        "of arrays shipped with the model creator (the feed_dict baseline)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, model_creator=make_model_creator) -> float:
    """Train and test; ``model_creator(args, image_shape, train=None)`` makes the replicas' model_creator."""
    args = parse_args(argv)
    # RAY_DATA_LOG_LEVEL: Ray Data's per-epoch "execution finished" lines stay in its log files.
    data = mnist.start(args, runtime_env={"env_vars": {"RAY_DATA_LOG_LEVEL": "WARNING"}})
    context = ray.data.DataContext.get_current()  # copied into the dataset: set before making it
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    # The training set as a Ray Dataset of {"image", "label"} rows, in the object store;
    # shuffled once here (streaming_split deals blocks, so each replica gets a mix of digits).
    order = np.random.RandomState(0).permutation(len(data["y_train"]))
    image_shape = data["x_train"].shape[1:]
    if args.input == "ray-data":
        train = ray.data.from_items([{"image": x, "label": y}
                                     for x, y in zip(data["x_train"][order], data["y_train"][order])])
        create, datasets = model_creator(args, image_shape), {"train": train}
    else:
        arrays = {"image": data["x_train"][order], "label": data["y_train"][order]}
        create, datasets = model_creator(args, image_shape, arrays), None
    start = time.perf_counter()
    with dsgd.DistributedSGD(create, num_workers=args.num_workers,
                             devices_per_worker=args.devices_per_worker, strategy=args.strategy,
                             batch_size=args.batch_size, datasets=datasets) as sgd:
        print(f"built {args.num_workers} x {args.devices_per_worker} replicas ({args.strategy}) "
              f"in {time.perf_counter() - start:.1f}s")
        train_s = mnist.train(sgd, args)
        epochs = sgd.for_model(lambda model: model.epoch)
        x_test, y_test = ray.put(data["x_test"]), ray.put(data["y_test"])
        accuracy = sgd.for_model(lambda model: test_accuracy(model, ray.get(x_test), ray.get(y_test)))
    samples = args.steps * args.batch_size * args.num_workers * args.devices_per_worker
    print(f"test accuracy {accuracy:.4f} after {args.steps} steps ({epochs} epochs, input {args.input}); "
          f"training {train_s:.1f}s ({samples / train_s:.0f} samples/s), "
          f"total {time.perf_counter() - start:.1f}s")
    return accuracy


if __name__ == "__main__":
    main()

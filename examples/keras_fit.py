"""A Keras program as Keras users write it (compile, fit with validation and callbacks, evaluate), trained by dsgd.

    python examples/keras_fit.py                  # 2 workers, "ps", local Ray
    python examples/keras_fit.py --address auto   # on a running Ray cluster

The program is plain Keras 3: ``build()`` makes and compiles the model,
``fit`` takes validation data and three of Keras's callbacks (early
stopping on the validation AUC with the best weights restored, a checkpoint
of the best model, the learning rate halved on a plateau), ``evaluate``
reports the test set. The one change from a one-process program is
``dsgd.KerasTrainer(build, ...)`` in place of ``build()``: ``batch_size`` is
the global batch, split over every replica of every worker. The data are
examples/mnist.py's digits (MNIST if on this machine, else the 8x8 digits
scikit-learn ships). Needs ``pip install 'dsgd[examples]'``.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time

import ray

import dsgd  # before tensorflow: dsgd keeps TensorFlow's start-up lines out of the output
import mnist  # examples/mnist.py, next to this file: its data


def build(image_shape: tuple[int, ...]):
    """The convnet, compiled: called once on the driver and once for every replica."""
    import keras

    model = keras.Sequential([
        keras.Input(image_shape),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")])
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--strategy", choices=["ps", "simple"], default="ps")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch")
    p.add_argument("--verbose", type=int, default=1, help="Keras's: 1 a progress bar, 2 a line an epoch, 0 none")
    p.add_argument("--data-dir", default=None, help="folder with mnist.npz or the IDX files")
    p.add_argument("--address", default=None, help="Ray cluster address; default: start a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the local Ray instance")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, data = mnist.load_digits(args.data_dir)
    print(f"data: {name}, {len(data['y_train'])} train / {len(data['y_test'])} test images")
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(address="local", num_cpus=args.num_cpus or max(4, args.num_workers), include_dashboard=False)
    import keras

    best = os.path.join(tempfile.mkdtemp(prefix="keras_fit_"), "best.keras")
    start = time.perf_counter()
    with dsgd.KerasTrainer(functools.partial(build, data["x_train"].shape[1:]), num_workers=args.num_workers, strategy=args.strategy) as trainer:
        history = trainer.fit(
            data["x_train"], data["y_train"], batch_size=args.batch_size, epochs=args.epochs,
            validation_split=0.1, verbose=args.verbose,
            callbacks=[keras.callbacks.EarlyStopping(monitor="val_accuracy", mode="max", patience=3,
                                                     restore_best_weights=True),
                       keras.callbacks.ModelCheckpoint(best, monitor="val_accuracy", mode="max",
                                                       save_best_only=True),
                       keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1)])
        results = trainer.evaluate(data["x_test"], data["y_test"], verbose=0, return_dict=True)
    print(f"{len(history.history['loss'])} epochs in {time.perf_counter() - start:.1f}s; best model in {best}")
    print("test " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))
    return results


if __name__ == "__main__":
    main()

"""Keras programs on dsgd: `KerasTrainer.fit`'s cost per step against the engine's own `step()` loop.

One `dsgd.KerasTrainer` per model shape (`--models`), at the engine's
defaults (`--num-workers` workers, "ps"), trained on synthetic arrays.
Two systems share that one engine (same processes, allocator, threads and
warm-up), interleaved in rounds, each system first in turn:

  fit    `trainer.fit(x, y, batch_size=B, epochs=E, shuffle=False,
         verbose=0)`: `--epochs` epochs of `--steps` steps, with what `fit`
         adds (the data put in the object store, Keras's callback list and
         History, the first epoch's start on every worker, at every epoch's
         end one call on the workers for the metrics' state and the weights,
         which are copied to the driver's model);
  steps  `trainer.engine.step()` E x `--steps` times, the last with
         `fetch_stats=True` (a step loop's usual wait for its result),
         reading the same rows (the trainer's feeds follow the step count);
  fit-dataset  `fit` on the same rows as a `tf.data.Dataset` of global
         batches made on the driver: each epoch read there by Keras's
         iterator and put in the object store as it begins;
  fit-one-epoch  `fit` of one epoch of E x `--steps` steps over the rows
         repeated E times: the same steps on the same rows as `fit`,
         with one epoch's end instead of E;
  fit-checkpoint  `fit` with `keras.callbacks.ModelCheckpoint` at its
         defaults (the model saved at every epoch's end, into a temporary
         directory): what the most common callback costs.

Reported per model: the median per-step time of each over the measured
rounds (`--warmup` rounds first, not counted), fit's over the loop's
(target <= 1.05), fit-dataset's over fit's (what reading the epochs on
the driver costs), what one epoch's end costs: (fit - fit-one-epoch)
over the E - 1 epoch ends fit has more, and fit-checkpoint's over fit's. Writes benchmarks/results/keras_fit.json. From the
repository root:

    .venv/bin/python -m benchmarks.keras_fit
    .venv/bin/python -m benchmarks.keras_fit --models mlp --rounds 3 --steps 20 --epochs 1
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/keras_fit.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

MODELS = ("mlp", "cnn")
FEATURES, IMAGE_SIZE, CLASSES = 64, 16, 10


def build(name: str) -> Any:
    """A compiled Keras 3 model: a small MLP (a step's fixed costs dominate) or a small CNN (compute does)."""
    import keras

    if name == "mlp":
        layers = [keras.Input((FEATURES,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(CLASSES)]
    else:
        layers = [keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                  keras.layers.Conv2D(64, 3, strides=2, activation="relu"), keras.layers.Flatten(),
                  keras.layers.Dense(CLASSES)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")])
    return model


def data(name: str, samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (FEATURES,) if name == "mlp" else (IMAGE_SIZE, IMAGE_SIZE, 3)
    return rng.normal(size=(samples, *shape)).astype(np.float32), rng.integers(0, CLASSES, samples)


def batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> Any:
    """The rows as a Keras user's ``tf.data`` pipeline gives them: a dataset of global batches."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def per_step(fn: Any, steps: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch")
    p.add_argument("--steps", type=int, default=30, help="steps an epoch")
    p.add_argument("--epochs", type=int, default=3, help="epochs a round, each system")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="rounds first, not counted")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "keras_fit.json")
    common.add_ray_flags(p, default_cpus="4")
    args = p.parse_args(argv)
    common.connect_ray(args, default_cpus=4)
    import keras

    import dsgd

    record: dict[str, Any] = {"command": common.command_line("benchmarks.keras_fit", argv),
                              "machine": common.machine(), "models": {}}
    for name in args.models:
        x, y = data(name, args.steps * args.batch_size)
        x_all, y_all = np.concatenate([x] * args.epochs), np.concatenate([y] * args.epochs)
        with dsgd.KerasTrainer(functools.partial(build, name), num_workers=args.num_workers) as trainer, \
                tempfile.TemporaryDirectory(prefix="keras-fit-") as scratch:
            trainer.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0)  # builds, traces

            steps = args.epochs * args.steps

            def loop() -> None:
                for _ in range(steps - 1):
                    trainer.engine.step()
                trainer.engine.step(fetch_stats=True)

            systems = {"fit": lambda: per_step(lambda: trainer.fit(x, y, batch_size=args.batch_size,
                                                                    epochs=args.epochs, shuffle=False, verbose=0),
                                               steps),
                       "steps": lambda: per_step(loop, steps),
                       "fit-dataset": lambda: per_step(lambda: trainer.fit(batches(x, y, args.batch_size),
                                                                            epochs=args.epochs, verbose=0), steps),
                       "fit-one-epoch": lambda: per_step(lambda: trainer.fit(x_all, y_all, batch_size=args.batch_size,
                                                                              epochs=1, shuffle=False, verbose=0),
                                                         steps),
                       "fit-checkpoint": lambda: per_step(lambda: trainer.fit(
                           x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0,
                           callbacks=[keras.callbacks.ModelCheckpoint(str(Path(scratch) / "model.keras"))]), steps)}
            print(f"== {name}: {args.num_workers} workers, global batch {args.batch_size}, {args.epochs} epochs of "
                  f"{args.steps} steps a round")
            times, order, _ = common.run_rounds(systems, args.rounds, warmup=args.warmup)
        measured = {k: v[args.warmup:] for k, v in times.items()}
        medians = {k: statistics.median(v) for k, v in measured.items() if v}
        result = {"per_step_s": measured, "median_s": medians, "order": order}
        if len(medians) == len(systems):
            result["fit_over_steps"] = medians["fit"] / medians["steps"]
            result["dataset_over_fit"] = medians["fit-dataset"] / medians["fit"]
            result["epoch_end_s"] = (medians["fit"] - medians["fit-one-epoch"]) * steps / max(args.epochs - 1, 1)
            result["checkpoint_over_fit"] = medians["fit-checkpoint"] / medians["fit"]
            print(f"{name}: fit {medians['fit'] * 1000:.1f} ms/step, step() loop {medians['steps'] * 1000:.1f} "
                  f"ms/step, fit on a tf.data.Dataset {medians['fit-dataset'] * 1000:.1f} ms/step: fit / loop = "
                  f"{result['fit_over_steps']:.3f} (target <= 1.05), dataset / arrays = "
                  f"{result['dataset_over_fit']:.3f}; one epoch's end {result['epoch_end_s'] * 1000:.1f} ms; with "
                  f"a ModelCheckpoint {medians['fit-checkpoint'] * 1000:.1f} ms/step, "
                  f"{result['checkpoint_over_fit']:.2f} x fit", flush=True)
        record["models"][name] = result
    print(f"wrote {common.write_json(record, args.out)}")
    return record


if __name__ == "__main__":
    main()

"""The same Keras program three ways, 2 workers, interleaved epoch by epoch: dsgd, Ray Train, one Keras 3 process.

The program is a Keras user's: build and compile a model (Adam 1e-3, sparse
categorical cross-entropy, accuracy and top-3 accuracy, as
examples/keras_fit.py), then `model.fit(..., batch_size=B, epochs=E)` on
the digits examples/mnist.py loads (scikit-learn's 8x8 digits offline),
B the global batch. Models (`--models`):

  convnet   examples/keras_fit.py's convnet (two convolutions, dropout, a
            softmax layer) on the digits as they are;
  resnet50  `applications.ResNet50(weights=None, classes=10)` on the digits
            upsampled to `--image-size` px, three channels.

An epoch is `--steps` global batches (default: every digit once for the
convnet, 5 batches for ResNet-50: its steps take seconds on 2 cores). The
systems, each running that program:

  dsgd-fit       `dsgd.KerasTrainer(build, num_workers=N).fit(x, y, ...)`,
                 Keras 3, at the engine's defaults (for ResNet-50 its timeouts
                 raised, as benchmarks/keras3.py);
  raytrain-mwms  Ray Train's `TensorflowTrainer`, N workers, each building the
                 same model in tf_keras under `MultiWorkerMirroredStrategy` and
                 calling `model.fit` on a `tf.data` dataset of global batches
                 (`from_tensor_slices((x, y)).shuffle(n, seed=0).batch(B)`):
                 Ray Train's documented way (Keras 3 does not run under that
                 strategy);
  keras3-single  one Keras 3 process (this driver) calling `model.fit(x, y,
                 batch_size=B)`, TensorFlow's default threads (every core).

Each system first runs a fit of one step (`steps_per_epoch=1`): its
start-up, timed from nothing (processes, model, engine, the step's trace)
to that step's end. Then one fit of `--warmup` + `--rounds` epochs per
system, all kept alive and interleaved: a callback's `on_epoch_begin` waits
for the system's turn on a turnstile actor (benchmarks/peers.py's, as Ray
Train's steps wait there in peers.py), and each round the driver opens one
epoch of every system, in an order rotated every round. An epoch's time is
taken in the process that runs the fit, from `on_epoch_begin` (after the
turn opened) to `on_epoch_end` (Ray Train's: rank 0's). The same allocator
for every system (`--allocator`), `--cpus-per-worker` threads in dsgd's and
Ray Train's workers. After the rounds, dsgd's own `step()` loop runs as many
steps on the same engine (3 times, not interleaved): fit's cost per step
against it, and the step's phases from its stats.

Reported per model and system: the median seconds an epoch over the
measured rounds, samples/s, ms a step, the start-up, the losses; dsgd's
ratio over Ray Train (target >= 1.5) and over the single process. Writes
benchmarks/results/keras_peers/keras_peers.json. From the repository root:

    .venv/bin/python -m benchmarks.keras_peers
    .venv/bin/python -m benchmarks.keras_peers --models convnet --steps 4 --rounds 2
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/keras_peers.py`
    import _repo_path  # noqa: F401

import argparse
import dataclasses
import functools
import importlib
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from benchmarks import common, peers

MODELS = ("convnet", "resnet50")
SYSTEMS = ("dsgd", "raytrain", "single")
SYSTEM_NAMES = {"dsgd": "dsgd-fit", "raytrain": peers.RayTrainRun.label, "single": "keras3-single"}
TARGETS = {"dsgd/raytrain": 1.5, "dsgd/single": None}  # dsgd's samples/s over the peer's, at least
DEFAULT_BATCH = {"convnet": 64, "resnet50": 16}  # the global batch
DEFAULT_STEPS = {"convnet": None, "resnet50": 5}  # steps an epoch; None: every digit once
LEARNING_RATE, CLASSES = 1e-3, 10
# dsgd's first TF2 step traces ResNet-50 (about 40 s on 2 cores): room for a busy machine, as benchmarks/keras3.py.
ENGINE_TIMEOUTS = {"resnet50": {"startup_timeout_s": 900.0, "timeout_s": 1800.0}}
LOOP_REPEATS = 3  # dsgd's step() loop, after the rounds


@dataclasses.dataclass
class Program:
    """What every system is asked: `model` on `image_size` px digits, `steps` global batches of
    `batch_size` an epoch, `epochs` epochs after the first fit of one step."""

    model: str
    image_size: int
    batch_size: int
    steps: int
    epochs: int

    @property
    def rows(self) -> int:
        return self.steps * self.batch_size


# examples/keras_fit.py's convnet, as (layer class, arguments) for Keras 3 and tf_keras alike.
CONVNET = (("Conv2D", {"filters": 32, "kernel_size": 3, "padding": "same", "activation": "relu"}),
           ("Conv2D", {"filters": 64, "kernel_size": 3, "strides": 2, "padding": "same", "activation": "relu"}),
           ("Flatten", {}), ("Dropout", {"rate": 0.25}), ("Dense", {"units": CLASSES, "activation": "softmax"}))


def build_model(framework: str, model: str, image_shape: tuple[int, ...]) -> Any:
    """The model compiled, in `framework` ("keras": Keras 3; "tf_keras": Keras 2, which Ray Train runs)."""
    keras = importlib.import_module(framework)
    if model == "convnet":
        net = keras.Sequential([keras.Input(image_shape)]
                               + [getattr(keras.layers, layer)(**kwargs) for layer, kwargs in CONVNET])
    else:
        net = keras.applications.ResNet50(weights=None, input_shape=image_shape, classes=CLASSES)
    net.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="sparse_categorical_crossentropy",
                metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")])
    return net


def training_data(program: Program) -> tuple[np.ndarray, np.ndarray]:
    """`program.rows` digits (repeated if there are fewer), at `image_size` px with three channels for ResNet-50."""
    _, digits = common.example("mnist").load_digits(None)
    x, y = digits["x_train"], digits["y_train"]
    repeats = math.ceil(program.rows / len(x))
    x, y = np.concatenate([x] * repeats)[:program.rows], np.concatenate([y] * repeats)[:program.rows]
    if program.model == "resnet50":
        import tensorflow as tf

        size = [program.image_size] * 2
        x = np.repeat(tf.image.resize(x, size).numpy(), 3, axis=-1)
    return x, y


def turn_callback(base: type, turnstile: Any, rank: int) -> Any:
    """A Keras callback (`base`: Keras 3's or tf_keras's Callback class) by which `fit` takes one epoch a turn
    of `turnstile` (benchmarks/peers.py's): it arrives when training begins, waits for turn e at epoch e's
    begin, and finishes the turn at its end with the epoch's seconds and loss."""

    class TakeTurns(base):
        def on_train_begin(self, logs: dict | None = None) -> None:
            ray.get(turnstile.arrive.remote(), timeout=peers.TURN_WAIT_S)

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            if not ray.get(turnstile.next_turn.remote(epoch), timeout=peers.TURN_WAIT_S):
                self.model.stop_training = True  # the driver stopped: fit ends after this epoch's first step
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            seconds = time.perf_counter() - self.started
            ray.get(turnstile.finish.remote(epoch, rank, seconds, float(logs["loss"])), timeout=peers.TURN_WAIT_S)

    return TakeTurns()


def run_program(fit: Any, data: dict[str, Any], program: Program, callback: Any) -> None:
    """The Keras program of every system: a fit of one step (its start-up), then `program.epochs` epochs, one a
    turn (`callback`). `fit` is Keras's (or KerasTrainer's); `data` its x, y and batch_size, or a dataset x."""
    fit(**data, epochs=1, steps_per_epoch=1, verbose=0)
    fit(**data, epochs=program.epochs, verbose=0, callbacks=[callback])


class DriverFitRun(peers.TurnTakingRun):
    """A system whose fit runs in this driver, in a thread: `make()` returns what has the `fit`
    (a compiled Keras 3 model, or a KerasTrainer)."""

    def __init__(self, program: Program, data: tuple[np.ndarray, np.ndarray], make: Any):
        print(f"[{self.label}] starting", flush=True)
        self.program, self.fitter = program, None
        fit_data = {"x": data[0], "y": data[1], "batch_size": program.batch_size}
        super().__init__(peers.Turnstile.remote(1), functools.partial(self._program, fit_data, make))

    def _program(self, fit_data: dict[str, Any], make: Any) -> None:
        import keras

        self.fitter = make()
        run_program(self.fitter.fit, fit_data, self.program, turn_callback(keras.callbacks.Callback,
                                                                           self.turnstile, 0))

    def details(self) -> dict[str, Any]:
        return {}


class SingleFitRun(DriverFitRun):
    """One Keras 3 process: the driver's own `model.fit` on the global batch."""

    label = SYSTEM_NAMES["single"]

    def __init__(self, program: Program, data: tuple[np.ndarray, np.ndarray]):
        super().__init__(program, data, functools.partial(build_model, "keras", program.model, data[0].shape[1:]))

    def details(self) -> dict[str, Any]:
        return {"threads": "TensorFlow's default (every core)"}


class DsgdFitRun(DriverFitRun):
    """dsgd: `KerasTrainer(build, num_workers=N, **engine_kwargs).fit`, then its engine's own `step()` loop."""

    label = SYSTEM_NAMES["dsgd"]

    def __init__(self, program: Program, data: tuple[np.ndarray, np.ndarray], num_workers: int,
                 engine_kwargs: dict[str, Any]):
        import dsgd

        self.engine_kwargs = engine_kwargs
        self.loop: dict[str, Any] = {}
        build = functools.partial(build_model, "keras", program.model, data[0].shape[1:])
        super().__init__(program, data, functools.partial(dsgd.KerasTrainer, build, num_workers=num_workers,
                                                          **engine_kwargs))

    def measure_step_loop(self) -> None:
        """Once fit is done: `program.steps` steps of the engine's own `step()` loop, LOOP_REPEATS times; the
        seconds per step of each, and the last step's stats (its phases)."""
        self.thread.join(timeout=peers.RAY_TRAIN_STOP_S)
        if self.thread.is_alive() or self.fitter is None:
            return
        per_step, stats = [], {}
        for _ in range(LOOP_REPEATS):
            start = time.perf_counter()
            stats = common.burst(self.fitter.engine.step, self.program.steps)
            per_step.append((time.perf_counter() - start) / self.program.steps)
        self.loop = {"per_step_s": per_step, "median_per_step_s": statistics.median(per_step),
                     "last_step_stats": {k: v for k, v in stats.items() if k.endswith("_s")}}

    def details(self) -> dict[str, Any]:
        return {"engine_kwargs": self.engine_kwargs, "step_loop": self.loop}

    def close(self) -> None:
        super().close()
        if self.fitter is not None:
            self.fitter.shutdown()


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: the program in tf_keras under MultiWorkerMirroredStrategy, `model.fit` on a tf.data
    dataset of global batches, an epoch a turn."""
    import tensorflow as tf
    import tf_keras
    from ray import train

    peers.prepare_ray_train_worker(config)
    program = Program(**config["program"])
    x, y = config["data"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model("tf_keras", program.model, x.shape[1:])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).batch(program.batch_size)
    rank = train.get_context().get_world_rank()
    run_program(model.fit, {"x": dataset}, program, turn_callback(tf_keras.callbacks.Callback, config["turnstile"],
                                                                   rank))


class RayTrainFitRun(peers.RayTrainRun):
    """Ray Train's TensorflowTrainer running the program (`_ray_train_loop`), an epoch a turn."""

    def __init__(self, program: Program, data: tuple[np.ndarray, np.ndarray], cfg: common.BenchConfig):
        self.program = program
        super().__init__(cfg, spread=False, train_loop=_ray_train_loop,
                         loop_config={"program": dataclasses.asdict(program), "data": data})

    def details(self) -> dict[str, Any]:
        return {"replica_batch": self.replica_batch, "timed": "rank 0's epoch, inside the worker"}


def build_run(system: str, program: Program, data: tuple[np.ndarray, np.ndarray], cfg: common.BenchConfig,
              engine_kwargs: dict[str, Any]) -> peers.TurnTakingRun:
    """`system` (one of SYSTEMS) started: its first step taken, its fit waiting for its first turn."""
    if system == "single":
        return SingleFitRun(program, data)
    if system == "raytrain":
        return RayTrainFitRun(program, data, cfg)
    return DsgdFitRun(program, data, cfg.num_workers, engine_kwargs)


def system_record(run: peers.TurnTakingRun, epochs_s: list[float], warmup: int) -> dict[str, Any]:
    """A system's figures: every epoch's seconds and loss, the median measured epoch, samples/s, ms a step."""
    measured = epochs_s[warmup:]
    median = statistics.median(measured) if measured else None
    program = run.program
    return {"system": run.label, "startup_s": run.setup_s, "epoch_s": epochs_s, "losses": run.losses,
            "median_epoch_s": median,
            "samples_per_s": program.rows / median if median else None,
            "per_step_s": median / program.steps if median else None, **run.details()}


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """dsgd's samples/s over each peer's (TARGETS' keys); None where either was not measured."""
    return common.ratios_over_peers({name: r["samples_per_s"] for name, r in systems.items()}, SYSTEM_NAMES, TARGETS)


def run_model(program: Program, systems: list[str], cfg: common.BenchConfig, warmup: int,
              engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every system started, then `program.epochs` rounds of one epoch each, interleaved; the model's record."""
    data = training_data(program)
    runs: list[peers.TurnTakingRun] = []
    try:
        for system in systems:
            runs.append(build_run(system, program, data, cfg, engine_kwargs))
        describe = lambda s: f"{s:8.2f} s/epoch  {program.rows / s:8.1f} samples/s"  # noqa: E731
        times, order, interrupted = common.run_rounds({run.label: run.step for run in runs}, program.epochs,
                                                      warmup, describe=describe)
        for run in runs:
            if isinstance(run, DsgdFitRun) and not interrupted:
                run.measure_step_loop()
        records = {run.label: system_record(run, times[run.label], warmup) for run in runs}
    finally:
        for run in runs:
            run.close()
    return {**dataclasses.asdict(program), "image_shape": list(data[0].shape[1:]), "rows": program.rows,
            "warmup": warmup, "order": order, "interrupted": interrupted, "systems": records,
            "ratios": ratios(records)}


def _figure(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def report_table(result: dict[str, Any]) -> str:
    """Every model's systems in markdown, then the ratios with their targets."""
    lines = ["| model | system | s/epoch (median) | samples/s | ms/step | start-up s | loss first → last |",
             "|---|---|---|---|---|---|---|"]
    for name, model in result["models"].items():
        for record in model["systems"].values():
            losses, per_step = record["losses"], record["per_step_s"]
            loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "–"
            lines.append(f"| {name} | {record['system']} | {_figure(record['median_epoch_s'], '.2f')} | "
                         f"{_figure(record['samples_per_s'], '.1f')} | "
                         f"{_figure(per_step and per_step * 1000, '.1f')} | "
                         f"{record['startup_s']:.1f} | {loss} |")
    lines += ["", "| model | ratio | value | target |", "|---|---|---|---|"]
    for name, model in result["models"].items():
        for ratio, value in model["ratios"].items():
            lines.append(f"| {name} | {ratio} | {_figure(value, '.2f')} | {common.verdict(TARGETS[ratio], value)} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"the global batch (default: {DEFAULT_BATCH})")
    p.add_argument("--steps", type=int, default=None,
                   help="steps an epoch (default: every digit once for the convnet, 5 for ResNet-50)")
    p.add_argument("--image-size", type=int, default=64, help="ResNet-50's images, px")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds, one epoch of every system each")
    p.add_argument("--warmup", type=int, default=1, help="rounds first, not measured")
    p.add_argument("--cpus-per-worker", type=int, default=1,
                   help="CPUs each dsgd and Ray Train worker reserves; also its TensorFlow thread count")
    p.add_argument("--allocator", choices=sorted(peers.ALLOCATORS), default="bfc",
                   help="TensorFlow's CPU allocator in every system (as benchmarks/peers.py)")
    common.add_engine_flags(p)
    common.add_ray_flags(p, "the CPUs every system's workers reserve, plus one")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "keras_peers" / "keras_peers.json")
    return p.parse_args(argv)


def program_for(model: str, args: argparse.Namespace) -> Program:
    """The program `args` ask of `model`."""
    batch_size = args.batch_size or DEFAULT_BATCH[model]
    steps = args.steps or DEFAULT_STEPS[model]
    if steps is None:  # every digit once
        steps = len(common.example("mnist").load_digits(None)[1]["y_train"]) // batch_size
    image_size = args.image_size if model == "resnet50" else 0
    return Program(model, image_size, batch_size, steps, args.warmup + args.rounds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.keras_peers", argv)
    print(f"command: {command}", flush=True)
    distributed = len([s for s in args.systems if s != "single"])
    # Logical CPUs for every system's workers at once (they take turns); Ray Train's bookkeeping needs the dashboard.
    common.connect_ray(args, args.num_workers * args.cpus_per_worker * distributed + 1,
                       include_dashboard=None if "raytrain" in args.systems else False)
    result: dict[str, Any] = {"command": command, "allocator": args.allocator, "targets": TARGETS, "models": {},
                              **common.machine()}
    with common.environment(**{peers.ALLOCATOR_ENV: peers.ALLOCATORS[args.allocator]}):
        for model in args.models:
            program = program_for(model, args)
            cfg = common.BenchConfig(model=model, image_size=program.image_size,
                                     batch_size=program.batch_size // args.num_workers, num_workers=args.num_workers,
                                     cpus_per_worker=args.cpus_per_worker, num_iters=args.rounds, warmup=args.warmup)
            engine_kwargs = {**ENGINE_TIMEOUTS.get(model, {}), **common.engine_kwargs(args)}
            print(f"== {model}: {args.num_workers} workers, global batch {program.batch_size}, {program.steps} steps "
                  f"an epoch, {args.warmup} + {args.rounds} epochs", flush=True)
            result["models"][model] = run_model(program, args.systems, cfg, args.warmup, engine_kwargs)
            for ratio, value in result["models"][model]["ratios"].items():
                print(f"{model}: {ratio} = {_figure(value, '.2f')}", flush=True)
    result["table"] = report_table(result)
    print(f"\n{result['table']}\n", flush=True)
    print(f"wrote {common.write_json(result, args.out)}")
    return result


if __name__ == "__main__":
    main()

"""Keras 3: time to a first step from nothing, a dsgd engine against Keras's own `train_on_batch`.

For a large model most of the time to a first result is TensorFlow's:
tracing the step and optimizing the traced graph on its first run. Keras
pays it on its first `train_on_batch`, a dsgd worker while it builds (it
plans its first step ahead). Each system starts from a fresh process, so
the times include starting it and importing TensorFlow; for each model
(`--models`):

  keras   a Ray actor (1 CPU, the workers' environment, dsgd imported
          before TensorFlow, and a 1-CPU worker's TensorFlow threads: 1
          per op, 2 ops at once) builds the Keras 3 model,
          compiles it and runs its first `train_on_batch` on one batch:
          timed in the driver from the actor's creation; then
          `--later-steps` more, each timed in the actor;
  dsgd    DistributedSGD(num_workers=1, devices_per_worker=D) for D in
          `--devices`, the same model as a `dsgd.KerasModel` on one batch
          per replica, at the defaults (one worker has no exchange): its
          construction and first step, timed in the driver; then
          `--later-steps` more, each timed in the driver (`sgd.step()`:
          the call to the worker and back included), and as many timed
          inside the worker (its step alone, as Keras's are timed).

In rounds (`--rounds`), the systems in an order rotated by the round.
Reported per model: the median time to the first step, the median later
step (dsgd's from the driver and inside the worker), and each dsgd run's
time to the first step over Keras's ("dsgd-1" trains the same single
replica). Writes benchmarks/results/first_step.json.
From the repository root:

    .venv/bin/python -m benchmarks.first_step
    .venv/bin/python -m benchmarks.first_step --models mobilenet_v2 --devices 2 --rounds 1
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/first_step.py`
    import _repo_path  # noqa: F401

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import ray

from benchmarks import common
from dsgd.cluster.cluster import worker_env

MODELS = ("mobilenet_v2", "cnn")
IMAGE_SIZE, CLASSES, BATCH = 32, 10, 8
STEP_TIMEOUT_S = 900.0
IN_WORKER_STEP_IDS = 1_000_000  # the step ids of the steps timed inside a worker, past any the driver gave


def make_net(name: str) -> Any:
    """A Keras 3 model: MobileNetV2 (alpha 0.35, batch norm in every block) or a small CNN."""
    import keras

    shape = (IMAGE_SIZE, IMAGE_SIZE, 3)
    if name == "mobilenet_v2":
        return keras.applications.MobileNetV2(weights=None, input_shape=shape, classes=CLASSES, alpha=0.35,
                                              classifier_activation=None)
    return keras.Sequential([keras.Input(shape), keras.layers.Conv2D(16, 3, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Conv2D(32, 3, activation="relu"),
                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(CLASSES)])


def one_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(BATCH, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32),
            rng.integers(0, CLASSES, BATCH))


def creator(name: str) -> Callable[[int, int], Any]:
    def create(worker_index: int, device_index: int):
        import keras

        import dsgd

        batch = one_batch(device_index)
        return dsgd.KerasModel(make_net(name), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=keras.optimizers.SGD(0.01), batches=iter(lambda: batch, None))
    return create


@ray.remote(num_cpus=1)
class KerasProcess:
    """One Keras 3 model in a process of its own."""

    def first_step(self, name: str) -> None:
        import dsgd  # noqa: F401  (before TensorFlow, as in a worker)
        import keras
        import tensorflow as tf

        # A 1-CPU dsgd worker's threads (dsgd.worker.runtime.thread_counts, less the receives' threads)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        self.net = make_net(name)
        self.net.compile(optimizer=keras.optimizers.SGD(0.01),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.batch = one_batch(0)
        self.net.train_on_batch(*self.batch)

    def later_steps(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.net.train_on_batch(*self.batch)
            times.append(time.perf_counter() - start)
        return times


def keras_steps(name: str, later_steps: int) -> dict[str, Any]:
    """The time to Keras's first step from the actor's creation, then ``later_steps`` step times (in its process)."""
    start = time.perf_counter()
    actor = KerasProcess.options(runtime_env={"env_vars": worker_env()}).remote()  # env merged with the job's
    try:
        ray.get(actor.first_step.remote(name), timeout=STEP_TIMEOUT_S)
        first = time.perf_counter() - start
        later = ray.get(actor.later_steps.remote(later_steps), timeout=STEP_TIMEOUT_S)
        return {"first": first, "later": later, "in_process": later}
    finally:
        ray.kill(actor)


def steps_in_worker(worker: Any, steps: int) -> list[float]:
    """``steps`` steps timed inside the worker process (run there by ``foreach_worker``): the worker's step alone."""
    times = []
    for k in range(steps):
        start = time.perf_counter()
        worker.step(IN_WORKER_STEP_IDS + k, False)
        times.append(time.perf_counter() - start)
    return times


def dsgd_steps(name: str, devices: int, later_steps: int) -> dict[str, Any]:
    """The time to the engine's first step from its construction, then ``later_steps`` step times in the driver and
    as many inside the worker."""
    import dsgd

    start = time.perf_counter()
    with dsgd.DistributedSGD(creator(name), num_workers=1, devices_per_worker=devices, startup_timeout_s=900,
                             timeout_s=STEP_TIMEOUT_S) as sgd:
        sgd.step()
        first, later = time.perf_counter() - start, []
        for _ in range(later_steps):
            start = time.perf_counter()
            sgd.step()
            later.append(time.perf_counter() - start)
        [in_process] = sgd.foreach_worker(lambda worker: steps_in_worker(worker, later_steps))
    return {"first": first, "later": later, "in_process": in_process}


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median time to the first step and median later step of ``runs``, from the driver and in the process that
    steps."""
    return {"to_first_step_s": statistics.median(r["first"] for r in runs),
            "later_step_s": statistics.median(t for r in runs for t in r["later"]),
            "later_step_in_process_s": statistics.median(t for r in runs for t in r["in_process"])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--devices", nargs="+", type=int, default=[1, 2], help="replicas of the 1-worker engine")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--later-steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "first_step.json")
    common.add_ray_flags(p, default_cpus="4")
    args = p.parse_args(argv)
    common.connect_ray(args, default_cpus=4)

    record: dict[str, Any] = {"command": common.command_line("benchmarks.first_step", argv),
                              "machine": common.machine(), "models": {}}
    for name in args.models:
        systems: dict[str, Callable[[], dict[str, Any]]] = {
            "keras": lambda: keras_steps(name, args.later_steps)}
        for devices in args.devices:
            systems[f"dsgd-{devices}"] = lambda d=devices: dsgd_steps(name, d, args.later_steps)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for round_index in range(args.rounds):
            for system in common.rotated(list(systems), round_index):
                runs[system].append(systems[system]())
                last = runs[system][-1]
                print(f"{name} round {round_index} {system}: to the first step {last['first']:.2f} s, later "
                      f"{statistics.median(last['later']):.3f} s ({statistics.median(last['in_process']):.3f} s "
                      "in its process)", flush=True)
        result = {system: {**summary(r), "runs_s": r} for system, r in runs.items()}
        for system in systems:
            if system != "keras":
                result[system]["to_first_step_over_keras"] = (
                    result[system]["to_first_step_s"] / result["keras"]["to_first_step_s"])
        record["models"][name] = result
        for system, r in result.items():
            ratio = r.get("to_first_step_over_keras")
            print(f"{name:13s} {system:8s} to the first step {r['to_first_step_s']:7.2f} s  later steps "
                  f"{r['later_step_s']:6.3f} s, in its process {r['later_step_in_process_s']:6.3f} s"
                  + (f"  (to the first step / Keras's: {ratio:.2f})" if ratio else ""), flush=True)
    print(f"wrote {common.write_json(record, args.out)}")


if __name__ == "__main__":
    main()

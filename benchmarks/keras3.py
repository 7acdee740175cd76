"""Keras 3 end to end: `keras.applications.ResNet50(weights=None)` trained by dsgd against its peers, interleaved.

Every system trains ResNet50 (1000
classes, softmax output) at `--image-size` px with momentum SGD (learning
rate 0.01, momentum 0.9: small batches of random labels, kept finite) and
sparse categorical cross-entropy, on synthetic data: each replica draws its images and labels
once in numpy (`synthetic_batch`, seeded by its worker index) and trains on
that batch every step. The systems:

  ps        dsgd.DistributedSGD(strategy="ps"): `--num-workers` workers, each
            a Keras 3 `dsgd.KerasModel` of `--batch-size` images (the TF2 way);
  raytrain  Ray Train's TensorflowTrainer under MultiWorkerMirroredStrategy,
            the same model in tf_keras (Ray Train sets TF_USE_LEGACY_KERAS=1 on
            its workers: Keras 3 does not run under that strategy), a
            `tf.function` step of `--batch-size` images per worker, stepped turn
            by turn through benchmarks/peers.py's turnstile;
  single    one Keras 3 model in this driver, a `tf.function` step
            (GradientTape, `optimizer.apply`) on the union of the workers'
            batches (`--num-workers` x `--batch-size`), TensorFlow's default
            threads (every core);
  ideal     one 1-worker dsgd engine per worker with the same Keras 3 model,
            all stepping at once (benchmarks.common.Ideal): dsgd with no exchange.

All are built first, then stepped in rounds, each round one step of every
system in an order rotated every round (common.run_rounds). dsgd's first
TF2 step traces the model (about 40 s for ResNet50 on a 2-core machine), so
the `--warmup` rounds absorb it; the engines' timeouts are raised to match.
Every system runs with the same TensorFlow CPU allocator (`--allocator`) and
dsgd's and Ray Train's workers with `--cpus-per-worker` threads each.
Reported: images/s per system and "ps" against Ray Train (target >= 1.5),
the ideal (target >= 0.9) and the single process. Writes
benchmarks/results/keras3.json. From the repository root:

    python benchmarks/keras3.py
    python -m benchmarks.keras3 --image-size 64 --batch-size 8 --num-workers 2 --warmup 3 --steps 10
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/keras3.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import itertools
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import dsgd
from benchmarks import common, peers, resnet
from benchmarks.resnet101 import DsgdRun

MODEL = "keras.applications.ResNet50"
SYSTEMS = ("ps", "raytrain", "single", "ideal")
SYSTEM_NAMES = {"ps": "dsgd-ps", "raytrain": peers.RayTrainRun.label, "single": "keras3-single",
                "ideal": peers.IdealRun.label}
TARGETS = {"ps/raytrain": 1.5, "ps/ideal": 0.9, "ps/single": None}  # "ps" images/s over its peer's, at least
LEARNING_RATE, MOMENTUM = 0.01, 0.9
# dsgd's first TF2 step traces ResNet50 (about 40 s here) and its build runs the model twice: room for a busy machine.
ENGINE_TIMEOUTS = {"startup_timeout_s": 900.0, "timeout_s": 1800.0}


def synthetic_batch(seed: int, batch_size: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A replica's fixed batch: normal float32 images (NHWC) and uniform int64 labels in [0, 1000)."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch_size, image_size, image_size, 3)).astype(np.float32)
    return images, rng.integers(0, resnet.NUM_CLASSES, batch_size)


def keras_replica(worker_index: int, device_index: int, batch_size: int, image_size: int) -> dsgd.KerasModel:
    """A dsgd replica: Keras 3 ResNet50 training on its fixed synthetic batch every step."""
    net = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3))
    batch = synthetic_batch(worker_index, batch_size, image_size)
    return dsgd.KerasModel(net, loss=keras.losses.SparseCategoricalCrossentropy(),
                           optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM),
                           batches=itertools.repeat(batch))


class SingleKerasRun:
    """One Keras 3 model in this process on the union of the workers' batches, stepped by a `tf.function`."""

    label = SYSTEM_NAMES["single"]

    def __init__(self, cfg: common.BenchConfig):
        print(f"[{self.label}] building", flush=True)
        start = time.perf_counter()
        shards = [synthetic_batch(w, cfg.batch_size, cfg.image_size) for w in range(cfg.num_workers)]
        images, labels = (tf.constant(np.concatenate(arrays)) for arrays in zip(*shards))
        net = keras.applications.ResNet50(weights=None, input_shape=(cfg.image_size, cfg.image_size, 3))
        optimizer = keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
        optimizer.build(net.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()

        @tf.function
        def train_step() -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, net(images, training=True))
            optimizer.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
            return loss

        self.train_step = train_step
        self.setup_s = time.perf_counter() - start
        self.losses: list[float] = []

    def step(self) -> float:
        start = time.perf_counter()
        loss = float(self.train_step())
        elapsed = time.perf_counter() - start
        self.losses.append(loss)
        return elapsed

    def details(self) -> dict[str, Any]:
        return {"keras": keras.__version__, "threads": "all cores", "setup_s": self.setup_s,
                "final_loss": self.losses[-1] if self.losses else None}

    def close(self) -> None:
        """Nothing to release: the model is this process's, freed with the run."""


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: tf_keras ResNet50 under MultiWorkerMirroredStrategy on its fixed synthetic batch,
    stepping when the turnstile gives it the turn."""
    import tf_keras
    from ray import train

    cfg = peers.prepare_ray_train_worker(config)
    rank = train.get_context().get_world_rank()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    images, labels = (tf.constant(a) for a in synthetic_batch(rank, cfg.batch_size, cfg.image_size))
    with strategy.scope():
        net = tf_keras.applications.ResNet50(weights=None, input_shape=(cfg.image_size, cfg.image_size, 3))
        optimizer = tf_keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    # A strategy's replicas reduce the loss themselves (tf_keras refuses its automatic reduction there).
    per_example_loss = tf_keras.losses.SparseCategoricalCrossentropy(reduction=tf_keras.losses.Reduction.NONE)

    def replica_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_loss(labels, net(images, training=True)))
            # The optimizer sums the replicas' gradients: scale to get their mean.
            scaled_loss = loss / strategy.num_replicas_in_sync
        grads = tape.gradient(scaled_loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    peers.take_turns(config["turnstile"], rank, peers.timed_step(strategy, replica_step))


def build_run(system: str, cfg: common.BenchConfig, engine_kwargs: dict[str, Any]) -> peers.Run:
    """`system` (one of SYSTEMS), built and ready to step."""
    if system == "single":
        return SingleKerasRun(cfg)
    if system == "raytrain":
        return peers.RayTrainRun(cfg, spread=False, train_loop=_ray_train_loop)
    creator = functools.partial(keras_replica, batch_size=cfg.batch_size, image_size=cfg.image_size)
    if system == "ideal":
        return peers.IdealRun(cfg, model_creator=creator, **engine_kwargs)
    return DsgdRun(cfg, strategy="ps", label=SYSTEM_NAMES["ps"], model_creator=creator, **engine_kwargs)


def ratios(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """"ps" mean images/s over each peer's (TARGETS' keys); None where either was not measured."""
    return common.ratios_over_peers({r["system"]: r["images_per_sec_mean"] for r in records}, SYSTEM_NAMES, TARGETS)


def report_table(records: list[dict[str, Any]], cfg: common.BenchConfig, command: str,
                 allocator: str) -> str:
    """The run in markdown: the command, the set-up, images/s per system and the ratios with their targets."""
    host = records[0]["host"] if records else {"cpu_model": "?", "cores": "?"}
    lines = [
        f"`{command}`",
        "",
        (f"{MODEL} (weights=None) at {cfg.image_size}x{cfg.image_size}, {cfg.batch_size} images per worker, "
         f"{cfg.num_workers} workers, global batch {cfg.global_batch}; Keras 3 in dsgd and the single process, "
         f"tf_keras in Ray Train. TensorFlow's {allocator} CPU allocator in every system; {cfg.cpus_per_worker} "
         f"thread(s) per dsgd and Ray Train worker, TensorFlow's default (every core) in the single process. "
         f"Interleaved: {cfg.warmup} warm-up rounds (dsgd's trace of its first step among them), then "
         f"{cfg.num_iters} measured. Host: {host['cpu_model']}, {host['cores']} cores."),
        "",
        "| system | images/s (mean ± std) | steps | set-up s |",
        "|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['system']} | {peers.rate(r)} | {r['measured_steps']} | {r['setup_s']:.1f} |")
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for name, value in ratios(records).items():
        lines.append(f"| {name} | {'–' if value is None else f'{value:.2f}'} | {common.verdict(TARGETS[name], value)} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="images per worker (the single process: all workers')")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=int, default=1,
                   help="CPUs each dsgd and Ray Train worker reserves; also its TensorFlow thread count")
    p.add_argument("--warmup", type=int, default=3, help="rounds first, not measured (they hold dsgd's trace)")
    p.add_argument("--steps", type=int, default=10, help="measured rounds, one step of every system each")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--allocator", choices=sorted(peers.ALLOCATORS), default="bfc",
                   help="TensorFlow's CPU allocator in every system (as benchmarks/peers.py)")
    common.add_engine_flags(p)
    common.add_ray_flags(p, "the CPUs every system's workers reserve, plus one")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "keras3.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = common.BenchConfig(model=MODEL, image_size=args.image_size, batch_size=args.batch_size,
                             num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
                             num_iters=args.steps, warmup=args.warmup)
    command = common.command_line("benchmarks.keras3", argv)
    engine_kwargs = {**ENGINE_TIMEOUTS, **common.engine_kwargs(args)}
    print(f"command: {command}", flush=True)
    distributed = len([s for s in args.systems if s != "single"])
    # Logical CPUs for every system's workers at once (they take turns); Ray Train's bookkeeping needs the dashboard.
    common.connect_ray(args, cfg.num_workers * cfg.cpus_per_worker * distributed + 1,
                       include_dashboard=None if "raytrain" in args.systems else False)
    build = functools.partial(build_run, cfg=cfg, engine_kwargs=engine_kwargs)
    with common.environment(**{peers.ALLOCATOR_ENV: peers.ALLOCATORS[args.allocator]}):
        records = peers.run_interleaved(args.systems, cfg, build, command=command, allocator=args.allocator)
    for record in records:
        common.print_summary(record)
    table = report_table(records, cfg, command, args.allocator)
    print(f"\n{table}\n", flush=True)
    result = {"command": command, "engine_kwargs": engine_kwargs, "allocator": args.allocator,
              "ratios": ratios(records), "targets": TARGETS, "systems": records, "table": table,
              **common.machine()}
    common.write_json(result, args.out)
    print(f"record written to {args.out}")
    return result


if __name__ == "__main__":
    main()

"""dsgd against its peers on the same ResNet, global batch and workers, interleaved.

Systems, all fed by the same in-graph synthetic ImageNet and all running the
graph built by `benchmarks.resnet.resnet_v1`:
  single   one plain TensorFlow process (tf.compat.v1 Session, all cores, in
           this driver) doing the whole global batch: the no-distribution baseline;
  raytrain Ray Train's TensorflowTrainer, MultiWorkerMirroredStrategy, one
           replica of `devices_per_worker * batch_size` images per worker;
  simple   dsgd, strategy="simple", otherwise at dsgd's defaults;
  ps       dsgd, strategy="ps", otherwise at dsgd's defaults;
  ideal    the same workers with no exchange at all: one 1-worker dsgd
           engine per worker, all stepping at once, each from a thread of
           its own; a step lasts until the slowest is done. What "ps" would
           reach if exchanging gradients cost nothing (target: "ps" >= 0.95x);
  ps-bf16  the same with compression="bf16": 16-bit partitions on the wire
           (not run unless asked for: `--systems ... ps-bf16`);
  ps-tf2   "ps" the TF2 way: the same ResNet, data and optimizer written as a
           `dsgd.TF2Model` (`ResNetTF2Model`: eager variables, Keras 3's
           momentum SGD, the step traced in a `tf.function`); its step time
           over "ps"'s is reported (target <= 1.1; `--systems ... ps-tf2`).

Every system is built first and kept alive; then they run in alternating
rounds: in round r each system takes one step, in an order rotated by r, so
machine noise falls on all of them alike. Ray Train runs its loop inside its
own `fit()` (in a driver thread here); before each step its workers wait for
a turnstile actor that the driver opens when the round reaches Ray Train, so
it too is interleaved step by step. Its step time is rank 0's `tf.function`
step, timed inside the worker; the others' are timed in the driver.

`--two-node` runs on a simulated two-node cluster (ray.cluster_utils.Cluster,
two raylets and two object stores on this machine): dsgd and Ray Train place
one worker per node, so gradient partitions cross between object stores; the
single process stays in the driver.

Writes one JSON record per system, report.md and throughput.png into
benchmarks/results/. From the repository root:

    python benchmarks/peers.py --model resnet101 --image-size 64 --batch-size 8
    python -m benchmarks.peers --model resnet101 --image-size 64 --batch-size 8 --two-node
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/peers.py`
    import _repo_path  # noqa: F401

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import ray
import tensorflow as tf

import dsgd

from benchmarks import common, resnet
from benchmarks.resnet101 import DsgdRun

SYSTEMS = ("single", "raytrain", "simple", "ps", "ideal", "ps-bf16", "ps-tf2")
DEFAULT_SYSTEMS = SYSTEMS[:5]
SYSTEM_NAMES = {"single": "single-process", "raytrain": "raytrain-mwms", "simple": "dsgd-simple",
                "ps": "dsgd-ps", "ideal": "dsgd-ideal", "ps-bf16": "dsgd-ps-bf16", "ps-tf2": "dsgd-ps-tf2"}
RATIO_PEERS = ("single", "raytrain", "simple", "ideal")  # the report's "vs" columns
TF2_TARGET = 1.1  # "ps-tf2"'s median step over "ps"'s
RAY_TRAIN_STOP_S = 120.0
# TensorFlow's CPU allocator, one setting for every system: dsgd's workers default to the BFC pool
# (dsgd/cluster/cluster.py), so the single process and Ray Train's workers get the same unless told otherwise.
ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
ALLOCATORS = {"bfc": "true", "default": "false"}


class Run(Protocol):
    """A system built and ready to step (dsgd's is benchmarks.resnet101.DsgdRun)."""

    label: str

    def step(self) -> float:
        """One training step; its time in seconds."""

    def details(self) -> dict[str, Any]:
        """What the system's record holds beyond the common fields."""

    def close(self) -> None:
        """Release the system's processes and sessions."""


class SingleProcessRun:
    """The whole global batch in this process, one tf.compat.v1 Session on all cores."""

    label = SYSTEM_NAMES["single"]

    def __init__(self, cfg: common.BenchConfig):
        print(f"[{self.label}] building", flush=True)
        start = time.perf_counter()
        graph = tf.Graph()
        with graph.as_default():
            self.loss, _ = resnet.build_v1_replica(cfg.model, cfg.global_batch, cfg.image_size)
            with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
                self.train_op = resnet.make_optimizer().minimize(self.loss)
            init = tf.compat.v1.global_variables_initializer()
        self.sess = tf.compat.v1.Session(graph=graph)
        self.sess.run(init)
        self.setup_s = time.perf_counter() - start
        self.losses: list[float] = []

    def step(self) -> float:
        start = time.perf_counter()
        _, loss = self.sess.run([self.train_op, self.loss])
        elapsed = time.perf_counter() - start
        self.losses.append(float(loss))
        return elapsed

    def details(self) -> dict[str, Any]:
        return {"threads": "all cores", "setup_s": self.setup_s,
                "final_loss": self.losses[-1] if self.losses else None}

    def close(self) -> None:
        self.sess.close()


@ray.remote(num_cpus=0)
class Turnstile:
    """Lets Ray Train's workers take a step only when the driver's round opens their turn.

    Workers call `arrive` once built, then `next_turn(t)` before step t and
    `finish` after it; the driver calls `run_turn(t)`, which opens turn t and
    returns once every worker has finished it.
    """

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.arrived = 0
        self.opened = 0  # turns opened so far
        self.stopped = False
        self.finished: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
        self.changed = asyncio.Condition()

    async def arrive(self) -> None:
        async with self.changed:
            self.arrived += 1
            self.changed.notify_all()

    async def all_arrived(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.arrived == self.num_workers)

    async def next_turn(self, turn: int) -> bool:
        """Wait until `turn` is opened (True) or the run is stopped (False)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.stopped or self.opened > turn)
            return self.opened > turn

    async def finish(self, turn: int, rank: int, seconds: float, loss: float) -> None:
        async with self.changed:
            self.finished[turn][rank] = (seconds, loss)
            self.changed.notify_all()

    async def run_turn(self, turn: int) -> tuple[float, float]:
        """Open `turn` and wait for every worker's step: rank 0's (seconds, loss)."""
        async with self.changed:
            self.opened = turn + 1
            self.changed.notify_all()
            await self.changed.wait_for(lambda: len(self.finished[turn]) == self.num_workers)
            return self.finished.pop(turn)[0]

    async def stop(self) -> None:
        async with self.changed:
            self.stopped = True
            self.changed.notify_all()


TURN_WAIT_S = 3600.0  # bound on a worker's wait for its next turn: every other system's step (or epoch) runs meanwhile


def take_turns(turnstile: Any, rank: int, step: Callable[[], tuple[float, float]]) -> int:
    """A worker's side of the turnstile: `step()` -> (seconds, loss) once per opened turn,
    until the driver stops; returns the number of steps taken."""
    ray.get(turnstile.arrive.remote(), timeout=TURN_WAIT_S)
    turn = 0
    while ray.get(turnstile.next_turn.remote(turn), timeout=TURN_WAIT_S):
        seconds, loss = step()
        ray.get(turnstile.finish.remote(turn, rank, seconds, loss), timeout=TURN_WAIT_S)
        turn += 1
    return turn


class VariableStore:
    """TF2 variable getter for `resnet_v1` of `model`, filled in two phases.

    First, a forward pass in inference mode (at construction) records every
    variable's spec, returning zeros, so nothing is created or communicated;
    `create()` then makes the tf.Variables, under whatever distribution
    strategy scope is open; afterwards the getter returns those variables.
    """

    def __init__(self, model: str):
        self.specs: dict[str, tuple[list[int], resnet.Initializer, bool]] = {}
        self.variables: dict[str, tf.Variable] = {}
        resnet.resnet_v1(tf.zeros([1, 32, 32, 3]), model, self, training=False)

    def __call__(self, name: str, shape: list[int], initializer: resnet.Initializer,
                 trainable: bool) -> tf.Variable | tf.Tensor:
        if self.variables:
            return self.variables[name]
        self.specs[name] = (shape, initializer, trainable)
        return tf.zeros(shape)

    def create(self) -> None:
        for name, (shape, initializer, trainable) in self.specs.items():
            # Moving statistics are per replica (updated locally, mean on read).
            sync = ({} if trainable else
                    {"synchronization": tf.VariableSynchronization.ON_READ,
                     "aggregation": tf.VariableAggregation.MEAN})
            self.variables[name] = tf.Variable(initializer(shape, dtype=tf.float32), name=name,
                                               trainable=trainable, **sync)

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        return [v for v in self.variables.values() if v.trainable]

    @property
    def moving_statistics(self) -> list[tf.Variable]:
        """Batch norm's moving means and variances: the variables the training step writes, not trains."""
        return [v for v in self.variables.values() if not v.trainable]


class ResNetTF2Model(dsgd.TF2Model):
    """dsgd's replica of `benchmarks.resnet101.ResNetModel` the TF2 way: the same `resnet_v1` on the same
    in-graph synthetic ImageNet, its variables in a `VariableStore`, the same momentum SGD from Keras 3."""

    def __init__(self, worker_index: int, device_index: int, model: str = "resnet101",
                 batch_size: int = 32, image_size: int = 224):
        self.model, self.batch_size, self.image_size = model, batch_size, image_size
        self.store = VariableStore(model)
        self.store.create()
        self.optimizer = resnet.make_keras_optimizer()

    def get_variables(self) -> list[tf.Variable]:
        return self.store.trainable_variables

    def get_state_variables(self) -> list[tf.Variable]:
        return self.store.moving_statistics  # averaged after every step, as the TF1 way averages them

    def get_optimizer(self) -> Any:
        return self.optimizer

    def get_batch(self) -> np.ndarray:
        return np.zeros((1,), np.float32)  # the batch is drawn in the graph, as the TF1 model's

    def get_loss(self, batch: tf.Tensor) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        loss, accuracy = resnet.build_v1_replica(self.model, self.batch_size, self.image_size, self.store)
        return loss, {"accuracy": accuracy}


def prepare_ray_train_worker(config: dict[str, Any]) -> common.BenchConfig:
    """A Ray Train worker set up as dsgd's are, from `RayTrainRun`'s loop config: the benchmark's CPU allocator,
    TensorFlow's warnings quieted, `cpus_per_worker` threads; the run's BenchConfig."""
    os.environ[ALLOCATOR_ENV] = config["allocator"]  # read when TensorFlow makes its first CPU tensor
    dsgd.worker.tf_logs.python_warnings_follow_cpp_level()  # MultiWorkerMirroredStrategy's INFO lines, as in dsgd's workers
    cfg = common.BenchConfig(**config["cfg"])
    tf.config.threading.set_intra_op_parallelism_threads(cfg.cpus_per_worker)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, cfg.cpus_per_worker))  # as dsgd's workers
    return cfg


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: MultiWorkerMirroredStrategy around the shared ResNet graph,
    stepping when the turnstile gives it the turn."""
    from ray import train

    cfg = prepare_ray_train_worker(config)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replica_batch = cfg.batch_size * cfg.devices_per_worker
    store = VariableStore(cfg.model)
    with strategy.scope():
        store.create()
        optimizer = resnet.make_optimizer()
    trainable = store.trainable_variables

    def replica_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss, _ = resnet.build_v1_replica(cfg.model, replica_batch, cfg.image_size, store)
            # v1 optimizers sum the replicas' gradients: scale to get their mean.
            scaled_loss = loss / strategy.num_replicas_in_sync
        grads = tape.gradient(scaled_loss, trainable)
        optimizer.apply_gradients(zip(grads, trainable))
        return loss

    take_turns(config["turnstile"], train.get_context().get_world_rank(), timed_step(strategy, replica_step))


def timed_step(strategy: tf.distribute.Strategy, replica_step: Callable[[], tf.Tensor]) -> Callable[[], tuple[float, float]]:
    """One step of ``replica_step`` on every replica of ``strategy``, in a ``tf.function``, timed: its seconds and
    the first replica's loss."""
    @tf.function
    def train_step() -> tf.Tensor:
        return strategy.experimental_local_results(strategy.run(replica_step))[0]

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        loss = float(train_step())
        return time.perf_counter() - start, loss
    return step


class TurnTakingRun:
    """A system whose training loop runs in a driver thread (``run``) and takes a turn of a `Turnstile` per
    step or epoch: built once its loop's workers arrive (``setup_s``), then stepped turn by turn by ``step``.
    Every wait is bounded by ``timeout_s`` and fails at once if the loop ends meanwhile."""

    label = "turn-taking"

    def __init__(self, turnstile: Any, run: Callable[[], Any], timeout_s: float = TURN_WAIT_S):
        self.turnstile, self.timeout_s = turnstile, timeout_s
        self.error: Exception | None = None
        self.losses: list[float] = []
        self.thread = threading.Thread(target=self._run, args=(run,), name=f"{self.label}-loop", daemon=True)
        start = time.perf_counter()
        self.thread.start()
        self._wait(self.turnstile.all_arrived.remote(), "its workers to build the model")
        self.setup_s = time.perf_counter() - start

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - raised by _wait, in the driver's thread
            self.error = e

    def _wait(self, ref: ray.ObjectRef, what: str) -> Any:
        """ray.get(ref) within ``timeout_s``, failing if the loop ends (its workers died) meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while not ray.wait([ref], timeout=1.0)[0]:
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.label}'s training loop ended while waiting for {what}: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label}: no {what} within {self.timeout_s:.0f} s")
        return ray.get(ref, timeout=self.timeout_s)

    def step(self) -> float:
        seconds, loss = self._wait(self.turnstile.run_turn.remote(len(self.losses)), f"turn {len(self.losses) + 1}")
        self.losses.append(loss)
        return seconds

    def close(self) -> None:
        ray.get(self.turnstile.stop.remote(), timeout=60)
        self.thread.join(timeout=RAY_TRAIN_STOP_S)


class RayTrainRun(TurnTakingRun):
    """Ray Train's TensorflowTrainer, its `fit()` in a driver thread, stepped through a Turnstile.

    `train_loop(config)` runs on every worker: `config` holds the BenchConfig as a dict ("cfg"), the
    "turnstile", the "allocator" (see `prepare_ray_train_worker`) and ``loop_config``; it steps through
    `take_turns` (or takes a turn per epoch of its own).
    """

    label = SYSTEM_NAMES["raytrain"]

    def __init__(self, cfg: common.BenchConfig, spread: bool,
                 train_loop: Callable[[dict[str, Any]], None] = _ray_train_loop,
                 loop_config: dict[str, Any] | None = None):
        from ray.train import RunConfig, ScalingConfig
        from ray.train.tensorflow import TensorflowTrainer

        print(f"[{self.label}] starting {cfg.num_workers} worker(s)", flush=True)
        self.replica_batch = cfg.batch_size * cfg.devices_per_worker
        turnstile = Turnstile.remote(cfg.num_workers)
        self.storage = tempfile.mkdtemp(prefix="dsgd-raytrain-")
        trainer = TensorflowTrainer(
            train_loop, train_loop_config={"cfg": dataclasses.asdict(cfg), "turnstile": turnstile,
                                           "allocator": os.environ[ALLOCATOR_ENV], **(loop_config or {})},
            scaling_config=ScalingConfig(num_workers=cfg.num_workers,
                                         resources_per_worker={"CPU": cfg.cpus_per_worker},
                                         placement_strategy="SPREAD" if spread else "PACK"),
            run_config=RunConfig(name="resnet", storage_path=self.storage))
        super().__init__(turnstile, trainer.fit)

    def details(self) -> dict[str, Any]:
        return {"replica_batch": self.replica_batch, "setup_s": self.setup_s,
                "timed": "rank 0's tf.function step, inside the worker",
                "final_loss": self.losses[-1] if self.losses else None}

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.storage, ignore_errors=True)


class IdealRun:
    """"ideal": one 1-worker dsgd engine per worker (no exchange), stepped at once from threads
    (``common.Ideal``); each trains ``model_creator``'s model (default: ``DsgdRun``'s ResNet)."""

    label = SYSTEM_NAMES["ideal"]

    def __init__(self, cfg: common.BenchConfig, model_creator: Callable[[int, int], Any] | None = None,
                 **engine_kwargs: Any):
        one_worker = dataclasses.replace(cfg, num_workers=1)
        self.runs: list[DsgdRun] = []
        self.ideal: common.Ideal | None = None
        try:
            for k in range(cfg.num_workers):
                self.runs.append(DsgdRun(one_worker, strategy="simple", label=f"{self.label} {k}",
                                         model_creator=model_creator, **engine_kwargs))
        except BaseException:
            self.close()
            raise
        self.ideal = common.Ideal([run.sgd for run in self.runs])

    def step(self) -> float:
        """One step of every engine (stats fetched), all at once; the wall time until the last is done."""
        start = time.perf_counter()
        self.ideal.burst(1)
        return time.perf_counter() - start

    def details(self) -> dict[str, Any]:
        return {"engines": len(self.runs), "engine_kwargs": self.runs[0].engine_kwargs if self.runs else {},
                "worker_nodes": [node for run in self.runs for node in run.worker_nodes],
                "setup_s": sum(run.setup_s for run in self.runs)}

    def close(self) -> None:
        if self.ideal is not None:
            self.ideal.close()
        for run in self.runs:
            run.close()


def build_run(system: str, cfg: common.BenchConfig, engine_kwargs: dict[str, Any], spread: bool) -> Run:
    """`system` (one of SYSTEMS), built and ready to step."""
    if system == "single":
        return SingleProcessRun(cfg)
    if system == "raytrain":
        return RayTrainRun(cfg, spread=spread)
    if system == "ideal":
        return IdealRun(cfg, **engine_kwargs)
    if system == "ps-bf16":
        return DsgdRun(cfg, strategy="ps", compression="bf16", **engine_kwargs)
    if system == "ps-tf2":
        creator = functools.partial(ResNetTF2Model, model=cfg.model, batch_size=cfg.batch_size,
                                    image_size=cfg.image_size)
        return DsgdRun(cfg, strategy="ps", label=SYSTEM_NAMES[system], model_creator=creator, **engine_kwargs)
    return DsgdRun(cfg, strategy=system, **engine_kwargs)


def run_interleaved(systems: list[str], cfg: common.BenchConfig, build: Callable[[str], Run],
                    **record_fields: Any) -> list[dict[str, Any]]:
    """Build every system (`build(system)`), run them in alternating rounds, close them; one record per system."""
    runs: list[Run] = []
    try:
        for system in systems:
            runs.append(build(system))
        times, order, interrupted = common.run_rounds(
            {run.label: run.step for run in runs}, cfg.warmup + cfg.num_iters, cfg.warmup,
            describe=common.images_per_s(cfg.global_batch))
        return [common.make_record(run.label, cfg, times[run.label], interrupted, run_order=order,
                                   **record_fields, **run.details()) for run in runs]
    finally:
        for run in runs:
            run.close()


def rate(record: dict[str, Any]) -> str:
    """A record's images/s as the reports print it: mean ± std, or – if nothing was measured."""
    mean, std = record["images_per_sec_mean"], record["images_per_sec_std"]
    return "–" if mean is None else f"{mean:.2f} ± {std:.2f}"


def _ratio(record: dict[str, Any], peer: dict[str, Any] | None) -> str:
    if peer is None or not record["images_per_sec_mean"] or not peer["images_per_sec_mean"]:
        return "–"
    return f"{record['images_per_sec_mean'] / peer['images_per_sec_mean']:.2f}"


def median_step_s(record: dict[str, Any] | None) -> float | None:
    """A record's median measured step in seconds; None without a record or a measured step."""
    measured = record["step_times_s"][record["warmup"]:] if record else []
    return statistics.median(measured) if measured else None


def tf2_ratio(records: list[dict[str, Any]]) -> float | None:
    """"ps-tf2"'s median step over "ps"'s (target <= TF2_TARGET); None unless both were measured."""
    by_system = {r["system"]: r for r in records}
    tf2, ps = (median_step_s(by_system.get(SYSTEM_NAMES[s])) for s in ("ps-tf2", "ps"))
    return None if tf2 is None or ps is None else tf2 / ps


def write_report(records: list[dict[str, Any]], cfg: common.BenchConfig, out_dir: Path,
                 command: str, cluster: str = "one node", allocator: str = "bfc") -> Path:
    """A markdown table of images/s with ratios to the single process, Ray Train, dsgd "simple" and the ideal;
    "ps-tf2"'s step over "ps"'s if both ran."""
    by_system = {r["system"]: r for r in records}
    peers = [by_system.get(SYSTEM_NAMES[s]) for s in RATIO_PEERS]
    host = records[0]["host"] if records else {"cpu_model": "?", "cores": "?"}
    lines = [
        f"# {cfg.model} on synthetic ImageNet: dsgd and its peers",
        "",
        f"`{command}`",
        "",
        (f"{cfg.image_size}x{cfg.image_size} images, {cfg.batch_size} per replica, "
         f"{cfg.num_workers} worker(s) x {cfg.devices_per_worker} device(s), global batch "
         f"{cfg.global_batch}; {cfg.cpus_per_worker} CPU(s)/threads per worker; {cluster}; "
         f"TensorFlow's {allocator} CPU allocator in every system. "
         f"The systems ran interleaved: {cfg.warmup} warm-up rounds, then {cfg.num_iters} measured, "
         f"each round one step of every system, in an order rotated every round. "
         f"Host: {host['cpu_model']}, {host['cores']} cores."),
        "",
        "| system | images/s (mean ± std) | steps | vs single process | vs Ray Train | vs dsgd-simple | vs ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['system']} | {rate(r)} | {r['measured_steps']} | "
                     + " | ".join(_ratio(r, peer) for peer in peers) + " |")
    nodes = [f"{r['system']} on {len(set(r['worker_nodes']))} node(s)" for r in records if "worker_nodes" in r]
    if nodes:
        lines += ["", "dsgd workers: " + ", ".join(nodes) + "."]
    ratio = tf2_ratio(records)
    if ratio is not None:
        verdict = "meets" if ratio <= TF2_TARGET else "misses"
        lines += ["", f"ps-tf2/ps, median step: **{ratio:.2f}** ({verdict} the target <= {TF2_TARGET})."]
    lines += ["", f"Generated {time.strftime('%Y-%m-%d %H:%M')}.", ""]
    path = out_dir / "report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


PLOT_SIZE_IN, PLOT_DPI = (6, 3.5), 120  # throughput.png: 720 x 420 pixels


def throughput_figure(records: list[dict[str, Any]], cfg: common.BenchConfig):
    """A matplotlib Figure: one bar of images/s per measured system, error bars one standard deviation."""
    from matplotlib.figure import Figure

    measured = [r for r in records if r["images_per_sec_mean"] is not None]
    fig = Figure(figsize=PLOT_SIZE_IN)
    ax = fig.add_subplot()
    ax.bar([r["system"] for r in measured], [r["images_per_sec_mean"] for r in measured],
           yerr=[r["images_per_sec_std"] for r in measured], capsize=4, color="tab:blue")
    ax.tick_params(axis="x", labelsize=8, labelrotation=15)  # five or six names side by side
    ax.set_ylabel("images/s")
    ax.set_title(f"{cfg.model}, {cfg.image_size}px, global batch {cfg.global_batch}, "
                 f"{cfg.num_workers}x{cfg.devices_per_worker}")
    fig.tight_layout()
    return fig


def plot_throughput(records: list[dict[str, Any]], cfg: common.BenchConfig, out_dir: Path) -> Path:
    """``throughput_figure`` written to ``out_dir/throughput.png``; the path."""
    path = out_dir / "throughput.png"
    throughput_figure(records, cfg).savefig(path, dpi=PLOT_DPI, format="png")
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_flags(parser)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS))
    common.add_engine_flags(parser)
    parser.add_argument("--two-node", action="store_true",
                        help="start a simulated two-node cluster here (one worker of each system per node)")
    parser.add_argument("--allocator", choices=sorted(ALLOCATORS), default="bfc",
                        help="TensorFlow's CPU allocator in every system: its BFC pool (dsgd workers' "
                             "default) or TensorFlow's default")
    parser.add_argument("--spread", action="store_true",
                        help="on a cluster this script joins: one worker of each system per node "
                             "(--two-node implies it)")
    parser.add_argument("--object-store-memory", type=int, default=None,
                        help="bytes (per node with --two-node, default 1 GiB), when this script starts Ray")
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true", help="skip throughput.png (needs matplotlib)")
    args = parser.parse_args(argv)
    cfg = common.bench_config_from_args(args)
    command = common.command_line("benchmarks.peers", argv)
    print(f"command: {command}", flush=True)
    distributed = len([s for s in args.systems if s != "single"])
    # Ray Train's own bookkeeping reads the state API, which Ray's dashboard process serves.
    dashboard = {"include_dashboard": None if "raytrain" in args.systems else False}
    if args.two_node:
        if ray.is_initialized():
            parser.error("--two-node starts its own cluster: run it without a Ray instance already started")
        where = "a two-node cluster (ray.cluster_utils)"
        workers_per_node = math.ceil(cfg.num_workers / 2)
        ray_context = common.local_cluster(2, workers_per_node * cfg.cpus_per_worker * distributed + 1,
                                           args.object_store_memory or 1 << 30, **dashboard)
    elif ray.is_initialized():
        where = f"the cluster this process joined ({sum(n['Alive'] for n in ray.nodes())} nodes)"
        ray_context = contextlib.nullcontext()
    else:
        where = "one node"
        # Logical CPUs for every system's workers at once: they take turns, so they share the cores.
        common.start_ray(num_cpus=cfg.num_workers * cfg.cpus_per_worker * distributed + 1,
                         object_store_memory=args.object_store_memory, **dashboard)
        ray_context = contextlib.nullcontext()
    # One allocator for this process (the single process), dsgd's workers and Ray Train's.
    with ray_context, common.environment(**{ALLOCATOR_ENV: ALLOCATORS[args.allocator]}):
        build = functools.partial(build_run, cfg=cfg, engine_kwargs=common.engine_kwargs(args),
                                  spread=args.two_node or args.spread)
        records = run_interleaved(args.systems, cfg, build, command=command, cluster=where, allocator=args.allocator)
    for record in records:
        common.print_summary(record)
        common.write_json(record, args.results_dir / f"{record['system']}.json")
    report = write_report(records, cfg, args.results_dir, command, where, args.allocator)
    print(report.read_text())
    if records and not args.no_plot:
        print(f"plot written to {plot_throughput(records, cfg, args.results_dir)}")
    return records


if __name__ == "__main__":
    main()

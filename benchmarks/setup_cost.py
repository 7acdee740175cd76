"""Set-up: building a DistributedSGD and its first step, against one plain TensorFlow session doing the same.

For each model size (`--variables 300 2000`: that many float32 variables
of ResNet-101's shapes, cycled and scaled to `--floats` (4 M) in all, the
exchange benchmark's model: loss = sum_k reduce_sum(v_k) * x_k), three
systems run in rounds, in an order rotated by the round:

  plain   one fresh Ray actor (1 CPU, started as a worker is: see start)
          that imports TensorFlow;
          once it answers, it builds the model and a GradientDescent train op
          in a new graph, initializes the variables and runs one step, timed
          inside it: what one process spends to train this model at all;
          then `--later-steps` more steps, each timed
  start   `--num-workers` fresh actors started as dsgd starts its workers
          (1 CPU each, the workers' environment, `dsgd.cluster.cluster.worker_env`,
          dsgd imported before TensorFlow, so TensorFlow's import skips Keras
          as a worker's does), started at once, timed from the driver until
          all answer: the process start dsgd cannot avoid
  dsgd    DistributedSGD(model, num_workers=--num-workers) at its defaults,
          then its first step(fetch_stats=True), each timed in the driver,
          then `--later-steps` more steps, each timed;
          its phases (workers up, models built, parameter servers started
          and connected, the workers building their exchange meanwhile,
          initial weights matched to worker 0's) read by timing the
          engine's Cluster methods

Every system starts fresh processes each round, so none reuses another's
warm TensorFlow. Reported per size: medians over the rounds and
(dsgd set-up + first step - start) / plain, the SPEC's set-up target
(<= 1.2); and the median later step of plain and dsgd, which at the same
bytes in more variables shows what each step pays per tensor (they do not
count in the set-up). Writes benchmarks/results/setup_cost.json. From the repository root:

    .venv/bin/python benchmarks/setup_cost.py
    .venv/bin/python -m benchmarks.setup_cost --variables 300 --rounds 2
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/setup_cost.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray

import dsgd
from benchmarks import common, exchange
from dsgd.cluster.cluster import Cluster, worker_env

SYSTEMS = ("plain", "start", "dsgd")
TARGET = 1.2  # (dsgd - start) / plain
PHASES = {"models built": "_build_models", "parameter servers": "_start_parameter_servers"}


def model_shapes(count: int, floats: float) -> list[tuple[str, list[int]]]:
    """``count`` 1-D variables with ResNet-101's sizes, cycled, scaled to about ``floats`` elements in all."""
    sizes = [int(np.prod(dims)) for _, dims in exchange.variable_shapes("resnet101")]
    cycled = [sizes[i % len(sizes)] for i in range(count)]
    scale = floats / sum(cycled)
    return [(f"v{i:04d}", [max(1, round(size * scale))]) for i, size in enumerate(cycled)]


@ray.remote(num_cpus=1)
class PlainProcess:
    """A process like a worker's; trains the model once in a plain TensorFlow session."""

    def __init__(self):
        import dsgd  # noqa: F401  (first, as in a worker: its hook on TensorFlow's import, dsgd.worker.keras_preload)
        import tensorflow  # noqa: F401  (imported at start, as a dsgd worker does)

    def ready(self) -> bool:
        return True

    def build_init_and_step(self, shapes: list[tuple[str, list[int]]], later_steps: int) -> dict[str, float]:
        """Seconds to build, initialize and step once ("total"), and the median of ``later_steps`` more steps."""
        import tensorflow as tf

        start = time.perf_counter()
        with tf.Graph().as_default():
            model = exchange.ExchangeModel(0, 0, shapes)
            train = model.get_optimizer().minimize(model.get_loss())
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                sess.run(train)
                total = time.perf_counter() - start
                return {"total": total, "later step": later_step(lambda: sess.run(train), later_steps)}


def later_step(step: Callable[[], Any], steps: int) -> float:
    """The median seconds of ``steps`` calls of ``step`` (NaN for none)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) if times else float("nan")


def new_process() -> ray.actor.ActorHandle:
    """A ``PlainProcess`` started as dsgd starts a worker (its environment)."""
    return PlainProcess.options(runtime_env={"env_vars": worker_env()}).remote()


def plain(shapes: list[tuple[str, list[int]]], later_steps: int, timeout_s: float) -> dict[str, float]:
    actor = new_process()
    try:
        ray.get(actor.ready.remote(), timeout=timeout_s)
        return ray.get(actor.build_init_and_step.remote(shapes, later_steps), timeout=timeout_s)
    finally:
        ray.kill(actor)


def process_start(num_workers: int, timeout_s: float) -> dict[str, float]:
    start = time.perf_counter()
    actors = [new_process() for _ in range(num_workers)]
    try:
        ray.get([a.ready.remote() for a in actors], timeout=timeout_s)
        return {"total": time.perf_counter() - start}
    finally:
        for actor in actors:
            ray.kill(actor)


@contextlib.contextmanager
def timing_phases(phases: dict[str, float]) -> Iterator[None]:
    """While open, add the seconds each of ``PHASES``' Cluster methods and ``Cluster.start`` take to ``phases``."""
    methods = {**PHASES, "cluster start": "start"}
    originals = {name: getattr(Cluster, method) for name, method in methods.items()}

    def timed(name, original):
        @functools.wraps(original)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return run

    for name, method in methods.items():
        setattr(Cluster, method, timed(name, originals[name]))
    try:
        yield
    finally:
        for name, method in methods.items():
            setattr(Cluster, method, originals[name])


def dsgd_setup(shapes: list[tuple[str, list[int]]], num_workers: int, later_steps: int,
               timeout_s: float) -> dict[str, float]:
    """The engine's set-up, its phases, its first step and its median later step, in seconds."""
    phases: dict[str, float] = {}
    creator = functools.partial(exchange.ExchangeModel, shapes=shapes)
    start = time.perf_counter()
    with timing_phases(phases):
        sgd = dsgd.DistributedSGD(creator, num_workers=num_workers, startup_timeout_s=timeout_s)
    try:
        built = time.perf_counter()
        sgd.step(fetch_stats=True)
        first_step = time.perf_counter() - built
        later = later_step(functools.partial(sgd.step, fetch_stats=True), later_steps)
    finally:
        sgd.shutdown()
    setup = built - start
    in_cluster = phases.pop("cluster start")
    return {"total": setup + first_step, "set-up": setup, "first step": first_step,
            "workers up": in_cluster - sum(phases.values()), **phases, "initial weights": setup - in_cluster,
            "later step": later}


def run_size(count: int, args: argparse.Namespace) -> dict[str, Any]:
    shapes = model_shapes(count, args.floats)
    floats = sum(dims[0] for _, dims in shapes)
    print(f"\n== {count} variables, {floats / 1e6:.2f} M float32, {args.num_workers} workers", flush=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SYSTEMS}
    systems = {"plain": lambda: plain(shapes, args.later_steps, args.timeout_s),
               "start": lambda: process_start(args.num_workers, args.timeout_s),
               "dsgd": lambda: dsgd_setup(shapes, args.num_workers, args.later_steps, args.timeout_s)}

    def step_of(name):
        def step() -> float:
            runs[name].append(systems[name]())
            return runs[name][-1]["total"]
        return step

    _, order, interrupted = common.run_rounds({name: step_of(name) for name in SYSTEMS}, args.rounds,
                                              describe=lambda s: f"{s:7.2f} s")
    medians = {name: {part: statistics.median(r[part] for r in rs) for part in rs[0]} if rs else None
               for name, rs in runs.items()}
    ratio = None
    if all(medians.values()):
        ratio = (medians["dsgd"]["total"] - medians["start"]["total"]) / medians["plain"]["total"]
    return {"variables": count, "floats": floats, "runs": runs, "order": order, "interrupted": interrupted,
            "median_s": medians, "ratio": ratio}


def table(sizes: list[dict[str, Any]]) -> str:
    lines = ["| variables | plain s | start s | dsgd set-up s | first step s | (dsgd - start)/plain | dsgd phases "
             "| later step ms: plain, dsgd |",
             "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        m = size["median_s"]
        if size["ratio"] is None:
            lines.append(f"| {size['variables']} | (interrupted) |  |  |  |  |  |  |")
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in m["dsgd"].items()
                           if k not in ("total", "set-up", "first step", "later step"))
        lines.append(f"| {size['variables']} | {m['plain']['total']:.2f} | {m['start']['total']:.2f} | "
                     f"{m['dsgd']['set-up']:.2f} | {m['dsgd']['first step']:.2f} | {size['ratio']:.2f} "
                     f"(target <= {TARGET}) | {phases} | {m['plain']['later step'] * 1000:.1f}, "
                     f"{m['dsgd']['later step'] * 1000:.1f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.setup_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--variables", type=int, nargs="+", default=[300, 2000], help="model sizes, in variables")
    p.add_argument("--floats", type=float, default=4e6, help="float32 elements of each model, in all")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds; every round starts every system afresh")
    p.add_argument("--later-steps", type=int, default=10,
                   help="steps after the first, timed each (plain and dsgd), not part of the set-up")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on each wait")
    common.add_ray_flags(p, "--num-workers + 2")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "setup_cost.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.setup_cost", argv)
    common.connect_ray(args, args.num_workers + 2)
    sizes = [run_size(count, args) for count in args.variables]
    result = {"command": command, "num_workers": args.num_workers, "rounds": args.rounds, "sizes": sizes,
              "table": table(sizes), **common.machine()}
    print("\n" + result["table"], flush=True)
    common.write_json(result, args.out)
    print(f"record written to {args.out}")
    return result


if __name__ == "__main__":
    main()

"""Exchange benchmark: what a 2-worker step costs beyond one worker alone, against the bound.

Four model shapes, each 2 workers x 1 device, every gradient computed by
TensorFlow (loss = sum over variables of reduce_sum(v) * x, x a random
scalar drawn in the graph each step: each gradient is a fresh full-size
tensor, while compute stays a read and a write of every weight):

  resnet101  ResNet-101's trainable variables (314 tensors, 44.5 M float32)
  huge       two embedding-like matrices of the same 44.5 M float32 in all
  tiny       3000 tensors of 256 float32 (3 MB)
  small      ResNet-101's 314 variables, every channel count scaled by 0.3
             (kernel sizes kept): 4.0 M float32, a small many-tensor model
  mnist      examples/mnist.py's convnet on its data (`--batch-size` per
             worker): 6 tensors, 0.14 M float32 on MNIST's 28x28 images,
             0.03 M on the 8x8 digits it falls back to offline

For each shape, five systems run interleaved in one run (round r: each takes
one step, in an order rotated by r, so machine noise hits all of them alike):

  floor   dsgd.DistributedSGD(model, num_workers=1): one worker computing alone
  ideal   one such 1-worker engine per worker (`--num-workers`), stepping at
          the same time, each from its own thread: the same workers
          computing, with no exchange
  simple  DistributedSGD(model, num_workers=2, strategy="simple")
  ps      DistributedSGD(model, num_workers=2, strategy="ps")
  bound   the driver averaging 2 gradient-sized float32 arrays into a
          preallocated buffer (numpy add, then multiply by 1/2): the
          in-process bound of a 2-way average

and, for mnist, a sixth:

  union   one plain TensorFlow session in this process (TensorFlow's
          default threads: every core) training the convnet on the union
          of the workers' batches, one batch of `--num-workers` x
          `--batch-size`: what "ps" is compared with (SPEC: "ps" <= 1.5x)

Every engine runs at dsgd's defaults unless an engine flag says otherwise.
`--nodes N` runs them on N simulated nodes (``ray.cluster_utils``: a raylet
and object store each, on this machine), the workers spread over them, so
pushes to a server on another node cross the object store (the cross-node
path); the record lists each node's actors.
`--compression bf16 [fp16]` adds a system per value, "ps-bf16" ("ps" whose
partitions travel as 16-bit floats), interleaved with the others.
`--tf2` adds "ps-tf2": the same variables and loss written as a
``dsgd.TF2Model`` (eager variables, a Keras SGD optimizer, the step traced
in a ``tf.function``), "ps" the TF2 way; its ratio to "ps" is reported
(target <= 1.1). Not for the mnist shape.
`--send-schedule POLICY` adds "ps-sched": "ps" with the workers' send
scheduler under that policy (``DSGD_SEND_SCHEDULE``, e.g. "rounds"; "ps"
runs the engine's own, "streams"), its ratio to "ps" reported.
A step is `sgd.step(fetch_stats=True)` timed in the driver; with `--burst N`
a system's turn is N steps back to back, all but the last without stats
(as examples/mnist.py trains: steps in flight, stats every `--log-every`),
timed together and divided by N. Reported: median
step of each system over `--steps` rounds after `--warmup` warm-up rounds
(and, with `--steady-warmup N`, again after N more rounds, labelled steady),
"ps"/"simple" (target <= 0.7), (ps - floor)/bound (target <= 2.0),
(ps - ideal)/bound (target <= 1.5) and, for mnist, ps/union (target <= 1.5).
Writes benchmarks/results/exchange.json. From the repository root:

    .venv/bin/python benchmarks/exchange.py
    .venv/bin/python -m benchmarks.exchange --shapes huge --steady-warmup 20
    .venv/bin/python -m benchmarks.exchange --shapes small tiny mnist
    .venv/bin/python -m benchmarks.exchange --shapes resnet101 small --tf2
    .venv/bin/python -m benchmarks.exchange --shapes resnet101 --nodes 2 --num-workers 4   # 2 workers per node
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/exchange.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import functools
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tensorflow as tf

import dsgd
from dsgd.config import SEND_SCHEDULE_ENV
from benchmarks import common
from benchmarks.resnet import resnet_v1

VARIABLE_SHAPES = ("resnet101", "huge", "tiny", "small")  # ExchangeModel's
SHAPES = (*VARIABLE_SHAPES, "mnist")
SYSTEMS = ("floor", "ideal", "simple", "ps", "bound")
HUGE_ROWS, HUGE_COLS = 174_020, 128  # two of these: ResNet-101's 44.5 M float32
TINY_SHAPE = [32, 8]
SMALL_WIDTH = 0.3  # the small shape: ResNet-101's channel counts times this (4.0 M float32)
LEARNING_RATE = 0.01
TARGETS = {"ps/simple": 0.7, "(ps - floor)/bound": 2.0, "(ps - ideal)/bound": 1.5, "ps/union": 1.5,
           "ps-tf2/ps": 1.1, "ps-sched/ps": 1.05}


def resnet_shapes(model: str) -> list[tuple[str, list[int]]]:
    """Names and shapes of a ResNet's trainable variables."""
    shapes = []

    def record(name, shape, initializer, trainable):
        if trainable:
            shapes.append((name, list(shape)))
        return tf.zeros(shape)

    with tf.Graph().as_default():
        resnet_v1(tf.zeros([1, 32, 32, 3]), model, record, training=False)
    return shapes


def variable_shapes(shape: str, scale: float = 1.0, tiny_count: int = 3000) -> list[tuple[str, list[int]]]:
    """The variables of model shape `shape`; `scale` < 1 shrinks each to a 1-D tensor
    of that fraction of its elements (at least one), for smoke runs."""
    if shape == "resnet101":
        variables = resnet_shapes("resnet101")
    elif shape == "huge":
        variables = [(f"embedding_{i}", [HUGE_ROWS, HUGE_COLS]) for i in range(2)]
    elif shape == "tiny":
        variables = [(f"tiny_{i:04d}", TINY_SHAPE) for i in range(tiny_count)]
    elif shape == "small":
        variables = [(name, narrower(dims, SMALL_WIDTH)) for name, dims in resnet_shapes("resnet101")]
    else:
        raise ValueError(f"shape must be one of {VARIABLE_SHAPES}, got {shape!r}")
    if scale == 1.0:
        return variables
    return [(name, [max(1, round(int(np.prod(dims)) * scale))]) for name, dims in variables]


def narrower(dims: list[int], width: float) -> list[int]:
    """A variable's shape with its channel counts times ``width`` (at least 1); a conv kernel's size is kept."""
    kept = 2 if len(dims) == 4 else 0
    return dims[:kept] + [max(1, round(d * width)) for d in dims[kept:]]


MIX_WIDTH = 64  # the compute's layers: MIX_WIDTH x MIX_WIDTH matrices
MIX = np.linalg.qr(np.random.default_rng(0).normal(size=(MIX_WIDTH, MIX_WIDTH)))[0].astype(np.float32)


class ExchangeModel(dsgd.Model):
    """Variables of the given shapes; loss = sum_k reduce_sum(v_k) * x_k, x random each step.

    TensorFlow computes each gradient, x_k broadcast to v_k's shape: a new
    full-size tensor every step (nothing fed, nothing aliased), for the cost
    of one read and one write of every weight. With ``compute_rows`` r > 0
    the variables are also a network: each one's elements, as many whole
    ``MIX_WIDTH`` x ``MIX_WIDTH`` matrices as it holds, are layers
    tanh(z @ (MIX + w)) that a batch z of r rows goes through, variable by
    variable in order (MIX a fixed orthogonal matrix), the batch's mean
    output added to the loss. Back-propagation then runs layer by layer from
    the last variable to the first, each gradient ready when its layers are
    done, as in a real network, in time that grows with r: what the
    exchange can hide behind.
    """

    def __init__(self, worker_index: int, device_index: int, shapes: list[tuple[str, list[int]]],
                 compute_rows: int = 0):
        scales = tf.unstack(tf.random.uniform([len(shapes)], 0.5, 1.5))
        variables = [tf.compat.v1.get_variable(name, shape, tf.float32, initializer=tf.compat.v1.zeros_initializer())
                     for name, shape in shapes]
        terms = [tf.reduce_sum(variable) * scale for variable, scale in zip(variables, scales)]
        if compute_rows:
            terms.append(tf.reduce_mean(_network_output(variables, compute_rows)))
        self.loss = tf.add_n(terms)

    def get_loss(self) -> tf.Tensor:
        return self.loss

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)


def _network_output(variables: list, rows: int) -> tf.Tensor:
    """A batch of ``rows`` rows through every variable's whole ``MIX_WIDTH`` x ``MIX_WIDTH`` matrices, in order,
    each a layer tanh(z @ (MIX + w)) (``ExchangeModel``'s compute)."""
    z = tf.constant(np.random.default_rng(1).normal(size=(rows, MIX_WIDTH)).astype(np.float32))
    for variable in variables:
        layers = variable.shape.num_elements() // MIX_WIDTH ** 2
        if layers:
            matrices = tf.reshape(tf.reshape(variable, [-1])[:layers * MIX_WIDTH ** 2], [layers, MIX_WIDTH, MIX_WIDTH])
            for layer in tf.unstack(matrices):
                z = tf.tanh(tf.matmul(z, MIX + layer))
    return z


class ExchangeModelTF2(dsgd.TF2Model):
    """``ExchangeModel`` the TF2 way: the same variables (eager, zeros) and loss, a Keras SGD optimizer."""

    def __init__(self, worker_index: int, device_index: int, shapes: list[tuple[str, list[int]]]):
        import keras

        self.variables = [tf.Variable(tf.zeros(shape), name=name.split(":")[0]) for name, shape in shapes]
        self.optimizer = keras.optimizers.SGD(LEARNING_RATE)

    def get_variables(self) -> list:
        return self.variables

    def get_optimizer(self):
        return self.optimizer

    def get_batch(self) -> np.ndarray:
        return np.zeros((1,), np.float32)  # the loss reads no input

    def get_loss(self, batch: tf.Tensor) -> tf.Tensor:
        scales = tf.unstack(tf.random.uniform([len(self.variables)], 0.5, 1.5))
        return tf.add_n([tf.reduce_sum(v) * scale for v, scale in zip(self.variables, scales)])


class Bound:
    """The in-process bound: average `workers` gradient-sized arrays into a preallocated buffer."""

    def __init__(self, num_elements: int, workers: int):
        rng = np.random.default_rng(0)
        self.arrays = [rng.random(num_elements, np.float32) for _ in range(workers)]
        self.out = np.empty(num_elements, np.float32)

    def step(self, fetch_stats: bool = True) -> None:
        """One average (``fetch_stats``, for ``burst``, changes nothing)."""
        np.add(self.arrays[0], self.arrays[1], out=self.out)
        for array in self.arrays[2:]:
            np.add(self.out, array, out=self.out)
        np.multiply(self.out, 1.0 / len(self.arrays), out=self.out)


class UnionBatch:
    """One plain TensorFlow session in this process training examples/mnist.py's convnet on the union of
    ``workers`` batches of ``batch_size``: one batch of ``workers x batch_size``, loss and accuracy fetched."""

    def __init__(self, workers: int, batch_size: int):
        mnist = common.example("mnist")
        args = mnist.parse_args(["--num-workers", "1", "--batch-size", str(workers * batch_size)])
        graph = tf.Graph()
        with graph.as_default():
            self.model = mnist.ConvNet(0, 0, args)
            train = self.model.get_optimizer().minimize(self.model.get_loss())
            self.fetches = {"train": train, "loss": self.model.get_loss(), **self.model.get_metrics()}
            self.variables = [(v.name, v.shape.as_list()) for v in tf.compat.v1.trainable_variables()]
            self.sess = tf.compat.v1.Session(graph=graph)
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def step(self, fetch_stats: bool = True) -> None:
        self.sess.run(self.fetches if fetch_stats else self.fetches["train"], self.model.get_feed_dict())

    def close(self) -> None:
        self.sess.close()


def timed_burst(run: Callable[[int], Any], steps: int) -> Callable[[], float]:
    """A system's turn: ``run(steps)`` timed, in seconds per step."""
    def turn() -> float:
        start = time.perf_counter()
        run(steps)
        return (time.perf_counter() - start) / steps
    return turn


def summarize_phase(times: dict[str, list[float]], warmup: int) -> dict[str, Any]:
    """Median ms of each system over the steps after `warmup`, and the target ratios."""
    medians = {name: statistics.median(t[warmup:]) * 1000 if t[warmup:] else None for name, t in times.items()}
    ratios = dict.fromkeys(TARGETS)
    if all(medians[name] is not None for name in SYSTEMS):
        ratios.update({"ps/simple": medians["ps"] / medians["simple"],
                       "(ps - floor)/bound": (medians["ps"] - medians["floor"]) / medians["bound"],
                       "(ps - ideal)/bound": (medians["ps"] - medians["ideal"]) / medians["bound"]})
        if medians.get("union") is not None:
            ratios["ps/union"] = medians["ps"] / medians["union"]
        for other in ("ps-tf2", "ps-sched"):
            if medians.get(other) is not None:
                ratios[f"{other}/ps"] = medians[other] / medians["ps"]
    return {"warmup": warmup, "measured_steps": min(len(t[warmup:]) for t in times.values()),
            "median_ms": medians, "ratios": ratios, "step_s": times}


def run_shape(shape: str, args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build the shape's engines and the bound, run the interleaved rounds; the shape's record."""
    union = None
    if shape == "mnist":
        union = UnionBatch(args.num_workers, args.batch_size)
        variables = union.variables
        creator = common.mnist_creator(args.num_workers, args.batch_size)
    else:
        variables = variable_shapes(shape, args.scale, args.tiny_count)
        creator = functools.partial(ExchangeModel, shapes=variables)
    num_elements = sum(int(np.prod(dims)) for _, dims in variables)
    print(f"\n== {shape}: {len(variables)} tensors, {num_elements / 1e6:.2f} M float32 "
          f"({num_elements * 4 / 1e6:.1f} MB), {args.num_workers} workers", flush=True)
    record: dict[str, Any] = {"shape": shape, "tensors": len(variables), "elements": num_elements,
                              "setup_s": {}, "interrupted": False}
    with contextlib.ExitStack() as engines_alive:
        if union is not None:
            engines_alive.callback(union.close)
        engines = {}
        # "ideal" steps the floor's engine and one more 1-worker engine per further worker, all at once
        ideal_engines = [f"ideal-{k}" for k in range(1, args.num_workers)]
        builds = [("floor", 1, {}), *((name, 1, {}) for name in ideal_engines),
                  ("simple", args.num_workers, {"strategy": "simple"}), ("ps", args.num_workers, {"strategy": "ps"})]
        builds += [(f"ps-{c}", args.num_workers, {"strategy": "ps", "compression": c}) for c in args.compression]
        if args.tf2 and union is None:
            builds.append(("ps-tf2", args.num_workers, {"strategy": "ps"}))
        if args.send_schedule:
            builds.append(("ps-sched", args.num_workers, {"strategy": "ps"}))
        for name, workers, strategy in builds:
            start = time.perf_counter()
            made_by = functools.partial(ExchangeModelTF2, shapes=variables) if name == "ps-tf2" else creator
            scheduled = common.environment(**{SEND_SCHEDULE_ENV: args.send_schedule}) if name == "ps-sched" else \
                contextlib.nullcontext()
            with scheduled:
                engines[name] = engines_alive.enter_context(
                    dsgd.DistributedSGD(made_by, num_workers=workers, **strategy, **kwargs))
            record["setup_s"][name] = time.perf_counter() - start
            print(f"  {name}: built in {record['setup_s'][name]:.1f} s", flush=True)
        ps = engines["ps"]
        record["num_parameter_servers"] = len(common.parameter_servers(ps))
        record["num_partitions"] = common.partition_count(ps)
        record["ps_actors_per_node"] = common.actors_per_node(ps)
        print(f"  ps: {record['num_parameter_servers']} parameter servers, "
              f"{record['num_partitions']} partitions; {'; '.join(record['ps_actors_per_node'])}", flush=True)
        bound = Bound(num_elements, args.num_workers)
        ideal = common.Ideal([engines["floor"], *(engines.pop(name) for name in ideal_engines)])
        engines_alive.callback(ideal.close)
        runs = {name: functools.partial(common.burst, engine.step) for name, engine in engines.items()}
        runs = {"floor": runs.pop("floor"), "ideal": ideal.burst, **runs,
                "bound": functools.partial(common.burst, bound.step)}
        if union is not None:
            runs["union"] = functools.partial(common.burst, union.step)
        systems = {name: timed_burst(run, args.burst) for name, run in runs.items()}
        record["systems"] = list(systems)

        times, record["order"], interrupted = common.run_rounds(
            systems, args.warmup + args.steps, args.warmup, settle_s=args.settle_s)
        record["first"] = summarize_phase(times, args.warmup)
        if args.steady_warmup and not interrupted:
            times, order, interrupted = common.run_rounds(
                systems, args.steady_warmup + args.steps, args.steady_warmup, settle_s=args.settle_s)
            record["order"] += order
            record["steady"] = summarize_phase(times, args.steady_warmup)
        record["interrupted"] = interrupted
    print_shape(record, args)
    return record


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(name: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f} ({'meets' if value <= TARGETS[name] else 'misses'} <= {TARGETS[name]})"


def phases(record: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, summary) of the shape's measured phases: the first steps, and steady state if run."""
    labelled = [(f"first {args.steps} after {args.warmup} warm-up", record["first"])]
    if "steady" in record:
        labelled.append((f"steady: {args.steps} after {args.warmup + args.steps + args.steady_warmup}",
                         record["steady"]))
    return labelled


def print_shape(record: dict[str, Any], args: argparse.Namespace) -> None:
    """The shape's medians per system and its two ratios, one column per phase."""
    labelled = phases(record, args)
    print(f"\n{record['shape']}: {record['tensors']} tensors, {record['elements'] / 1e6:.2f} M float32; "
          f"ps: {record.get('num_parameter_servers', '?')} parameter servers, "
          f"{record.get('num_partitions', '?')} partitions")
    print(f"{'median step, ms':<22}" + "".join(f"{label:>40}" for label, _ in labelled))
    for name in record["systems"]:
        print(f"{name:<22}" + "".join(f"{_ms(phase['median_ms'][name]):>40}" for _, phase in labelled))
    for name in TARGETS:
        print(f"{name:<22}" + "".join(f"{_ratio(name, phase['ratios'][name]):>40}" for _, phase in labelled))


def summary_table(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """A markdown table of every shape and phase: medians, ratios, servers and partitions."""
    systems = list(dict.fromkeys(name for r in records for name in r["systems"])) or list(SYSTEMS)
    lines = ["| shape | steps | " + " | ".join(f"{n} ms" for n in systems)
             + " | ps/simple | (ps − floor)/bound | (ps − ideal)/bound | ps/union | ps-tf2/ps | ps-sched/ps"
               " | servers / partitions |",
             "|---" * (len(systems) + 3 + len(TARGETS)) + "|"]
    for r in records:
        for label, phase in phases(r, args):
            ms, ratios = phase["median_ms"], phase["ratios"]
            ratio_cells = " | ".join("–" if ratios[n] is None else f"{ratios[n]:.2f}" for n in TARGETS)
            lines.append(f"| {r['shape']} | {label} | " + " | ".join(_ms(ms.get(n)) for n in systems)
                         + f" | {ratio_cells} | {r.get('num_parameter_servers', '?')} / "
                           f"{r.get('num_partitions', '?')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--num-workers", type=int, default=2, help="workers of simple and ps (at least 2)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds, not measured")
    p.add_argument("--steps", type=int, default=10, help="measured rounds (one step per system each)")
    p.add_argument("--steady-warmup", type=int, default=0,
                   help="then N more rounds and --steps more measured: steady state, reported beside")
    p.add_argument("--settle-s", type=float, default=0.1,
                   help="pause before every step, so one system's trailing work does not slow the next")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink every tensor to this fraction of its elements (1-D), for smoke runs")
    p.add_argument("--tiny-count", type=int, default=3000, help="tensors of the tiny shape")
    p.add_argument("--burst", type=int, default=1,
                   help="steps per system's turn, back to back, stats fetched by the last; reported per step")
    p.add_argument("--batch-size", type=int, default=32, help="the mnist shape's batch per worker "
                                                               "(examples/mnist.py's default)")
    common.add_engine_flags(p)
    p.add_argument("--compression", nargs="+", choices=["bf16", "fp16"], default=[],
                   help='also "ps" with its float32 partitions sent as these 16-bit floats ("ps-bf16", ...)')
    common.add_ray_flags(p, "the CPUs the engines reserve: 3 x workers, and workers more per --compression value")
    p.add_argument("--tf2", action="store_true", help='also "ps" the TF2 way ("ps-tf2", a dsgd.TF2Model)')
    p.add_argument("--send-schedule", default=None, metavar="POLICY",
                   help='also "ps" with the workers\' send scheduler under this policy ("ps-sched"; e.g. rounds)')
    p.add_argument("--object-store-memory", type=int, default=2 << 30,
                   help="bytes (per node with --nodes), when starting Ray here")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes to start here (ray.cluster_utils), the CPUs split evenly among them")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "exchange.json")
    args = p.parse_args(argv)
    if args.num_workers < 2:
        p.error("--num-workers must be at least 2: the exchange is between workers")
    if args.nodes < 1:
        p.error("--nodes must be at least 1")
    if args.nodes > 1 and args.address:
        p.error("--nodes starts its own cluster: leave out --address")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.exchange", argv)
    kwargs = common.engine_kwargs(args)
    print(f"command: {command}\nengine arguments: {kwargs or 'defaults'}", flush=True)
    # floor and ideal: one engine of 1 worker per worker; simple, ps and each ps-<compression>: one of all workers
    cpus = args.num_cpus or args.num_workers * (3 + len(args.compression) + args.tf2 + bool(args.send_schedule))
    if args.nodes > 1:
        cluster = common.local_cluster(args.nodes, math.ceil(cpus / args.nodes), args.object_store_memory)
    else:
        common.connect_ray(args, cpus, object_store_memory=args.object_store_memory)
        cluster = contextlib.nullcontext()
    records = []
    with cluster:
        for shape in args.shapes:
            records.append(run_shape(shape, args, kwargs))
            if records[-1]["interrupted"]:
                break
    table = summary_table(records, args)
    print(f"\n{command}\n\n{table}")
    result = {"command": command, "engine_kwargs": kwargs, "num_workers": args.num_workers, "nodes": args.nodes,
              "settle_s": args.settle_s, "burst": args.burst, "scale": args.scale, "shapes": records, "table": table,
              **common.machine()}
    common.write_json(result, args.out)
    print(f"\nrecord written to {args.out}")
    return result


if __name__ == "__main__":
    main()

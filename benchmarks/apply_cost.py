"""What applying a step's mean costs: Keras 3's own updates against TensorFlow's fused kernels.

The TF2 way applies the mean with the user's Keras 3 optimizer
(``optimizer.apply`` inside the traced step), its per-variable updates
swapped for TensorFlow's fused training kernels where they compute the same
(``dsgd.worker.tf2.fused_updates``). This times one Keras optimizer's apply
with its own updates ("keras") and with the kernels ("fused"), alone, in one
process, on the exchange benchmark's variable shapes (default: ResNet-101's
44.5 M float32), each traced once in a ``tf.function`` and called `--burst`
times per measured step, the systems interleaved (``common.run_rounds``).
Printed per optimizer: median ms per apply and keras/fused.

    .venv/bin/python -m benchmarks.apply_cost
    .venv/bin/python benchmarks/apply_cost.py --optimizers sgd adam --shape small
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/apply_cost.py`
    import _repo_path  # noqa: F401

import argparse
import os
import statistics
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import tensorflow as tf

from benchmarks import common, exchange
from dsgd.worker.tf2.fused_updates import fuse_updates

LEARNING_RATE = 0.01
MOMENTUM = 0.9
OPTIMIZERS = ("sgd", "momentum", "adam")


def keras_optimizer(kind: str) -> keras.optimizers.Optimizer:
    if kind == "sgd":
        return keras.optimizers.SGD(LEARNING_RATE)
    if kind == "momentum":
        return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    return keras.optimizers.Adam(LEARNING_RATE)


def traced_apply(kind: str, fused: bool, variables: list[tf.Variable], grads: list[tf.Tensor]) -> Callable[[], Any]:
    """One traced ``optimizer.apply`` of `grads` to `variables`: Keras's own updates, or the fused kernels."""
    optimizer = keras_optimizer(kind)
    optimizer.build(variables)
    if fused and not fuse_updates(optimizer):
        raise ValueError(f"{kind}: dsgd has no fused kernel for {type(optimizer).__name__}")
    return tf.function(lambda: optimizer.apply(grads, variables), autograph=False).get_concrete_function()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=exchange.VARIABLE_SHAPES, default="resnet101")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds")
    p.add_argument("--burst", type=int, default=5, help="applies per timed step")
    p.add_argument("--scale", type=float, default=1.0, help="the shape's size fraction (smoke runs)")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "apply_cost.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.apply_cost", argv)
    print(f"command: {command}", flush=True)
    shapes = exchange.variable_shapes(args.shape, args.scale)
    variables = [tf.Variable(tf.zeros(dims)) for _, dims in shapes]
    grads = [tf.fill(dims, 1e-3) for _, dims in shapes]
    systems = {}
    for kind in args.optimizers:
        for way in ("keras", "fused"):
            apply = traced_apply(kind, way == "fused", variables, grads)
            systems[f"{kind}-{way}"] = common.timed(lambda apply=apply: [apply() for _ in range(args.burst)])
    times, order, interrupted = common.run_rounds(systems, args.warmup + args.rounds, args.warmup)
    median_ms = {name: statistics.median(t[args.warmup:]) / args.burst * 1000 for name, t in times.items()
                 if len(t) > args.warmup}
    lines = ["| optimizer | Keras's updates ms | fused kernels ms | keras/fused |", "|---|---|---|---|"]
    for kind in args.optimizers:
        keras_ms, fused_ms = median_ms.get(f"{kind}-keras"), median_ms.get(f"{kind}-fused")
        if keras_ms is not None and fused_ms is not None:
            lines.append(f"| {kind} | {keras_ms:.1f} | {fused_ms:.1f} | {keras_ms / fused_ms:.2f} |")
    table = "\n".join(lines)
    print(f"\n{command}\n{args.shape}: {sum(v.shape.num_elements() for v in variables) / 1e6:.1f} M float32\n\n{table}")
    result = {"command": command, "shape": args.shape, "burst": args.burst, "median_ms": median_ms,
              "times": times, "order": order, "interrupted": interrupted, "table": table, **common.machine()}
    common.write_json(result, args.out)
    return result


if __name__ == "__main__":
    main()

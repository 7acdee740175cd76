"""The apply's non-finite check: dsgd's two against one CheckNumerics per tensor, on the exchange benchmark's shapes.

Every step checks each mean before the apply (``nan_policy``). This times,
in one process with one TensorFlow thread (a worker's budget), a run of the
check alone over each shape's variables (random float32, fed once into
variables), three ways, interleaved, median of `--reps` runs each:

  checknumerics  one `CheckNumerics` op per tensor (dsgd's check until
                 2026-11-24, whose element loop is scalar)
  tensors        dsgd's check per mean (``dsgd.worker.finite_checks.finite_tensors``: a
                 vectorized `is_finite` reduction per large tensor, one
                 assert for them all): "simple", the Python "ps" path, one
                 worker alone
  partitions     dsgd's check per received partition
                 (``dsgd.worker.finite_checks.finite_partitions``), "ps" through the
                 op library: the same floats in the partitions the engine
                 would make at its defaults for two parameter servers, laid
                 out as they arrive (one flat tensor per partition)

From the repository root:

    .venv/bin/python benchmarks/finite_check.py [--shapes resnet101 small tiny] [--reps 20]
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/finite_check.py`
    import _repo_path  # noqa: F401

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

from benchmarks.exchange import variable_shapes
from dsgd.wire import partitions
from dsgd.worker import finite_checks
from dsgd.config import WorkerConfig


CHECKS = ("checknumerics", "tensors", "partitions")
SERVERS = 2  # the partitions' layout is the engine's default for this many parameter servers


def check_ops(shape: str) -> tuple[tf.Graph, dict[str, tf.Operation], int]:
    """A graph holding ``shape``'s variables, the same floats laid out in partitions, and the three checks
    over them (``CHECKS``); the checks by name (and "init"), and the float count."""
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    config = WorkerConfig(exchange="ps", devices_per_worker=1, gpu=False, all_reduce_alg="auto",
                          cpus_per_worker=1, step_timeout_s=60, startup_timeout_s=60)
    specs = [partitions.VarSpec(name, tuple(dims), np.dtype(np.float32)) for name, dims in variable_shapes(shape)]
    layout = partitions.plan_partitions(specs, partitions.default_partition_bytes(specs, SERVERS))
    with graph.as_default():
        names, tensors = [], []
        for spec in specs:
            v = tf.compat.v1.Variable(rng.standard_normal(spec.shape).astype(np.float32),
                                      name=spec.name.replace(":", "_"))
            names.append(spec.name)
            tensors.append(v.read_value())
        flat = [tf.compat.v1.Variable(rng.standard_normal(s.size).astype(np.float32)).read_value()
                for s in layout]
        ops = {"checknumerics": tf.group(*[tf.debugging.check_numerics(t, f"non-finite {n}")
                                           for t, n in zip(tensors, names)]),
               "tensors": tf.group(*finite_checks.finite_tensors(tensors, names, "gradient", config)),
               "partitions": tf.group(*finite_checks.finite_partitions(flat, layout, specs, len(specs), config)),
               "init": tf.compat.v1.global_variables_initializer()}
    return graph, ops, sum(s.size for s in specs)


def measure(shape: str, reps: int) -> dict[str, float]:
    """Median ms of each check's run over ``shape``'s tensors, interleaved."""
    graph, ops, floats = check_ops(shape)
    session_config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    times: dict[str, list[float]] = {name: [] for name in CHECKS}
    with tf.compat.v1.Session(graph=graph, config=session_config) as session:
        session.run(ops["init"])
        for name in times:  # warm-up: TensorFlow plans each run once
            session.run(ops[name])
        for _ in range(reps):
            for name in times:
                start = time.perf_counter()
                session.run(ops[name])
                times[name].append((time.perf_counter() - start) * 1000)
    result = {name: statistics.median(t) for name, t in times.items()}
    base = result["checknumerics"]
    print(f"{shape}: {floats / 1e6:.1f} M float32 in {len(variable_shapes(shape))} tensors: "
          f"CheckNumerics per tensor {base:.1f} ms, dsgd's check per tensor {result['tensors']:.1f} ms "
          f"({result['tensors'] / base:.2f}x), per partition {result['partitions']:.1f} ms "
          f"({result['partitions'] / base:.2f}x)", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=["resnet101", "small", "huge", "tiny"],
                        default=["resnet101", "small"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    for shape in args.shapes:
        measure(shape, args.reps)


if __name__ == "__main__":
    main()

"""The fixed CPU cost of one partition per "ps" step, for A/B runs across engine versions.

A 1 MiB model (64 variables of 4096 float32) trained by 2 workers with
"ps", its gradients cut into `--partitions` partitions. Prints the whole
machine's busy CPU time per step (from /proc/stat, so workers, servers,
raylet and driver all count) and the wall time per step, over `--steps`
steps after `--warmup`. The bytes are tiny, so the difference between two
partition counts is the per-partition cost. `--tree DIR` imports dsgd from
another checkout (e.g. `git worktree add /tmp/old <commit>`, with its op
library built), so two engine versions run the same script; run it from
that checkout's directory, since Ray workers import from the working
directory first:

    .venv/bin/python benchmarks/partition_cost.py --partitions 1 --num-parameter-servers 1
    .venv/bin/python benchmarks/partition_cost.py --partitions 16 --num-parameter-servers 1
    cd /tmp/old && $REPO/.venv/bin/python $REPO/benchmarks/partition_cost.py --partitions 16 --tree /tmp/old

Linux only (/proc/stat). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy (not idle or waiting on I/O) since boot."""
    fields = [float(x) for x in open("/proc/stat").readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--num-parameter-servers", type=int, default=None,
                        help="pass this to the engine (only engines that have the option)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="checkout to import dsgd from (default: this one)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)

    import ray
    import tensorflow as tf
    from ray.util.state import list_actors  # counts the servers the same way in any engine version

    import dsgd

    num_vars, size = 64, 4096

    class Model(dsgd.Model):
        def __init__(self, worker_index, device_index):
            variables = [tf.compat.v1.get_variable(f"v{i}", [size], initializer=tf.compat.v1.zeros_initializer())
                         for i in range(num_vars)]
            self.loss = tf.add_n([tf.reduce_sum(v) for v in variables])

        def get_loss(self):
            return self.loss

        def get_optimizer(self):
            return tf.compat.v1.train.GradientDescentOptimizer(0.01)

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": args.tree, "TF_CPP_MIN_LOG_LEVEL": "2"}})
    options = {"grad_shard_bytes": num_vars * size * 4 // args.partitions, "nan_policy": "ignore"}
    if args.num_parameter_servers is not None:
        options["num_parameter_servers"] = args.num_parameter_servers
    with dsgd.DistributedSGD(Model, num_workers=2, strategy="ps", **options) as sgd:
        for _ in range(args.warmup):
            sgd.step()
        sgd.get_weights()
        cpu, wall = busy_cpu_s(), time.perf_counter()
        for _ in range(args.steps):
            sgd.step()
        sgd.get_weights()
        wall, cpu = (time.perf_counter() - wall) / args.steps, (busy_cpu_s() - cpu) / args.steps
        servers = list_actors(filters=[("class_name", "=", "ParameterServer"), ("state", "=", "ALIVE")])
        print(f"tree {args.tree}: {args.partitions} partitions requested, {len(servers)} parameter "
              f"server processes; per step: {wall * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms machine CPU")
    ray.shutdown()


if __name__ == "__main__":
    main()

"""Stragglers: backup workers against none, one worker slowed every step, interleaved in one run.

Two engines at dsgd's defaults ("ps"), `--num-workers` workers (3) of one
device, the last worker slowed in every step:

  b=0   DistributedSGD(..., backup_workers=0): every step waits for it
  b=1   DistributedSGD(..., backup_workers=1): a step closes without it

The model is a small MLP on synthetic data (each worker its own batches; a
step of the others takes milliseconds). The slow worker is slowed one of two
ways (`--slow`):

  sleep   it sleeps `--delay-s` in every get_feed_dict
  hog     it shares one core with `--hogs` busy-looping processes (pinned
          there with it), a noisy neighbour instead of a fixed delay

Both engines start from the same weights and run in rounds: round r runs
`--chunk` steps of each engine (each step `step(fetch_stats=True)`, timed in
the driver), in an order rotated by r; after a chunk the engine is drained
(untimed), so a straggler never catches up on the other engine's clock.
Reported: each engine's step-time median and p90 over the measured rounds,
the ratios b=1/b=0, and the loss on a fixed held-out batch after the same
number of steps (what dropping the straggler's gradients costs). Writes
benchmarks/results/stragglers.json. From the repository root:

    .venv/bin/python benchmarks/stragglers.py                       # 1 s delay, 3 warm-up + 10 rounds of 10 steps
    .venv/bin/python -m benchmarks.stragglers --slow hog --hogs 3
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/stragglers.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import dsgd
from benchmarks import common

SYSTEMS = {"b=0": 0, "b=1": 1}
# A busy loop that ends once the process that started it (the slow worker) is gone.
HOG = ("import os, time\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
       "    end = time.perf_counter() + 0.05\n    while time.perf_counter() < end:\n        pass\n")


class StragglerMLP(dsgd.Model):
    """Softmax regression through one hidden layer on fixed random data; worker ``slow_worker`` is slowed."""

    def __init__(self, worker_index: int, device_index: int, slow_worker: int, slow: str, delay_s: float,
                 hogs: int, features: int = 64, hidden: int = 256, classes: int = 10, batch: int = 64):
        self.rng = np.random.RandomState(worker_index)
        self.shape = (batch, features, classes)
        self.x = tf.compat.v1.placeholder(tf.float32, [None, features])
        self.y = tf.compat.v1.placeholder(tf.int64, [None])
        w1 = tf.compat.v1.get_variable("hidden/w", [features, hidden])
        b1 = tf.compat.v1.get_variable("hidden/b", [hidden], initializer=tf.compat.v1.zeros_initializer())
        w2 = tf.compat.v1.get_variable("out/w", [hidden, classes])
        logits = tf.nn.relu(tf.matmul(self.x, w1) + b1) @ w2
        self.loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=self.y, logits=logits))
        self.truth = np.random.RandomState(99).randn(features, classes).astype(np.float32)  # the labels' rule
        self.delay_s = delay_s if worker_index == slow_worker and slow == "sleep" else 0.0
        self.hogs = _start_hogs(hogs) if worker_index == slow_worker and slow == "hog" else []

    def batch(self, rng: np.random.RandomState) -> dict:
        size, features, _ = self.shape
        x = rng.randn(size, features).astype(np.float32)
        return {self.x: x, self.y: np.argmax(x @ self.truth, axis=1)}

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(0.1)

    def get_feed_dict(self):
        time.sleep(self.delay_s)
        return self.batch(self.rng)

    def held_out_loss(self) -> float:
        """The loss on a fixed batch no worker trains on (the worker's session is the default)."""
        return float(tf.compat.v1.get_default_session().run(self.loss, self.batch(np.random.RandomState(12345))))


def _start_hogs(count: int) -> list[subprocess.Popen]:
    """Pin this process to one core and start ``count`` busy loops on the same core."""
    core = {max(os.sched_getaffinity(0))}
    os.sched_setaffinity(0, core)
    return [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=lambda: os.sched_setaffinity(0, core))
            for _ in range(count)]


def run_chunk(sgd: dsgd.DistributedSGD, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` timed steps, then an untimed drain; their times and the gradients each dropped."""
    times, dropped = [], []
    for _ in range(steps):
        start = time.perf_counter()
        stats = sgd.step(fetch_stats=True)
        times.append(time.perf_counter() - start)
        dropped.append(stats.get("dropped_gradients", 0.0))
    sgd.get_weights()  # the drain: every worker caught up
    return times, dropped


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=3)
    p.add_argument("--slow", choices=["sleep", "hog"], default="sleep", help="how the last worker is slowed")
    p.add_argument("--delay-s", type=float, default=1.0, help="--slow sleep: the delay in every step")
    p.add_argument("--hogs", type=int, default=3, help="--slow hog: busy processes on the slow worker's core")
    p.add_argument("--chunk", type=int, default=10, help="steps of one engine in a round")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds, not measured")
    p.add_argument("--rounds", type=int, default=10, help="measured rounds")
    common.add_ray_flags(p, "what both engines reserve, plus 2")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "stragglers.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.stragglers", argv)
    print(f"command: {command}", flush=True)
    common.connect_ray(args, 2 * args.num_workers + 2)
    creator = functools.partial(StragglerMLP, slow_worker=args.num_workers - 1, slow=args.slow,
                                delay_s=args.delay_s, hogs=args.hogs)
    engines = {name: dsgd.DistributedSGD(creator, num_workers=args.num_workers, backup_workers=b)
               for name, b in SYSTEMS.items()}
    try:
        start = engines["b=0"].get_weights()
        engines["b=1"].set_weights(start)
        times: dict[str, list[float]] = {name: [] for name in engines}
        dropped: dict[str, list[float]] = {name: [] for name in engines}
        order = []
        for r in range(args.warmup + args.rounds):
            for name in common.rotated(list(engines), r):
                chunk_times, chunk_dropped = run_chunk(engines[name], args.chunk)
                order.append(name)
                if r >= args.warmup:
                    times[name] += chunk_times
                    dropped[name] += chunk_dropped
                print(f"[round {r + 1}/{args.warmup + args.rounds} {'warm-up' if r < args.warmup else 'measure'}] "
                      f"{name}: median step {statistics.median(chunk_times) * 1000:.1f} ms", flush=True)
        losses = {name: sgd.for_model(lambda m: m.held_out_loss()) for name, sgd in engines.items()}
        steps = {name: sgd.num_steps for name, sgd in engines.items()}
    finally:
        for sgd in engines.values():
            sgd.shutdown()
    summary = {name: {"median_s": percentile(t, 50), "p90_s": percentile(t, 90), "held_out_loss": losses[name],
                      "steps": steps[name], "dropped_gradients_mean": statistics.fmean(dropped[name] or [0.0])}
               for name, t in times.items()}
    ratios = {"median_b1_over_b0": summary["b=1"]["median_s"] / summary["b=0"]["median_s"],
              "p90_b1_over_b0": summary["b=1"]["p90_s"] / summary["b=0"]["p90_s"]}
    slowed = f"{args.delay_s} s sleep" if args.slow == "sleep" else f"{args.hogs} busy processes on its core"
    table = "\n".join(["| engine | median step | p90 step | held-out loss | steps | dropped gradients/step |",
                       "|---|---|---|---|---|---|"] + [
        f"| {name} | {s['median_s'] * 1000:.1f} ms | {s['p90_s'] * 1000:.1f} ms | {s['held_out_loss']:.4f} | "
        f"{s['steps']} | {s['dropped_gradients_mean']:.2f} |" for name, s in summary.items()])
    print(f"\n{args.num_workers} workers, the last slowed by {slowed}\n{table}\n"
          f"b=1/b=0: median {ratios['median_b1_over_b0']:.2f}, p90 {ratios['p90_b1_over_b0']:.2f}", flush=True)
    result = {"command": command, "num_workers": args.num_workers, "slow": args.slow, "delay_s": args.delay_s,
              "hogs": args.hogs, "chunk": args.chunk, "warmup": args.warmup, "rounds": args.rounds,
              "summary": summary, "ratios": ratios, "table": table, "order": order, "step_times_s": times,
              **common.machine()}
    common.write_json(result, args.out)
    print(f"record written to {args.out}")
    return result


if __name__ == "__main__":
    main()

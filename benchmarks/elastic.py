"""Elastic training: the time to grow by one worker and to shrink by one, against a restart from a checkpoint.

For each model (ResNet-101's shapes on synthetic ImageNet, examples/mnist.py's
convnet) one engine of `--num-workers` workers runs, and each round times,
in an order rotated every round:

- `grow`: `resize(n + 1)` (settle, start and build one worker, copy the
  state to it, re-plan the parameter servers), then one step;
- `shrink`: `resize(n)` from n + 1, then one step;
- `restart`: what a restarting trainer does (Ray Train's resize): `save` is
  taken first (not timed), then the engine is shut down, a new one of n + 1
  workers built and the checkpoint restored, then one step. The new
  engine is then resized back to n (not timed) and goes on as the engine.

Each timing includes the one step after it, so none stops its clock while
work it caused is still running. Survivors' process ids are checked
after every grow and shrink. Prints every round and, per model, the mean
of each and the ratios grow/restart and shrink/restart. From the
repository root:

    python benchmarks/elastic.py                                  # both models, 3 rounds
    python -m benchmarks.elastic --models mnist --rounds 1        # a smoke run
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/elastic.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import ray
from ray import cloudpickle

import dsgd
from benchmarks import common
from benchmarks.resnet101 import ResNetModel

EXAMPLES_DIR = common.REPO_ROOT / "examples"


def mnist_creator(num_workers: int, batch_size: int) -> Callable[[int, int], dsgd.Model]:
    """examples/mnist.py's ConvNet, its data sliced for up to ``num_workers`` workers."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    import mnist

    cloudpickle.register_pickle_by_value(mnist)  # the workers may lack examples/ on their path
    args = mnist.parse_args(["--num-workers", str(num_workers), "--batch-size", str(batch_size)])
    return lambda worker_index, device_index: mnist.ConvNet(worker_index, device_index, args)


def model_creator(model: str, args: argparse.Namespace) -> Callable[[int, int], dsgd.Model]:
    if model == "mnist":
        return mnist_creator(args.num_workers + 1, args.batch_size)
    return functools.partial(ResNetModel, model="resnet101", batch_size=args.batch_size, image_size=args.image_size)


class ElasticRun:
    """One model's engine and the three ways to change its size, each a timed step."""

    def __init__(self, model: str, args: argparse.Namespace, checkpoint_dir: str):
        self.creator = model_creator(model, args)
        self.n, self.strategy, self.checkpoint = args.num_workers, args.strategy, f"{checkpoint_dir}/{model}.npz"
        start = time.perf_counter()
        self.sgd = self._engine(self.n)
        print(f"[{model}] built {self.n} workers in {time.perf_counter() - start:.1f}s", flush=True)
        self.sgd.step(fetch_stats=True)
        self.survivors_kept = True

    def _engine(self, num_workers: int) -> dsgd.DistributedSGD:
        return dsgd.DistributedSGD(self.creator, num_workers=num_workers, strategy=self.strategy)

    def _pids(self) -> list[int]:
        return self.sgd.foreach_worker(lambda worker: worker.identity().pid)

    def grow_and_shrink(self) -> tuple[float, float]:
        pids = self._pids()
        start = time.perf_counter()
        self.sgd.resize(self.n + 1)
        self.sgd.step(fetch_stats=True)
        grow = time.perf_counter() - start
        grown = self._pids()
        start = time.perf_counter()
        self.sgd.resize(self.n)
        self.sgd.step(fetch_stats=True)
        shrink = time.perf_counter() - start
        self.survivors_kept &= grown[:self.n] == pids and self._pids() == pids
        return grow, shrink

    def restart(self) -> float:
        self.sgd.save(self.checkpoint)
        start = time.perf_counter()
        self.sgd.shutdown()
        self.sgd = self._engine(self.n + 1)
        self.sgd.restore(self.checkpoint)
        self.sgd.step(fetch_stats=True)
        seconds = time.perf_counter() - start
        self.sgd.resize(self.n)
        return seconds


def run_model(model: str, args: argparse.Namespace, checkpoint_dir: str) -> dict[str, Any]:
    """Interleaved rounds of grow-and-shrink and restart on one model; the record."""
    run = ElasticRun(model, args, checkpoint_dir)
    times: dict[str, list[float]] = {"grow": [], "shrink": [], "restart": []}

    def grow_and_shrink() -> float:
        grow, shrink = run.grow_and_shrink()
        times["grow"].append(grow)
        times["shrink"].append(shrink)
        print(f"  grow {grow:7.2f} s, shrink {shrink:7.2f} s", flush=True)
        return grow + shrink

    def restart() -> float:
        seconds = run.restart()
        times["restart"].append(seconds)
        return seconds

    try:
        _, _, interrupted = common.run_rounds({"grow+shrink": grow_and_shrink, "restart": restart}, args.rounds,
                                              describe=lambda s: f"{s:7.2f} s")
    finally:
        run.sgd.shutdown()
    means = {name: statistics.fmean(t) if t else None for name, t in times.items()}
    record = {"model": model, "num_workers": args.num_workers, "strategy": args.strategy, "times_s": times,
              "mean_s": means, "survivors_kept": run.survivors_kept, "interrupted": interrupted}
    if means["restart"] and means["grow"] is not None:
        record["grow_over_restart"] = means["grow"] / means["restart"]
        record["shrink_over_restart"] = means["shrink"] / means["restart"]
    return record


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["resnet101", "mnist"], default=["resnet101", "mnist"])
    parser.add_argument("--num-workers", type=int, default=2, help="the engine's size; grow adds one")
    parser.add_argument("--strategy", choices=["ps", "simple"], default="ps")
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--image-size", type=int, default=224, help="ResNet-101's input")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON record path (default benchmarks/results/elastic.json)")
    args = parser.parse_args(argv)
    command = common.command_line("benchmarks.elastic", argv)
    print(f"command: {command}", flush=True)
    if not ray.is_initialized():
        common.start_ray(num_cpus=max(4, args.num_workers + 2))
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        records = [run_model(model, args, checkpoint_dir) for model in args.models]
    for r in records:
        mean = r["mean_s"]
        print(f"{r['model']}: grow {mean['grow']:.2f} s, shrink {mean['shrink']:.2f} s, restart {mean['restart']:.2f} s; "
              f"grow/restart {r.get('grow_over_restart', float('nan')):.2f}, "
              f"shrink/restart {r.get('shrink_over_restart', float('nan')):.2f}; "
              f"survivors kept their processes: {r['survivors_kept']}")
    out = common.write_json({"command": command, "machine": common.machine(), "records": records},
                            args.out or common.RESULTS_DIR / "elastic.json")
    print(f"record written to {out}")
    return records


if __name__ == "__main__":
    import benchmarks

    # Workers on other nodes may lack the checkout: send the benchmark's code by value.
    cloudpickle.register_pickle_by_value(benchmarks)
    main()

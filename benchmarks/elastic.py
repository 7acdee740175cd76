"""Elastic training: the time to grow by one worker and to shrink by one, against a restart from a checkpoint.

For each model (ResNet-101's shapes on synthetic ImageNet, examples/mnist.py's
convnet) one engine of `--num-workers` workers runs, and each round times,
in an order rotated every round:

- `grow`: `resize(n + 1)` (settle, start and build one worker, copy the
  state to it, re-plan the parameter servers);
- `shrink`: `resize(n)` from n + 1;
- `restart`: what a restarting trainer does (Ray Train's resize): `save` is
  taken first (not timed), then the engine is shut down, a new one of n + 1
  workers built and the checkpoint restored. The new engine is then
  resized back to n (not timed) and goes on as the engine;
- `one worker`: a new engine of one worker, built beside it and shut down
  after (not timed): what one worker costs from nothing to stepping, the
  "building one worker" SPEC bounds the grow by.

Each of them is timed in three parts: the call itself (the resize, the
restart, the construction), the first step after it and the second (a
steady step at the new size). The first step pays what the change left for
later (TensorFlow's first run of a new step, a new worker's first
allocations), so a change's cost is the call plus the first step's excess
over the steady one; the totals of earlier records (the call plus the first
step) are kept too. A grow's log line (logger `dsgd`) gives its phases,
recorded per round. Survivors' process ids are checked after every grow and
shrink. Prints every round and, per model, the means and the ratios. From
the repository root:

    python benchmarks/elastic.py                                  # both models, 3 rounds
    python -m benchmarks.elastic --models mnist --rounds 1        # a smoke run
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/elastic.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import logging
import statistics
import tempfile
import time
from typing import Any, Callable

import ray
from ray import cloudpickle

import dsgd
from benchmarks import common
from benchmarks.resnet101 import ResNetModel

def model_creator(model: str, args: argparse.Namespace) -> Callable[[int, int], dsgd.Model]:
    if model == "mnist":
        return common.mnist_creator(args.num_workers + 1, args.batch_size)
    return functools.partial(ResNetModel, model="resnet101", batch_size=args.batch_size, image_size=args.image_size)


class ResizePhases(logging.Handler):
    """Keeps the phases (``{phase: seconds}``) of the last resize the engine logged (logger ``dsgd``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        phases = getattr(record, "resize_phases", None)
        if phases is not None:
            self.last = phases


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class ElasticRun:
    """One model's engine and the three ways to change its size, each timed with the two steps after it."""

    def __init__(self, model: str, args: argparse.Namespace, checkpoint_dir: str):
        self.creator = model_creator(model, args)
        self.n, self.strategy, self.checkpoint = args.num_workers, args.strategy, f"{checkpoint_dir}/{model}.npz"
        start = time.perf_counter()
        self.sgd = self._engine(self.n)
        print(f"[{model}] built {self.n} workers in {time.perf_counter() - start:.1f}s", flush=True)
        self.sgd.step(fetch_stats=True)
        self.survivors_kept = True
        self.phases = ResizePhases()
        logging.getLogger("dsgd").addHandler(self.phases)
        if logging.getLogger("dsgd").getEffectiveLevel() > logging.INFO:
            logging.getLogger("dsgd").setLevel(logging.INFO)  # a grow's phases come with its INFO line

    def close(self) -> None:
        logging.getLogger("dsgd").removeHandler(self.phases)
        self.sgd.shutdown()

    def _engine(self, num_workers: int) -> dsgd.DistributedSGD:
        return dsgd.DistributedSGD(self.creator, num_workers=num_workers, strategy=self.strategy)

    def _pids(self) -> list[int]:
        return self.sgd.foreach_worker(lambda worker: worker.identity().pid)

    def _timed_change(self, change: Callable[[], Any]) -> dict[str, float]:
        """``change`` then two steps, each timed: {"call", "first_step", "steady_step"}."""
        def step() -> None:
            self.sgd.step(fetch_stats=True)  # of the engine after the change (a restart builds a new one)

        return {"call": timed(change), "first_step": timed(step), "steady_step": timed(step)}

    def grow_and_shrink(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """The grow's and the shrink's timings (``_timed_change``) and the grow's phases (its log line's)."""
        pids = self._pids()
        grow = self._timed_change(lambda: self.sgd.resize(self.n + 1))
        grow_phases = self.phases.last
        grown = self._pids()
        shrink = self._timed_change(lambda: self.sgd.resize(self.n))
        self.survivors_kept &= grown[:self.n] == pids and self._pids() == pids
        return grow, shrink, grow_phases

    def restart(self) -> dict[str, float]:
        self.sgd.save(self.checkpoint)

        def rebuild() -> None:
            self.sgd.shutdown()
            self.sgd = self._engine(self.n + 1)
            self.sgd.restore(self.checkpoint)

        times = self._timed_change(rebuild)
        self.sgd.resize(self.n)
        return times

    def one_worker(self) -> dict[str, float]:
        """A new engine of one worker beside this one, built and stepped twice (``_timed_change``'s three
        parts), then shut down: what one worker costs from nothing to stepping."""
        engine: list[dsgd.DistributedSGD] = []

        def step() -> None:
            engine[0].step(fetch_stats=True)

        try:
            return {"call": timed(lambda: engine.append(self._engine(1))), "first_step": timed(step),
                    "steady_step": timed(step)}
        finally:
            if engine:
                engine[0].shutdown()


def resize_cost(t: dict[str, float]) -> float:
    """What a change costs beyond steady training: the call, plus the first step's excess over a steady one."""
    return t["call"] + t["first_step"] - t["steady_step"]


def new_worker_build(phases: dict[str, float]) -> float:
    """From a grow's phases: starting the new worker's process and building its model."""
    return phases.get("start workers", 0.0) + phases.get("build models", 0.0)


def run_model(model: str, args: argparse.Namespace, checkpoint_dir: str) -> dict[str, Any]:
    """Interleaved rounds of grow-and-shrink and restart on one model; the record."""
    run = ElasticRun(model, args, checkpoint_dir)
    times: dict[str, list[float]] = {"grow": [], "shrink": [], "restart": []}  # each with the first step after it
    split: dict[str, list[dict[str, float]]] = {"grow": [], "shrink": [], "restart": [], "one worker": []}
    grow_phases: list[dict[str, float]] = []

    def keep(name: str, t: dict[str, float]) -> float:
        split[name].append(t)
        if name in times:
            times[name].append(t["call"] + t["first_step"])
        print(f"  {name:<10} call {t['call']:7.2f} s, first step {t['first_step']:7.2f} s, steady step "
              f"{t['steady_step']:7.2f} s: cost {resize_cost(t):7.2f} s", flush=True)
        return t["call"] + t["first_step"]

    def grow_and_shrink() -> float:
        grow, shrink, phases = run.grow_and_shrink()
        grow_phases.append(phases)
        print(f"  grow's phases: {', '.join(f'{k} {v:.2f} s' for k, v in phases.items())}", flush=True)
        return keep("grow", grow) + keep("shrink", shrink)

    def restart() -> float:
        return keep("restart", run.restart())

    def one_worker() -> float:
        return keep("one worker", run.one_worker())

    try:
        _, _, interrupted = common.run_rounds({"grow+shrink": grow_and_shrink, "restart": restart,
                                               "one worker": one_worker}, args.rounds,
                                              describe=lambda s: f"{s:7.2f} s")
    finally:
        run.close()
    means = {name: statistics.fmean(t) if t else None for name, t in times.items()}
    costs = {name: [resize_cost(t) for t in ts] for name, ts in split.items()}
    mean_costs = {name: statistics.fmean(c) if c else None for name, c in costs.items()}
    record = {"model": model, "num_workers": args.num_workers, "strategy": args.strategy, "times_s": times,
              "mean_s": means, "split_s": split, "cost_s": costs, "mean_cost_s": mean_costs,
              "grow_phases_s": grow_phases, "new_worker_build_s": [new_worker_build(p) for p in grow_phases],
              "survivors_kept": run.survivors_kept, "interrupted": interrupted}
    if means["restart"] and means["grow"] is not None:
        record["grow_over_restart"] = means["grow"] / means["restart"]
        record["shrink_over_restart"] = means["shrink"] / means["restart"]
    if mean_costs["restart"] and mean_costs["grow"] is not None:
        record["grow_cost_over_restart_cost"] = mean_costs["grow"] / mean_costs["restart"]
    if mean_costs["one worker"] is not None and mean_costs["grow"] is not None:
        record["grow_cost_beyond_one_worker_s"] = mean_costs["grow"] - mean_costs["one worker"]
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
        mean, cost = r["mean_s"], r["mean_cost_s"]
        print(f"{r['model']}: with the first step, grow {mean['grow']:.2f} s, shrink {mean['shrink']:.2f} s, "
              f"restart {mean['restart']:.2f} s; grow/restart {r.get('grow_over_restart', float('nan')):.2f}, "
              f"shrink/restart {r.get('shrink_over_restart', float('nan')):.2f}")
        print(f"{r['model']}: cost (call + first step - steady step), grow {cost['grow']:.2f} s, shrink "
              f"{cost['shrink']:.2f} s, restart {cost['restart']:.2f} s; grow/restart "
              f"{r.get('grow_cost_over_restart_cost', float('nan')):.2f}; one worker {cost['one worker']:.2f} s, "
              f"the grow {r.get('grow_cost_beyond_one_worker_s', float('nan')):+.2f} s beyond it; "
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

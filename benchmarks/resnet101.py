"""ResNet on synthetic ImageNet trained with dsgd: images/s per step and a summary.

dsgd runs at its defaults; the engine flags (--grad-shard-bytes,
--num-parameter-servers, --nan-policy, --no-ops) override them one by one.
From the repository root:

    python benchmarks/resnet101.py --num-workers 2 --strategy ps --batch-size 32
    python -m benchmarks.resnet101 --num-workers 2 --strategy ps --batch-size 32
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/resnet101.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import ray
import tensorflow as tf

import dsgd
from benchmarks import common, resnet


class ResNetModel(dsgd.Model):
    """One dsgd replica of ResNet v1 fed by in-graph synthetic ImageNet."""

    def __init__(self, worker_index: int, device_index: int, model: str = "resnet101",
                 batch_size: int = 32, image_size: int = 224):
        self.loss, self.accuracy = resnet.build_v1_replica(model, batch_size, image_size)

    def get_loss(self) -> tf.Tensor:
        return self.loss

    def get_optimizer(self) -> tf.compat.v1.train.Optimizer:
        return resnet.make_optimizer()

    def get_metrics(self) -> dict[str, tf.Tensor]:
        return {"accuracy": self.accuracy}


def _node_id(worker: Any) -> str:
    return ray.get_runtime_context().get_node_id()


class DsgdRun:
    """A dsgd engine training `cfg.model` (or `model_creator`'s model), built at once and stepped by the caller."""

    def __init__(self, cfg: common.BenchConfig, strategy: str, gpu: bool = False, label: str | None = None,
                 model_creator: Callable[[int, int], Any] | None = None, **engine_kwargs: Any):
        self.label = label or (f"dsgd-{strategy}"
                               + (f"-{engine_kwargs['compression']}" if engine_kwargs.get("compression") else "")
                               + ("-no-ops" if engine_kwargs.get("use_ops") is False else ""))
        self.strategy, self.gpu, self.engine_kwargs = strategy, gpu, engine_kwargs
        print(f"[{self.label}] building {cfg.num_workers} worker(s) x {cfg.devices_per_worker} device(s)",
              flush=True)
        model_creator = model_creator or functools.partial(ResNetModel, model=cfg.model, batch_size=cfg.batch_size,
                                                           image_size=cfg.image_size)
        start = time.perf_counter()
        self.sgd = dsgd.DistributedSGD(model_creator, num_workers=cfg.num_workers,
                                       devices_per_worker=cfg.devices_per_worker, gpu=gpu, strategy=strategy,
                                       cpus_per_worker=cfg.cpus_per_worker, **engine_kwargs)
        self.setup_s = time.perf_counter() - start
        self.worker_nodes = self.sgd.foreach_worker(_node_id)
        self.stats: list[dict[str, Any]] = []

    def step(self) -> float:
        """One `sgd.step(fetch_stats=True)`; its wall time in the driver."""
        start = time.perf_counter()
        self.stats.append(self.sgd.step(fetch_stats=True))
        return time.perf_counter() - start

    def details(self) -> dict[str, Any]:
        """What the run's record holds beyond the common fields."""
        return {"strategy": self.strategy, "gpu": self.gpu, "engine_kwargs": self.engine_kwargs,
                "num_parameter_servers": len(common.parameter_servers(self.sgd)), "worker_nodes": self.worker_nodes,
                "setup_s": self.setup_s, "engine_step_times_s": [s["step_time_s"] for s in self.stats],
                "final_loss": self.stats[-1]["loss"] if self.stats else None}

    def close(self) -> None:
        self.sgd.shutdown()


def run_dsgd(cfg: common.BenchConfig, strategy: str, gpu: bool = False, timeline: str | None = None,
             **engine_kwargs: Any) -> dict[str, Any]:
    """Train `cfg.model` with dsgd on the running Ray instance; returns the run's record.

    With `timeline`, one more step after the measured ones writes its Chrome trace there.
    """
    run = DsgdRun(cfg, strategy, gpu, **engine_kwargs)
    try:
        times, _, interrupted = common.run_rounds({run.label: run.step}, cfg.warmup + cfg.num_iters, cfg.warmup,
                                                  describe=common.images_per_s(cfg.global_batch))
        if timeline and not interrupted:
            run.sgd.step(write_timeline=timeline)
            print(f"[{run.label}] timeline of one more step written to {timeline}", flush=True)
        return common.make_record(run.label, cfg, times[run.label], interrupted, **run.details())
    finally:
        run.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_flags(parser)
    parser.add_argument("--strategy", choices=["simple", "ps"], default="ps")
    parser.add_argument("--gpu", action="store_true", help="one replica per GPU instead of per CPU device")
    common.add_engine_flags(parser)
    parser.add_argument("--object-store-memory", type=int, default=None,
                        help="bytes, when this script starts Ray itself")
    parser.add_argument("--timeline", default=None,
                        help="write a Chrome trace of one extra step here (open in Perfetto or chrome://tracing)")
    parser.add_argument("--out", default=None,
                        help="JSON record path (default benchmarks/results/dsgd-<strategy>.json)")
    args = parser.parse_args(argv)
    cfg = common.bench_config_from_args(args)
    command = common.command_line("benchmarks.resnet101", argv)
    print(f"command: {command}", flush=True)
    if not ray.is_initialized():
        common.start_ray(object_store_memory=args.object_store_memory)
    record = run_dsgd(cfg, args.strategy, gpu=args.gpu, timeline=args.timeline, **common.engine_kwargs(args))
    record["command"] = command
    common.print_summary(record)
    out = common.write_json(record, args.out or common.RESULTS_DIR / f"{record['system']}.json")
    print(f"record written to {out}")
    return record


if __name__ == "__main__":
    import benchmarks
    from ray import cloudpickle

    # Workers on other nodes may lack the checkout: send the benchmark's code by value.
    cloudpickle.register_pickle_by_value(benchmarks)
    main()

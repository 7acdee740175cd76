"""ResNet on synthetic ImageNet trained with dsgd: images/s per step and a summary.

Run from the repository root (Ray workers import `benchmarks` from there):

    python -m benchmarks.resnet101 --num-workers 2 --strategy ps --batch-size 32
"""

from __future__ import annotations

import argparse
import functools
import time
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


def run_dsgd(cfg: common.BenchConfig, strategy: str, gpu: bool = False,
             grad_shard_bytes: int = 10_000_000, timeline: str | None = None,
             use_ops: bool | None = None) -> dict[str, Any]:
    """Train `cfg.model` with dsgd on the running Ray instance; returns the run's record.

    With `timeline`, one more step after the measured ones writes its Chrome trace there.
    """
    model_creator = functools.partial(ResNetModel, model=cfg.model, batch_size=cfg.batch_size,
                                      image_size=cfg.image_size)
    label = f"dsgd-{strategy}" + ("-no-ops" if use_ops is False and strategy == "ps" else "")
    print(f"[{label}] building {cfg.num_workers} worker(s) x {cfg.devices_per_worker} device(s)", flush=True)
    start = time.perf_counter()
    with dsgd.DistributedSGD(model_creator, num_workers=cfg.num_workers,
                             devices_per_worker=cfg.devices_per_worker, gpu=gpu, strategy=strategy,
                             grad_shard_bytes=grad_shard_bytes, use_ops=use_ops,
                             # Like its peers, a throughput run does not check for NaN (random
                             # labels at tiny batches can diverge; that is not what is measured).
                             nan_policy="ignore",
                             cpus_per_worker=cfg.cpus_per_worker) as sgd:
        setup_s = time.perf_counter() - start
        times, stats, interrupted = common.time_steps(lambda: sgd.step(fetch_stats=True), cfg, label)
        if timeline and not interrupted:
            sgd.step(write_timeline=timeline)
            print(f"[{label}] timeline of one more step written to {timeline}", flush=True)
    return common.make_record(
        label, cfg, times, interrupted, strategy=strategy, gpu=gpu, grad_shard_bytes=grad_shard_bytes,
        setup_s=setup_s, engine_step_times_s=[s["step_time_s"] for s in stats],
        final_loss=stats[-1]["loss"] if stats else None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_flags(parser)
    parser.add_argument("--strategy", choices=["simple", "ps"], default="ps")
    parser.add_argument("--gpu", action="store_true", help="one replica per GPU instead of per CPU device")
    parser.add_argument("--grad-shard-bytes", type=int, default=10_000_000)
    parser.add_argument("--object-store-memory", type=int, default=None,
                        help="bytes, when this script starts Ray itself")
    parser.add_argument("--no-ops", action="store_true",
                        help='"ps" exchanges shards through Python instead of the C++ ops')
    parser.add_argument("--timeline", default=None,
                        help="write a Chrome trace of one extra step here (open in Perfetto or chrome://tracing)")
    parser.add_argument("--out", default=None,
                        help="JSON record path (default benchmarks/results/dsgd-<strategy>.json)")
    args = parser.parse_args(argv)
    cfg = common.bench_config_from_args(args)
    if not ray.is_initialized():
        ray.init(object_store_memory=args.object_store_memory)
    record = run_dsgd(cfg, args.strategy, gpu=args.gpu, grad_shard_bytes=args.grad_shard_bytes,
                      timeline=args.timeline, use_ops=False if args.no_ops else None)
    common.print_summary(record)
    out = common.write_json(record, args.out or common.RESULTS_DIR / f"{record['system']}.json")
    print(f"record written to {out}")
    return record


if __name__ == "__main__":
    main()

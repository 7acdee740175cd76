"""Timing, summaries and JSON records shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from benchmarks.resnet import BLOCKS_PER_STAGE

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class BenchConfig:
    """What every system is asked to do; `batch_size` is per replica."""

    model: str = "resnet101"
    image_size: int = 224
    batch_size: int = 32
    num_workers: int = 2
    devices_per_worker: int = 1
    cpus_per_worker: int = 1
    num_iters: int = 20
    warmup: int = 5

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_workers * self.devices_per_worker


def add_run_flags(parser) -> None:
    """The argparse flags that fill a BenchConfig (same names, dashes for underscores)."""
    defaults = BenchConfig()
    parser.add_argument("--model", choices=sorted(BLOCKS_PER_STAGE), default=defaults.model)
    parser.add_argument("--image-size", type=int, default=defaults.image_size)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per replica")
    parser.add_argument("--num-workers", type=int, default=defaults.num_workers)
    parser.add_argument("--devices-per-worker", type=int, default=defaults.devices_per_worker)
    parser.add_argument("--cpus-per-worker", type=int, default=defaults.cpus_per_worker,
                        help="CPUs each worker reserves; also its TensorFlow thread count")
    parser.add_argument("--num-iters", type=int, default=defaults.num_iters,
                        help="measured steps, after the warm-up steps")
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help="steps run first and excluded from the summary")


def bench_config_from_args(args) -> BenchConfig:
    return BenchConfig(**{name: getattr(args, name) for name in BenchConfig.__dataclass_fields__})


def time_steps(step: Callable[[], dict[str, float] | None], cfg: BenchConfig, label: str,
               verbose: bool = True) -> tuple[list[float], list[dict[str, float]], bool]:
    """Run `cfg.warmup + cfg.num_iters` steps; if verbose, print images/s after each.

    Returns (wall time of each step in seconds, what each step returned,
    whether Ctrl-C stopped the loop early). Ctrl-C never loses finished steps.
    """
    total = cfg.warmup + cfg.num_iters
    times: list[float] = []
    outputs: list[dict[str, float]] = []
    try:
        for i in range(total):
            start = time.perf_counter()
            out = step() or {}
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            outputs.append(out)
            if not verbose:
                continue
            phase = "warm-up" if i < cfg.warmup else "measure"
            loss = f"  loss {out['loss']:.3f}" if "loss" in out else ""
            print(f"[{label}] step {i + 1}/{total} ({phase}): {cfg.global_batch / elapsed:8.2f} images/s"
                  f"  {elapsed:7.3f} s{loss}", flush=True)
    except KeyboardInterrupt:
        print(f"[{label}] interrupted after {len(times)} steps", flush=True)
        return times, outputs, True
    return times, outputs, False


def summarize(step_times: list[float], images_per_step: int, warmup: int) -> dict[str, Any]:
    """Mean and standard deviation of images/s over the steps after the warm-up."""
    rates = [images_per_step / t for t in step_times[warmup:]]
    return {
        "measured_steps": len(rates),
        "images_per_sec_mean": statistics.fmean(rates) if rates else None,
        "images_per_sec_std": statistics.stdev(rates) if len(rates) > 1 else 0.0 if rates else None,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def make_record(system: str, cfg: BenchConfig, step_times: list[float], interrupted: bool,
                **extra: Any) -> dict[str, Any]:
    """One JSON-ready record of a run: configuration, throughput, machine, versions."""
    return {
        "system": system,
        "model": cfg.model,
        "image_size": cfg.image_size,
        "batch_size_per_replica": cfg.batch_size,
        "global_batch": cfg.global_batch,
        "num_workers": cfg.num_workers,
        "devices_per_worker": cfg.devices_per_worker,
        "cpus_per_worker": cfg.cpus_per_worker,
        "num_iters": cfg.num_iters,
        "warmup": cfg.warmup,
        "interrupted": interrupted,
        **summarize(step_times, cfg.global_batch, cfg.warmup),
        "step_times_s": step_times,
        **extra,
        "host": {"cores": os.cpu_count(), "cpu_model": _cpu_model(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(),
                     **{p: _version(p) for p in ("tensorflow", "ray", "numpy", "dsgd")}},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_summary(record: dict[str, Any]) -> None:
    mean, std = record["images_per_sec_mean"], record["images_per_sec_std"]
    if mean is None:
        print(f"[{record['system']}] no measured steps (warm-up {record['warmup']})", flush=True)
        return
    print(f"[{record['system']}] {record['model']} {record['image_size']}px, global batch "
          f"{record['global_batch']}: {mean:.2f} ± {std:.2f} images/s over "
          f"{record['measured_steps']} steps", flush=True)


def write_json(record: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path

"""Soak: 500 "ps" steps at dsgd's defaults; object-store memory and every actor's RSS must stay flat.

One engine, 2 workers x 1 device, strategy "ps" with dsgd's default
partitions and parameter servers, on one of the exchange benchmark's model
shapes (default: ResNet-101's 314 variables, 44.5 M float32, every gradient
a fresh tensor computed by TensorFlow each step; see benchmarks/exchange.py).
After `--warmup` steps it samples, then samples again every
`--sample-every` steps up to `--steps`; steps between samples are
`sgd.step()`, as a training loop runs them, and a sample follows a
`sgd.step(fetch_stats=True)`, so no step is in flight. Sampled:

  object store   bytes in use in Ray's object store: "object_store_memory" of
                 ray.cluster_resources() minus ray.available_resources()
  worker i       VmRSS of worker i's process (its pid from its identity() call)
  server j       VmRSS of parameter server j's process

Printed for each: the first and last sample and last/first; flat means
within `--tolerance` (5 %). RSS is read from /proc, so the actors must run
on this machine (the script starts its own Ray unless one is running).
Writes benchmarks/results/soak.json. From the repository root:

    .venv/bin/python benchmarks/soak.py
    .venv/bin/python -m benchmarks.soak --shape huge --steps 1000
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/soak.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

import dsgd
from benchmarks import common, exchange

OBJECT_STORE = "object store"


def rss_mib(pid: int) -> float:
    """Resident set size (VmRSS) of process ``pid``, in MiB, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    raise ValueError(f"/proc/{pid}/status has no VmRSS line")


def object_store_used_mib() -> float:
    """Memory in use in the Ray cluster's object store, in MiB, from Ray's resource view."""
    total = ray.cluster_resources().get("object_store_memory", 0.0)
    free = ray.available_resources().get("object_store_memory", 0.0)
    return (total - free) / 2**20


def actor_pids(sgd: dsgd.DistributedSGD) -> dict[str, int]:
    """'worker 0', 'parameter server 0', ... -> pid, for every actor of the engine; they must run on this node."""
    identities = ray.get([actor.identity.remote() for actor in sgd.workers + sgd.ps_actors], timeout=60)
    here = ray.get_runtime_context().get_node_id()
    elsewhere = [str(i) for i in identities if i.node_id != here]
    if elsewhere:
        raise RuntimeError(f"{', '.join(elsewhere)} run on another node, whose /proc this process cannot read; "
                           "run the soak on a one-node Ray")
    return {str(i): i.pid for i in identities}


def sample(step: int, pids: dict[str, int], settle_s: float) -> dict[str, Any]:
    """The object store's use and every actor's RSS, in MiB, after ``step`` measured steps and ``settle_s``."""
    time.sleep(settle_s)
    return {"step": step, "mib": {OBJECT_STORE: object_store_used_mib(),
                                  **{label: rss_mib(pid) for label, pid in pids.items()}}}


def print_sample(taken: dict[str, Any], step_time_s: float | None = None) -> None:
    print(f"  step {taken['step']:4d}: " + ", ".join(f"{name} {mib:.0f}" for name, mib in taken["mib"].items())
          + " MiB" + ("" if step_time_s is None else f"; that step took {step_time_s * 1000:.0f} ms"), flush=True)


def summarize(samples: list[dict[str, Any]], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per quantity: first and last sample, last/first (None if first is 0) and whether it stayed flat."""
    summary = {}
    for name in samples[0]["mib"]:
        first, last = samples[0]["mib"][name], samples[-1]["mib"][name]
        ratio = last / first if first else None
        flat = abs(ratio - 1) <= tolerance if ratio is not None else last == first
        summary[name] = {"start_mib": first, "end_mib": last, "ratio": ratio, "flat": flat}
    return summary


def run(args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, warm it up, run the measured steps sampling memory; the record."""
    variables = exchange.variable_shapes(args.shape, args.scale, args.tiny_count)
    elements = sum(int(np.prod(dims)) for _, dims in variables)
    creator = functools.partial(exchange.ExchangeModel, shapes=variables)
    record: dict[str, Any] = {"shape": args.shape, "tensors": len(variables), "elements": elements}
    with dsgd.DistributedSGD(creator, num_workers=args.num_workers, strategy="ps", **kwargs) as sgd:
        record["num_parameter_servers"] = len(sgd.ps_actors)
        record["num_partitions"] = len(sgd.layout)
        print(f"{args.shape}: {len(variables)} tensors, {elements / 1e6:.2f} M float32; {args.num_workers} workers, "
              f"{record['num_parameter_servers']} parameter servers, {record['num_partitions']} partitions",
              flush=True)
        pids = actor_pids(sgd)
        record["pids"] = pids
        for _ in range(args.warmup):
            sgd.step(fetch_stats=True)
        samples = [sample(0, pids, args.settle_s)]
        print_sample(samples[-1])
        for step in range(1, args.steps + 1):
            sampled = step % args.sample_every == 0 or step == args.steps
            stats = sgd.step(fetch_stats=sampled)
            if sampled:
                samples.append(sample(step, pids, args.settle_s))
                print_sample(samples[-1], stats["step_time_s"])
    record["samples"] = samples
    record["summary"] = summarize(samples, args.tolerance)
    return record


def report(record: dict[str, Any], args: argparse.Namespace) -> str:
    """A markdown table of every quantity: start, end, end/start, flat or not."""
    lines = [f"{args.steps} steps after {args.warmup} warm-up, {record['shape']} "
             f"({record['tensors']} tensors, {record['elements'] / 1e6:.2f} M float32), "
             f"{record['num_parameter_servers']} parameter servers, {record['num_partitions']} partitions",
             "", "| quantity | start MiB | end MiB | end/start | flat (±" f"{args.tolerance:.0%}) |",
             "|---|---|---|---|---|"]
    for name, s in record["summary"].items():
        ratio = "–" if s["ratio"] is None else f"{s['ratio']:.3f}"
        label = name if name == OBJECT_STORE else f"{name} RSS"
        lines.append(f"| {label} | {s['start_mib']:.1f} | {s['end_mib']:.1f} | {ratio} | "
                     f"{'yes' if s['flat'] else 'no'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=exchange.SHAPES, default="resnet101")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5, help="steps before the first sample (at least 1)")
    p.add_argument("--steps", type=int, default=500, help="measured steps, after the warm-up")
    p.add_argument("--sample-every", type=int, default=100, help="steps between samples")
    p.add_argument("--tolerance", type=float, default=0.05, help="flat: end within this fraction of start")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="pause before each sample: Ray's resource view of the store lags it by up to a report")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink every tensor to this fraction of its elements (1-D), for smoke runs")
    p.add_argument("--tiny-count", type=int, default=3000, help="tensors of the tiny shape")
    common.add_engine_flags(p)
    p.add_argument("--num-cpus", type=int, default=None,
                   help="logical CPUs when starting Ray here (default: 1 + 2 x workers, as the exchange benchmark)")
    p.add_argument("--object-store-memory", type=int, default=2 << 30, help="bytes, when starting Ray here")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "soak.json")
    args = p.parse_args(argv)
    if args.num_workers < 2:
        p.error("--num-workers must be at least 2: with one worker there are no parameter servers")
    if args.warmup < 1 or args.steps < 1 or args.sample_every < 1:
        p.error("--warmup, --steps and --sample-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.soak", argv)
    kwargs = common.engine_kwargs(args)
    print(f"command: {command}\nengine arguments: {kwargs or 'defaults'}", flush=True)
    if not ray.is_initialized():
        common.start_ray(num_cpus=args.num_cpus or 1 + 2 * args.num_workers,
                         object_store_memory=args.object_store_memory)
    record = run(args, kwargs)
    table = report(record, args)
    print(f"\n{command}\n\n{table}")
    result = {"command": command, "engine_kwargs": kwargs, "num_workers": args.num_workers, "steps": args.steps,
              "warmup": args.warmup, "tolerance": args.tolerance, "scale": args.scale, **record, "table": table,
              **common.machine()}
    common.write_json(result, args.out)
    print(f"\nrecord written to {args.out}")
    return result


if __name__ == "__main__":
    main()

"""Soak: 500 "ps" steps at dsgd's defaults; object-store memory and every actor's RSS must stay flat.

One engine (and one per `--peer-env`), 2 workers x 1 device, strategy "ps" with dsgd's default
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
within `--tolerance` (5 %), and the median step time. Each `--peer-env
NAME=VALUE` adds an engine whose workers get that environment variable
(TF_CPU_ALLOCATOR_USE_BFC=false gives them TensorFlow's default CPU allocator); all engines step
in rounds, in an order rotated every round, and each peer's median step is
printed as a ratio to the defaults'. RSS is read from /proc, so the actors must run
on this machine (the script starts its own Ray unless one is running).
Writes benchmarks/results/soak.json. From the repository root:

    .venv/bin/python benchmarks/soak.py
    .venv/bin/python -m benchmarks.soak --shape huge --steps 1000
    .venv/bin/python benchmarks/soak.py --peer-env TF_CPU_ALLOCATOR_USE_BFC=false
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/soak.py`
    import _repo_path  # noqa: F401

import argparse
import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import ray

import dsgd
from benchmarks import common, exchange
from dsgd.cluster.cluster import WORKER_ENV_DEFAULTS

OBJECT_STORE = "object store"
DEFAULTS = "defaults"


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
    identities = common.identities(sgd)
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


def print_sample(taken: dict[str, Any], label: str | None = None) -> None:
    print(f"  step {taken['step']:4d}" + (f" [{label}]" if label else "") + ": "
          + ", ".join(f"{name} {mib:.0f}" for name, mib in taken["mib"].items()) + " MiB", flush=True)


def summarize(samples: list[dict[str, Any]], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per quantity: first and last sample, last/first (None if first is 0) and whether it stayed flat."""
    summary = {}
    for name in samples[0]["mib"]:
        first, last = samples[0]["mib"][name], samples[-1]["mib"][name]
        ratio = last / first if first else None
        flat = abs(ratio - 1) <= tolerance if ratio is not None else last == first
        summary[name] = {"start_mib": first, "end_mib": last, "ratio": ratio, "flat": flat}
    return summary


def build(creator, args: argparse.Namespace, kwargs: dict[str, Any], env: dict[str, str]) -> dsgd.DistributedSGD:
    """An engine whose workers get ``env`` on top of dsgd's worker environment (the driver's overrides it)."""
    with mock.patch.dict(os.environ, env):  # read by dsgd.cluster.cluster.worker_env as the workers start
        return dsgd.DistributedSGD(creator, num_workers=args.num_workers, strategy="ps", **kwargs)


def run(args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build the engines, warm them up, run the measured steps interleaved, sampling memory; the record.

    The engine at dsgd's defaults is the record's top level; each ``--peer-env``
    engine is under "peers", by its label, with its step times as a ratio to the defaults'.
    """
    variables = exchange.variable_shapes(args.shape, args.scale, args.tiny_count)
    elements = sum(int(np.prod(dims)) for _, dims in variables)
    creator = functools.partial(exchange.ExchangeModel, shapes=variables)
    envs = {DEFAULTS: {}, **{f"workers' {n}={v}": {n: v} for n, v in args.peer_env}}
    engines: dict[str, dsgd.DistributedSGD] = {}
    try:
        for label, env in envs.items():
            engines[label] = build(creator, args, kwargs, env)
        sgd = engines[DEFAULTS]
        record: dict[str, Any] = {"shape": args.shape, "tensors": len(variables), "elements": elements,
                                  "num_parameter_servers": len(common.parameter_servers(sgd)), "num_partitions": common.partition_count(sgd)}
        print(f"{args.shape}: {len(variables)} tensors, {elements / 1e6:.2f} M float32; {args.num_workers} workers, "
              f"{record['num_parameter_servers']} parameter servers, {record['num_partitions']} partitions; "
              f"engines: {', '.join(engines)}", flush=True)
        runs = {label: {"pids": actor_pids(e), "samples": [], "step_s": []} for label, e in engines.items()}
        for _ in range(args.warmup):
            for e in engines.values():
                e.step(fetch_stats=True)
        for step in range(args.steps + 1):
            sampled = step % args.sample_every == 0 or step == args.steps
            for label in common.rotated(list(engines), step):
                if step:  # step 0 is the sample after the warm-up
                    started = time.perf_counter()
                    engines[label].step(fetch_stats=sampled)
                    runs[label]["step_s"].append(time.perf_counter() - started)
            if sampled:
                for label, r in runs.items():
                    r["samples"].append(sample(step, r["pids"], args.settle_s if label == DEFAULTS else 0.0))
                    print_sample(r["samples"][-1], label if len(runs) > 1 else None)
    finally:
        for e in engines.values():
            e.shutdown()
    for label, r in runs.items():
        r["summary"] = summarize(r["samples"], args.tolerance)
        r["median_step_ms"] = 1000 * statistics.median(r.pop("step_s"))
    record.update(runs.pop(DEFAULTS))
    for r in runs.values():
        r["step_time_ratio"] = r["median_step_ms"] / record["median_step_ms"]
    record["peers"] = runs
    return record


def report(record: dict[str, Any], args: argparse.Namespace) -> str:
    """A markdown table of every quantity of every engine: start, end, end/start, flat or not; step times."""
    lines = [f"{args.steps} steps after {args.warmup} warm-up, {record['shape']} "
             f"({record['tensors']} tensors, {record['elements'] / 1e6:.2f} M float32), "
             f"{record['num_parameter_servers']} parameter servers, {record['num_partitions']} partitions",
             "", "| engine | quantity | start MiB | end MiB | end/start | flat (±" f"{args.tolerance:.0%}) |",
             "|---|---|---|---|---|---|"]
    for label, r in {DEFAULTS: record, **record["peers"]}.items():
        for name, s in r["summary"].items():
            ratio = "–" if s["ratio"] is None else f"{s['ratio']:.3f}"
            quantity = name if name == OBJECT_STORE else f"{name} RSS"
            lines.append(f"| {label} | {quantity} | {s['start_mib']:.1f} | {s['end_mib']:.1f} | {ratio} | "
                         f"{'yes' if s['flat'] else 'no'} |")
    lines.append("")
    lines.append(f"median step: {DEFAULTS} {record['median_step_ms']:.1f} ms" + "".join(
        f"; {label} {r['median_step_ms']:.1f} ms ({r['step_time_ratio']:.3f}x)" for label, r in record["peers"].items()))
    return "\n".join(lines)


def env_assignment(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` from the command line, as (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


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
    p.add_argument("--peer-env", type=env_assignment, action="append", default=[], metavar="NAME=VALUE",
                   help="also run an engine whose workers get this environment variable, interleaved with the "
                        "one at the defaults (repeat for more engines), e.g. TF_CPU_ALLOCATOR_USE_BFC=false; "
                        f"one of the variables dsgd sets in its workers: {', '.join(WORKER_ENV_DEFAULTS)}")
    common.add_engine_flags(p)
    p.add_argument("--num-cpus", type=int, default=None,
                   help="logical CPUs when starting Ray here (default: 1 + 2 x workers per engine, as the exchange "
                        "benchmark)")
    p.add_argument("--object-store-memory", type=int, default=2 << 30, help="bytes, when starting Ray here")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "soak.json")
    args = p.parse_args(argv)
    if args.num_workers < 2:
        p.error("--num-workers must be at least 2: with one worker there are no parameter servers")
    unknown = sorted({name for name, _ in args.peer_env} - WORKER_ENV_DEFAULTS.keys())
    if unknown:
        p.error(f"--peer-env sets {unknown}, which dsgd does not pass to its workers; "
                f"expected one of {sorted(WORKER_ENV_DEFAULTS)}")
    if args.warmup < 1 or args.steps < 1 or args.sample_every < 1:
        p.error("--warmup, --steps and --sample-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.soak", argv)
    kwargs = common.engine_kwargs(args)
    print(f"command: {command}\nengine arguments: {kwargs or 'defaults'}", flush=True)
    if not ray.is_initialized():
        common.start_ray(num_cpus=args.num_cpus or 1 + 2 * args.num_workers * (1 + len(args.peer_env)),
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

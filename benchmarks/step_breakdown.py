"""Where a "ps" step's time goes, per process: CPU time from /proc, and a traced step's spans by kind.

For each of `--shapes` (the exchange benchmark's model shapes) and each
cluster of `--nodes` (default: 1 and 2, one after the other in the same run;
2 or more are simulated nodes, ``ray.cluster_utils``, a raylet and object
store each, all on this machine), one "ps" engine of `--num-workers` workers
at dsgd's defaults:

1. `--warmup` steps, not measured;
2. `--steps` steps (`step(fetch_stats=True)`), timed in the driver, with
   every process's CPU time (user + system, from /proc/<pid>/stat) read
   around them: the workers, the parameter servers, the driver, and Ray's
   own daemons of this cluster (its raylets, which move objects between
   nodes, and its GCS). Every simulated node runs here, so /proc sees them
   all;
3. `--traced` steps with `step(write_timeline=...)`, whose events are summed
   per process and kind: a worker's TensorFlow ops (the apply, the
   non-finite checks, the graph callbacks of the sends and receives, dsgd's
   pack/unpack ops, the rest of the compute) and its exchange spans (per
   partition, on its send scheduler's lanes: pushing it, i.e. packing or
   putting it into the object store and the signal, stream write or actor
   call; waiting for its answer and reading the mean, i.e. the object-store
   get on the cross-node path; and the step's own wait for the mean); a
   server's sums, puts of the mean and relay pushes.

Spans on several threads overlap, so a process's kinds can add up to more
than the step; tracing slows a step, so the traced figures are shares, and
the untraced CPU and wall times are the step's cost. Prints a table per
shape and cluster; writes benchmarks/results/step_breakdown.json. From the
repository root:

    .venv/bin/python benchmarks/step_breakdown.py                              # resnet101, 1 and 2 nodes, 2 workers
    .venv/bin/python -m benchmarks.step_breakdown --nodes 2 --num-workers 4    # 2 workers per node: relays
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/step_breakdown.py`
    import _repo_path  # noqa: F401

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray

import dsgd
from dsgd.worker import finite_checks
from benchmarks import common
from benchmarks.exchange import SHAPES, ExchangeModel, variable_shapes

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# Span names (their start) of the workers' exchange (the send scheduler's lanes, and the step's waits) and the
# servers' work, and the kind each counts as.
SPAN_KINDS = (
    ("push partition", "push partitions (pack, signal / actor call)"),
    ("answer of partition", "wait for and read the means"),
    ("collect the mean", "the step waits for the means"),
    ("average partition", "sum partitions"),
    ("sum partition", "sum partitions (relayed)"),
    ("put the mean", "put the means"),
    ("push the node's partial sum", "push partial sums (relay)"),
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime (fields 14 and 15 of stat)


def ray_daemons() -> dict[str, list[int]]:
    """'raylets' and 'gcs' -> the pids of this cluster's raylet and GCS processes (by its session name: other
    Ray instances on this machine are not counted)."""
    session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
    daemons: dict[str, list[int]] = {"raylets": [], "gcs": []}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            if comm in ("raylet", "gcs_server"):
                with open(f"/proc/{pid}/cmdline") as f:
                    if session in f.read():
                        daemons["raylets" if comm == "raylet" else "gcs"].append(int(pid))
        except FileNotFoundError:  # gone meanwhile
            continue
    return daemons


def event_kind(event: dict[str, Any]) -> str | None:
    """What a trace event counts as, or None for those not summed (the step's own phases, the driver's)."""
    op = event.get("args", {}).get("op")
    if op is not None:  # a TensorFlow op (``dsgd.common.timeline.from_step_stats``)
        op_type = op.split("(", 1)[0]
        if op_type.startswith(("Apply", "ResourceApply")):
            return "TF: apply"
        if finite_checks.FINITE_SCOPE in event["name"]:
            return "TF: non-finite checks"
        if op_type in ("PyFunc", "EagerPyFunc"):
            return "TF: graph callbacks (sends, receives)"
        if op_type.startswith("Dsgd"):
            return "TF: dsgd ops (pack, unpack, alias)"
        return "TF: other ops (compute)"
    return next((kind for prefix, kind in SPAN_KINDS if event["name"].startswith(prefix)), None)


def traced_kinds(path: str) -> dict[str, dict[str, float]]:
    """Process name -> kind -> summed milliseconds, from one written timeline."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        kind = event_kind(event) if event.get("ph") == "X" else None
        if kind is not None:
            sums[names[event["pid"]]][kind] += event["dur"] / 1000
    return sums


def measure(shape: str, args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """One engine on the current cluster: untimed warm-up, CPU and wall per step, traced kinds per step."""
    if shape == "mnist":
        creator = common.mnist_creator(args.num_workers, args.batch_size)
    else:
        creator = functools.partial(ExchangeModel, shapes=variable_shapes(shape, args.scale))
    with dsgd.DistributedSGD(creator, num_workers=args.num_workers, strategy="ps") as sgd:
        actors = {str(i): i for i in common.identities(sgd)}
        where = common.actors_per_node(sgd)
        print(f"  {shape} on {nodes} node(s): {'; '.join(where)}", flush=True)
        for _ in range(args.warmup):
            sgd.step(fetch_stats=True)
        pids = {name: [identity.pid] for name, identity in actors.items()} | {"driver": [os.getpid()]}
        pids |= ray_daemons()
        before = {name: sum(map(cpu_seconds, group)) for name, group in pids.items()}
        walls = []
        for _ in range(args.steps):
            start = time.perf_counter()
            stats = sgd.step(fetch_stats=True)
            walls.append(time.perf_counter() - start)
        cpu_ms = {name: (sum(map(cpu_seconds, group)) - before[name]) * 1000 / args.steps
                  for name, group in pids.items()}
        traced: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(args.traced):
                path = f"{tmp}/step{k}.json"
                sgd.step(write_timeline=path)
                for process, kinds in traced_kinds(path).items():
                    for kind, ms in kinds.items():
                        traced[process][kind] += ms / args.traced
    return {"shape": shape, "nodes": nodes, "actors_per_node": where, "step_ms_median": statistics.median(walls) * 1000,
            "cpu_ms_per_step": cpu_ms, "traced_ms_per_step": {p: dict(k) for p, k in traced.items()},
            "node_sent_bytes": stats.get("node_sent_bytes"), "sent_bytes": stats.get("sent_bytes")}


def table(record: dict[str, Any]) -> str:
    """A markdown table: a column per process, CPU per step, then each traced kind."""
    processes = list(record["cpu_ms_per_step"])
    kinds = sorted({kind for per in record["traced_ms_per_step"].values() for kind in per})
    lines = [f"{record['shape']}, {record['nodes']} node(s) ({'; '.join(record['actors_per_node'])}): "
             f"median step {record['step_ms_median']:.1f} ms",
             "", "| ms per step | " + " | ".join(processes) + " |", "|---" * (len(processes) + 1) + "|",
             "| CPU (untraced steps) | " + " | ".join(f"{record['cpu_ms_per_step'][p]:.1f}" for p in processes) + " |"]
    for kind in kinds:
        cells = [record["traced_ms_per_step"].get(p, {}).get(kind) for p in processes]
        lines.append(f"| {kind} | " + " | ".join("–" if c is None else f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=["resnet101"])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="cluster sizes to run, in turn")
    p.add_argument("--num-workers", type=int, default=2, help="workers of the engine (at least 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    p.add_argument("--steps", type=int, default=10, help="measured steps (CPU and wall)")
    p.add_argument("--traced", type=int, default=2, help="traced steps, their spans averaged")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every tensor to this fraction, for smoke runs")
    p.add_argument("--batch-size", type=int, default=32, help="the mnist shape's batch per worker "
                                                               "(examples/mnist.py's default)")
    p.add_argument("--object-store-memory", type=int, default=1 << 30, help="bytes per node")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "step_breakdown.json")
    args = p.parse_args(argv)
    if args.num_workers < 2:
        p.error("--num-workers must be at least 2: with one worker there are no parameter servers")
    if min(args.nodes) < 1:
        p.error("--nodes: every cluster size must be at least 1")
    if ray.is_initialized():
        p.error("this script starts its own Ray clusters: run it without one")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = common.command_line("benchmarks.step_breakdown", argv)
    print(f"command: {command}", flush=True)
    cpus = 3 * args.num_workers  # the workers and the servers dsgd plans for the CPUs it finds
    records, tables = [], []
    for nodes in args.nodes:
        if nodes == 1:
            common.start_ray(num_cpus=cpus, object_store_memory=args.object_store_memory)
            cluster = contextlib.ExitStack()
            cluster.callback(ray.shutdown)
        else:
            cluster = common.local_cluster(nodes, math.ceil(cpus / nodes), args.object_store_memory)
        with cluster:
            for shape in args.shapes:
                records.append(measure(shape, args, nodes))
                tables.append(table(records[-1]))
                print(f"\n{tables[-1]}\n", flush=True)
    result = {"command": command, "num_workers": args.num_workers, "warmup": args.warmup, "steps": args.steps,
              "traced": args.traced, "records": records, "tables": tables, **common.machine()}
    common.write_json(result, args.out)
    print(f"{command}\n\n" + "\n\n".join(tables) + f"\n\nrecord written to {args.out}")
    return result


if __name__ == "__main__":
    main()

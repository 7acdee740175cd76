"""What the benchmark scripts share: flags, starting Ray, interleaved rounds, records."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle

from benchmarks.resnet import BLOCKS_PER_STAGE

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
EXAMPLES_DIR = REPO_ROOT / "examples"


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


def add_run_flags(parser: argparse.ArgumentParser) -> None:
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


def bench_config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(**{name: getattr(args, name) for name in BenchConfig.__dataclass_fields__})


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for dsgd.DistributedSGD's tuning arguments; each left unset runs the engine's default."""
    parser.add_argument("--grad-shard-bytes", type=int, default=None,
                        help="partition size (default: the engine's choice)")
    parser.add_argument("--num-parameter-servers", type=int, default=None,
                        help="parameter-server processes (default: the engine's choice)")
    parser.add_argument("--nan-policy", choices=["raise", "skip", "ignore"], default=None,
                        help="what a non-finite gradient does (default: the engine's)")
    parser.add_argument("--no-ops", action="store_true",
                        help='"ps" moves partitions through Python instead of the C++ op library')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """DistributedSGD keyword arguments for the engine flags given, and only those."""
    kwargs = {name: getattr(args, name) for name in ("grad_shard_bytes", "num_parameter_servers", "nan_policy")
              if getattr(args, name) is not None}
    if args.no_ops:
        kwargs["use_ops"] = False
    return kwargs


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """This process's environment variables set to `values` while open, then as they were."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_ray(address: str | None = None, node_ip_address: str | None = None, **init_kwargs: Any) -> None:
    """Connect to the cluster at `address`, or start Ray here with `init_kwargs` (no dashboard
    unless they ask for one). `node_ip_address`: this machine's address in that cluster, where
    Ray cannot tell it (a head node on a bridge of its own).

    Either way the job's workers find the `benchmarks` package (the repository
    root is put on their PYTHONPATH) and get this process's TF_CPP_MIN_LOG_LEVEL
    (benchmarks/__init__.py sets it).
    """
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env_vars = {"PYTHONPATH": pythonpath, "TF_CPP_MIN_LOG_LEVEL": os.environ["TF_CPP_MIN_LOG_LEVEL"]}
    if address:
        # Code in the workers that looks the cluster up (Ray Train does) finds this one.
        env_vars["RAY_ADDRESS"] = address
        ray.init(address=address, runtime_env={"env_vars": env_vars}, logging_level="ERROR",
                 _node_ip_address=node_ip_address)
    else:
        init_kwargs.setdefault("include_dashboard", False)
        ray.init(runtime_env={"env_vars": env_vars}, logging_level="ERROR", **init_kwargs)


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: int, object_store_memory: int, **init_kwargs: Any) -> Iterator[None]:
    """``nodes`` raylets with their own object stores on this machine (``ray.cluster_utils``), connected to
    while open; ``init_kwargs`` go to each node.

    Ray keeps the cluster under a private temp dir (RAY_TMPDIR): otherwise its
    address file would send other Ray drivers on this machine to it.
    """
    from ray.cluster_utils import Cluster

    private = tempfile.mkdtemp(prefix=f"dsgd-{nodes}n-")
    with environment(RAY_TMPDIR=private):
        cluster = Cluster()
        try:
            for _ in range(nodes):
                cluster.add_node(num_cpus=cpus_per_node, object_store_memory=object_store_memory, **init_kwargs)
            cluster.wait_for_nodes()
            start_ray(cluster.address)
            yield
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(private, ignore_errors=True)


def add_ray_flags(parser: argparse.ArgumentParser, default_cpus: str) -> None:
    """`--address` (join a running cluster) and `--num-cpus` (the Ray instance the script starts otherwise)."""
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start one here)")
    parser.add_argument("--num-cpus", type=int, default=None,
                        help=f"logical CPUs when starting Ray here (default: {default_cpus})")


def connect_ray(args: argparse.Namespace, default_cpus: int, **init_kwargs: Any) -> None:
    """Unless this process is connected already: join `args.address`, or start Ray here with `args.num_cpus`
    (else `default_cpus`) logical CPUs and `init_kwargs` (the flags of ``add_ray_flags``)."""
    if not ray.is_initialized():
        start_ray(args.address, num_cpus=args.num_cpus or default_cpus, **init_kwargs)


def example(name: str) -> Any:
    """examples/<name>.py as a module, pickled by value (the workers may lack examples/ on their path)."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    module = importlib.import_module(name)
    cloudpickle.register_pickle_by_value(module)
    return module


def mnist_creator(num_workers: int, batch_size: int) -> Callable[[int, int], Any]:
    """examples/mnist.py's ConvNet, ``batch_size`` per replica, its data sliced for up to ``num_workers`` workers."""
    mnist = example("mnist")
    args = mnist.parse_args(["--num-workers", str(num_workers), "--batch-size", str(batch_size)])
    return lambda worker_index, device_index: mnist.ConvNet(worker_index, device_index, args)


def parameter_servers(sgd: Any) -> list:
    """The engine's parameter-server actors, read from its internals ([] without servers)."""
    group = sgd._cluster.servers
    return list(group.actors) if group else []


def identities(sgd: Any) -> list:
    """Who every actor of the engine is (``dsgd.common.actor_identity.ActorIdentity``: kind, index, node, pid): its
    workers, then its parameter servers."""
    return ray.get([actor.identity.remote() for actor in sgd.workers + parameter_servers(sgd)], timeout=60)


def actors_per_node(sgd: Any) -> list[str]:
    """Each node's actors, one line per node in order of first appearance ("node 1: worker 0, worker 1, ...")."""
    nodes: dict[str, list[str]] = {}
    for identity in identities(sgd):
        nodes.setdefault(identity.node_id, []).append(str(identity))
    return [f"node {k + 1}: {', '.join(actors)}" for k, actors in enumerate(nodes.values())]


def partition_count(sgd: Any) -> int:
    """How many partitions the engine's gradients travel in (0 without servers)."""
    group = sgd._cluster.servers
    return len(group.layout) if group else 0


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that made a run: this process's own, or `python -m module argv` when
    `main(argv)` was called from Python."""
    if argv is None:
        return shlex.join(sys.orig_argv)
    return shlex.join(["python", "-m", module, *argv])


Step = Callable[[], float]  # runs one step of a system, returns its time in seconds


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """`names` rotated left by `round_index`: each name goes first in turn."""
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def run_rounds(systems: dict[str, Step], rounds: int, warmup: int = 0,
               describe: Callable[[float], str] = lambda s: f"{s * 1000:8.1f} ms",
               settle_s: float = 0.0) -> tuple[dict[str, list[float]], list[str], bool]:
    """Run the systems interleaved: in round r each takes one step, in order rotated by r.

    So machine noise falls on every system alike and none always goes
    first. `settle_s` is a pause before every step, which keeps one
    system's trailing work (Ray freeing objects, garbage collection) off the
    next one's clock. Prints each step, the first `warmup` rounds marked as
    warm-up.

    Returns (every step's time per system, the order the steps ran in,
    whether Ctrl-C stopped the rounds early). Ctrl-C never loses finished steps.
    """
    times: dict[str, list[float]] = {name: [] for name in systems}
    order: list[str] = []
    width = max(map(len, systems))
    try:
        for r in range(rounds):
            phase = "warm-up" if r < warmup else "measure"
            for name in rotated(list(systems), r):
                time.sleep(settle_s)
                seconds = systems[name]()
                times[name].append(seconds)
                order.append(name)
                print(f"[round {r + 1}/{rounds} {phase}] {name:<{width}} {describe(seconds)}", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted in round {len(order) // len(systems) + 1}", flush=True)
        return times, order, True
    return times, order, False


def images_per_s(global_batch: int) -> Callable[[float], str]:
    """How `run_rounds` prints a training step: images/s and seconds."""
    return lambda seconds: f"{global_batch / seconds:8.2f} images/s  {seconds:7.3f} s"


def timed(fn: Callable[[], Any]) -> Step:
    """A Step that calls `fn` and returns its wall time."""

    def step() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return step


def ratios_over_peers(rates: dict[str, float | None], names: dict[str, str],
                      pairs: Iterable[str]) -> dict[str, float | None]:
    """For each "ours/peer" of ``pairs`` (keys of ``names``, which gives their system names): the rate of ours
    over the peer's (``rates`` by system name); None where either was not measured."""
    result = {}
    for pair in pairs:
        ours, peer = (rates.get(names[key]) for key in pair.split("/"))
        result[pair] = ours / peer if ours and peer else None
    return result


def verdict(target: float | None, value: float | None) -> str:
    """A ratio against its target (at least): "meets >= 1.5", "misses >= 1.5", ">= 1.5" unmeasured, "–" without."""
    if target is None:
        return "–"
    return f">= {target}" if value is None else f"{'meets' if value >= target else 'misses'} >= {target}"


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
        **machine(),
    }


def machine() -> dict[str, Any]:
    """The host, the versions that matter and the time, for a JSON record."""
    return {
        "host": {"cores": os.cpu_count(), "cpu_model": _cpu_model(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(),
                     **{p: _version(p) for p in ("tensorflow", "ray", "numpy", "dsgd")}},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_summary(record: dict[str, Any]) -> None:
    """One line: the system's mean images/s over its measured steps."""
    mean, std = record["images_per_sec_mean"], record["images_per_sec_std"]
    if mean is None:
        print(f"[{record['system']}] no measured steps (warm-up {record['warmup']})", flush=True)
        return
    print(f"[{record['system']}] {record['model']} {record['image_size']}px, global batch "
          f"{record['global_batch']}: {mean:.2f} ± {std:.2f} images/s over "
          f"{record['measured_steps']} steps", flush=True)


def write_json(record: Any, path: str | os.PathLike) -> Path:
    """`record` as indented JSON at `path` (directories made as needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


class Ideal:
    """The same workers computing with no exchange: one 1-worker engine per worker, stepping at once, each from
    its thread (the exchange and peers benchmarks' "ideal")."""

    def __init__(self, engines: list[Any]):
        self.engines = engines
        self.pool = concurrent.futures.ThreadPoolExecutor(len(engines))

    def burst(self, steps: int) -> None:
        """``steps`` steps of every engine, each from its thread, all at once."""
        for run in [self.pool.submit(burst, engine.step, steps) for engine in self.engines]:
            run.result()

    def close(self) -> None:
        self.pool.shutdown()


def burst(step: Callable[..., Any], steps: int) -> Any:
    """``steps`` calls of ``step``, stats fetched by the last only (a training loop that logs now and then);
    the last one's stats."""
    for _ in range(steps - 1):
        step(fetch_stats=False)
    return step(fetch_stats=True)

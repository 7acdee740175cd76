"""The driver: creates worker and parameter-server actors and runs steps."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import ray

from dsgd.errors import DSGDError, WorkerMismatchError
from dsgd.model import Model
from dsgd.ps_actor import ParameterServer
from dsgd.sgd_worker import ALL_REDUCE_ALGS, SGDWorker, WorkerConfig, WorkerSignature

logger = logging.getLogger(__name__)

STRATEGIES = ("ps", "simple")


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _cluster_capacity() -> tuple[dict[str, float], list[dict[str, float]]]:
    """Total resources and per-node resources of the live Ray nodes."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return ray.cluster_resources(), nodes


class DistributedSGD:
    """Synchronous data-parallel SGD over ``num_workers`` x ``devices_per_worker`` replicas.

    Args:
        model_creator: ``(worker_index, device_index) -> dsgd.Model``; must be
            picklable (it runs inside the worker actors).
        num_workers: worker actors, each a Ray actor with its own TF session.
        devices_per_worker: replicas per worker, one per device.
        gpu: place replicas on GPUs (one per replica) instead of virtual CPUs.
        strategy: "ps" (sharded parameter servers) or "simple" (the driver
            averages; a reference for debugging).
        grad_shard_bytes: target shard size for "ps"; 0 means one shard.
        all_reduce_alg: local allreduce across a worker's devices: "simple"
            (add_n on device 0) or "nccl" (GPU only).
        cpus_per_worker: CPUs each worker reserves; also its TF thread count.
        timeout_s: bound on every wait for a step or an actor call.
        startup_timeout_s: bound on building the workers' graphs.
    """

    def __init__(
        self,
        model_creator: Callable[[int, int], Model],
        num_workers: int = 1,
        devices_per_worker: int = 1,
        gpu: bool = False,
        strategy: str = "ps",
        grad_shard_bytes: int = 10_000_000,
        all_reduce_alg: str = "simple",
        *,
        cpus_per_worker: int = 1,
        timeout_s: float = 600.0,
        startup_timeout_s: float = 300.0,
    ):
        if not callable(model_creator):
            raise TypeError(f"model_creator must be callable (worker_index, device_index) -> dsgd.Model, got {model_creator!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if all_reduce_alg not in ALL_REDUCE_ALGS:
            raise ValueError(f"all_reduce_alg must be one of {ALL_REDUCE_ALGS}, got {all_reduce_alg!r}")
        if all_reduce_alg == "nccl" and not gpu:
            raise ValueError("all_reduce_alg='nccl' needs gpu=True; use 'simple' on CPUs")
        if not isinstance(gpu, bool):
            raise ValueError(f"gpu must be True or False, got {gpu!r}")
        num_workers = _check_int("num_workers", num_workers, 1)
        devices_per_worker = _check_int("devices_per_worker", devices_per_worker, 1)
        grad_shard_bytes = _check_int("grad_shard_bytes", grad_shard_bytes, 0)
        cpus_per_worker = _check_int("cpus_per_worker", cpus_per_worker, 1)
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if strategy == "ps" and num_workers == 1:
            logger.warning("strategy='ps' with num_workers=1 has no parameter servers to use: "
                           "the worker averages its replicas locally, as 'simple' does")
        self.strategy = strategy
        self.num_workers = num_workers
        self.devices_per_worker = devices_per_worker
        self.timeout_s = float(timeout_s)
        self.workers: list = []
        self.ps_actors: list = []
        self._step_id = 0
        self._in_flight: list = []
        self._closed = False
        if not ray.is_initialized():
            logger.info("Ray is not initialized; starting a local Ray instance")
            ray.init()
        self._check_resources(gpu, cpus_per_worker)
        config = WorkerConfig(num_workers, devices_per_worker, gpu, all_reduce_alg,
                              grad_shard_bytes, cpus_per_worker, float(timeout_s))
        try:
            self._start_workers(model_creator, config, gpu, startup_timeout_s)
            if strategy == "ps" and num_workers > 1:
                self._start_parameter_servers()
            self.set_weights(self._call(self.workers[0].get_weights.remote(), "worker 0's initial weights"))
        except BaseException:
            self.shutdown()
            raise

    # ---- set-up -----------------------------------------------------------

    def _check_resources(self, gpu: bool, cpus_per_worker: int) -> None:
        """Fail fast, naming what is missing, instead of waiting forever."""
        total, nodes = _cluster_capacity()
        need = {"CPU": cpus_per_worker, "GPU": self.devices_per_worker if gpu else 0}
        for resource, per_worker in need.items():
            if per_worker == 0:
                continue
            have = total.get(resource, 0)
            largest = max((n.get(resource, 0) for n in nodes), default=0)
            what = f"{'gpu=True with ' if resource == 'GPU' else ''}{self.num_workers} workers x {per_worker} {resource}"
            if per_worker > largest:
                raise ValueError(
                    f"{what}: each worker needs {per_worker} {resource} on one node, but the largest "
                    f"Ray node has {largest:g} (cluster total {have:g})")
            if per_worker * self.num_workers > have:
                raise ValueError(
                    f"{what} needs {per_worker * self.num_workers} {resource} in all, but the Ray cluster "
                    f"has {have:g}; lower num_workers/cpus_per_worker or start Ray with more")

    def _start_workers(self, model_creator, config: WorkerConfig, gpu: bool, startup_timeout_s: float) -> None:
        actor = ray.remote(SGDWorker).options(
            num_cpus=config.cpus_per_worker,
            num_gpus=config.devices_per_worker if gpu else 0,
            scheduling_strategy="SPREAD")
        self.workers = [actor.remote(i, config) for i in range(self.num_workers)]
        refs = [w.setup.remote(model_creator) for w in self.workers]
        signatures: list[WorkerSignature] = self._call(refs, "the workers to build their models", startup_timeout_s)
        for i, sig in enumerate(signatures[1:], start=1):
            if sig != signatures[0]:
                ours, theirs = set(map(str, sig.weights + sig.exchange)), set(map(str, signatures[0].weights + signatures[0].exchange))
                diff = sorted(ours ^ theirs)
                raise WorkerMismatchError(
                    f"worker {i} built a model that differs from worker 0's: {'; '.join(diff[:6]) or sig.metrics}")
        self.signature = signatures[0]

    def _start_parameter_servers(self) -> None:
        layout = self._call(self.workers[0].shard_layout.remote(), "worker 0's shard layout")
        actor = ray.remote(ParameterServer).options(num_cpus=0, scheduling_strategy="SPREAD")
        self.ps_actors = [actor.remote(s.index, self.num_workers, s.size, s.dtype.str) for s in layout]
        self._call([ps.ping.remote() for ps in self.ps_actors], "the parameter servers to start")
        self._call([w.set_parameter_servers.remote(self.ps_actors) for w in self.workers],
                   "the workers to connect to the parameter servers")
        logger.info("%d parameter servers, shard sizes %s bytes", len(layout), [s.nbytes for s in layout])

    # ---- waiting ----------------------------------------------------------

    def _call(self, refs, what: str, timeout: float | None = None):
        """ray.get with a bound, turning Ray's errors into ones that say what failed."""
        timeout = self.timeout_s if timeout is None else timeout
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise DSGDError(f"timed out after {timeout:.0f}s waiting for {what}") from e
        except ray.exceptions.RayActorError as e:
            raise DSGDError(f"{self._actor_name(e.actor_id)} died while waiting for {what}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, DSGDError):
                raise e.cause.with_traceback(None) from None
            raise DSGDError(f"failed while waiting for {what}:\n{e}") from e

    def _actor_name(self, actor_id) -> str:
        """'worker 1' or 'parameter server 3' for a Ray actor id."""
        for kind, actors in (("worker", self.workers), ("parameter server", self.ps_actors)):
            for i, actor in enumerate(actors):
                if actor._actor_id.hex() == getattr(actor_id, "hex", lambda: actor_id)():
                    return f"{kind} {i}"
        return "an actor"

    def _drain(self) -> None:
        """Wait for a step that was left running by step(fetch_stats=False)."""
        refs, self._in_flight = self._in_flight, []
        if refs:
            self._call(refs, f"step {self._step_id - 1} to finish")

    def _check_open(self) -> None:
        if self._closed:
            raise DSGDError("this DistributedSGD has been shut down; create a new one")

    # ---- stepping ---------------------------------------------------------

    def step(self, fetch_stats: bool = False) -> dict[str, float] | None:
        """One synchronous step on every replica.

        With ``fetch_stats=True`` waits for the step and returns ``loss`` and
        every metric (means over all replicas), ``step_time_s`` and ``step``.
        With ``fetch_stats=False`` returns None once the step is submitted;
        it waits only for the previous step, so at most one step is in
        flight and no barrier is added beyond the strategy's own.
        """
        self._check_open()
        start = time.perf_counter()
        step_id = self._step_id
        self._step_id += 1
        if self.strategy == "simple" and self.num_workers > 1:
            self._drain()
            per_worker = self._step_simple(step_id, fetch_stats)
        else:
            if self.num_workers == 1:
                refs = [self.workers[0].step_local.remote(fetch_stats)]
            else:
                refs = [w.step_ps.remote(step_id, fetch_stats) for w in self.workers]
            self._drain()
            self._in_flight = refs
            if not fetch_stats:
                return None
            self._in_flight = []
            per_worker = self._call(refs, f"step {step_id} on all workers")
        if not fetch_stats:
            return None
        stats = {k: float(np.mean([s[k] for s in per_worker])) for k in per_worker[0]}
        stats["step_time_s"] = time.perf_counter() - start
        stats["step"] = step_id
        return stats

    def _step_simple(self, step_id: int, fetch_stats: bool) -> list[dict[str, float]]:
        """Gather every worker's averaged gradients, average on the driver, apply."""
        results = self._call([w.compute_gradients.remote(fetch_stats) for w in self.workers],
                             f"the workers' gradients of step {step_id}")
        means = [np.copy(g) for g in results[0][0]]
        for grads, _ in results[1:]:
            for total, g in zip(means, grads):
                np.add(total, g, out=total)
        for total in means:
            np.divide(total, self.num_workers, out=total)
        means_ref = ray.put(means)
        self._call([w.apply_gradients.remote(means_ref) for w in self.workers],
                   f"the workers to apply step {step_id}")
        return [stats for _, stats in results]

    # ---- weights and callbacks -------------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """Worker 0, replica 0's variables, keyed by name without ``device_<i>/``."""
        self._check_open()
        self._drain()
        return self._call(self.workers[0].get_weights.remote(), "worker 0's weights")

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign ``weights`` (as from get_weights) to every replica on every worker."""
        self._check_open()
        if not isinstance(weights, dict):
            raise TypeError(f"set_weights expects a dict of name -> ndarray, got {type(weights).__name__}")
        expected = {s.name: s for s in self.signature.weights}
        missing, unknown = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
        if missing or unknown:
            raise ValueError(f"set_weights: missing variables {missing}, unknown variables {unknown}")
        for name, value in weights.items():
            if np.shape(value) != expected[name].shape:
                raise ValueError(f"set_weights: {name!r} has shape {np.shape(value)}, expected {expected[name].shape}")
        self._drain()
        ref = ray.put(weights)
        self._call([w.set_weights.remote(ref) for w in self.workers], "the workers to set weights")

    def foreach_worker(self, fn: Callable[[SGDWorker], Any]) -> list:
        """``fn(worker)`` on each worker actor; the list of results, worker order."""
        self._check_open()
        self._drain()
        return self._call([w.apply_fn.remote(fn) for w in self.workers], "foreach_worker")

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """``fn(model)`` on every replica; a flat list, worker then device order."""
        self._check_open()
        self._drain()
        per_worker = self._call([w.foreach_model.remote(fn) for w in self.workers], "foreach_model")
        return [r for results in per_worker for r in results]

    def warmup(self) -> None:
        """Run each worker's forward and backward pass once without applying it."""
        self._check_open()
        self._drain()
        self._call([w.warmup.remote() for w in self.workers], "the workers to warm up")

    # ---- teardown ---------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the worker and parameter-server actors. Safe to call twice."""
        self._closed = True
        self._in_flight = []
        if ray.is_initialized():
            for actor in self.workers + self.ps_actors:
                ray.kill(actor)
        self.workers, self.ps_actors = [], []

    def __enter__(self) -> "DistributedSGD":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

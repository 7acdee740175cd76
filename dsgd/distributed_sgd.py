"""The driver: creates worker and parameter-server actors, runs and recovers steps."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import ray

from dsgd import checkpoint, shards, strategies, timeline
from dsgd.errors import ActorFailure, DSGDError, DSGDTimeoutError, WorkerMismatchError
from dsgd.model import Model
from dsgd.placement import actor_placement
from dsgd.ps_actor import StepAborted
from dsgd.server_group import ServerGroup, plan_servers
from dsgd.sgd_worker import ALL_REDUCE_ALGS, NAN_POLICIES, SGDWorker, WorkerConfig, WorkerSignature

logger = logging.getLogger(__name__)

STRATEGIES = ("ps", "simple")
PING_TIMEOUT_S = 10.0

# Errors that mean an actor (or an object it owned) is gone: recoverable.
_FAULTS = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, StepAborted)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _ops_wanted(use_ops: bool | None) -> bool:
    """Whether the "ps" exchange uses the op library; builds it if needed."""
    if use_ops is False:
        return False
    from dsgd import ops

    if ops.is_available():
        return True
    if use_ops:
        ops.load()  # raises the build or load error, which says what is missing
    logger.warning("the dsgd op library could not be built or loaded (run `python -m dsgd.ops.build` "
                   "to see why); the 'ps' strategy exchanges shards through Python instead")
    return False


def _fault_of(error: BaseException) -> BaseException | None:
    """The actor failure behind ``error``, if that is what it is."""
    if isinstance(error, _FAULTS):
        return error
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, _FAULTS):
        return error.cause
    return None


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
        grad_shard_bytes: partition size for "ps": the unit that travels
            to a parameter server and is pipelined with back-propagation.
            ``None`` (default): dsgd picks about 4 partitions per server, at
            least 1 MiB each, and logs its choice; 0 means one partition.
            Never changes how many server processes start.
        all_reduce_alg: local allreduce across a worker's devices: "simple"
            (add_n on device 0) or "nccl" (GPU only).
        num_parameter_servers: server processes for "ps", each summing many
            partitions. ``None`` (default): per node holding workers, one,
            plus one for every 2 CPUs those workers leave free, at most one
            per worker there; logged. An int is spread over those nodes.
        cpus_per_worker: CPUs each worker reserves; also its TF thread count.
        nan_policy: a step whose averaged gradient holds NaN or Inf is
            "raise"d (naming the variable) or "skip"ped, on every replica
            alike; "ignore" applies it unchecked (saves one pass over the
            gradients).
        use_ops: for "ps", move shards with the C++ op library (dsgd.ops):
            each shard leaves from inside the graph as soon as its gradients
            exist, and averaged shards reach TensorFlow without a copy.
            ``None`` (default) uses it when it builds and loads, and warns
            otherwise; ``False`` exchanges through Python after the
            gradients are computed (what the benchmark compares against).
        max_failures: dead workers or parameter servers to replace over the
            engine's life before giving up.
        timeout_s: bound on every wait for a step or an actor call.
        startup_timeout_s: bound on building the workers' graphs.
        logdir: if set, every ``step(fetch_stats=True)`` writes its stats
            there as TensorBoard scalars (see dsgd.tensorboard).
        batch_size: samples in one replica's batch, if you want
            ``samples_per_s`` in the stats (dsgd cannot know it: a model may
            make its batches inside the graph).
    """

    def __init__(
        self,
        model_creator: Callable[[int, int], Model],
        num_workers: int = 1,
        devices_per_worker: int = 1,
        gpu: bool = False,
        strategy: str = "ps",
        grad_shard_bytes: int | None = None,
        all_reduce_alg: str = "simple",
        *,
        num_parameter_servers: int | None = None,
        cpus_per_worker: int = 1,
        nan_policy: str = "raise",
        use_ops: bool | None = None,
        max_failures: int = 3,
        timeout_s: float = 600.0,
        startup_timeout_s: float = 300.0,
        logdir: str | None = None,
        batch_size: int | None = None,
    ):
        if not callable(model_creator):
            raise TypeError(f"model_creator must be callable (worker_index, device_index) -> dsgd.Model, got {model_creator!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if all_reduce_alg not in ALL_REDUCE_ALGS:
            raise ValueError(f"all_reduce_alg must be one of {ALL_REDUCE_ALGS}, got {all_reduce_alg!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}")
        if not isinstance(gpu, bool):
            raise ValueError(f"gpu must be True or False, got {gpu!r}")
        if all_reduce_alg == "nccl" and not gpu:
            raise ValueError("all_reduce_alg='nccl' needs gpu=True; use 'simple' on CPUs")
        num_workers = _check_int("num_workers", num_workers, 1)
        devices_per_worker = _check_int("devices_per_worker", devices_per_worker, 1)
        if grad_shard_bytes is not None:
            grad_shard_bytes = _check_int("grad_shard_bytes", grad_shard_bytes, 0)
        if num_parameter_servers is not None:
            num_parameter_servers = _check_int("num_parameter_servers", num_parameter_servers, 1)
        cpus_per_worker = _check_int("cpus_per_worker", cpus_per_worker, 1)
        max_failures = _check_int("max_failures", max_failures, 0)
        timeout_s = _check_seconds("timeout_s", timeout_s)
        if batch_size is not None:
            batch_size = _check_int("batch_size", batch_size, 1)
        startup_timeout_s = _check_seconds("startup_timeout_s", startup_timeout_s)
        if use_ops not in (None, True, False):
            raise ValueError(f"use_ops must be None, True or False, got {use_ops!r}")
        if strategy == "ps" and num_workers == 1:
            logger.warning("strategy='ps' with num_workers=1 has no parameter servers to use: "
                           "the worker averages its replicas locally, as 'simple' does")
        self.strategy = strategy
        self.num_workers = num_workers
        self.devices_per_worker = devices_per_worker
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_failures = max_failures
        self.failures = 0
        self.workers: list = []
        self.servers: ServerGroup | None = None
        self._grad_shard_bytes = grad_shard_bytes
        self._num_parameter_servers = num_parameter_servers
        self._model_creator = model_creator
        self._config = WorkerConfig(num_workers, devices_per_worker, gpu, all_reduce_alg,
                                    cpus_per_worker, timeout_s, nan_policy,
                                    use_ops=self._uses_ps and _ops_wanted(use_ops))
        self._strategy = strategies.make(strategy, num_workers, self._call, self._span)
        self._step_id = 0  # steps submitted; step ids count from 0
        self._in_flight: list[tuple[int, list]] = []
        self._closed = False
        self._samples_per_step = batch_size * num_workers * devices_per_worker if batch_size else None
        self._trace: timeline.Recorder | None = None
        self._scalars = None
        if logdir is not None:
            from dsgd.tensorboard import ScalarLogger

            self._scalars = ScalarLogger(logdir)
        if not ray.is_initialized():
            logger.info("Ray is not initialized; starting a local Ray instance")
            ray.init()
        self._check_resources()
        try:
            self._start_workers()
            if self._uses_ps:
                self._check_object_store()
                self._start_parameter_servers()
            initial = self._call(self.workers[0].get_weights.remote(), "worker 0's initial weights",
                                 self.startup_timeout_s)
            self.set_weights(initial)
        except BaseException:
            self.shutdown()
            raise

    @property
    def _uses_ps(self) -> bool:
        return self.strategy == "ps" and self.num_workers > 1

    @property
    def ps_actors(self) -> list:
        """The parameter-server actors ("ps" with several workers; else empty)."""
        return list(self.servers.actors) if self.servers else []

    @property
    def layout(self) -> list[shards.Shard]:
        """The gradient partitions ("ps" with several workers; else empty)."""
        return list(self.servers.layout) if self.servers else []

    # ---- set-up -----------------------------------------------------------

    def _check_resources(self) -> None:
        """Fail fast, naming what is missing, instead of waiting forever."""
        total = ray.cluster_resources()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        cfg = self._config
        need = {"CPU": cfg.cpus_per_worker, "GPU": cfg.devices_per_worker if cfg.gpu else 0}
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

    def _check_object_store(self) -> None:
        """Each step holds every worker's shards plus one mean per shard in the store."""
        exchange = sum(s.size * s.dtype.itemsize for s in self.signature.exchange)
        need = exchange * (self.num_workers + 1)
        have = ray.cluster_resources().get("object_store_memory", 0)
        if need > have:
            raise ValueError(
                f"the exchange needs {need / 2**20:.0f} MiB of Ray object-store memory per step "
                f"({self.num_workers} workers' gradients of {exchange / 2**20:.0f} MiB plus their mean), "
                f"but the cluster has {have / 2**20:.0f} MiB; start Ray with a larger object_store_memory")

    def _new_worker(self, index: int):
        cfg = self._config
        return ray.remote(SGDWorker).options(
            num_cpus=cfg.cpus_per_worker,
            num_gpus=cfg.devices_per_worker if cfg.gpu else 0,
            scheduling_strategy=actor_placement()).remote(index, cfg)

    def _start_workers(self) -> None:
        self.workers = [self._new_worker(i) for i in range(self.num_workers)]
        refs = [w.setup.remote(self._model_creator) for w in self.workers]
        signatures: list[WorkerSignature] = self._call(
            refs, "the workers to build their models", self.startup_timeout_s)
        for i, sig in enumerate(signatures[1:], start=1):
            if sig != signatures[0]:
                ours, theirs = (set(map(str, s.weights + s.exchange)) for s in (sig, signatures[0]))
                diff = sorted(ours ^ theirs)
                raise WorkerMismatchError(
                    f"worker {i} built a model that differs from worker 0's: {'; '.join(diff[:6]) or sig.metrics}")
        self.signature = signatures[0]

    def _start_parameter_servers(self) -> None:
        """Plan the servers and the partitions on the driver, start them, connect the workers."""
        worker_nodes = self._call([w.node_id.remote() for w in self.workers], "the workers' nodes")
        node_cpus = {n["NodeID"]: n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")}
        nodes = plan_servers(worker_nodes, node_cpus, self._config.cpus_per_worker, self._num_parameter_servers)
        specs = self.signature.exchange
        shard_bytes = self._grad_shard_bytes
        if shard_bytes is None:
            shard_bytes = shards.default_partition_bytes(specs, len(nodes))
        layout = shards.plan_shards(specs, shard_bytes)
        self.servers = ServerGroup(layout, nodes[:len(layout)], self.num_workers, self.timeout_s)
        self._call(self.servers.start(), "the parameter servers to start", self.startup_timeout_s)
        self._connect_parameter_servers(self.workers)
        logger.info("strategy 'ps': %s%s", self.servers.describe(),
                    "" if self._grad_shard_bytes is None and self._num_parameter_servers is None else
                    f" (grad_shard_bytes={self._grad_shard_bytes}, num_parameter_servers={self._num_parameter_servers})")

    def _connect_parameter_servers(self, workers: list) -> None:
        group = self.servers
        self._call([w.connect.remote(group.layout, group.placement, group.actors, self.startup_timeout_s)
                    for w in workers], "the workers to connect to the parameter servers", self.startup_timeout_s)

    # ---- waiting ----------------------------------------------------------

    def _call(self, refs, what: str, timeout: float | None = None):
        """ray.get with a bound, turning Ray's errors into ones that say what failed.

        Results are taken as they complete, so the first failure is raised at
        once rather than after the slowest of the other calls.
        """
        timeout = self.timeout_s if timeout is None else timeout
        pending = list(refs) if isinstance(refs, list) else [refs]
        deadline = time.monotonic() + timeout
        values = {}
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise DSGDTimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; "
                                           "raise timeout_s if steps are legitimately this slow")
                values[ready[0]] = ray.get(ready[0])
        except ray.exceptions.RayError as e:
            fault = _fault_of(e)
            if fault is not None:
                raise ActorFailure(f"{self._actor_name(fault)} failed while waiting for {what}: {fault}") from e
            if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, DSGDError):
                raise e.cause.with_traceback(None) from None
            raise DSGDError(f"failed while waiting for {what}:\n{e}") from e
        return self._result_list(refs, values)

    def _actor_name(self, error: BaseException) -> str:
        """'worker 1' or 'parameter server 3' for the actor behind an error."""
        actor_id = getattr(error, "actor_id", None)
        for kind, actors in (("worker", self.workers), ("parameter server", self.ps_actors)):
            for i, actor in enumerate(actors):
                if actor_id is not None and actor._actor_id.hex() == actor_id:
                    return f"{kind} {i}"
        return "an actor"

    def _result_list(self, refs, values: dict):
        return [values[r] for r in refs] if isinstance(refs, list) else values[refs]

    def _check_open(self) -> None:
        if self._closed:
            raise DSGDError("this DistributedSGD has been shut down; create a new one")

    # ---- stepping ---------------------------------------------------------

    def step(self, fetch_stats: bool = False, write_timeline: str | None = None) -> dict[str, float] | None:
        """One synchronous step on every replica.

        With ``fetch_stats=True`` waits for the step and returns ``loss`` and
        every metric (means over all replicas), ``step_time_s`` and ``step``.
        With ``fetch_stats=False`` returns None once the step is submitted;
        it waits only for the previous step, so at most one step is in
        flight and no barrier is added beyond the strategy's own. A failed
        step's error shows at the next call.

        ``write_timeline=path`` runs the step alone (after the previous one)
        and writes a Chrome trace of it to ``path``: the driver, every worker
        (its Python phases and every TensorFlow op, with the shards' sends and
        receives) and every parameter server (the average, the put of the
        mean, each worker's push waiting for it), on one clock, a track group
        per actor.
        """
        self._check_open()
        if write_timeline is not None:
            return self._traced_step(fetch_stats, write_timeline)
        start = time.perf_counter()
        step_id = self._step_id
        self._step_id += 1

        def submit() -> None:
            with self._span("submit"):
                self._in_flight.append((step_id, self._strategy.submit(self.workers, step_id, fetch_stats)))

        per_worker = self._recovering(submit, fetch_stats)  # None, unless recovery completed the step
        if per_worker is None:
            with self._span("wait for the workers"):
                per_worker = self._drain(keep_last=not fetch_stats, fetch_stats=fetch_stats)
        if not fetch_stats:
            return None
        if not per_worker:
            logger.warning("step %d was completed by recovery on some workers; its stats are lost", step_id)
            per_worker = [{"loss": float("nan")}]
        stats = {k: float(np.mean([s[k] for s in per_worker])) for k in per_worker[0] if k != "skipped"}
        stats["step_time_s"] = time.perf_counter() - start
        if self._samples_per_step:
            stats["samples_per_s"] = self._samples_per_step / stats["step_time_s"]
        if self._scalars is not None:
            self._scalars.log(step_id, stats)
        stats["step"] = step_id
        return stats

    def _traced_step(self, fetch_stats: bool, path: str) -> dict[str, float] | None:
        self._drain()
        step_id = self._step_id
        self._call([w.start_trace.remote() for w in self.workers], "the workers to start tracing")
        self._trace = timeline.Recorder()
        try:
            with self._trace.span(f"step {step_id}"):
                stats = self.step(fetch_stats=True)
        finally:
            driver, self._trace = self._trace, None
            workers = self._call([w.collect_trace.remote() for w in self.workers], "the workers' traces")
        servers = self._call(self.servers.traces(step_id), "the parameter servers' traces") if self.servers else []
        timeline.write(path, [("driver", driver.events)]
                       + [(f"worker {i}", events) for i, events in enumerate(workers)]
                       + [(f"parameter server {j}", events) for j, events in enumerate(servers)])
        return stats if fetch_stats else None

    def _span(self, name: str):
        return timeline.maybe_span(self._trace, name)

    def _drain(self, keep_last: bool = False, fetch_stats: bool = False) -> list | None:
        """Wait for submitted steps (all, or all but the newest); recover from faults.

        Returns the per-worker results of the newest step waited for.
        """
        results = None
        while len(self._in_flight) > (1 if keep_last else 0):
            step_id, refs = self._in_flight[0]
            results = self._recovering(lambda: self._call(refs, f"step {step_id} on all workers"), fetch_stats)
            if not self._in_flight:  # recovery aborted every step in flight and re-ran them
                return results
            self._in_flight.pop(0)
            self._warn_skipped(results)
        return results

    def _warn_skipped(self, results: list) -> None:
        skipped = [r["skipped"] for r in results if isinstance(r, dict) and "skipped" in r]
        if skipped:
            logger.warning("skipped a step (nan_policy='skip'): %s", skipped[0])

    def _recovering(self, run: Callable[[], list | None], fetch_stats: bool) -> list | None:
        """``run()``; recover from a dead actor (the re-run steps' results), or settle the workers after another error."""
        try:
            return run()
        except ActorFailure as e:
            return self._recover(e, fetch_stats)
        except DSGDTimeoutError:
            self._in_flight.clear()
            raise
        except DSGDError:
            self._step_id = self._settle()
            raise

    # ---- recovery ---------------------------------------------------------

    def _recover(self, error: ActorFailure, fetch_stats: bool) -> list:
        """Replace dead actors, make every replica equal again, re-run lost steps.

        A step is applied by a worker only once it holds every averaged
        shard, so after a failure some workers may have applied the step and
        others not. Workers that are behind (or new) get the full state —
        weights, optimizer slots, step count — of the most advanced
        survivor; then the steps no worker applied are run again. Returns
        the per-worker results of the last step run.
        """
        while True:
            self.failures += 1
            if self.failures > self.max_failures:
                raise DSGDError(f"giving up after {self.max_failures} recoveries (max_failures); "
                                f"last failure: {error}") from error
            logger.warning("%s; recovering (failure %d of at most %d)", error, self.failures, self.max_failures)
            try:
                applied = self._settle(replace_dead=True)
                results = []
                for step_id in range(applied, self._step_id):
                    last = step_id == self._step_id - 1
                    refs = self._strategy.submit(self.workers, step_id, fetch_stats and last)
                    results = self._call(refs, f"re-run of step {step_id}")
                    self._warn_skipped(results)
                return results
            except ActorFailure as e:
                error = e

    def _settle(self, replace_dead: bool = False) -> int:
        """Abort steps in flight and bring every worker to one state; the step count."""
        self._abort_in_flight()
        fresh = self._replace_dead_actors() if replace_dead else set()
        return self._resynchronize(fresh)

    def _abort_in_flight(self) -> None:
        """Unblock workers waiting on sums that will never complete, then wait for them."""
        if self.servers:
            self.servers.abort()
        refs = [r for _, step_refs in self._in_flight for r in step_refs]
        self._in_flight.clear()
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)

    def _is_alive(self, actor) -> bool:
        try:
            ray.get(actor.ping.remote(), timeout=PING_TIMEOUT_S)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def _replace_dead_actors(self) -> set[int]:
        """Start new actors for dead ones; the indices of the new workers."""
        dead_ps = self.servers.replace_dead(self._is_alive) if self.servers else []
        for j in dead_ps:
            logger.warning("parameter server %d is dead; started a new one", j)
        dead_workers = [i for i, w in enumerate(self.workers) if not self._is_alive(w)]
        if len(dead_workers) == self.num_workers:
            raise DSGDError("every worker died, so no replica is left to restore the weights from; "
                            "restore from a checkpoint (DistributedSGD.restore) in a new engine")
        for i in dead_workers:
            logger.warning("worker %d is dead; starting a new one", i)
            self.workers[i] = self._new_worker(i)
        if dead_workers:
            self._call([self.workers[i].setup.remote(self._model_creator) for i in dead_workers],
                       "replacement workers to build their models", self.startup_timeout_s)
        if self._uses_ps and (dead_ps or dead_workers):
            self._connect_parameter_servers(self.workers)
        return set(dead_workers)

    def _resynchronize(self, fresh: set[int]) -> int:
        """Copy the most advanced survivor's state to every worker behind it (or new)."""
        counts = self._call([w.applied_steps_count.remote() for w in self.workers], "the workers' step counts")
        survivors = [i for i in range(self.num_workers) if i not in fresh]
        source = max(survivors, key=lambda i: counts[i])
        applied = counts[source]
        behind = [w for i, w in enumerate(self.workers) if i in fresh or counts[i] < applied]
        if behind:
            state = self.workers[source].get_state.remote()
            self._call([w.set_state.remote(state) for w in behind], f"worker {source}'s state to be copied")
        if self.servers:
            self._call(self.servers.reset(applied), "the parameter servers to reset")
        return applied

    # ---- weights, state and callbacks ------------------------------------

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

    def save(self, path: str) -> None:
        """Write weights, optimizer state and step count to ``path``, atomically.

        ``path`` is a file, or a directory (existing, or ending in a separator)
        that gets ``dsgd_checkpoint.npz``: a ``ray.train.Checkpoint`` directory.
        """
        self._check_open()
        self._drain()
        checkpoint.save(path, self._call(self.workers[0].get_state.remote(), "worker 0's state"))

    def restore(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (its file or its directory) onto every replica."""
        self._check_open()
        self._drain()
        state = checkpoint.load(path, {"weights": self.signature.weights, "optimizer": self.signature.optimizer})
        ref = ray.put(state)
        self._call([w.set_state.remote(ref) for w in self.workers], "the workers to load the checkpoint")
        self._step_id = state["applied_steps"]
        if self.servers:
            self._call(self.servers.reset(self._step_id), "the parameter servers to reset")

    @property
    def num_steps(self) -> int:
        """Steps submitted so far (restored checkpoints count theirs)."""
        return self._step_id

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
        if self._scalars is not None:
            self._scalars.close()
        if ray.is_initialized():
            for actor in self.workers:
                ray.kill(actor)
            if self.servers:
                self.servers.kill()
        self.workers, self.servers = [], None

    def __enter__(self) -> "DistributedSGD":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

"""The engine's actors on Ray: starts, places, replaces and kills them.

``Cluster`` owns the worker actors and the parameter servers
(``dsgd.cluster.server_group``, which also plans them). It checks that the Ray
cluster has the CPUs and GPUs for the workers before starting any, and the
object-store memory for the exchange before starting the parameter servers
(the exchange's size is known once the workers have built their models).
Every wait goes through its ``calls`` (``dsgd.common.calls``: bounded, Ray's errors
turned into dsgd's). Replacements for dead actors go on live nodes: a new
worker on a node with room for it beside the surviving workers (else an
error names what is missing), a new parameter server beside the workers.

``resize`` starts or stops workers between steps (``DistributedSGD.resize``):
new workers are built before anything else changes (meanwhile the servers
of the new count start and the survivors prepare its exchange), so a size
the cluster cannot hold, or a new worker that fails to build, leaves the
engine as it was; ``connect_exchange`` then gives every worker the exchange
of the new count and its parameter servers, planned as at start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Collection

import ray

from dsgd.integrations import data
from dsgd.worker import keras_preload
from dsgd.wire import codec, partitions
from dsgd.common.calls import Calls
from dsgd.config import Options
from dsgd.cluster.topology import Topology
from dsgd.errors import ActorFailure, DSGDError, WorkerMismatchError
from dsgd.model import Model
from dsgd.cluster.placement import actor_placement, live_node_resources, place_new_workers
from dsgd.cluster.server_group import ServerGroup, plan_group
from dsgd.sgd_worker import SGDWorker
from dsgd.common.stopwatch import Phases
from dsgd.worker.tf1.worker_graph import WorkerSignature

logger = logging.getLogger(__name__)

ELASTIC_PLACEMENTS = 5  # an elastic engine places replacements this often before a lost node's failure is raised
ELASTIC_POLL_S = 1.0  # an elastic engine waiting for room for its minimum looks again this often
KILL_WAIT_S = 10.0  # how long kill waits for killed workers to be gone before it stops their datasets

# The workers' environment, each variable unless the driver's environment sets it:
# - TF_CPP_MIN_LOG_LEVEL 3 hides TensorFlow's start-up lines, including "failed call to
#   cuInit" on CPU-only machines;
# - TF_CPU_ALLOCATOR_USE_BFC true gives TensorFlow's CPU tensors its best-fit pool (the
#   allocator it uses for GPU memory) instead of malloc. A step frees and allocates
#   every gradient again; glibc's malloc keeps a varying share of that freed memory, so
#   a worker's RSS wandered by 3-9 % over hundreds of steps, while the pool is reused
#   and stays flat (benchmarks/soak.py, docs/benchmarks.md "Soak");
# - DSGD_SKIP_KERAS_PRELOAD 1 saves a starting worker 1.2 s of importing Keras with
#   TensorFlow (dsgd.worker.keras_preload).
WORKER_ENV_DEFAULTS = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_CPU_ALLOCATOR_USE_BFC": "true", keras_preload.ENV: "1"}


def worker_env() -> dict[str, str]:
    """The environment variables a new worker gets: WORKER_ENV_DEFAULTS, overridden by the driver's."""
    return {name: os.environ.get(name, default) for name, default in WORKER_ENV_DEFAULTS.items()}

class Cluster:
    """The workers and parameter servers of one engine."""

    def __init__(self, options: Options, model_creator: Callable[[int, int], Model],
                 datasets: dict[str, Any] | None = None):
        self.options = options
        self.topology = Topology.of(options)  # set_size changes it
        self.worker_config = options.worker_config(self.topology.exchange, feed_concurrently=datasets is not None)
        self.workers: list[Any] = []
        self.servers: ServerGroup | None = None
        self._next_servers: ServerGroup | None = None  # a grow's, started while its new workers build
        self._kept_servers: ServerGroup | None = None  # the servers of the count before the last resize, idle
        self.signature: WorkerSignature | None = None  # what every worker built
        self.calls = Calls(options.timeout_s, options.startup_timeout_s)
        self._model_creator = model_creator
        self.splits = data.DatasetSplits(datasets, options.devices_per_worker)
        self._worker_nodes: list[str] = []  # the node id of each worker

    def set_size(self, num_workers: int) -> None:
        """The one place the engine's worker count changes: a resize, an elastic shrink or start."""
        self.topology = self.topology.resized(num_workers)

    # ---- start ------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, then the parameter servers, and connect them; each once the cluster can hold it.

        CPUs and GPUs are checked before any worker starts; the object store
        once the workers have built their models, before any parameter server
        starts: the exchange's size is the model's, known only then.
        """
        if self.options.elastic:
            self.set_size(self._elastic_start_count())
            logger.info("num_workers=%s: starting %d workers", (self.options.min_workers, self.options.max_workers),
                        self.topology.num_workers)
        self.check_resources()
        self.workers = [self._new_worker(i) for i in range(self.topology.num_workers)]
        self._worker_nodes = [i.node_id for i in self.calls.identify(self.workers)]
        self.splits.split(self._worker_nodes, self.calls.call_startup)
        self._build_models(range(self.topology.num_workers))
        if self.topology.uses_ps:
            self.check_object_store()
            self._start_parameter_servers(self._worker_nodes)

    def match_initial_weights(self) -> dict[int, list[str]]:
        """Every replica starts from worker 0's replica 0's weights; per worker, the variables it was given.

        Worker 0 reads its weights while the others read theirs; each then
        assigns only the variables that differ (``SGDWorker.match_weights``).
        Worker 0 takes part only for its other replicas.
        """
        indices = range(self.topology.num_workers) if self.options.devices_per_worker > 1 else \
            range(1, self.topology.num_workers)
        if not indices:
            return {}  # one replica in all
        reference = self.workers[0].get_weights.remote()
        assigned = self.calls.call_startup([self.workers[i].match_weights.remote([reference]) for i in indices],
                                           "the workers to start from worker 0's weights")
        return dict(zip(indices, assigned))

    def check_resources(self) -> None:
        """Fail fast, naming what is missing, instead of waiting forever."""
        total = ray.cluster_resources()
        nodes = list(live_node_resources().values())
        num_workers = self.topology.num_workers
        for resource, per_worker in self._worker_needs().items():
            have = total.get(resource, 0)
            largest = max((n.get(resource, 0) for n in nodes), default=0)
            what = f"{'gpu=True with ' if resource == 'GPU' else ''}{num_workers} workers x {per_worker} {resource}"
            if per_worker > largest:
                raise ValueError(
                    f"{what}: each worker needs {per_worker} {resource} on one node, but the largest "
                    f"Ray node has {largest:g} (cluster total {have:g})")
            if per_worker * num_workers > have:
                raise ValueError(
                    f"{what} needs {per_worker * num_workers} {resource} in all, but the Ray cluster "
                    f"has {have:g}; lower num_workers/cpus_per_worker or start Ray with more")

    def _worker_needs(self) -> dict[str, int]:
        """What one worker reserves on its node: CPUs, and GPUs with gpu=True."""
        opts = self.options
        return {"CPU": opts.cpus_per_worker, **({"GPU": opts.devices_per_worker} if opts.gpu else {})}

    def _room(self, new: list[int]) -> tuple[list[str], dict[str, dict[str, float]]]:
        """A live node for each of the new workers ``new`` in turn, as long as they fit; each node's free resources.

        Nodes where other workers run come first (they answered just now),
        the dead workers' own nodes last: Ray sees a lost node dead only
        seconds after its actors. Only the engine's workers count as holding
        resources (what other Ray jobs hold may be freed; waiting for that is
        bounded).
        """
        needs = self._worker_needs()
        free = {node: {r: have.get(r, 0) for r in needs} for node, have in live_node_resources().items()}
        others = [node for i, node in enumerate(self._worker_nodes) if i not in new]
        own = [self._worker_nodes[i] for i in new if i < len(self._worker_nodes)]
        for node in others:
            if node in free:
                for r, amount in needs.items():
                    free[node][r] -= amount
        return place_new_workers(len(new), needs, free, first=others, last=own), free

    def _nodes_for(self, new: list[int], what: str = "replace dead worker") -> list[str]:
        """A live node for each of the new workers ``new`` (``_room``); a DSGDError naming what is missing if not all fit."""
        nodes, free = self._room(new)
        if len(nodes) < len(new):
            room = "; ".join(f"node {n[:8]} has {_amounts(have)} free" for n, have in free.items())
            raise DSGDError(f"cannot {what} {new[len(nodes)]}: it needs {_amounts(self._worker_needs())} on one "
                            f"node, and no live node has that free beside the other workers "
                            f"({room or 'no node is alive'})")
        return nodes

    def room_to_grow(self) -> int:
        """How many more workers (up to ``max_workers``) fit beside the engine's, and in what Ray has free now.

        The second bound keeps a grow from waiting for resources that other
        Ray jobs hold.
        """
        n = len(self.workers)
        fit = len(self._room(list(range(n, self.options.max_workers or n)))[0])
        available = ray.available_resources()
        return min([fit] + [int(available.get(r, 0) // amount) for r, amount in self._worker_needs().items()])

    def _elastic_start_count(self) -> int:
        """The workers an elastic engine starts with: as many as fit, up to max; waits up to startup_timeout_s for min."""
        opts = self.options
        deadline = time.monotonic() + opts.startup_timeout_s
        while True:
            fit = len(self._room(list(range(opts.max_workers)))[0])
            if fit >= opts.min_workers:
                return fit
            if time.monotonic() >= deadline:
                raise DSGDError(
                    f"num_workers={(opts.min_workers, opts.max_workers)}: after {opts.startup_timeout_s:.0f}s the "
                    f"live Ray nodes have room for {fit} workers of {_amounts(self._worker_needs())}, fewer than the "
                    f"minimum {opts.min_workers}; add nodes or lower the minimum")
            logger.info("num_workers=%s: room for %d workers, waiting for %d", (opts.min_workers, opts.max_workers),
                        fit, opts.min_workers)
            time.sleep(ELASTIC_POLL_S)

    def check_object_store(self, num_workers: int | None = None) -> None:
        """Each step may hold every worker's partitions (of ``num_workers``, default the engine's) plus their means."""
        num_workers = self.topology.num_workers if num_workers is None else num_workers
        exchange = sum(s.size * codec.wire_dtype(s.dtype, self.options.compression).itemsize
                       for s in self.signature.exchange)
        need = exchange * (num_workers + 1)
        have = ray.cluster_resources().get("object_store_memory", 0)
        if need > have:
            raise ValueError(
                f"the exchange needs {need / 2**20:.0f} MiB of Ray object-store memory per step "
                f"({num_workers} workers' gradients of {exchange / 2**20:.0f} MiB plus their mean), "
                f"but the cluster has {have / 2**20:.0f} MiB; start Ray with a larger object_store_memory")

    def _new_worker(self, index: int, node_id: str | None = None, topology: Topology | None = None):
        """Start worker ``index`` (on ``node_id``, or where Ray spreads it), with the exchange of ``topology``
        (default the engine's)."""
        opts = self.options
        config = dataclasses.replace(self.worker_config, exchange=(topology or self.topology).exchange)
        return ray.remote(SGDWorker).options(
            num_cpus=opts.cpus_per_worker,
            num_gpus=opts.devices_per_worker if opts.gpu else 0,
            runtime_env={"env_vars": worker_env()},
            scheduling_strategy=actor_placement(node_id)).remote(index, config)

    def _build_models(self, indices, state: ray.ObjectRef | None = None, new: Collection[int] = ()) -> None:
        """Workers ``indices`` build their models (again, keeping their state, if built); all the same one.
        Those of ``new`` start from ``state`` (a survivor's ``get_state()``)."""
        self._check_models(indices, self.calls.call_startup(self._setup_calls(indices, state, new),
                                                            "the workers to build their models"))

    def _setup_calls(self, indices, state: ray.ObjectRef | None = None,
                     new: Collection[int] = ()) -> list[ray.ObjectRef]:
        """Workers ``indices`` start building their models (``_check_models`` checks what they built); those of
        ``new`` start from ``state``."""
        creators = [data.ShardedModelCreator(self._model_creator, self.splits.for_worker(i)) for i in indices]
        return [self.workers[i].setup.remote(c, state if i in new else None) for i, c in zip(indices, creators)]

    def _check_models(self, indices, signatures: list[WorkerSignature]) -> None:
        """Every worker of ``indices`` built what the first (or the engine so far) built, else WorkerMismatchError."""
        expected = self.signature or signatures[0]
        for i, sig in zip(indices, signatures):
            if sig != expected:
                raise WorkerMismatchError(
                    f"worker {i} built a model that differs from worker 0's: "
                    f"{partitions.spec_difference(sig.weights + sig.exchange, expected.weights + expected.exchange) or sig.metrics}")
        self.signature = expected

    def _split_datasets(self, worker_nodes: list[str]) -> bool:
        """New splits of every dataset over the replicas of workers on ``worker_nodes``; False without datasets."""
        if not self.splits.datasets:
            return False
        self.stop_datasets()
        self.splits.split(worker_nodes, self.calls.call_startup)
        return True

    def stop_datasets(self) -> None:
        """Stop the dataset splits: every read waiting on one fails now (no-op without datasets)."""
        self.splits.stop()

    def _start_parameter_servers(self, worker_nodes: list[str], phases: Phases | None = None) -> None:
        """Plan the servers and the partitions from the workers' nodes, start them (or take up the kept servers
        of that plan, ``_take_kept_servers``), connect the workers.

        The workers are asked to connect as soon as the servers are asked to
        start: each builds its exchange's graph while the server processes
        start, then attaches to them (a bounded wait in the worker). So
        "connect" includes the wait for new servers to start.
        """
        phases = phases or Phases()
        with phases("start servers"):
            planned = plan_group(self.options, self.topology, self.signature.exchange, worker_nodes)
            self.servers = self._take_kept_servers(planned)
            started = None
            if self.servers is None:
                self.servers = planned
                started = planned.start()
        with phases("connect"):
            connecting = self._connect_workers()
            if started is not None:
                self.calls.identify(started)
            self._link_servers()
            self.calls.call_startup(connecting, "the workers to connect to the parameter servers")

    def connect_parameter_servers(self) -> None:
        self._link_servers()
        self.calls.call_startup(self._connect_workers(), "the workers to connect to the parameter servers")

    def _link_servers(self) -> None:
        self.calls.call_startup(self.servers.link(), "the parameter servers that relay to learn the others")

    def _connect_workers(self) -> list:
        """Refs of every worker's ``connect`` to the parameter servers."""
        group = self.servers
        return [w.connect.remote(group.layout, group.placement, group.actors, group.routes(i))
                for i, w in enumerate(self.workers)]

    def node_sent_bytes(self) -> int:
        """The most gradient bytes one node pushes to parameter servers on other nodes per step ("ps")."""
        return max(self.servers.node_sent_bytes(self._worker_nodes).values(), default=0)

    # ---- state -----------------------------------------------------------

    def latest_state(self) -> dict:
        """``get_state()`` of the live worker that has applied the most steps (worker 0 when none is behind)."""
        counts = self.calls.answers([w.applied_steps_count.remote() for w in self.workers], self.options.timeout_s)
        live = [i for i, count in enumerate(counts) if count is not None]
        if not live:
            raise DSGDError("no worker answered, so there is no state to read; restore from a checkpoint")
        source = max(live, key=lambda i: counts[i])
        return self.calls.call(self.workers[source].get_state.remote(), f"worker {source}'s state")

    # ---- recovery's operations ------------------------------------------

    def replace_dead(self) -> set[int]:
        """Start new actors for dead ones, reconnect; the indices of the new workers.

        Workers first, on live nodes with room (a DSGDError names what is
        missing if there are none); then parameter servers, beside the
        workers, so a server lost with its node moves to a live one. An
        elastic engine without room for every dead worker goes on with fewer
        (``_shrink_around``), as long as ``min_workers`` remain.
        """
        dead_workers = self.calls.unresponsive(self.workers)
        if len(dead_workers) == self.topology.num_workers:
            raise DSGDError("every worker died, so no replica is left to restore the weights from; "
                            "restore from a checkpoint (DistributedSGD.restore) in a new engine")
        if self.options.elastic:
            dead_workers, shrunk = self._replace_or_shrink(dead_workers)
        else:
            self._replace_workers(dead_workers)
            shrunk = False
        rebuilt = dead_workers
        if self._split_datasets(self._worker_nodes):  # new splits for every replica: survivors rebuild theirs too
            rebuilt = range(self.topology.num_workers)
        if rebuilt:
            self._build_models(rebuilt)
        if shrunk:
            self.connect_exchange()
            return set(dead_workers)
        dead_servers = self.calls.unresponsive(self.servers.actors) if self.servers else []
        if dead_servers or (self.servers and rebuilt):  # new workers may sit on other nodes: relays re-planned
            for identity in self.calls.identify(self.servers.replace(dead_servers, self._worker_nodes)):
                logger.warning("parameter server %d %s; started a new one, pid %d on node %s", identity.index,
                               "is dead" if identity.index in dead_servers else
                               "serves a new relay plan (a new worker runs on another node)",
                               identity.pid, identity.node_id[:8])
            self.connect_parameter_servers()
        return set(dead_workers)

    def _replace_or_shrink(self, dead: list[int]) -> tuple[list[int], bool]:
        """An elastic engine's ``_replace_workers``: replace the dead workers that fit, go on without the others.

        Returns the indices of the new workers and whether the engine shrank
        (``_shrink_around``). A new worker placed on a node that turns out
        lost (Ray had not yet seen it dead) counts as dead: the engine looks
        again at the room there is.
        """
        shrunk, placements = False, 0
        while True:
            dead, shrank = self._shrink_around(dead)
            shrunk = shrunk or shrank
            try:
                self._replace_workers(dead, place_again=False)
                return dead, shrunk
            except ActorFailure:
                placements += 1
                if placements == ELASTIC_PLACEMENTS:
                    raise
                logger.warning("a node chosen for a new worker is lost too; looking again at the room there is")
                dead = self.calls.unresponsive(self.workers)

    def _replace_workers(self, dead: list[int], place_again: bool = True) -> None:
        """Kill what is left of workers ``dead``, start new ones on live nodes (their models are not built yet).

        If a node chosen for a new worker turns out lost as well (Ray had not
        yet seen it dead), the new workers are placed again without it (or,
        without ``place_again``, the ActorFailure raised).
        """
        if not dead:
            return
        needs = _amounts(self._worker_needs())
        while True:
            nodes = self._nodes_for(dead)
            for i, node in zip(dead, nodes):
                logger.warning("worker %d is dead; starting a new one on node %s", i, node[:8])
                ray.kill(self.workers[i])
                self.workers[i] = self._new_worker(i, node)
            try:
                identities = self.calls.identify([self.workers[i] for i in dead],
                                            f"new workers {dead} to start (each needs {needs} on its node)")
                break
            except ActorFailure:
                if not place_again or set(nodes) <= live_node_resources().keys():
                    raise
                logger.warning("a node chosen for a new worker is lost too; placing the new workers again")
        for i, identity in zip(dead, identities):
            self._worker_nodes[i] = identity.node_id

    def _shrink_around(self, dead: list[int]) -> tuple[list[int], bool]:
        """An elastic engine's dead workers without room for all: drop those that fit nowhere, close up the indices.

        Returns the indices of the dead workers still to replace and whether
        the engine shrank. The surviving workers keep their order and take
        the indices from 0 (``SGDWorker.renumber``); the replacements that
        fit come last. Below ``min_workers`` nothing changes (and
        ``_replace_workers`` raises the error naming what is missing).
        """
        fit = len(self._room(dead)[0])
        keep = len(self.workers) - len(dead) + fit
        if fit >= len(dead) or keep < self.options.min_workers:
            return dead, False
        for i in dead:
            ray.kill(self.workers[i])
        order = [i for i in range(len(self.workers)) if i not in dead] + dead[:fit]
        self.workers = [self.workers[i] for i in order]
        self._worker_nodes = [self._worker_nodes[i] for i in order]
        survivors = len(order) - fit
        moved = [new for new, old in enumerate(order[:survivors]) if new != old]
        self.calls.call([self.workers[i].renumber.remote(i) for i in moved], "the survivors to take new indices")
        self.calls.identify([self.workers[i] for i in moved], "the survivors to answer")
        logger.warning("workers %s are lost and the live nodes have room for %d of them: going on with %d workers "
                       "(num_workers=%s)", dead, fit, keep, (self.options.min_workers, self.options.max_workers))
        self.set_size(keep)
        return list(range(survivors, keep)), True

    # ---- resizing --------------------------------------------------------

    def resize(self, n: int, state: ray.ObjectRef | None, phases: Phases | None = None,
               fetch_stats: bool = True) -> None:
        """Start or stop workers so that ``n`` run.

        Growing, the new workers start on nodes with room (a DSGDError names
        what is missing, before any starts) and build their models, starting
        from ``state`` (a survivor's ``get_state()``, taken once the steps in
        flight were settled: no step runs during a resize); meanwhile
        the parameter servers of the new count start and the survivors build
        its exchange and have TensorFlow plan its step (``fetch_stats``: as
        the last step fetched stats or not; ``SGDWorker.prepare_exchange``),
        without taking it up. If that fails (or is interrupted), the new
        workers and servers are killed and the engine is as it was (with
        datasets, the survivors get splits for the old count again). Shrinking
        stops the highest-indexed workers (with datasets, the survivors then
        get new splits). Once the topology's count is ``n`` (also if an error comes
        later), call ``connect_exchange`` before the next step. ``phases``
        times each part.
        """
        phases = phases or Phases()
        old = self.topology.num_workers
        resized = self.topology.resized(n)
        if n > old:
            new = list(range(old, n))
            nodes = self._nodes_for(new, f"grow to {n} workers: no room for new worker")
            if resized.uses_ps:
                self.check_object_store(n)
            try:
                self._grow(new, nodes, resized, state, phases, fetch_stats)
            except BaseException:
                self._kill_next_servers()
                self._stop_workers(old)
                if self._split_datasets(self._worker_nodes):
                    self._build_models(range(old))
                raise
            self.set_size(n)
            return
        with phases("stop workers"):
            self._stop_workers(n)
        self.set_size(n)
        if self._split_datasets(self._worker_nodes):
            with phases("build models"):
                self._build_models(range(n))

    def _grow(self, new: list[int], nodes: list[str], resized: Topology, state: ray.ObjectRef | None,
              phases: Phases, fetch_stats: bool) -> None:
        """Start workers ``new`` on ``nodes`` and build their models from ``state``; meanwhile, with "ps", the
        servers of ``resized`` start (``_next_servers``, taken up by ``connect_exchange``) and the survivors prepare its
        exchange; the new workers prepare it once built, planned for the feeds of a survivor's last step (so
        their first step is not TensorFlow planning it while every other worker waits). With datasets every
        worker builds its model again (new splits): nothing is prepared."""
        survivors = self.workers[:new[0]]
        preparing, group = [], None
        with phases("start workers"):
            self.workers += [self._new_worker(i, node, resized) for i, node in zip(new, nodes)]
            if resized.uses_ps and not self.splits.datasets:
                # The new workers run on ``nodes`` (hard node affinity), so the servers are planned as at start.
                group = self._next_servers = plan_group(self.options, resized, self.signature.exchange, self._worker_nodes + nodes)
                group.start()
                feed_names = survivors[0].step_feed_names.remote()  # before it is busy preparing
                preparing = [w.prepare_exchange.remote(resized.exchange, fetch_stats, group.layout, group.placement)
                             for w in survivors]
            identities = self.calls.identify(self.workers[len(survivors):], f"new workers {new} to start")
        self._worker_nodes += [i.node_id for i in identities]
        with phases("build models"):
            rebuilt = range(len(self.workers)) if self._split_datasets(self._worker_nodes) else new
            self._build_models(rebuilt, state, new)
        if group is not None:
            preparing += [w.prepare_exchange.remote(resized.exchange, fetch_stats, group.layout, group.placement, feed_names)
                          for w in self.workers[len(survivors):]]
            with phases("start servers"):
                self.calls.identify(group.actors, "the parameter servers to start")
        if not preparing:
            return
        with phases("prepare workers"):
            try:
                self.calls.call_startup(preparing, f"the workers to prepare the exchange of "
                                                   f"{resized.num_workers} workers")
            except ActorFailure as e:  # a dead survivor is replaced once the new workers are in (connect_exchange)
                logger.warning("%s; the grow goes on", e)

    def _kill_next_servers(self) -> None:
        if self._next_servers is not None:
            self._next_servers.kill()
            self._next_servers = None

    def _stop_workers(self, keep: int) -> None:
        """Kill the workers from index ``keep`` on."""
        for worker in self.workers[keep:]:
            ray.kill(worker)
        del self.workers[keep:], self._worker_nodes[keep:]

    def connect_exchange(self, phases: Phases | None = None) -> None:
        """Every worker combines gradients as the engine's count asks; the parameter servers planned anew.

        After a resize: with "ps" and several workers, the servers are
        planned (how many, where, the partitions) from the workers' nodes as
        at start, and every worker connects to them: those a grow started
        meanwhile (``_grow``), the servers kept from before the last resize if
        they are what the plan asks (a resize back), else new ones. The
        servers of the old count are kept, idle, for a resize back (the group
        kept before is killed). Safe to call again after a failure.
        """
        phases = phases or Phases()
        previous, self.servers = self.servers, None
        try:
            with phases("set exchange"):
                self.calls.call_startup([w.set_exchange.remote(self.topology.exchange) for w in self.workers],
                                        "the workers to change their exchange")
            if self._next_servers is not None:  # started while a grow's new workers built
                self.servers, self._next_servers = self._next_servers, None
                with phases("connect"):
                    self.connect_parameter_servers()
            elif self.topology.uses_ps:
                self._start_parameter_servers(self._worker_nodes, phases)
        finally:
            self._keep_servers(previous)

    def _keep_servers(self, group: ServerGroup | None) -> None:
        """Keep ``group``, the servers of the count before a resize, for a resize back (``_take_kept_servers``);
        the group kept before is killed."""
        if self._kept_servers is not None and self._kept_servers is not self.servers:
            self._kept_servers.kill()
        self._kept_servers = group if group is not self.servers else None

    def _take_kept_servers(self, planned: ServerGroup) -> ServerGroup | None:
        """The kept servers if they are what ``planned`` plans and all answer (a resize back), else None (and
        they are killed)."""
        kept, self._kept_servers = self._kept_servers, None
        if kept is None:
            return None
        if kept.plan() == planned.plan() and not self.calls.unresponsive(kept.actors):
            return kept
        kept.kill()
        return None

    def abort_servers(self) -> None:
        """Make every waiting and future push fail until ``reset_servers`` (no-op without servers)."""
        if self.servers:
            self.servers.abort()

    def reset_servers(self, step_id: int) -> None:
        """Servers forget partial sums and expect ``step_id`` next (no-op without servers)."""
        if self.servers:
            self.calls.call(self.servers.reset(step_id), "the parameter servers to reset")

    # ---- teardown ---------------------------------------------------------

    def kill(self) -> None:
        """Kill every actor (if Ray is still up). Safe to call twice."""
        if ray.is_initialized():
            for actor in self.workers:
                ray.kill(actor)
            if self.servers:
                self.servers.kill()
            self._kill_next_servers()
            self._keep_servers(None)
            if self.splits.datasets and self.workers:
                # ray.kill returns before the process is gone: a worker still reading could start a new epoch
                # on a split coordinator being stopped, whose progress bars would then be left open. A call on
                # a killed actor fails once it is dead; wait for that (bounded).
                ray.wait([w.identity.remote() for w in self.workers], num_returns=len(self.workers),
                         timeout=KILL_WAIT_S)
            self.stop_datasets()
        self.workers, self.servers = [], None


def _amounts(resources: dict[str, float]) -> str:
    """'2 CPU, 1 GPU'."""
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())

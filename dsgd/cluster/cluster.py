"""The engine's actors on Ray: the worker group's lifecycle.

``Cluster`` owns the worker actors, the engine's live ``Topology``
(``dsgd.cluster.topology``) and the parameter servers' slots
(``dsgd.cluster.server_slots``). It starts the workers once the Ray cluster
has room for them (``dsgd.cluster.room``), has them build their models (all
the same one), splits the datasets over them, starts the parameter servers
once the object store can hold the exchange (its size is known once the
workers have built their models), and kills everything. Every wait goes
through its ``calls`` (``dsgd.common.calls``: bounded, Ray's errors turned
into dsgd's).

Replacing dead actors is ``dsgd.cluster.replacement``; starting or stopping
workers between steps is ``dsgd.cluster.resizing``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Collection

import ray

from dsgd.integrations import data
from dsgd.wire import partitions
from dsgd.worker import keras_preload
from dsgd.common.calls import Calls
from dsgd.config import Options
from dsgd.cluster.topology import Topology
from dsgd.errors import DSGDError, WorkerMismatchError
from dsgd.model import Model
from dsgd.cluster import replacement, resizing
from dsgd.cluster.placement import actor_placement, in_placement_group
from dsgd.cluster.room import HeldResources, WorkerRoom, check_object_store
from dsgd.cluster.server_group import ServerGroup, plan_group
from dsgd.cluster.server_slots import ServerSlots
from dsgd.sgd_worker import SGDWorker
from dsgd.common.stopwatch import Phases
from dsgd.worker.signature import WorkerSignature

logger = logging.getLogger(__name__)

KILL_WAIT_S = 10.0  # how long kill waits for the killed actors to be dead, then for the workers' resources

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
        self.room = WorkerRoom(options)
        self.workers: list[Any] = []
        self.worker_nodes: list[str] = []  # the node id of each worker
        self.calls = Calls(options.timeout_s, options.startup_timeout_s)
        self.server_slots = ServerSlots(self.calls)
        self.signature: WorkerSignature | None = None  # what every worker built
        self.splits = data.DatasetSplits(datasets, options.devices_per_worker)
        self._model_creator = model_creator

    @property
    def servers(self) -> ServerGroup | None:
        """The parameter servers the workers push to ("ps" with several workers; else None)."""
        return self.server_slots.current

    def set_size(self, num_workers: int) -> None:
        """The one place the engine's worker count changes: a resize, an elastic shrink or start."""
        self.topology = self.topology.resized(num_workers)

    # ---- start ------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, then the parameter servers, and connect them; each once the cluster can hold it.

        CPUs and GPUs are checked before any worker starts (with ``server_resource``, outside the servers'
        nodes, which must exist); the object store
        once the workers have built their models, before any parameter server
        starts: the exchange's size is the model's, known only then.
        """
        if self.options.elastic:
            self.set_size(self.room.elastic_start_count())
            logger.info("num_workers=%s: starting %d workers", (self.options.min_workers, self.options.max_workers),
                        self.topology.num_workers)
        self.room.check(self.topology.num_workers)
        nodes = self.room.start_nodes(self.topology.num_workers)
        self.workers = [self.new_worker(i, node) for i, node in enumerate(nodes)]
        self.worker_nodes = [i.node_id for i in self.calls.identify(self.workers)]
        self.splits.split(self.worker_nodes, self.calls.call_startup)
        self._build_models(range(self.topology.num_workers))
        if self.topology.uses_ps:
            self.check_object_store(self.topology.num_workers)
            self._start_parameter_servers(self.worker_nodes)

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

    def check_object_store(self, num_workers: int) -> None:
        """The object store holds a step of ``num_workers`` workers' exchange (``room.check_object_store``)."""
        check_object_store(self.signature.exchange, self.options.compression, num_workers)

    def new_worker(self, index: int, node_id: str | None = None, topology: Topology | None = None):
        """Start worker ``index`` (on ``node_id``, or where Ray spreads it), with the exchange of ``topology``
        (default the engine's)."""
        opts = self.options
        config = dataclasses.replace(self.worker_config, exchange=(topology or self.topology).exchange)
        # Inside a placement group (a Tune trial) a worker takes any bundle with room, a replacement as the
        # first workers did: the lowest bundle on its node may be the trial's own, whose CPU the trial holds.
        return ray.remote(SGDWorker).options(
            num_cpus=opts.cpus_per_worker,
            num_gpus=opts.devices_per_worker if opts.gpu else 0,
            runtime_env={"env_vars": worker_env()},
            scheduling_strategy=actor_placement(None if in_placement_group() else node_id)).remote(index, config)

    # ---- models and datasets ------------------------------------------------

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
            if sig.runtime != expected.runtime:
                kinds = {"tf1": "a TF1 dsgd.Model (or tf_keras KerasModel)", "tf2": "a TF2 model (dsgd.TF2Model or "
                         "a Keras 3 KerasModel)"}
                raise WorkerMismatchError(f"worker {i} built {kinds[sig.runtime]}, worker 0 {kinds[expected.runtime]}: "
                                          "build one kind of model in an engine")
            if sig != expected:
                raise WorkerMismatchError(
                    f"worker {i} built a model that differs from worker 0's: "
                    f"{partitions.spec_difference(sig.weights + sig.exchange, expected.weights + expected.exchange) or sig.metrics}")
        self.signature = expected

    def split_datasets(self) -> bool:
        """New splits of every dataset over the replicas of the workers now; False without datasets."""
        if not self.splits.datasets:
            return False
        self.stop_datasets()
        self.splits.split(self.worker_nodes, self.calls.call_startup)
        return True

    def stop_datasets(self) -> None:
        """Stop the dataset splits: every read waiting on one fails now (no-op without datasets)."""
        self.splits.stop()

    # ---- parameter servers --------------------------------------------------

    def _start_parameter_servers(self, worker_nodes: list[str], phases: Phases | None = None) -> None:
        """Plan the servers and the partitions from the workers' nodes, start them (or take up the kept servers
        of that plan), connect the workers (``ServerSlots.start_current``)."""
        planned = plan_group(self.options, self.topology, self.signature.exchange, worker_nodes)
        self.server_slots.start_current(planned, self.workers, phases or Phases())

    def node_sent_bytes(self) -> int:
        """The most gradient bytes one node pushes to parameter servers on other nodes per step ("ps")."""
        return max(self.servers.node_sent_bytes(self.worker_nodes).values(), default=0)

    def abort_servers(self) -> None:
        """Make every waiting and future push fail until ``reset_servers`` (no-op without servers)."""
        if self.servers:
            self.servers.abort()

    def reset_servers(self, step_id: int) -> None:
        """Servers forget partial sums and expect ``step_id`` next (no-op without servers)."""
        if self.servers:
            self.calls.call(self.servers.reset(step_id), "the parameter servers to reset")

    # ---- state, recovery, resizing --------------------------------------------

    def latest_state(self) -> dict:
        """``get_state()`` of the live worker that has applied the most steps (worker 0 when none is behind)."""
        counts = self.calls.answers([w.applied_steps_count.remote() for w in self.workers], self.options.timeout_s)
        live = [i for i, count in enumerate(counts) if count is not None]
        if not live:
            raise DSGDError("no worker answered, so there is no state to read; restore from a checkpoint")
        source = max(live, key=lambda i: counts[i])
        return self.calls.call(self.workers[source].get_state.remote(), f"worker {source}'s state")

    def replace_dead(self) -> set[int]:
        """Start new actors for dead ones, reconnect; the indices of the new workers (``replacement.replace_dead``)."""
        return replacement.replace_dead(self)

    def resize(self, n: int, state: ray.ObjectRef | None, phases: Phases | None = None,
               fetch_stats: bool = True) -> None:
        """Start or stop workers so that ``n`` run; ``connect_exchange`` follows (``resizing.resize``)."""
        resizing.resize(self, n, state, phases or Phases(), fetch_stats)

    def connect_exchange(self, phases: Phases | None = None) -> None:
        """Every worker on the exchange of the count now, the servers planned anew (``resizing.connect_exchange``)."""
        resizing.connect_exchange(self, phases or Phases())

    # ---- teardown ---------------------------------------------------------

    def kill(self) -> None:
        """Kill every actor (if Ray is still up); return once they are dead and (from a driver) Ray lists the
        workers' resources free again, so that an engine started next is placed on them (``HeldResources``; both
        waits bounded). Safe to call twice."""
        if ray.is_initialized():
            actors = self.workers + self.server_slots.actors()
            held = HeldResources(self.workers, self.room.needs)
            for actor in self.workers:
                ray.kill(actor)
            self.server_slots.kill()
            # ray.kill returns before the processes are gone: a worker still reading could start a new epoch on
            # a split coordinator being stopped, whose progress bars would then be left open. A call on a
            # killed actor fails once it is dead.
            if actors:
                ray.wait([a.identity.remote() for a in actors], num_returns=len(actors), timeout=KILL_WAIT_S)
            held.wait_released(KILL_WAIT_S)
            self.stop_datasets()
        self.workers = []
        self.server_slots.current = None

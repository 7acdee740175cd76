"""The worker actor: its replicas' runtime and the exchange that steps them.

The driver calls ``setup`` first (builds the replicas, one per device),
``connect`` for "ps" with several workers, then ``step`` every step. How a
step combines this worker's gradients with the others' is the worker's
``Exchange`` (``dsgd.exchange``); building and running the replicas (the
local means, the checked apply, phase times, stats, state) is its
``ReplicaRuntime`` (``dsgd.worker.runtime``; TF1 graphs:
``dsgd.worker.tf1.runtime``). The actor's methods delegate to them.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
from typing import Any, Callable, Sequence

import numpy as np
import ray
import tensorflow as tf

from dsgd.common import actor_identity, timeline
from dsgd.config import WorkerConfig
from dsgd.common.calls import peer_errors
from dsgd.common.results import Evaluation, LocalState, StepResult
from dsgd.errors import DSGDError, ModelCreatorError
from dsgd.exchange import registry
from dsgd.exchange.base import Exchange
from dsgd.exchange.ps_client import ParameterServerClient
from dsgd.model import Model, TF1ModelOutsideGraph, TF2ModelInGraph
from dsgd.wire import partitions
from dsgd.worker import tf_logs
from dsgd.worker.inputs import InputSource
from dsgd.worker.signature import WorkerSignature
from dsgd.worker.runtime import ReplicaRuntime
from dsgd.worker.tf1.runtime import Tf1Runtime
from dsgd.worker.tf2.runtime import Tf2Runtime

logger = logging.getLogger(__name__)


class SGDWorker:
    """Runs as a Ray actor. ``sess`` is its session, ``models`` its replicas in device order."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        tf_logs.python_warnings_follow_cpp_level()
        self.worker_index = worker_index
        self.config = config
        self.runtime: ReplicaRuntime = Tf1Runtime(worker_index, config)  # Tf2Runtime once a TF2 model shows
        self.exchange: Exchange | None = None  # for "ps", made by connect
        self.client: ParameterServerClient | None = None  # "ps" with several workers, set by connect
        # Every exchange built so far, for a resize back to a count seen before: its step (graph
        # ops and their planned run, in TF1) is reused instead of built anew.
        self._local_exchanges: dict[str, Exchange | None] = {}  # by WorkerConfig.exchange
        self._ps_exchanges: dict[tuple, tuple[ParameterServerClient, Exchange]] = {}  # see connect

    @property
    def sess(self) -> tf.compat.v1.Session | None:
        return self.runtime.sess

    @property
    def models(self) -> list[Model]:
        return self.runtime.models

    # ---- set-up -----------------------------------------------------------

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("worker", self.worker_index)

    def setup(self, model_creator: Callable[[int, int], Model], state: dict | None = None) -> WorkerSignature:
        """Build the replicas and initialize their variables (local ones too); what was built.

        With ``state`` (another worker's ``get_state()``: a grow's new
        worker) the replicas start from it instead of their initializers.
        Called again (with new dataset splits after a recovery), it builds
        them anew and loads the state they had; ``connect`` then rebuilds the
        "ps" exchange.
        """
        if self.runtime.is_built:
            state = self.runtime.get_state()
            gc.unfreeze()  # let the old replicas' objects be collected
        signature = self._build(model_creator, state)
        self._local_exchanges.clear()  # their steps were the old replicas'
        self._ps_exchanges.clear()
        if self.client is not None:  # its exchange went with the old replicas: ``connect`` makes a new one
            self.client.close()
            self.client = None
        self.exchange = self._local_exchange()
        # The replicas' Python objects live as long as the worker: keep the cyclic
        # garbage collector from walking them on every full collection.
        gc.freeze()
        return signature

    def _build(self, model_creator: Callable[[int, int], Any], state: dict | None) -> WorkerSignature:
        """Build the replicas with the runtime their model needs: a TF1 graph first (``dsgd.Model``, tf_keras),
        and for good the TF2 runtime once a TF2 model shows up there (``dsgd.TF2Model``, Keras 3), or once
        ``model_creator`` raised in the graph (eager-only code before the model is made, such as a
        ``tf.data`` iterator) and builds a TF2 model eagerly."""
        if not isinstance(self.runtime, Tf1Runtime):
            return self.runtime.build(model_creator, state)
        try:
            return self.runtime.build(model_creator, state)
        except TF2ModelInGraph:
            return self._build_eagerly(model_creator, state)
        except ModelCreatorError as in_graph:
            if in_graph.__cause__ is None:  # it returned something unusable: no eager try would change that
                raise
            try:
                return self._build_eagerly(model_creator, state)
            except TF1ModelOutsideGraph:
                raise in_graph from in_graph.__cause__  # a TF1 model: the graph's error is the one
            except ModelCreatorError as eagerly:
                if _same_error(in_graph.__cause__, eagerly.__cause__):  # not about graph or eager
                    raise in_graph from in_graph.__cause__
                raise ModelCreatorError(f"{in_graph}\nBuilt eagerly (the TF2 way) instead, {eagerly}") from eagerly

    def _build_eagerly(self, model_creator: Callable[[int, int], Any], state: dict | None) -> WorkerSignature:
        if "keras" in sys.modules:  # the graph's try named Keras layers: the replicas get the first names again
            sys.modules["keras"].backend.clear_session(free_memory=False)
        self.runtime = Tf2Runtime(self.worker_index, self.config)
        return self.runtime.build(model_creator, state)

    def connect(self, layout: list[partitions.Partition], placement: list[int], servers: list,
                routes: list[int] | None = None, rounds: list[list[int]] | None = None) -> int:
        """Exchange ``layout``'s partitions with ``servers`` (``placement[j]`` sums partition j; ``routes[j]``,
        default ``placement[j]``, is where this worker pushes it: its node's relay, ``dsgd.cluster.server_group``;
        ``rounds``: the order it pushes them in, ``ParameterServerClient``).

        The first call (and the first after ``setup`` rebuilt the replicas)
        makes the "ps" exchange; later calls, after a server or worker was
        replaced, only re-attach. Returns how many servers are reached
        through shared memory.
        """
        if self.client is None:
            self.client, self.exchange = self._ps_exchange(layout, placement, rounds)
        elif [s.index for s in layout] != [s.index for s in self.client.layout] or placement != self.client.placement:
            raise DSGDError(f"worker {self.worker_index} was connected with another partition layout")
        return self.client.connect(servers, routes, rounds)

    def _ps_exchange(self, layout: list[partitions.Partition], placement: list[int],
                     rounds: list[list[int]] | None) -> tuple[ParameterServerClient, Exchange]:
        """The "ps" exchange of ``layout`` and ``placement`` for this index and its client, built once (whatever
        the ``rounds``: its client's send scheduler takes new ones as it connects)."""
        key = (self.worker_index, tuple(layout), tuple(placement))  # what a "ps" exchange is built for
        if key not in self._ps_exchanges:
            client = ParameterServerClient(self.worker_index, layout, placement, self.config.step_timeout_s,
                                           self.config.startup_timeout_s, rounds, self.config.send_schedule)
            self._ps_exchanges[key] = client, registry.worker_half("ps", self.runtime, client)
        return self._ps_exchanges[key]

    def _local_exchange(self, kind: str | None = None) -> Exchange | None:
        """The exchange of ``kind`` (default ``WorkerConfig.exchange``) if it needs no servers (None for "ps"),
        built once."""
        kind = kind or self.config.exchange
        if registry.needs_servers(kind):
            return None  # made by ``connect`` once the servers exist
        if kind not in self._local_exchanges:
            self._local_exchanges[kind] = registry.worker_half(kind, self.runtime)
        return self._local_exchanges[kind]

    def renumber(self, worker_index: int) -> None:
        """Take index ``worker_index``: an elastic engine lost a worker below this one and closed up the indices.

        The replicas keep what ``model_creator`` built for the old index;
        ``set_exchange`` (which follows) connects under the new one.
        """
        self.worker_index = worker_index
        self.runtime.worker_index = worker_index

    def set_exchange(self, kind: str) -> None:
        """Combine gradients the way ``kind`` says (``WorkerConfig.exchange``) from the next step on.

        A resize changed the worker count: the old exchange (and, for "ps",
        the connection to the old servers) is dropped; for "ps", ``connect``
        makes the new one, or takes up the one it made before for the same
        partitions. The replicas stay.
        """
        self.config = dataclasses.replace(self.config, exchange=kind)
        self.runtime.config = self.config
        if self.client is not None:
            self.client.close()
        self.client = None
        self.exchange = self._local_exchange()

    def prepare_exchange(self, kind: str, fetch_stats: bool, layout: list[partitions.Partition] | None = None,
                         placement: list[int] | None = None, rounds: list[list[int]] | None = None,
                         feed_names: Sequence[str] | None = None) -> None:
        """Build the exchange of ``kind`` (for "ps": of ``layout``, ``placement`` and ``rounds``, as ``connect``
        takes them) without taking it up, and
        have TensorFlow plan its step (stats fetched or not) for the feeds of this worker's last step, or, for a
        worker that has not stepped yet, ``feed_names`` (a survivor's, ``step_feed_names``).

        A survivor of a grow does this while the new workers build their
        models, and a new worker once its model is built; ``set_exchange``
        and ``connect`` then take the exchange up, and its first step runs
        the planned run (if its feeds are the ones planned for). Without
        feeds to plan for, only the exchange is built. A plan that fails is
        dropped: the step then runs as it would have.
        """
        if registry.needs_servers(kind):
            exchange = self._ps_exchange(layout, placement, rounds)[1]
        else:
            exchange = self._local_exchange(kind)
        feed_names = self.runtime.feed_names if self.runtime.feed_names is not None else feed_names
        if exchange is None or feed_names is None:
            return
        try:
            exchange.prepare(fetch_stats, feed_names)
        except (KeyError, ValueError, TypeError, tf.errors.OpError) as e:
            logger.debug("worker %d dropped the plan of its next step: %s", self.worker_index, e)

    def step_feed_names(self) -> tuple[str, ...] | None:
        """The tensors this worker's last step fed (None before its first): what a new worker plans for."""
        return self.runtime.feed_names

    # ---- stepping -----------------------------------------------------------

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> StepResult | list[np.ndarray]:
        """One step through the worker's exchange (``means``: the driver's, for "simple"'s second call)."""
        return self.exchange.step(step_id, fetch_stats, means)

    def warmup(self) -> None:
        """Compute a step once without applying it (no weight change)."""
        self.runtime.warmup()

    def start_trace(self) -> None:
        """Record a timeline of the calls until ``collect_trace``."""
        self.runtime.trace = timeline.Recorder()

    def collect_trace(self) -> list[timeline.Event]:
        trace, self.runtime.trace = self.runtime.trace, None
        return trace.events if trace else []

    # ---- evaluation and prediction ------------------------------------------

    def evaluate(self, source: InputSource) -> list[Evaluation]:
        """Every replica's evaluation of its batches from ``source`` (``ReplicaRuntime.evaluate``)."""
        with self.runtime.user_context():
            return self.runtime.evaluate(source)

    def evaluation_logs(self, evaluation: Evaluation) -> dict[str, Any]:
        """The logs of ``evaluation``, every replica's reduced (``ReplicaRuntime.evaluation_logs``)."""
        with self.runtime.user_context():
            return self.runtime.evaluation_logs(evaluation)

    def predict(self, source: InputSource) -> list[Any]:
        """Every replica's outputs for its batches from ``source`` (``ReplicaRuntime.predict``)."""
        with self.runtime.user_context():
            return self.runtime.predict(source)

    # ---- state and user callbacks ----------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """Replica 0's variables, keyed by name without the replica scope."""
        return self.runtime.get_weights()

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.runtime.set_group("weights", weights)

    def match_weights(self, reference: list) -> list[str]:
        """Make every replica's weights bit-identical to ``reference[0]``; the names of the variables assigned.

        ``reference[0]`` is a Ray reference to worker 0's ``get_weights()``
        (the engine's initial weights), awaited only once this worker has
        read its own, so both reads overlap. Only the variables that differ
        on some replica are assigned (all of them when the initializers are
        random; none when they are deterministic): bytes are compared, so a
        variable left unassigned holds exactly the reference's bits.
        """
        own = self.runtime.replica_weights()
        with peer_errors(f"worker {self.worker_index} waited more than {self.config.startup_timeout_s:.0f}s "
                         "for worker 0's initial weights"):
            weights = ray.get(reference[0], timeout=self.config.startup_timeout_s)
        differ = sorted(name for name, value in weights.items()
                        if not all(_same_bits(value, replica[name]) for replica in own))
        self.runtime.set_group("weights", {name: weights[name] for name in differ})
        return differ

    def get_state(self) -> dict:
        """Weights, optimizer state and step count: all a replica needs to go on."""
        return self.runtime.get_state()

    def set_state(self, state: dict) -> None:
        """Load get_state()'s result onto every replica."""
        self.runtime.set_state(state)

    def take_local_state(self, state: LocalState) -> None:
        """Start every replica from the local state of the lost worker this one replaces (``LocalState``)."""
        self.runtime.take_local_state(state)

    def applied_steps_count(self) -> int:
        return self.runtime.applied_steps

    def apply_fn(self, fn: Callable[["SGDWorker"], Any]) -> Any:
        """``fn(self)``, in the runtime's context for user code (TF1: the worker's session as the default)."""
        with self.runtime.user_context():
            return fn(self)

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """``fn(model)`` on replica 0, in the runtime's context for user code."""
        with self.runtime.user_context():
            return fn(self.models[0])

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """``fn(model)`` on every replica, device order, in the runtime's context for user code."""
        with self.runtime.user_context():
            return [fn(m) for m in self.models]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` hold the same dtype, shape and bytes (object arrays, e.g. strings: never)."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.dtype == b.dtype and a.shape == b.shape and a.dtype != object
            and a.tobytes() == b.tobytes())


def _same_error(a: BaseException | None, b: BaseException | None) -> bool:
    return type(a) is type(b) and str(a) == str(b)

"""The worker actor: builds its graph (``dsgd.worker.tf1.worker_graph``) and steps it through its exchange.

The driver calls ``setup`` first (builds the graph, one replica per device),
``connect`` for "ps" with several workers, then ``step`` every step. How a
step combines this worker's gradients with the others' is the worker's
``Exchange`` (``dsgd.exchange``); running the graph
(feeds, phase times, stats, the checked apply) is its ``StepRunner``
(``dsgd.worker.tf1.step_runner``). The worker also reads and writes its state and runs
the user's callbacks.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any, Callable, Sequence

import numpy as np
import ray
import tensorflow as tf

from dsgd.common import actor_identity, timeline
from dsgd.exchange import registry
from dsgd.exchange.base import Exchange
from dsgd.wire import partitions
from dsgd.worker import tf_logs
from dsgd.worker.tf1 import worker_graph
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError, DSGDTimeoutError
from dsgd.model import Model
from dsgd.exchange.ps_client import ParameterServerClient
from dsgd.worker.tf1.step_runner import StepRunner

logger = logging.getLogger(__name__)


class SGDWorker:
    """Runs as a Ray actor. ``sess`` is its session, ``models`` its replicas in device order."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        tf_logs.python_warnings_follow_cpp_level()
        self.worker_index = worker_index
        self.config = config
        self.runner = StepRunner(worker_index, config)
        self.models: list[Model] = []
        self.exchange: Exchange | None = None  # for "ps", made by connect
        self.client: ParameterServerClient | None = None  # "ps" with several workers, set by connect
        # Every exchange built into the graph so far, for a resize back to a count seen before: its graph
        # ops, and the session's plan for the step that runs them, are reused instead of built anew.
        self._local_exchanges: dict[str, Exchange | None] = {}  # by WorkerConfig.exchange
        self._ps_exchanges: dict[tuple, tuple[ParameterServerClient, Exchange]] = {}  # see connect

    @property
    def sess(self) -> tf.compat.v1.Session | None:
        return self.runner.sess

    @property
    def graph(self) -> tf.Graph | None:
        """The session's graph, where the replicas live."""
        return self.runner.sess.graph if self.runner.sess is not None else None

    @property
    def built(self) -> worker_graph.WorkerGraph | None:
        return self.runner.built

    # ---- set-up -----------------------------------------------------------

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("worker", self.worker_index)

    def setup(self, model_creator: Callable[[int, int], Model], state: dict | None = None) -> worker_graph.WorkerSignature:
        """Build the replicas and initialize their variables (local ones too); what was built.

        With ``state`` (another worker's ``get_state()``: a grow's new
        worker) the replicas start from it instead of their initializers.
        Called again (with new dataset splits after a recovery), it builds
        them anew and loads the state they had; ``connect`` then rebuilds the
        "ps" exchange.
        """
        runner = self.runner
        if runner.built is not None:
            state = self.get_state()
        if runner.sess is not None:
            runner.sess.close()
            gc.unfreeze()  # let the old graph's objects be collected
        runner.sess = tf.compat.v1.Session(graph=tf.Graph(), config=worker_graph.session_config(self.config))
        with runner.default_session():
            runner.built = worker_graph.build(self.worker_index, self.config, model_creator, runner.sess, state)
        self.models = runner.built.models
        self._local_exchanges.clear()  # their ops were in the old graph
        self._ps_exchanges.clear()
        if self.client is not None:  # its exchange went with the old graph: ``connect`` makes a new one
            self.client.close()
            self.client = None
        self.exchange = self._local_exchange()
        if state is not None:
            runner.applied_steps = state["applied_steps"]
        # The graph's Python objects live as long as the worker: keep the cyclic
        # garbage collector from walking them on every full collection.
        gc.freeze()
        return runner.built.signature

    def connect(self, layout: list[partitions.Partition], placement: list[int], servers: list,
                routes: list[int] | None = None) -> int:
        """Exchange ``layout``'s partitions with ``servers`` (``placement[j]`` sums partition j; ``routes[j]``,
        default ``placement[j]``, is where this worker pushes it: its node's relay, ``dsgd.cluster.server_group``).

        The first call (and the first after ``setup`` rebuilt the graph)
        makes the "ps" exchange; later calls, after a server or worker was
        replaced, only re-attach. Returns how many servers are reached
        through shared memory.
        """
        if self.client is None:
            self.client, self.exchange = self._ps_exchange(layout, placement)
        elif [s.index for s in layout] != [s.index for s in self.client.layout] or placement != self.client.placement:
            raise DSGDError(f"worker {self.worker_index} was connected with another partition layout")
        return self.client.connect(servers, routes)

    def _ps_exchange(self, layout: list[partitions.Partition],
                     placement: list[int]) -> tuple[ParameterServerClient, Exchange]:
        """The "ps" exchange of ``layout`` and ``placement`` for this index and its client, built once."""
        key = self.worker_index, tuple(layout), tuple(placement)  # what a "ps" exchange is built for
        if key not in self._ps_exchanges:
            client = ParameterServerClient(self.worker_index, layout, placement, self.config.step_timeout_s,
                                           self.config.startup_timeout_s)
            self._ps_exchanges[key] = client, registry.worker_half("ps", self.runner, client)
        return self._ps_exchanges[key]

    def _local_exchange(self, kind: str | None = None) -> Exchange | None:
        """The exchange of ``kind`` (default ``WorkerConfig.exchange``) if it needs no servers (None for "ps"),
        built once."""
        kind = kind or self.config.exchange
        if registry.needs_servers(kind):
            return None  # made by ``connect`` once the servers exist
        if kind not in self._local_exchanges:
            self._local_exchanges[kind] = registry.worker_half(kind, self.runner)
        return self._local_exchanges[kind]

    def renumber(self, worker_index: int) -> None:
        """Take index ``worker_index``: an elastic engine lost a worker below this one and closed up the indices.

        The replicas keep the graph ``model_creator`` built for the old index;
        ``set_exchange`` (which follows) connects under the new one.
        """
        self.worker_index = worker_index
        self.runner.worker_index = worker_index

    def set_exchange(self, kind: str) -> None:
        """Combine gradients the way ``kind`` says (``WorkerConfig.exchange``) from the next step on.

        A resize changed the worker count: the old exchange (and, for "ps",
        the connection to the old servers) is dropped; for "ps", ``connect``
        makes the new one, or takes up the one it made before for the same
        partitions. The graph's replicas and the session stay.
        """
        self.config = dataclasses.replace(self.config, exchange=kind)
        self.runner.config = self.config
        if self.client is not None:
            self.client.close()
        self.client = None
        self.exchange = self._local_exchange()

    def prepare_exchange(self, kind: str, fetch_stats: bool, layout: list[partitions.Partition] | None = None,
                         placement: list[int] | None = None, feed_names: Sequence[str] | None = None) -> None:
        """Build the exchange of ``kind`` (for "ps": of ``layout`` and ``placement``) without taking it up, and
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
            exchange = self._ps_exchange(layout, placement)[1]
        else:
            exchange = self._local_exchange(kind)
        feed_names = self.runner.feed_names if self.runner.feed_names is not None else feed_names
        if exchange is None or feed_names is None:
            return
        try:
            exchange.prepare(fetch_stats, feed_names)
        except (KeyError, ValueError, TypeError, tf.errors.OpError) as e:
            logger.debug("worker %d dropped the plan of its next step: %s", self.worker_index, e)

    def step_feed_names(self) -> tuple[str, ...] | None:
        """The tensors this worker's last step fed (None before its first): what a new worker plans for."""
        return self.runner.feed_names

    # ---- stepping -----------------------------------------------------------

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> dict | tuple[list[np.ndarray], dict[str, float]]:
        """One step through the worker's exchange (``means``: the driver's, for "simple"'s second call)."""
        return self.exchange.step(step_id, fetch_stats, means)

    def warmup(self) -> None:
        """Run the gradient computation once without applying it (no weight change)."""
        self.runner.sess.run(self.runner.built.local_means, feed_dict=self.runner.feed_dict())

    def start_trace(self) -> None:
        """Record a timeline of the calls until ``collect_trace``."""
        self.runner.trace = timeline.Recorder()

    def collect_trace(self) -> list[timeline.Event]:
        trace, self.runner.trace = self.runner.trace, None
        return trace.events if trace else []

    # ---- state and user callbacks ----------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """Replica 0's variables, keyed by name without the replica scope."""
        return self.sess.run(dict(self.built.replicas[0].weights))

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._set_state("weights", weights)

    def match_weights(self, reference: list) -> list[str]:
        """Make every replica's weights bit-identical to ``reference[0]``; the names of the variables assigned.

        ``reference[0]`` is a Ray reference to worker 0's ``get_weights()``
        (the engine's initial weights), awaited only once this worker has
        read its own, so both reads overlap. Only the variables that differ
        on some replica are assigned (all of them when the initializers are
        random; none when they are deterministic): bytes are compared, so a
        variable left unassigned holds exactly the reference's bits.
        """
        own = self.sess.run([dict(r.weights) for r in self.built.replicas])
        try:
            weights = ray.get(reference[0], timeout=self.config.startup_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise DSGDTimeoutError(f"worker {self.worker_index} waited more than "
                                   f"{self.config.startup_timeout_s:.0f}s for worker 0's initial weights") from e
        differ = sorted(name for name, value in weights.items()
                        if not all(_same_bits(value, replica[name]) for replica in own))
        self._set_state("weights", {name: weights[name] for name in differ})
        return differ

    def _set_state(self, group: str, values: dict[str, np.ndarray]) -> None:
        self.built.state_assigns.run(self.sess, group, values)

    def get_state(self) -> dict:
        """Weights, optimizer state and step count: all a replica needs to go on."""
        groups = self.built.state_vars
        weights, optimizer = self.sess.run([dict(groups["weights"][0]), dict(groups["optimizer"][0])])
        return {"weights": weights, "optimizer": optimizer, "applied_steps": self.runner.applied_steps}

    def set_state(self, state: dict) -> None:
        """Load get_state()'s result onto every replica."""
        self._set_state("weights", state["weights"])
        self._set_state("optimizer", state["optimizer"])
        self.runner.applied_steps = state["applied_steps"]

    def applied_steps_count(self) -> int:
        return self.runner.applied_steps

    def apply_fn(self, fn: Callable[["SGDWorker"], Any]) -> Any:
        """``fn(self)``, with the worker's session as the default."""
        with self.runner.default_session():
            return fn(self)

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """``fn(model)`` on replica 0, with the worker's session as the default."""
        with self.runner.default_session():
            return fn(self.models[0])

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """``fn(model)`` on every replica, device order, with the worker's session as the default."""
        with self.runner.default_session():
            return [fn(m) for m in self.models]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` hold the same dtype, shape and bytes (object arrays, e.g. strings: never)."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.dtype == b.dtype and a.shape == b.shape and a.dtype != object
            and a.tobytes() == b.tobytes())

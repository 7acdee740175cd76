"""The worker actor: runs its graph (``dsgd.worker_graph``) step after step.

The driver calls ``setup`` first (builds the graph, one replica per device),
``connect`` for "ps" with several workers, then one step method per
strategy: ``step_local`` (one worker alone), ``compute_gradients`` +
``apply_gradients`` ("simple", the driver averages) or ``step_ps``. The
worker feeds every replica its batch, times the step's phases, reduces the
stats, skips or refuses non-finite steps, and reads and writes its state.
"""

from __future__ import annotations

import contextlib
import gc
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd import actor_identity, shards, timeline, worker_graph
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError, NonFiniteGradientError
from dsgd.model import Model
from dsgd.ps_client import ParameterServerClient

_NONFINITE = re.compile(r"dsgd: non-finite (gradient|value) of '([^']+)'")


class SGDWorker:
    """Runs as a Ray actor. ``sess`` is its session, ``models`` its replicas in device order."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        self.worker_index = worker_index
        self.config = config
        self.graph: tf.Graph | None = None
        self.sess: tf.compat.v1.Session | None = None
        self.models: list[Model] = []
        self.built: worker_graph.WorkerGraph | None = None
        self.client: ParameterServerClient | None = None  # "ps" with several workers, set by connect
        self.exchange: worker_graph.OpsExchange | None = None  # the in-graph "ps" exchange (use_ops)
        self.layout: list[shards.Shard] = []  # the partitions, set by connect
        self.applied_steps = 0
        self._callback_error: BaseException | None = None
        self._trace: timeline.Recorder | None = None
        self._phase_s: dict[str, float] = {}  # this step's phases, reported with its stats
        # One thread per replica to ask for batches, with Ray Data input: a
        # streaming split starts an epoch only once every replica has asked.
        self._feeders = (ThreadPoolExecutor(config.devices_per_worker, thread_name_prefix="dsgd-feed")
                         if config.feed_concurrently and config.devices_per_worker > 1 else None)

    # ---- set-up -----------------------------------------------------------

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("worker", self.worker_index)

    def setup(self, model_creator: Callable[[int, int], Model]) -> worker_graph.WorkerSignature:
        """Build the replicas and initialize their variables (local ones too); what was built.

        Called again (with new dataset splits after a recovery), it builds
        them anew and loads the state they had; ``connect`` then rebuilds the
        in-graph exchange.
        """
        state = self.get_state() if self.built is not None else None
        if self.sess is not None:
            self.sess.close()
            gc.unfreeze()  # let the old graph's objects be collected
        self.graph = tf.Graph()
        self.sess = tf.compat.v1.Session(graph=self.graph, config=worker_graph.session_config(self.config))
        with self._default_session():
            self.built = worker_graph.build(self.worker_index, self.config, model_creator, self.sess)
        self.models = self.built.models
        self.exchange = None
        if state is not None:
            self.set_state(state)
        # The graph's Python objects live as long as the worker: keep the cyclic
        # garbage collector from walking them on every full collection.
        gc.freeze()
        return self.built.signature

    def _default_session(self):
        """The worker's graph and session as TensorFlow's defaults (for user code too)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.graph.as_default())
        stack.enter_context(self.sess.as_default())
        return stack

    def connect(self, layout: list[shards.Shard], placement: list[int], servers: list,
                timeout_s: float) -> int:
        """Exchange ``layout``'s partitions with ``servers`` (``placement[j]`` sums partition j).

        The first call (and the first after ``setup`` rebuilt the graph)
        builds the in-graph exchange (with the op library); later calls, after
        a server or worker was replaced, only re-attach.
        Returns how many servers are reached through shared memory.
        """
        if self.client is None:
            self.layout = list(layout)
            self.client = ParameterServerClient(self.worker_index, layout, placement, self.config.timeout_s)
        elif [s.index for s in layout] != [s.index for s in self.layout] or placement != self.client.placement:
            raise DSGDError(f"worker {self.worker_index} was connected with another partition layout")
        if self.config.use_ops and self.exchange is None:
            with self._default_session():
                self.exchange = worker_graph.build_ops_exchange(
                    self.built, self.config, self.layout, self._send_shard, self._receive_shard)
        return self.client.connect(servers, timeout_s)

    @contextlib.contextmanager
    def _callback(self, span: str):
        """The body of a graph callback: traced, and its error kept for ``_step_ps_ops`` (TF wraps it)."""
        try:
            with timeline.maybe_span(self._trace, span, "exchange"):
                yield
        except BaseException as e:
            self._callback_error = e
            raise

    def _send_shard(self, shard: shards.Shard, arrays: list[np.ndarray], step: np.ndarray) -> None:
        with self._callback(f"send partition {shard.index}"):
            self.client.send(shard, int(step), arrays)

    def _receive_shard(self, shard: shards.Shard, step: np.ndarray) -> np.ndarray:
        with self._callback(f"receive partition {shard.index}"):
            return self.client.receive(shard, int(step))

    # ---- running the graph ------------------------------------------------

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the step for its stats (``<name>_s``) and, if tracing, the timeline."""
        start = time.perf_counter()
        try:
            with timeline.maybe_span(self._trace, name):
                yield
        finally:
            key = name.replace(",", "").replace(" ", "_") + "_s"
            self._phase_s[key] = self._phase_s.get(key, 0.0) + time.perf_counter() - start

    def _run(self, fetches, feed_dict: dict, phase: str):
        """session.run; while tracing, with TensorFlow's per-op step stats."""
        trace = self._trace
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE) if trace else None
        metadata = tf.compat.v1.RunMetadata() if trace else None
        try:
            with self._phase(phase):
                return self.sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        finally:
            if trace:
                trace.events += timeline.from_step_stats(metadata.step_stats)

    def start_trace(self) -> None:
        """Record a timeline of the calls until ``collect_trace``."""
        self._trace = timeline.Recorder()

    def collect_trace(self) -> list[timeline.Event]:
        events, self._trace = (self._trace.events if self._trace else []), None
        return events

    def _feed_dict(self) -> dict:
        """Every replica's next batch (asked concurrently with Ray Data input); starts the step's phase timings."""
        self._phase_s = {}
        with self._phase("get_feed_dict"):
            replicas = self.built.replicas
            parts = (self._feeders.map(self._replica_feed, replicas) if self._feeders
                     else map(self._replica_feed, replicas))
            feed: dict = {}
            for part in parts:
                feed.update(part)
            return feed

    def _replica_feed(self, replica: worker_graph.Replica) -> dict:
        """``replica``'s get_feed_dict(), checked; in any thread, with the worker's session as the default."""
        where = f"worker {self.worker_index}, device {replica.index}"
        with self._default_session():
            part = worker_graph.call_user(replica.model, "get_feed_dict", where) or {}
            if not isinstance(part, dict):
                raise DSGDError(f"get_feed_dict() must return a dict, got {type(part).__name__} on {where}")
            for key in part:
                self._check_feed_key(key, where)
        return part

    def _check_feed_key(self, key, where: str) -> None:
        if isinstance(key, (tf.Tensor, tf.Operation)) and key.graph is self.graph:
            return
        if isinstance(key, str):
            try:
                self.graph.as_graph_element(key)
                return
            except (KeyError, ValueError) as e:
                raise DSGDError(f"get_feed_dict() on {where} names {key!r}, which is not a tensor of the model's graph: {e}") from e
        raise DSGDError(
            f"get_feed_dict() on {where} returned key {key!r}, which is not a tensor of the replica's graph; "
            "use placeholders created in the model's __init__")

    def _stats_fetches(self, fetch_stats: bool) -> dict:
        if not fetch_stats:
            return {}
        replicas = self.built.replicas
        return {"loss": [r.loss for r in replicas],
                "metrics": {k: [r.metrics[k] for r in replicas] for k in replicas[0].metrics}}

    def _stats(self, fetched: dict) -> dict[str, float]:
        """Loss and metrics (means over replicas) with the step's phase times; {} if none were fetched."""
        if not fetched:
            return {}
        stats = {"loss": float(np.mean(fetched["loss"]))}
        stats.update({k: float(np.mean(v)) for k, v in fetched["metrics"].items()})
        return {**stats, **self._phase_s}

    def _apply(self, fetches: dict, feed_dict: dict, phase: str = "apply") -> dict:
        """Run an apply; a non-finite mean raises or skips the step on every replica.

        Every worker applies the same global mean, so every worker makes the
        same choice and replicas stay identical. Returns the run's outputs
        and, under "skipped", the variable that made the step skip.
        """
        try:
            out = self._run(fetches, feed_dict, phase)
        except tf.errors.InvalidArgumentError as e:
            found = _NONFINITE.search(e.message)
            if not found:
                raise
            what = f"non-finite {found.group(1)} of variable '{found.group(2)}' in step {self.applied_steps}"
            if self.config.nan_policy == "raise":
                raise NonFiniteGradientError(
                    f"{what}; no replica applied it (nan_policy='skip' skips such steps)") from None
            self.applied_steps += 1
            return {"skipped": what}
        self.applied_steps += 1
        return out

    def _result(self, fetched_stats: dict, applied: dict) -> dict:
        """A step's result: its stats, and "skipped" if the apply skipped it."""
        result = self._stats(fetched_stats)
        if "skipped" in applied:
            result["skipped"] = applied["skipped"]
        return result

    # ---- steps, one set per strategy -------------------------------------

    def step_local(self, fetch_stats: bool) -> dict:
        """One worker alone: average over local replicas and apply, one run."""
        out = self._apply({"apply": self.built.apply_local, "stats": self._stats_fetches(fetch_stats)},
                          self._feed_dict(), "compute and apply")
        return self._result(out.get("stats", {}), out)

    def compute_gradients(self, fetch_stats: bool) -> tuple[list[np.ndarray], dict[str, float]]:
        """The worker's averaged exchange tensors (for the "simple" strategy), and its stats."""
        out = self._run({"means": self.built.local_means, "stats": self._stats_fetches(fetch_stats)},
                        self._feed_dict(), "compute")
        return out["means"], self._stats(out["stats"])

    def apply_gradients(self, means: Sequence[np.ndarray], stats: dict | None = None) -> dict:
        """Apply the global mean of the exchange tensors on every replica; ``stats`` come back with the result."""
        applied = self._apply({"apply": self.built.apply_fed}, dict(zip(self.built.mean_inputs, means)))
        return {**(stats or {}), **self._result({}, applied)}

    def step_ps(self, step_id: int, fetch_stats: bool) -> dict:
        """Compute, push partitions to the parameter servers, receive their means, apply."""
        if self.exchange is not None:
            return self._step_ps_ops(step_id, fetch_stats)
        out = self._run({"means": self.built.local_means, "stats": self._stats_fetches(fetch_stats)},
                        self._feed_dict(), "compute")
        try:
            with self._phase("pack and send"):
                for shard in self.layout:
                    self.client.send_gradients(shard, step_id, out["means"])
            with self._phase("receive"):
                shard_means = [self.client.receive(shard, step_id) for shard in self.layout]
        except BaseException:
            self.client.forget_pushes()
            raise
        means = shards.unpack(shard_means, self.layout, self.built.signature.exchange)
        applied = self._apply({"apply": self.built.apply_fed}, dict(zip(self.built.mean_inputs, means)))
        return self._result(out["stats"], applied)

    def _step_ps_ops(self, step_id: int, fetch_stats: bool) -> dict:
        """One session run: compute, send, receive and apply all happen in the graph."""
        from dsgd import ops

        feed = self._feed_dict()
        feed[self.exchange.step_input] = step_id
        self._callback_error = None
        try:
            out = self._apply({"apply": self.exchange.apply, "stats": self._stats_fetches(fetch_stats)}, feed,
                              "compute, exchange and apply")
        except tf.errors.OpError:
            ops.discard_unclaimed()
            self.client.forget_pushes()
            if self._callback_error is not None:
                raise self._callback_error from None  # e.g. a dead parameter server: the driver recovers
            raise
        finally:
            ops.drain_released()
        return self._result(out.get("stats", {}), out)

    def warmup(self) -> None:
        """Run the gradient computation once without applying it (no weight change)."""
        self.sess.run(self.built.local_means, feed_dict=self._feed_dict())

    # ---- state and user callbacks ----------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        """Replica 0's variables, keyed by name without the replica scope."""
        return self.sess.run(dict(self.built.replicas[0].weights))

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self._set_state("weights", weights)

    def _set_state(self, group: str, values: dict[str, np.ndarray]) -> None:
        inputs = self.built.state_inputs[group]
        if inputs:
            self.sess.run(self.built.set_state[group], feed_dict={inputs[k]: v for k, v in values.items()})

    def get_state(self) -> dict:
        """Weights, optimizer state and step count: all a replica needs to go on."""
        groups = self.built.state_vars
        weights, optimizer = self.sess.run([dict(groups["weights"][0]), dict(groups["optimizer"][0])])
        return {"weights": weights, "optimizer": optimizer, "applied_steps": self.applied_steps}

    def set_state(self, state: dict) -> None:
        """Load get_state()'s result onto every replica."""
        self._set_state("weights", state["weights"])
        self._set_state("optimizer", state["optimizer"])
        self.applied_steps = state["applied_steps"]

    def applied_steps_count(self) -> int:
        return self.applied_steps

    def apply_fn(self, fn: Callable[["SGDWorker"], Any]) -> Any:
        """``fn(self)``, with the worker's session as the default."""
        with self._default_session():
            return fn(self)

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """``fn(model)`` on replica 0, with the worker's session as the default."""
        with self._default_session():
            return fn(self.models[0])

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """``fn(model)`` on every replica, device order, with the worker's session as the default."""
        with self._default_session():
            return [fn(m) for m in self.models]

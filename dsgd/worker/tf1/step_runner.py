"""Running one worker's graph for a step: feeds, phases, stats, the apply and its non-finite check.

``StepRunner`` is what every exchange (``dsgd.exchange``) builds its step
body from: ``feed_dict`` asks every replica for its batch, ``run`` is
``session.run`` timed as a phase of the step (and traced while a timeline is
recorded), ``apply`` runs an apply and turns a non-finite mean into a raised
error or a skipped step, ``result`` reduces the replicas' stats.

TensorFlow plans a run the first time it sees its fetches and feeds
(optimizes and partitions the graph: seconds for a large model). ``plan``
does that ahead of time, off the step's path (a resize has the survivors
plan the new exchange's step while a new worker builds its model): a
``PreparedRun``, TensorFlow's callable (``Session::MakeCallable``), which
``run`` takes in place of ``session.run`` when the feeds are the planned ones.
"""

from __future__ import annotations

import contextlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.client import session as session_lib

from dsgd.common import timeline
from dsgd.worker import user_model
from dsgd.worker.tf1 import worker_graph
from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError, NonFiniteGradientError

# a non-finite check's message (dsgd.worker.tf1.worker_graph._finite); an assert's escapes the quotes
_NONFINITE = re.compile(r"dsgd: non-finite (gradient|value) of \\?'([^'\\]+)\\?'")


class StepRunner:
    """Runs ``built`` in ``sess`` for worker ``worker_index``; counts the steps it applied."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        self.worker_index = worker_index
        self.config = config
        self.sess: tf.compat.v1.Session | None = None
        self.built: worker_graph.WorkerGraph | None = None
        self.applied_steps = 0
        self.trace: timeline.Recorder | None = None  # set while a timeline is recorded
        self._phase_s: dict[str, float] = {}  # this step's phases, reported with its stats
        self.feed_names: tuple[str, ...] | None = None  # the tensors the last step's feeds went to, sorted
        # One thread per replica to ask for batches, with Ray Data input: a
        # streaming split starts an epoch only once every replica has asked.
        self._feeders = (ThreadPoolExecutor(config.devices_per_worker, thread_name_prefix="dsgd-feed")
                         if config.feed_concurrently and config.devices_per_worker > 1 else None)

    def default_session(self) -> contextlib.ExitStack:
        """The worker's graph and session as TensorFlow's defaults (for user code too)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.sess.graph.as_default())
        stack.enter_context(self.sess.as_default())
        return stack

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase of the step for its stats (``<name>_s``) and, if tracing, the timeline."""
        start = time.perf_counter()
        try:
            with timeline.maybe_span(self.trace, name):
                yield
        finally:
            key = name.replace(",", "").replace(" ", "_") + "_s"
            self._phase_s[key] = self._phase_s.get(key, 0.0) + time.perf_counter() - start

    def run(self, fetches, feed_dict: dict, phase: str, prepared: PreparedRun | None = None):
        """session.run; while tracing, with TensorFlow's per-op step stats.

        ``prepared``: ``plan``'s run of these ``fetches``, used instead if it
        was planned for the tensors ``feed_dict`` feeds (and no trace is recorded).
        """
        trace = self.trace
        if prepared is not None and not trace and prepared.feed_names == self.names_of(feed_dict):
            with self.phase(phase):
                return prepared(feed_dict)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE) if trace else None
        metadata = tf.compat.v1.RunMetadata() if trace else None
        try:
            with self.phase(phase):
                return self.sess.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
        finally:
            if trace:
                trace.events += timeline.from_step_stats(metadata.step_stats)

    def plan(self, fetches, feed_names: Sequence[str]) -> PreparedRun:
        """Have TensorFlow plan a run of ``fetches`` fed the tensors ``feed_names`` now; for ``run``'s ``prepared``."""
        graph = self.sess.graph
        feeds = [graph.as_graph_element(name) for name in sorted(feed_names)]
        handler = session_lib._FetchHandler(graph, fetches, {})
        options = config_pb2.CallableOptions(feed=[t.name for t in feeds],
                                             fetch=[t.name for t in handler.fetches()],
                                             target=[op.name for op in handler.targets()])
        return PreparedRun(self, feeds, handler, self.sess._make_callable_from_options(options))

    def names_of(self, feed_dict: dict) -> tuple[str, ...]:
        """The names of the tensors ``feed_dict`` feeds (its keys are tensors or names), sorted."""
        return tuple(sorted(_tensor_name(self.sess.graph, key) for key in feed_dict))

    # ---- feeding ------------------------------------------------------------

    def feed_dict(self) -> dict:
        """Every replica's next batch (asked concurrently with Ray Data input); starts the step's phase timings."""
        self._phase_s = {}
        with self.phase("get_feed_dict"):
            replicas = self.built.replicas
            parts = (self._feeders.map(self._replica_feed, replicas) if self._feeders
                     else map(self._replica_feed, replicas))
            feed: dict = {}
            for part in parts:
                feed.update(part)
            self.feed_names = self.names_of(feed)
            return feed

    def _replica_feed(self, replica: worker_graph.Replica) -> dict:
        """``replica``'s get_feed_dict(), checked; in any thread, with the worker's session as the default."""
        where = f"worker {self.worker_index}, device {replica.index}"
        with self.default_session():
            part = user_model.call_user(replica.model, "get_feed_dict", where) or {}
            if not isinstance(part, dict):
                raise DSGDError(f"get_feed_dict() must return a dict, got {type(part).__name__} on {where}")
            for key in part:
                self._check_feed_key(key, where)
        return part

    def _check_feed_key(self, key, where: str) -> None:
        graph = self.sess.graph
        if isinstance(key, (tf.Tensor, tf.Operation)) and key.graph is graph:
            return
        if isinstance(key, str):
            try:
                graph.as_graph_element(key)
                return
            except (KeyError, ValueError) as e:
                raise DSGDError(f"get_feed_dict() on {where} names {key!r}, which is not a tensor of the model's graph: {e}") from e
        raise DSGDError(
            f"get_feed_dict() on {where} returned key {key!r}, which is not a tensor of the replica's graph; "
            "use placeholders created in the model's __init__")

    # ---- stats and the apply --------------------------------------------------

    def stats_fetches(self, fetch_stats: bool) -> dict:
        """What to fetch for the step's stats: every replica's loss and metric tensors ({} without stats)."""
        if not fetch_stats:
            return {}
        replicas = self.built.replicas
        return {"loss": [r.loss for r in replicas],
                "metrics": {k: [r.metrics[k] for r in replicas] for k in replicas[0].metrics}}

    def stats(self, fetched: dict, sent_bytes: int) -> dict[str, float]:
        """Loss and metrics (means over replicas) with the step's phase times; {} if none were fetched.

        ``sent_bytes``: what this worker pushed to the servers (or the driver) in the step.
        """
        if not fetched:
            return {}
        stats = {"loss": float(np.mean(fetched["loss"]))}
        stats.update({k: float(np.mean(v)) for k, v in fetched["metrics"].items()})
        return {**stats, **self._phase_s, "sent_bytes": float(sent_bytes)}

    def apply(self, fetches: dict, feed_dict: dict, phase: str = "apply", prepared: PreparedRun | None = None) -> dict:
        """Run an apply; a non-finite mean raises or skips the step on every replica.

        Every worker applies the same global mean, so every worker makes the
        same choice and replicas stay identical. Returns the run's outputs
        and, under "skipped", the variable that made the step skip.
        """
        try:
            out = self.run(fetches, feed_dict, phase, prepared)
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

    def result(self, fetched_stats: dict, applied: dict, sent_bytes: int) -> dict:
        """A step's result: its stats (``stats``), and "skipped" if the apply skipped it."""
        result = self.stats(fetched_stats, sent_bytes)
        if "skipped" in applied:
            result["skipped"] = applied["skipped"]
        return result


class PreparedRun:
    """A run TensorFlow planned ahead (``StepRunner.plan``); called with a feed dict, it returns what
    ``session.run`` would."""

    def __init__(self, runner: StepRunner, feeds: list[tf.Tensor], handler, call):
        self.runner = runner
        self.feed_names = tuple(t.name for t in feeds)  # the order ``call`` takes their values in
        self.handler = handler  # the fetches' structure
        self.call = call
        self._dtypes = [t.dtype.as_numpy_dtype for t in feeds]

    def __call__(self, feed_dict: dict):
        graph = self.runner.sess.graph
        by_name = {_tensor_name(graph, key): value for key, value in feed_dict.items()}
        values = [np.asarray(by_name[name], dtype=dtype) for name, dtype in zip(self.feed_names, self._dtypes)]
        return self.handler.build_results(self.runner.sess, self.call(*values))


def _tensor_name(graph: tf.Graph, key) -> str:
    """The name of the tensor a feed dict's ``key`` (a tensor or a name) feeds."""
    return key.name if isinstance(key, tf.Tensor) else graph.as_graph_element(key).name

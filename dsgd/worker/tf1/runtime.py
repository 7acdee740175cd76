"""The TF1 replica runtime: the worker's replicas in one TensorFlow graph, stepped by session runs.

``build`` opens a session on a new graph and builds the replicas into it
(``worker_graph``). A step is session runs: ``compute`` runs the local means,
``apply`` a fed apply of the global means, and a ``Tf1FusedStep`` the
compute, any in-step exchange and the apply in one run, which it can have
TensorFlow plan ahead (``session_runs.plan``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.model import Model
from dsgd.common.results import Value
from dsgd.worker import tf_logs
from dsgd.worker.runtime import FusedStep, InStepExchange, ReplicaRuntime
from dsgd.worker.signature import WorkerSignature
from dsgd.worker.tf1 import feeds, session_runs, worker_graph
from dsgd.worker.tf1.applies import build_apply
from dsgd.worker.tf1.session_config import session_config


class Tf1Runtime(ReplicaRuntime):
    """The replicas of ``worker_graph`` in ``sess``; both are made by ``build``."""

    def __init__(self, worker_index: int, config: WorkerConfig):
        super().__init__(worker_index, config)
        self.sess: tf.compat.v1.Session | None = None
        self.worker_graph: worker_graph.WorkerGraph | None = None
        self._feed_names: tuple[str, ...] | None = None  # the tensors the last step's feeds went to, sorted

    # ---- building -----------------------------------------------------------

    def build(self, model_creator: Callable[[int, int], Model], state: dict | None = None) -> WorkerSignature:
        if self.sess is not None:
            self.sess.close()
        with tf_logs.start_up_lines_hidden():  # every kind of device listed: CUDA's probe, on any machine
            tf.config.list_physical_devices()
        self.sess = tf.compat.v1.Session(graph=tf.Graph(), config=session_config(self.config))
        try:
            with self.user_context():
                self.worker_graph = worker_graph.build(self.worker_index, self.config, model_creator, self.sess, state)
        except Exception:  # a TF2 model (built eagerly instead) or a model_creator that raised
            self.sess.close()
            self.sess = None
            raise
        if state is not None:
            self.applied_steps = state["applied_steps"]
        return self.worker_graph.signature

    @property
    def is_built(self) -> bool:
        return self.worker_graph is not None

    @property
    def signature(self) -> WorkerSignature:
        return self.worker_graph.signature

    @property
    def trainable_count(self) -> int:
        return len(self.worker_graph.replicas[0].train_vars)

    @property
    def models(self) -> list[Model]:
        return self.worker_graph.models if self.worker_graph is not None else []

    def user_context(self) -> contextlib.ExitStack:
        """The worker's graph and session as TensorFlow's defaults (user code may ``Tensor.eval()``)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.sess.graph.as_default())
        stack.enter_context(self.sess.as_default())
        return stack

    # ---- stepping -------------------------------------------------------------

    def compute(self, fetch_stats: bool) -> tuple[list[np.ndarray], dict[str, Value]]:
        out = self.run({"means": self.worker_graph.local_means, "stats": self.stats_fetches(fetch_stats)},
                       self.feed_dict(), "compute")
        return out["means"], self.reduce(out["stats"])

    def apply(self, means: Sequence[np.ndarray]) -> dict:
        built = self.worker_graph
        out = self.checked_run({"apply": built.apply_fed}, dict(zip(built.mean_inputs, means)), "apply")
        return _outcome(out)

    def drop_batches(self) -> None:
        self.feed_dict()

    def fused_step(self, exchange: InStepExchange | None = None) -> Tf1FusedStep:
        return Tf1FusedStep(self, exchange)

    def warmup(self) -> None:
        self.sess.run(self.worker_graph.local_means, feed_dict=self.feed_dict())

    @property
    def feed_names(self) -> tuple[str, ...] | None:
        return self._feed_names

    def feed_dict(self) -> dict:
        """Every replica's next batch; starts the step (its phase timings)."""
        self.start_step()
        with self.phase("get_feed_dict"):
            feed = feeds.feed_dict(self.worker_graph.replicas, self.sess.graph, self.user_context,
                                   self.worker_index, self.each_replica)
            self._feed_names = session_runs.names_of(self.sess.graph, feed)
            return feed

    def run(self, fetches, feed_dict: dict, phase: str, prepared: session_runs.PreparedRun | None = None):
        """``session.run`` timed as ``phase`` of the step (``session_runs.run``)."""
        return session_runs.run(self.sess, fetches, feed_dict, self.phase(phase), self.trace, prepared)

    def checked_run(self, fetches: dict, feed_dict: dict, phase: str,
                    prepared: session_runs.PreparedRun | None = None) -> dict:
        """Run an apply: its outputs, or {"skipped": why} if a non-finite check failed it (``skipped``)."""
        try:
            out = self.run(fetches, feed_dict, phase, prepared)
        except tf.errors.InvalidArgumentError as e:
            skipped = self.skipped(e.message)
            if skipped is None:
                raise
            return skipped
        self.applied_steps += 1
        return out

    def stats_fetches(self, fetch_stats: bool) -> dict:
        """What to fetch for the step's stats: every replica's loss and metric tensors ({} without stats)."""
        if not fetch_stats:
            return {}
        replicas = self.worker_graph.replicas
        return {"loss": [r.loss for r in replicas],
                "metrics": {k: [r.metrics[k] for r in replicas] for k in replicas[0].metrics}}

    def reduce(self, fetched: dict) -> dict[str, Value]:
        """``stats_fetches``'s values as the step's loss and metrics ({} if none were fetched)."""
        return self.replica_stats(fetched["loss"], fetched["metrics"]) if fetched else {}

    # ---- state --------------------------------------------------------------------

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.sess.run(dict(self.worker_graph.replicas[0].weights))

    def replica_weights(self) -> list[dict[str, np.ndarray]]:
        return self.sess.run([dict(r.weights) for r in self.worker_graph.replicas])

    def set_group(self, group: str, values: dict[str, np.ndarray]) -> None:
        self.worker_graph.state_assigns.run(self.sess, group, values)

    def get_groups(self) -> dict[str, dict[str, np.ndarray]]:
        groups = self.worker_graph.state_vars
        weights, optimizer = self.sess.run([dict(groups["weights"][0]), dict(groups["optimizer"][0])])
        return {"weights": weights, "optimizer": optimizer}


class Tf1FusedStep(FusedStep):
    """One session run: compute, the in-step exchange if any (fed the step id), and the apply.

    A run that fetches the step's stats applies through an apply of its own
    that waits for them: in one run nothing else orders a metric that reads
    a variable (not on the gradients' path) before the apply writes it.
    ``_prepared`` holds the runs planned ahead, by ``fetch_stats``.
    """

    def __init__(self, runtime: Tf1Runtime, exchange: InStepExchange | None):
        self.runtime = runtime
        built = runtime.worker_graph
        with runtime.user_context():
            if exchange is None:
                self.step_input = None
                self._means, self._checks = built.replica_means, None
            else:
                self.step_input = tf.compat.v1.placeholder(tf.int64, [], name="step_id")
                means, self._checks = exchange(built.local_means, self.step_input)
                self._means = [means] * len(built.replicas)
        self._applies = {False: self._build_apply(())}  # by fetch_stats; the other is built when first run
        self.phase = "compute and apply" if exchange is None else "compute, exchange and apply"
        self._prepared: dict[bool, session_runs.PreparedRun] = {}

    def _build_apply(self, after: Sequence[tf.Tensor]) -> tf.Operation:
        runtime = self.runtime
        with runtime.user_context():
            return build_apply(runtime.worker_graph, self._means, runtime.config, self._checks, after)

    def run(self, step_id: int, fetch_stats: bool) -> tuple[dict[str, Value], dict]:
        runtime = self.runtime
        feed = runtime.feed_dict()
        if self.step_input is not None:
            feed[self.step_input] = step_id
        out = runtime.checked_run(self._fetches(fetch_stats), feed, self.phase, self._prepared.get(fetch_stats))
        return runtime.reduce(out.get("stats", {})), _outcome(out)

    def prepare(self, fetch_stats: bool, feed_names: Sequence[str]) -> None:
        own = [self.step_input.name] if self.step_input is not None else []
        names = tuple(sorted([*feed_names, *own]))
        if fetch_stats not in self._prepared or self._prepared[fetch_stats].feed_names != names:
            self._prepared[fetch_stats] = session_runs.plan(self.runtime.sess, self._fetches(fetch_stats), names)

    def _fetches(self, fetch_stats: bool) -> dict:
        stats = self.runtime.stats_fetches(fetch_stats)
        if fetch_stats not in self._applies:
            self._applies[fetch_stats] = self._build_apply(tf.nest.flatten(stats))
        return {"apply": self._applies[fetch_stats], "stats": stats}


def _outcome(out: dict) -> dict:
    """An apply's outcome from its run's outputs (``Tf1Runtime.checked_run``): {} or {"skipped": why}."""
    return {"skipped": out["skipped"]} if "skipped" in out else {}

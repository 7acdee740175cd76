"""Bringing the workers to one state after a fault: counting failures, replacing dead actors, copying state.

A dead actor (``ActorFailure``) is replaced (``Cluster.replace_dead``,
which also gives every worker new Ray Data splits); every worker that is
behind (or new) gets the full state (weights, optimizer slots, step count)
of the most advanced survivor. A worker applies a step only once it holds
every averaged partition, so no replica applies a partial or duplicated
update; parameter servers hold nothing across steps, so they only need a
reset. The step ledger then runs again the steps no worker applied.

What a replica keeps to itself (its local state, e.g. a Keras model's
metrics over an epoch) no survivor holds: each worker's latest comes back
with its step results (``keep_local_state``), and a worker whose replicas are
built anew starts from the one its slot held, if that is of the step count
the engine goes on from.
"""

from __future__ import annotations

import logging
from typing import Any, Collection, Mapping

import ray

from dsgd.cluster.cluster import Cluster
from dsgd.common.results import LocalState, StepResult
from dsgd.errors import ActorFailure, DSGDError

logger = logging.getLogger(__name__)


class Recovery:
    """The failures of one engine's ``cluster`` recovered from, at most ``max_failures`` over its life."""

    def __init__(self, cluster: Cluster, max_failures: int):
        self.cluster = cluster
        self.max_failures = max_failures
        self.failures = 0
        self.early_state: tuple | None = None  # (a survivor, its get_state call) made as a grow began
        self._local_states: dict[int, tuple[Any, LocalState]] = {}  # worker index -> (its actor, its latest)

    def keep_local_state(self, results: Mapping[int, Any]) -> None:
        """Each worker's latest local state, from its step result (worker index -> ``StepResult``)."""
        for i, result in results.items():
            if isinstance(result, StepResult) and result.local_state is not None:
                self._local_states[i] = self.cluster.workers[i], result.local_state

    def count(self, error: ActorFailure) -> None:
        """Count a failure to recover from; a DSGDError past ``max_failures``."""
        self.failures += 1
        if self.failures > self.max_failures:
            raise DSGDError(f"giving up after {self.max_failures} recoveries (max_failures); "
                            f"last failure: {error}") from error
        logger.warning("%s; recovering (failure %d of at most %d)", error, self.failures, self.max_failures)

    def settle(self, in_flight: list[ray.ObjectRef], replace_dead: bool = False) -> int:
        """Abort ``in_flight``, optionally replace dead actors, bring every worker to one state; its step count."""
        cluster = self.cluster
        cluster.abort_servers()  # workers waiting on sums that will never complete fail now
        if replace_dead:
            cluster.stop_datasets()  # and those waiting on a dataset split (replace_dead splits anew)
        cluster.calls.wait_finished(in_flight)
        if not replace_dead:
            return self.resynchronize(set())
        before = list(cluster.workers)
        fresh = cluster.replace_dead()
        applied = self.resynchronize(fresh)
        # With datasets every worker's replicas were built anew, on new splits (replacement.replace_dead).
        self._pass_on_local_state(range(len(before)) if cluster.splits.datasets else fresh, before, applied)
        return applied

    def _pass_on_local_state(self, built: Collection[int], before: list, applied: int) -> None:
        """Workers ``built`` (their replicas new) start from the local state the worker in their slot
        (``before``, the workers before the recovery) held after ``applied`` steps, if its last step result
        gave it; else their replicas start with none (an elastic engine that went on with fewer renumbered its
        workers: none is passed on)."""
        workers = self.cluster.workers
        if len(workers) != len(before):
            self._local_states.clear()
            return
        calls = []
        for i in built:
            actor, state = self._local_states.get(i, (None, None))
            if actor is before[i] and state.applied_steps == applied:
                calls.append(workers[i].take_local_state.remote(state))
        if calls:
            self.cluster.calls.call(calls, "the new workers to start from their predecessors' local state")

    def resynchronize(self, fresh: set[int]) -> int:
        """Copy the most advanced survivor's state to every worker behind it (or new, ``fresh``); its step count.

        A grow's ``early_state`` (taken before any step could change it) is copied if it is that survivor's.
        """
        workers, calls = self.cluster.workers, self.cluster.calls
        counts = calls.call([w.applied_steps_count.remote() for w in workers], "the workers' step counts")
        survivors = [i for i in range(len(workers)) if i not in fresh]
        source = max(survivors, key=lambda i: counts[i])
        applied = counts[source]
        behind = [w for i, w in enumerate(workers) if i in fresh or counts[i] < applied]
        if behind:
            early = self.early_state
            state = early[1] if early and early[0] is workers[source] else workers[source].get_state.remote()
            calls.call([w.set_state.remote(state) for w in behind], f"worker {source}'s state to be copied")
        self.cluster.reset_servers(applied)
        return applied

"""Bringing an engine back after a failure: abort, replace, resynchronize, re-run.

A step is applied by a worker only once it holds every averaged partition,
so after a failure some workers may have applied the step and others not.
``Recovery.recover`` aborts the steps in flight, replaces dead actors, gives
every worker that is behind (or new) the full state (weights, optimizer
slots, step count) of the most advanced survivor, then runs again the steps
no worker applied. Parameter servers hold nothing across steps, so they only
need a reset. With Ray Data input, every worker also gets new splits
(``Cluster.replace_dead``), so every replica starts a new epoch.
"""

from __future__ import annotations

import logging

import ray

from dsgd.cluster import Cluster
from dsgd.errors import ActorFailure, DSGDError
from dsgd.strategies import Strategy, warn_if_skipped

logger = logging.getLogger(__name__)


class Recovery:
    """Recovers one engine's ``cluster``, re-running steps through its ``strategy``."""

    def __init__(self, cluster: Cluster, strategy: Strategy, max_failures: int):
        self.cluster = cluster
        self.strategy = strategy
        self.max_failures = max_failures
        self.failures = 0  # recoveries so far, over the engine's life

    def recover(self, error: ActorFailure, in_flight: list[ray.ObjectRef], steps_submitted: int) -> list:
        """Recover from ``error``; the per-worker results (with stats) of the last step re-run, [] if none was.

        ``in_flight``: the calls of the steps not yet waited for. Every step
        below ``steps_submitted`` is applied on every worker on return.
        """
        while True:
            self.failures += 1
            if self.failures > self.max_failures:
                raise DSGDError(f"giving up after {self.max_failures} recoveries (max_failures); "
                                f"last failure: {error}") from error
            logger.warning("%s; recovering (failure %d of at most %d)", error, self.failures, self.max_failures)
            try:
                applied = self.settle(in_flight, replace_dead=True)
                results = []
                for step_id in range(applied, steps_submitted):
                    in_flight = self.strategy.submit(self.cluster.workers, step_id, True)
                    results = self.cluster.call(in_flight, f"re-run of step {step_id}")
                    warn_if_skipped(results)
                return results
            except ActorFailure as e:
                error = e

    def settle(self, in_flight: list[ray.ObjectRef], replace_dead: bool = False) -> int:
        """Abort ``in_flight``, optionally replace dead actors, bring every worker to one state; its step count."""
        self.cluster.abort_servers()  # workers waiting on sums that will never complete fail now
        if replace_dead:
            self.cluster.stop_datasets()  # and those waiting on a dataset split (replace_dead splits anew)
        self.cluster.wait_finished(in_flight)
        fresh = self.cluster.replace_dead() if replace_dead else set()
        return self._resynchronize(fresh)

    def _resynchronize(self, fresh: set[int]) -> int:
        """Copy the most advanced survivor's state to every worker behind it (or new)."""
        workers = self.cluster.workers
        counts = self.cluster.call([w.applied_steps_count.remote() for w in workers], "the workers' step counts")
        survivors = [i for i in range(len(workers)) if i not in fresh]
        source = max(survivors, key=lambda i: counts[i])
        applied = counts[source]
        behind = [w for i, w in enumerate(workers) if i in fresh or counts[i] < applied]
        if behind:
            state = workers[source].get_state.remote()
            self.cluster.call([w.set_state.remote(state) for w in behind], f"worker {source}'s state to be copied")
        self.cluster.reset_servers(applied)
        return applied

"""Bringing the workers to one state after a fault: counting failures, replacing dead actors, copying state.

A dead actor (``ActorFailure``) is replaced (``Cluster.replace_dead``,
which also gives every worker new Ray Data splits); every worker that is
behind (or new) gets the full state (weights, optimizer slots, step count)
of the most advanced survivor. A worker applies a step only once it holds
every averaged partition, so no replica applies a partial or duplicated
update; parameter servers hold nothing across steps, so they only need a
reset. The step ledger then runs again the steps no worker applied.
"""

from __future__ import annotations

import logging

import ray

from dsgd.cluster.cluster import Cluster
from dsgd.errors import ActorFailure, DSGDError

logger = logging.getLogger(__name__)


class Recovery:
    """The failures of one engine's ``cluster`` recovered from, at most ``max_failures`` over its life."""

    def __init__(self, cluster: Cluster, max_failures: int):
        self.cluster = cluster
        self.max_failures = max_failures
        self.failures = 0
        self.early_state: tuple | None = None  # (a survivor, its get_state call) made as a grow began

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
        fresh = cluster.replace_dead() if replace_dead else set()
        return self.resynchronize(fresh)

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

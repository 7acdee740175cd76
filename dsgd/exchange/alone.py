"""One worker alone: its replicas' local mean is applied in the same session run that computes it."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsgd.exchange.base import Exchange
from dsgd.worker.tf1 import worker_graph
from dsgd.worker.tf1.step_runner import StepRunner


class AloneWorker(Exchange):
    """One worker: average over the local replicas and apply, one session run."""

    def __init__(self, runner: StepRunner):
        super().__init__(runner)
        built = runner.built
        with runner.default_session():
            self.apply = worker_graph.build_apply(built, built.replica_means, runner.config)

    def step(self, step_id: int, fetch_stats: bool, means: Sequence[np.ndarray] | None = None) -> dict:
        runner = self.runner
        out = runner.apply(self._step_fetches(fetch_stats), runner.feed_dict(), "compute and apply",
                           self._prepared.get(fetch_stats))
        return runner.result(out.get("stats", {}), out, sent_bytes=0)

    def _step_fetches(self, fetch_stats: bool) -> dict:
        return {"apply": self.apply, "stats": self.runner.stats_fetches(fetch_stats)}

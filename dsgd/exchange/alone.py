"""One worker alone: its replicas' local mean is applied in the step that computes it."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsgd.common.results import StepResult
from dsgd.exchange.base import Exchange
from dsgd.worker.runtime import ReplicaRuntime


class AloneWorker(Exchange):
    """One worker: average over the local replicas and apply, one fused step (one session run in TF1)."""

    def __init__(self, runtime: ReplicaRuntime):
        super().__init__(runtime)
        self.fused = runtime.fused_step()

    def step(self, step_id: int, fetch_stats: bool, means: Sequence[np.ndarray] | None = None) -> StepResult:
        stats, applied = self.fused.run(step_id, fetch_stats)
        return self.runtime.result(stats, applied, sent_bytes=0)

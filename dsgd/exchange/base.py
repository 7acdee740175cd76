"""The two halves of an exchange: how one step combines every worker's gradients.

Each way to combine gradients (``dsgd.exchange.registry.KINDS``) has a worker
half, an ``Exchange`` whose step body drives the worker's replica runtime
(``dsgd.worker.runtime.ReplicaRuntime``: local means and the checked apply,
in numpy, or a fused step with the exchange built in), and a driver half, a
``DriverHalf`` that submits the step to the workers. The step ledger
(``dsgd.driver.ledger``) submits every step, and every re-run after a
failure, through the driver half. An exchange knows no TensorFlow session,
graph or feed: it serves every runtime.

Every exchange reports ``sent_bytes`` with its stats: what the worker pushed
in the step (to the servers in its partitions' wire form, see
``dsgd.wire.codec``; to the driver; or nothing, alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import ray

from dsgd.common.results import StepResult

if TYPE_CHECKING:
    from dsgd.worker.runtime import FusedStep, ReplicaRuntime


class Exchange:
    """How one worker's step combines its gradients with the other workers'.

    An exchange whose step is a fused step of the runtime (``fused``) can
    have it planned ahead (``prepare``), for a worker that takes it up after
    a resize.
    """

    def __init__(self, runtime: ReplicaRuntime):
        self.runtime = runtime
        self.fused: FusedStep | None = None  # the step, if it is one fused step

    def prepare(self, fetch_stats: bool, feed_names: Sequence[str]) -> None:
        """Plan the step for the model's inputs ``feed_names`` now (``FusedStep.prepare``), unless planned.

        No-op for an exchange whose step is several runs, which every count shares (planned at their first step).
        """
        if self.fused is not None:
            self.fused.prepare(fetch_stats, feed_names)

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> StepResult | list[np.ndarray]:
        """One step of this worker; its result (``StepResult``)."""
        raise NotImplementedError


class DriverHalf:
    """Runs one step on every worker: ``submit`` returns refs of each worker's ``StepResult``."""

    def submit(self, workers: Sequence[Any], step_id: int, fetch_stats: bool) -> list[ray.ObjectRef]:
        raise NotImplementedError


class EachWorkerSteps(DriverHalf):
    """One worker alone, or "ps": each worker's exchange combines the gradients; the driver only submits."""

    def submit(self, workers, step_id, fetch_stats):
        return [w.step.remote(step_id, fetch_stats) for w in workers]

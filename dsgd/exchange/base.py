"""The two halves of an exchange: how one step combines every worker's gradients.

Each way to combine gradients (``dsgd.exchange.registry.KINDS``) has a worker
half, an ``Exchange`` that owns its piece of the worker's graph and its step
body (built from the worker's ``StepRunner``: feeds, timed runs, the checked
apply), and a driver half, a ``DriverHalf`` that submits the step to the
workers. The step ledger (``dsgd.driver.ledger``) submits every step, and
every re-run after a failure, through the driver half.

Every exchange reports ``sent_bytes`` with its stats: what the worker pushed
in the step (to the servers in its partitions' wire form, see
``dsgd.wire.codec``; to the driver; or nothing, alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import ray

if TYPE_CHECKING:
    from dsgd.worker.tf1.step_runner import PreparedRun, StepRunner


class Exchange:
    """How one worker's step combines its gradients with the other workers'.

    An exchange whose step is a run of its own graph ops (``_step_fetches``)
    can have TensorFlow plan that run ahead (``prepare``), for a worker that
    takes it up after a resize.
    """

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self._prepared: dict[bool, PreparedRun] = {}  # by fetch_stats

    def prepare(self, fetch_stats: bool, feed_names: Sequence[str]) -> None:
        """Plan the step's run for the model's feeds ``feed_names`` now (``StepRunner.plan``), unless planned.

        No-op for an exchange whose runs every count shares (TensorFlow planned them at their first step).
        """
        fetches = self._step_fetches(fetch_stats)
        if fetches is None:
            return
        names = tuple(sorted([*feed_names, *self._own_feeds()]))
        if fetch_stats not in self._prepared or self._prepared[fetch_stats].feed_names != names:
            self._prepared[fetch_stats] = self.runner.plan(fetches, names)

    def _step_fetches(self, fetch_stats: bool) -> dict | None:
        """What the step's run of this exchange's own ops fetches; None if it has none."""
        return None

    def _own_feeds(self) -> list[str]:
        """The tensors the exchange feeds in its step's run, besides the model's."""
        return []

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> dict | tuple[list[np.ndarray], dict[str, float]]:
        """One step of this worker; its result dict (stats, and "skipped" if the apply skipped it)."""
        raise NotImplementedError


class DriverHalf:
    """Runs one step on every worker: ``submit`` returns refs of each worker's result dict."""

    def submit(self, workers: Sequence[Any], step_id: int, fetch_stats: bool) -> list[ray.ObjectRef]:
        raise NotImplementedError


class EachWorkerSteps(DriverHalf):
    """One worker alone, or "ps": each worker's exchange combines the gradients; the driver only submits."""

    def submit(self, workers, step_id, fetch_stats):
        return [w.step.remote(step_id, fetch_stats) for w in workers]

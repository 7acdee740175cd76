"""The worker's side of the exchange: one implementation per way a step combines gradients.

A worker has one ``Exchange``; ``SGDWorker.step`` is its ``step``. Each
implementation owns its piece of the worker's graph and its step body, built
from the worker's ``StepRunner`` (feeds, timed runs, the checked apply):

- ``Alone``: one worker; its replicas' local mean is applied in the same
  session run that computes it.
- ``DriverAverage`` ("simple" with several workers): a step is two calls
  from the driver (``dsgd.strategies``): without ``means`` the worker
  computes and returns its gradients; with the driver's ``means`` it applies
  them.
- ``dsgd.ps_exchanges.PythonParameterServers`` and
  ``dsgd.ps_exchanges.OpsParameterServers`` ("ps" with several workers):
  the partitions go to the parameter servers through the worker's
  ``ParameterServerClient``, from Python after the gradients are computed,
  or from inside the graph with the op library (``dsgd.ops``).

Every exchange reports ``sent_bytes`` with its stats: what the worker
pushed in the step (to the servers in its partitions' wire form, see
``dsgd.wire``; to the driver; or nothing, alone).

Backup workers (a step that closes without the slowest workers) are built
in the parameter server's closing rule (``ParameterServer._closes``) and the
"ps" exchanges' ``begin`` (``dsgd.ps_exchanges``): a worker that finds its
step closed applies the mean without computing; one whose push finds it
closed gets the mean like any other.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsgd import worker_graph
from dsgd.step_runner import PreparedRun, StepRunner


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


class Alone(Exchange):
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


class DriverAverage(Exchange):
    """"simple": the driver gathers every worker's gradients and sends back their mean.

    The first call of a step returns ``(gradients, stats)``; the second,
    given ``means``, applies them and returns the stats kept from the first.
    """

    def __init__(self, runner: StepRunner):
        super().__init__(runner)
        self._stats: dict[str, float] = {}  # the step's stats, from its gradients' call to its apply

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> dict | tuple[list[np.ndarray], dict[str, float]]:
        runner = self.runner
        built = runner.built
        if means is None:
            out = runner.run({"means": built.local_means, "stats": runner.stats_fetches(fetch_stats)},
                             runner.feed_dict(), "compute")
            self._stats = runner.stats(out["stats"], sent_bytes=sum(m.nbytes for m in out["means"]))
            return out["means"], self._stats
        applied = runner.apply({"apply": built.apply_fed}, dict(zip(built.mean_inputs, means)))
        return {**self._stats, **runner.result({}, applied, sent_bytes=0)}


def without_servers(runner: StepRunner, kind: str) -> Exchange | None:
    """The worker's exchange of ``kind`` (``WorkerConfig.exchange``) if it needs no parameter server; None for "ps"."""
    if kind == "ps":
        return None  # made by SGDWorker.connect (dsgd.ps_exchanges), once the servers exist
    return Alone(runner) if kind == "alone" else DriverAverage(runner)

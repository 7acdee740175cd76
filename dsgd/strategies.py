"""The driver's half of each exchange: how the driver submits one step to the workers.

The workers' half is ``dsgd.exchanges``. For one worker alone and for "ps"
the workers' exchanges do everything and the driver only calls ``step`` on
each (``WorkersExchange``); for "simple" the driver gathers every worker's
gradients, averages them with the parameter servers' function
(``dsgd.arrays.average_into``, so both strategies agree bit for bit) and
sends the mean back (``DriverAverage``). The step ledger (``dsgd.ledger``)
submits every step, and every re-run after a failure, through one of them.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import ray

from dsgd.arrays import average_into


class Strategy:
    """Runs one step on every worker: ``submit`` returns refs of each worker's result dict."""

    def submit(self, workers: Sequence[Any], step_id: int, fetch_stats: bool) -> list[ray.ObjectRef]:
        raise NotImplementedError


class WorkersExchange(Strategy):
    """One worker alone, or "ps": each worker's exchange combines the gradients; the driver only submits."""

    def submit(self, workers, step_id, fetch_stats):
        return [w.step.remote(step_id, fetch_stats) for w in workers]


class DriverAverage(Strategy):
    """"simple": the driver gathers every worker's gradients, averages them, sends the mean back.

    ``call(refs, what)`` is the driver's bounded wait; ``span(name)`` its
    timeline span. The gather blocks; the applies are returned in flight.
    """

    def __init__(self, call: Callable[[list, str], list], span: Callable[[str], ContextManager]):
        self.call = call
        self.span = span

    def submit(self, workers, step_id, fetch_stats):
        with self.span("gather gradients"):
            results = self.call([w.step.remote(step_id, fetch_stats) for w in workers],
                                f"the workers' gradients of step {step_id}")
        with self.span("average"):
            per_worker = [grads for grads, _ in results]
            means = [average_into(np.empty_like(g), [grads[k] for grads in per_worker])
                     for k, g in enumerate(per_worker[0])]
            means_ref = ray.put(means)
        return [w.step.remote(step_id, fetch_stats, means_ref) for w in workers]


def make(exchange: str, call: Callable[[list, str], list], span: Callable[[str], ContextManager]) -> Strategy:
    """The driver's half of ``exchange`` (``Options.exchange``)."""
    return DriverAverage(call, span) if exchange == "driver" else WorkersExchange()

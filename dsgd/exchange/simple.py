"""The "simple" exchange: the driver gathers every worker's gradients and sends back their mean.

A step is two calls on each worker. The driver half (``SimpleDriver``)
calls ``step`` without means and gets each worker's gradients, averages
them with the parameter servers' function (``dsgd.wire.arrays.average_into``,
so both strategies agree bit for bit), and calls ``step`` again with the
mean, which the worker half (``SimpleWorker``) applies.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Sequence

import numpy as np
import ray

from dsgd.common.results import StepResult, Value
from dsgd.exchange.base import DriverHalf, Exchange
from dsgd.wire.arrays import average_into
from dsgd.worker.runtime import ReplicaRuntime


class SimpleWorker(Exchange):
    """"simple": the driver gathers every worker's gradients and sends back their mean.

    The first call of a step returns the gradients; the second, given
    ``means``, applies them and returns the step's result: the loss and
    metrics kept from the first, and the phases of both.
    """

    def __init__(self, runtime: ReplicaRuntime):
        super().__init__(runtime)
        self._values: dict[str, Value] = {}  # the step's loss and metrics, from its gradients' call to its apply
        self._sent_bytes = 0

    def step(self, step_id: int, fetch_stats: bool,
             means: Sequence[np.ndarray] | None = None) -> StepResult | list[np.ndarray]:
        runtime = self.runtime
        if means is None:
            local_means, self._values = runtime.compute(fetch_stats)
            self._sent_bytes = sum(m.nbytes for m in local_means)
            return local_means
        return runtime.result(self._values, runtime.apply(means), self._sent_bytes)


class SimpleDriver(DriverHalf):
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
            means = [average_into(np.empty_like(g), [grads[k] for grads in results])
                     for k, g in enumerate(results[0])]
            means_ref = ray.put(means)
        return [w.step.remote(step_id, fetch_stats, means_ref) for w in workers]

"""How the workers' gradients are combined: the strategies, and the one averaging function they share.

The driver picks one ``Strategy`` object (``make``) and submits every step,
and every re-run after a failure, through it.

``average_into(out, inputs)`` computes ``(inputs[0] + inputs[1] + ...) / n``
adding in worker order, block by block so each block stays in cache between
the adds and the divide. The driver's "simple" strategy and every parameter
server call it, so the two strategies agree bit for bit. No TensorFlow here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import ray

logger = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 18


def average_into(out: np.ndarray, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """``out[:] = mean of inputs`` (same flat size and dtype), summed in the order given."""
    n = len(inputs)
    if n == 0:
        raise ValueError("average_into needs at least one input")
    flat_out = out.reshape(-1)
    flat = [a.reshape(-1) for a in inputs]
    block = max(1, BLOCK_BYTES // max(1, out.dtype.itemsize))
    for lo in range(0, flat_out.size, block):
        hi = min(lo + block, flat_out.size)
        target = flat_out[lo:hi]
        if n == 1:
            np.copyto(target, flat[0][lo:hi])
        else:
            np.add(flat[0][lo:hi], flat[1][lo:hi], out=target)
            for a in flat[2:]:
                np.add(target, a[lo:hi], out=target)
        np.divide(target, n, out=target)
    return out


def warn_if_skipped(results: Sequence[dict]) -> None:
    """Log the reason when the workers' results say they skipped the step (nan_policy="skip")."""
    skipped = [r["skipped"] for r in results if isinstance(r, dict) and "skipped" in r]
    if skipped:
        logger.warning("skipped a step (nan_policy='skip'): %s", skipped[0])


class Strategy:
    """Runs one step on every worker: ``submit`` returns refs of each worker's result dict."""

    def submit(self, workers: Sequence[Any], step_id: int, fetch_stats: bool) -> list[ray.ObjectRef]:
        raise NotImplementedError


class OneWorker(Strategy):
    """A single worker averages its replicas locally and applies, in one session run."""

    def submit(self, workers, step_id, fetch_stats):
        return [workers[0].step_local.remote(fetch_stats)]


class ParameterServers(Strategy):
    """"ps": every worker exchanges its partitions with the parameter servers and applies."""

    def submit(self, workers, step_id, fetch_stats):
        return [w.step_ps.remote(step_id, fetch_stats) for w in workers]


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
            results = self.call([w.compute_gradients.remote(fetch_stats) for w in workers],
                                f"the workers' gradients of step {step_id}")
        with self.span("average"):
            per_worker = [grads for grads, _ in results]
            means = [average_into(np.empty_like(g), [grads[k] for grads in per_worker])
                     for k, g in enumerate(per_worker[0])]
            means_ref = ray.put(means)
        return [w.apply_gradients.remote(means_ref, stats) for w, (_, stats) in zip(workers, results)]


def make(strategy: str, num_workers: int, call: Callable[[list, str], list],
         span: Callable[[str], ContextManager]) -> Strategy:
    """The strategy object for ``DistributedSGD(strategy=...)``; one worker always runs alone."""
    if num_workers == 1:
        return OneWorker()
    return ParameterServers() if strategy == "ps" else DriverAverage(call, span)

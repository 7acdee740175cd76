"""The one place that maps an exchange's kind to its two halves.

A kind is how a step combines gradients: "alone" (one worker), "simple"
(the driver averages) or "ps" (the parameter servers average).
``Options.exchange`` picks it from the public ``strategy`` and the worker
count; everything else asks this module what the kind needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager

from dsgd.exchange.base import DriverHalf, EachWorkerSteps, Exchange

if TYPE_CHECKING:
    from dsgd.exchange.ps_client import ParameterServerClient
    from dsgd.worker.runtime import ReplicaRuntime

KINDS = ("alone", "simple", "ps")


def kind_of(strategy: str, num_workers: int) -> str:
    """The exchange a ``strategy`` ("ps" or "simple") uses with ``num_workers`` workers."""
    return "alone" if num_workers == 1 else strategy


def needs_servers(kind: str) -> bool:
    """Whether ``kind`` runs parameter servers (its worker half is made once they exist)."""
    return kind == "ps"


def driver_half(kind: str, call: Callable[[list, str], list], span: Callable[[str], ContextManager]) -> DriverHalf:
    """The driver's half of ``kind``: ``call(refs, what)`` is the driver's bounded wait, ``span`` its timeline."""
    if kind == "simple":
        from dsgd.exchange.simple import SimpleDriver
        return SimpleDriver(call, span)
    return EachWorkerSteps()


def worker_half(kind: str, runtime: ReplicaRuntime, client: ParameterServerClient | None = None) -> Exchange:
    """The worker's half of ``kind`` on ``runtime``; for "ps", ``client`` reaches the servers."""
    if kind == "alone":
        from dsgd.exchange.alone import AloneWorker
        return AloneWorker(runtime)
    if kind == "simple":
        from dsgd.exchange.simple import SimpleWorker
        return SimpleWorker(runtime)
    from dsgd.exchange.ps import ps_worker
    return ps_worker(runtime, client)

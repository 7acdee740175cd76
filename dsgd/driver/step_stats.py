"""What ``DistributedSGD.step(fetch_stats=True)`` returns, from the workers' results and the topology now."""

from __future__ import annotations

import logging

from dsgd.cluster.topology import Topology
from dsgd.common import results
from dsgd.common.results import StepResult
from dsgd.errors import WorkerMismatchError

logger = logging.getLogger(__name__)


def combine(step_id: int, per_worker: list[StepResult], topology: Topology,
            devices_per_worker: int) -> dict[str, float]:
    """The workers' values reduced once, as each declares (the loss and every metric: means over the replicas
    that computed the step; phase times and ``sent_bytes``: means over those workers), and ``num_replicas``;
    with backup workers, ``dropped_gradients``. ``per_worker`` is [] if recovery completed the step and none
    of the workers that computed it returned: its stats are lost (the loss is NaN)."""
    if per_worker:
        stats = _reduced(per_worker)
    else:
        logger.warning("step %d was completed by recovery on some workers; its stats are lost", step_id)
        stats = {"loss": float("nan")}
    backup = bool(per_worker) and all(r.backup is not None for r in per_worker)
    stats["num_replicas"] = float((topology.quorum if backup else topology.num_workers) * devices_per_worker)
    if backup:  # every worker done with the step knows which workers every partition averaged
        stats["dropped_gradients"] = float(topology.num_workers - len(per_worker[0].backup.kept))
    return stats


def _reduced(per_worker: list[StepResult]) -> dict[str, float]:
    """The workers' values, reduced once (a worker that caught up without computing adds nothing)."""
    try:
        return results.combine(per_worker).floats()
    except results.DifferentNames as e:
        first, other = e.names
        raise WorkerMismatchError(f"the workers' models report different metrics: {first} and {other}; every "
                                  "replica must report the same names (get_metrics, or the dict get_loss "
                                  "returns)") from None

"""What ``DistributedSGD.step(fetch_stats=True)`` returns, from the workers' results and the topology now."""

from __future__ import annotations

import logging

import numpy as np

from dsgd.cluster.topology import Topology
from dsgd.errors import WorkerMismatchError

logger = logging.getLogger(__name__)


def combine(step_id: int, per_worker: list[dict], topology: Topology, devices_per_worker: int) -> dict[str, float]:
    """The loss and every metric (means over the workers that computed the step), and ``num_replicas``; with
    backup workers, ``dropped_gradients``. ``per_worker`` is [] if recovery completed the step and none of
    the workers that computed it returned: its stats are lost (the loss is NaN)."""
    if not per_worker:
        logger.warning("step %d was completed by recovery on some workers; its stats are lost", step_id)
        per_worker = [{"loss": float("nan")}]
    per_worker, backup = _backup_stats(per_worker, topology, devices_per_worker)
    _check_same_metrics(per_worker)
    stats = {k: float(np.mean([s[k] for s in per_worker])) for k in per_worker[0] if k != "skipped"}
    stats.update(backup)
    stats.setdefault("num_replicas", float(topology.num_workers * devices_per_worker))
    return stats


def _check_same_metrics(per_worker: list[dict]) -> None:
    """Every worker's model reports the same metrics (a mean of some workers' metric would pass for all's)."""
    names = [sorted(k for k in s if k != "skipped") for s in per_worker]
    for other in names[1:]:
        if other != names[0]:
            raise WorkerMismatchError(f"the workers' models report different metrics: {names[0]} and {other}; "
                                      "every replica must report the same names (get_metrics, or the dict "
                                      "get_loss returns)")


def _backup_stats(per_worker: list[dict], topology: Topology,
                  devices_per_worker: int) -> tuple[list[dict], dict[str, float]]:
    """With backup workers: the results of the workers that computed the step (a worker behind applies the
    step's mean without computing it), and ``num_replicas`` and ``dropped_gradients``."""
    if not all("backup" in s for s in per_worker):
        return per_worker, {}
    infos = [s.pop("backup") for s in per_worker]
    computed = [s for s, info in zip(per_worker, infos) if info["computed"]]
    kept = infos[0]["kept"]  # every worker done with the step knows which workers every partition averaged
    return computed or per_worker, {
        "num_replicas": float(topology.quorum * devices_per_worker),
        "dropped_gradients": float(topology.num_workers - len(kept))}

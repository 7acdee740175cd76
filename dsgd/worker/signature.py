"""What a worker built, which the driver checks every worker agrees on."""

from __future__ import annotations

from dataclasses import dataclass

from dsgd.wire import partitions


@dataclass(frozen=True)
class WorkerSignature:
    """What a worker built; the driver checks all workers agree.

    ``exchange`` lists the exchange tensors in exchange order: the gradients
    of the trainable variables, then the values of the state variables
    averaged with them (batch-norm statistics).
    """

    weights: tuple[partitions.VarSpec, ...]
    exchange: tuple[partitions.VarSpec, ...]
    optimizer: tuple[partitions.VarSpec, ...]
    metrics: tuple[str, ...]
    runtime: str = "tf1"  # "tf1": a TF1 graph (dsgd.Model, tf_keras); "tf2": eager replicas (TF2Model, Keras 3)

"""The driver's bookkeeping behind ``DistributedSGD``: the steps in flight (``ledger``), recovery
(``recovery``), resizing (``resizer``), a step's timeline (``tracing``), its stats (``step_stats``),
checkpoints (``checkpoint``)."""

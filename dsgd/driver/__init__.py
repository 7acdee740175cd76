"""The driver's bookkeeping behind ``DistributedSGD``: the steps in flight, recovery and resizing (``ledger``), checkpoints (``checkpoint``)."""

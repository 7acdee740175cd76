"""The engine's live shape: how many workers run, how a step combines their gradients, how many it waits for.

``Options`` are the user's checked arguments and never change. The
``Topology`` is what a resize, an elastic shrink or an elastic start
changes: the cluster holds the one current value (``Cluster.topology``) and
replaces it in one place (``Cluster.set_size``); the step ledger, the
driver's half of the exchange and the step stats read it every step, and the
parameter servers are planned from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsgd.config import Options
from dsgd.exchange import registry


@dataclass(frozen=True)
class Topology:
    """The worker count now, and what follows from it."""

    strategy: str  # Options.strategy: "ps" or "simple"
    num_workers: int
    backups_asked: int  # Options.backup_workers: they apply only while the exchange is "ps"

    @classmethod
    def of(cls, options: Options) -> "Topology":
        """The topology ``options`` ask for (an elastic engine's maximum, until it starts)."""
        return cls(options.strategy, options.num_workers, options.backup_workers)

    def resized(self, num_workers: int) -> "Topology":
        return dataclasses.replace(self, num_workers=num_workers)

    @property
    def exchange(self) -> str:
        """How a step combines gradients (``dsgd.exchange.registry.KINDS``): "alone", "simple" or "ps"."""
        return registry.kind_of(self.strategy, self.num_workers)

    @property
    def uses_ps(self) -> bool:
        """Parameter servers run: "ps" with more than one worker."""
        return registry.needs_servers(self.exchange)

    @property
    def backup_workers(self) -> int:
        """The workers a step may close without (0 unless the parameter servers run)."""
        return self.backups_asked if self.uses_ps else 0

    @property
    def quorum(self) -> int:
        """The workers whose gradients a step averages: the first ``num_workers - backup_workers`` to push."""
        return self.num_workers - self.backup_workers

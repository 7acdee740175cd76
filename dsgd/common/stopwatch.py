"""Wall time of a call's named phases, in order: what a resize reports in its log line (``dsgd.driver.ledger``)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Phases:
    """Seconds per named phase, in the order first timed; a phase timed twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """'settle 0.01 s, start workers 1.20 s, ...'."""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())

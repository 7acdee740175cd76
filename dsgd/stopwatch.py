"""Wall time of a call's named phases, in order: what a resize reports in its log line (``dsgd.ledger``)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Phases:
    """Seconds per named phase, in the order first timed; a phase timed twice adds up.

    The phases follow one another (their sum is the call's time); work done
    meanwhile, within one of them, is noted apart (``meanwhile``).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.meanwhile: dict[str, tuple[str, float]] = {}  # name -> (the phase it ran within, seconds)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the body as phase ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def note(self, name: str, within: str, seconds: float) -> None:
        """Work ``name`` took ``seconds`` within phase ``within`` (not added to the total)."""
        self.meanwhile[name] = (within, seconds)

    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """'settle 0.01 s, build models 7.20 s (meanwhile: start servers 0.90 s), ...'."""
        parts = []
        for name, seconds in self.seconds.items():
            within = [f"{n} {s:.2f} s" for n, (w, s) in self.meanwhile.items() if w == name]
            parts.append(f"{name} {seconds:.2f} s" + (f" (meanwhile: {', '.join(within)})" if within else ""))
        return ", ".join(parts)

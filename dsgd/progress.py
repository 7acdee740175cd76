"""A dependency-free progress line: steps done, throughput, latest values, ETA.

On a terminal the line is redrawn in place (``\\r``); otherwise (a log file,
CI) a plain line is written every ``every`` steps and at the last step.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Mapping, TextIO

BAR_WIDTH = 20
REDRAW_INTERVAL_S = 0.1  # on a terminal, redraw at most this often (and at the last step)


def format_duration(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Progress of ``total`` steps, each handling some number of ``unit`` (e.g. samples).

    Usage::

        bar = Progress(400, unit="samples")
        for step in range(400):
            stats = sgd.step(fetch_stats=(step % 50 == 0))
            bar.update(samples=64, values={"loss": stats["loss"]} if stats else None)
        bar.close()
    """

    def __init__(self, total: int, *, unit: str = "samples", every: int = 50,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter):
        if total < 1 or every < 1:
            raise ValueError(f"total and every must be >= 1, got total={total}, every={every}")
        self.total, self.unit, self.every = total, unit, every
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.count = 0
        self.values: dict[str, float] = {}
        self._last_draw = float("-inf")
        self._drawn = False

    def update(self, steps: int = 1, samples: int = 0, values: Mapping[str, float] | None = None) -> None:
        """Record ``steps`` more steps that handled ``samples`` more units; ``values`` (e.g. loss)
        replace the ones shown until the next update that brings them."""
        self.done += steps
        self.count += samples
        if values:
            self.values.update(values)
        now = self.clock()
        finished = self.done >= self.total
        if self.interactive:
            if not (finished or now - self._last_draw >= REDRAW_INTERVAL_S):
                return
            self.stream.write("\r" + self.line(now) + "\x1b[K")  # \x1b[K: clear the rest of the old line
            self._last_draw, self._drawn = now, True
        elif finished or self.done % self.every == 0:
            self.stream.write(self.line(now) + "\n")
        else:
            return
        self.stream.flush()

    def line(self, now: float | None = None) -> str:
        """The current progress line, without line end."""
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * BAR_WIDTH)
        parts = [f"step {self.done}/{self.total}", f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}]",
                 f"{fraction:4.0%}"]
        if self.count:
            parts.append(f"{self.count / elapsed:.0f} {self.unit}/s")
        parts += [f"{name} {value:.4g}" for name, value in self.values.items()]
        if self.done < self.total:
            remaining = elapsed / self.done * (self.total - self.done) if self.done else None
            parts.append(f"ETA {format_duration(remaining) if remaining is not None else '?'}")
        else:
            parts.append(f"in {format_duration(elapsed)}")
        return "  ".join(parts)

    def close(self) -> None:
        """End the redrawn line on a terminal, so later output starts on a new line."""
        if self.interactive and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

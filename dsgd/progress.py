"""A training loop's progress, drawn by tqdm: steps done, throughput, latest values, ETA.

For your own loop around ``DistributedSGD.step`` (the MNIST example uses
it). It needs tqdm, the ``progress`` extra (``pip install 'dsgd[progress]'``);
``import dsgd`` does not import this module.

On a terminal, tqdm redraws one line in place. Elsewhere (a log file, CI)
the same line, in tqdm's format with ASCII bars, is written on its own line
every ``every`` steps and at the last step, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Mapping, TextIO

try:
    from tqdm import tqdm
except ModuleNotFoundError as e:  # an optional extra: say which
    raise ModuleNotFoundError("dsgd.progress draws with tqdm: pip install 'dsgd[progress]'", name=e.name) from e


class Progress:
    """Progress of ``total`` steps, each handling some number of ``unit`` (e.g. samples).

    Example:
        ```python
        from dsgd.progress import Progress

        bar = Progress(400, unit="samples")
        for step in range(400):
            stats = sgd.step(fetch_stats=(step % 50 == 0))
            bar.update(samples=64, values={"loss": stats["loss"]} if stats else None)
        bar.close()
        ```

    Args:
        total: the steps the loop will take (at least 1).
        unit: what ``update``'s ``samples`` counts, shown as ``<unit>/s``.
        every: off a terminal, write the line every this many steps.
        stream: where to draw; stderr by default.
        clock: the clock for throughput and ETA (for tests).

    Raises:
        ValueError: ``total`` or ``every`` is below 1.
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
        self._bar = (tqdm(total=total, unit="step", file=self.stream, dynamic_ncols=True, leave=True)
                     if self.interactive else None)

    def update(self, steps: int = 1, samples: int = 0, values: Mapping[str, float] | None = None) -> None:
        """Record ``steps`` more steps that handled ``samples`` more units; ``values`` (e.g. loss)
        replace the ones shown until the next update that brings them."""
        self.done += steps
        self.count += samples
        if values:
            self.values.update(values)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(self.clock() - self.start), refresh=False)
            self._bar.update(steps)  # tqdm redraws at most every 0.1 s
        elif self.done >= self.total or self.done % self.every == 0:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def _postfix(self, elapsed: float) -> str:
        parts = [f"{self.count / max(elapsed, 1e-9):.0f} {self.unit}/s"] if self.count else []
        return ", ".join(parts + [f"{name} {value:.4g}" for name, value in self.values.items()])

    def line(self, now: float | None = None) -> str:
        """The current progress line (tqdm's format, ASCII bar), without line end."""
        elapsed = (self.clock() if now is None else now) - self.start
        return tqdm.format_meter(min(self.done, self.total), self.total, elapsed, unit="step",
                                 postfix=self._postfix(elapsed), ascii=True)

    def close(self) -> None:
        """On a terminal, draw the final state and end the line, so later output starts on a new line."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(self.clock() - self.start), refresh=False)
            self._bar.close()
            self._bar = None

"""The arithmetic of a closed step: a partition's pushes averaged into its mean slot, or summed for a relay.

Pushes are added in worker order (``dsgd.wire.arrays``), so a mean is bit for
bit the same in every run and equals the "simple" strategy's. A compressed
partition is averaged in float32 and its mean rounded once into its 16-bit
slot; a relay sums its node's copies without dividing, into float32 if
compressed (``RelayedPartition.total``), and the partition's server divides by
the number of workers the pushes stand for.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dsgd.server.layout import Place
from dsgd.wire import arrays


def average(place: Place, step_id: int, inputs: Sequence[Sequence[np.ndarray]], workers: int) -> None:
    """Average the pushes ``inputs`` (each a list of segments; together they stand for ``workers`` workers) into
    ``step_id``'s mean slot."""
    partition = place.partition
    compressed = partition.wire_dtype != partition.dtype
    _segment_by_segment(arrays.average_rounded_into if compressed else arrays.average_into,
                        place.mean(step_id), place.segments, inputs, workers)


def average_span(place: Place, step_id: int, inputs: Sequence[Sequence[np.ndarray]], workers: int, start: int,
                 stop: int) -> None:
    """``average`` of elements ``[start, stop)`` of the partition only (a sum as the pushes arrive: every element
    is summed as ``average`` sums it, so the mean is the same bit for bit)."""
    partition = place.partition
    average_into = arrays.average_rounded_into if partition.wire_dtype != partition.dtype else arrays.average_into
    target = place.mean(step_id)
    for k, (first, size) in enumerate(place.segments):
        lo, hi = max(start, first), min(stop, first + size)
        if lo < hi:
            average_into(target[lo:hi], [pushed[k][lo - first:hi - first] for pushed in inputs], workers)


def add(target: np.ndarray, place: Place, inputs: Sequence[Sequence[np.ndarray]]) -> None:
    """Sum the pushes ``inputs`` into ``target`` (a relay's partial sum)."""
    _segment_by_segment(arrays.average_into, target, place.segments, inputs, 1)


def _segment_by_segment(average_into: Callable, target: np.ndarray, segments: Sequence[tuple[int, int]],
                        inputs: Sequence[Sequence[np.ndarray]], divisor: int) -> None:
    for k, (start, size) in enumerate(segments):
        average_into(target[start:start + size], [pushed[k] for pushed in inputs], divisor)

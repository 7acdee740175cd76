"""Step results: each value declares how it reduces, kept as an exact partial reduction, reduced once.

A worker's step result names its values (the loss, each metric, its phase
times, ``sent_bytes``), each a ``Value`` with its ``Reduction``. A mean is
kept as its total (an exact fraction of the floats summed) and count, so
results combine exactly and in any grouping: replicas inside a worker, then
workers on the driver, give the mean over every contribution, however many
each worker had, rounded once. An evaluation (``evaluate``) is reduced the
same way, once, from every replica's: ``Means`` of the model's own loss and
metrics over every row, or a Keras model's metric state
(``dsgd.integrations.metric_states.MetricState``). No TensorFlow here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Protocol, Sequence


class Reduction(enum.Enum):
    """How contributions to one value combine."""

    MEAN = "mean"  # over every contribution, each counted once: total / count


@dataclass(frozen=True)
class Value:
    """A partial reduction of one value: ``count`` contributions, the exact total of the finite ones and the sum
    of the others (NaN or an infinity; 0 if none), which IEEE sums alike in any order."""

    reduction: Reduction
    total: Fraction
    count: int
    nonfinite: float = 0.0

    @classmethod
    def mean(cls, contributions: Iterable[float]) -> Value:
        """The mean of ``contributions`` (e.g. one per replica, or this worker's one figure)."""
        values = [float(c) for c in contributions]
        finite = [Fraction(v) for v in values if math.isfinite(v)]
        return cls(Reduction.MEAN, sum(finite, Fraction(0)), len(values),
                   sum(v for v in values if not math.isfinite(v)))

    @classmethod
    def repeated(cls, value: float, times: int) -> Value:
        """``times`` contributions of ``value`` each (e.g. a batch's mean loss, once per row of the batch)."""
        if math.isfinite(value):
            return cls(Reduction.MEAN, Fraction(value) * times, times)
        return cls(Reduction.MEAN, Fraction(0), times, value)

    def combine(self, other: Value) -> Value:
        """This and ``other``, both partial reductions of one value, as one."""
        return Value(self.reduction, self.total + other.total, self.count + other.count,
                     self.nonfinite + other.nonfinite)

    def result(self) -> float:
        """The value the user sees."""
        return self.nonfinite if self.nonfinite else float(self.total / self.count)


@dataclass(frozen=True)
class Backup:
    """A step's outcome on one worker with backup workers: whether it computed the step (or caught up without),
    and which workers' gradients every partition averaged."""

    computed: bool
    kept: tuple[int, ...]


@dataclass(frozen=True)
class LocalState:
    """A worker's replicas' local state after its first ``applied_steps`` steps: variables each replica keeps to
    itself, exchanged with no one (a Keras model's metrics over an epoch), one flat array per replica, device
    order. The driver keeps each worker's latest, so a replacement for a lost worker starts from it."""

    applied_steps: int
    replicas: list


@dataclass
class StepResult:
    """One worker's step: its values (none if stats were not fetched, or if it caught up without computing),
    why its apply skipped the step (nan_policy "skip"), its backup outcome (with backup workers), and its
    replicas' local state after it (if they keep any)."""

    values: dict[str, Value] = field(default_factory=dict)
    skipped: str | None = None
    backup: Backup | None = None
    local_state: LocalState | None = None

    def floats(self) -> dict[str, float]:
        """Every value as the user sees it."""
        return {name: value.result() for name, value in self.values.items()}


class DifferentNames(ValueError):
    """Two results with values name different ones (``names``: both, sorted)."""

    def __init__(self, first: list[str], other: list[str]):
        super().__init__(f"step results name different values: {first} and {other}")
        self.names = first, other


def combine(results: Sequence[StepResult]) -> StepResult:
    """The values of ``results`` reduced as each declares; a result without values adds nothing. The first
    reason to skip is kept; backup outcomes are each worker's own and are not. Raises ``DifferentNames`` when two
    results with values name different ones."""
    combined: dict[str, Value] = {}
    skipped = next((r.skipped for r in results if r.skipped is not None), None)
    for result in results:
        if not result.values:
            continue
        if combined and sorted(combined) != sorted(result.values):
            raise DifferentNames(sorted(combined), sorted(result.values))
        combined = ({name: value.combine(result.values[name]) for name, value in combined.items()}
                    if combined else dict(result.values))
    return StepResult(combined, skipped)


class Evaluation(Protocol):
    """One replica's evaluation of its part of the input (``evaluate``), reduced with every other replica's once,
    on the driver."""

    @classmethod
    def reduce(cls, parts: Sequence[Evaluation]) -> Evaluation:
        """Every replica's evaluation (each of this type) as one: the evaluation of all their rows."""


@dataclass(frozen=True)
class Means:
    """An evaluation by the model's own loss and metrics: each one's mean over every row evaluated (a replica
    that evaluated no rows has none)."""

    values: dict[str, Value]

    @classmethod
    def reduce(cls, parts: Sequence[Means]) -> Means:
        return cls(combine([StepResult(part.values) for part in parts]).values)

    def logs(self) -> dict[str, float]:
        return {name: value.result() for name, value in self.values.items()}

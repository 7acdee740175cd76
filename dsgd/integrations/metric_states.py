"""Keras metrics across replicas: their state reduced as each variable declares, then read by Keras on the driver.

A Keras 3 metric keeps its state in variables (a ``Mean``'s total and
count, an ``AUC``'s confusion counts), each declaring how copies of it
combine (``Variable.aggregation``: "sum" for a metric's, unless it says
otherwise). Reducing every replica's state by that rule, then letting the
driver's copy of the metric compute ``result()`` from it, gives the metric
over every sample all the replicas saw: an AUC over the whole epoch, not
a mean of per-replica AUCs.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

State = list  # one array per variable of model.metrics_variables, in their order


def aggregations(model: Any) -> list[str]:
    """How each of ``model.metrics_variables`` combines across replicas."""
    return [getattr(v, "aggregation", "sum") or "none" for v in model.metrics_variables]


def reduce(states: Sequence[State], rules: Sequence[str]) -> State:
    """One state from several (replicas', or workers' each reduced from equally many replicas): per variable,
    the sum, the mean, or the first one's (for "none" and "only_first_replica")."""
    if not states:
        raise ValueError("no metric states to reduce")
    reduced = []
    for k, rule in enumerate(rules):
        values = [np.asarray(s[k]) for s in states]
        if rule == "sum":
            reduced.append(np.sum(values, axis=0).astype(values[0].dtype))
        elif rule == "mean":
            reduced.append(np.mean(values, axis=0).astype(values[0].dtype))
        else:
            reduced.append(values[0])
    return reduced


@dataclasses.dataclass(frozen=True)
class MetricState:
    """An evaluation by a compiled Keras model's metrics (``dsgd.common.results.Evaluation``): their variables'
    ``state``, each reduced across replicas by its rule in ``rules`` (``aggregations``)."""

    state: State
    rules: tuple[str, ...]

    @classmethod
    def of(cls, model: Any) -> MetricState:
        """``model``'s metric state now."""
        return cls([np.asarray(v.numpy()) for v in model.metrics_variables], tuple(aggregations(model)))

    @classmethod
    def reduce(cls, parts: Sequence[MetricState]) -> MetricState:
        return cls(reduce([part.state for part in parts], parts[0].rules), parts[0].rules)


def results(model: Any, state: State) -> dict[str, float | np.ndarray]:
    """Keras's own results (``model.get_metrics_result()``, as Python numbers) of ``state`` written into
    ``model``'s metrics: the logs ``fit`` and ``evaluate`` report."""
    variables = model.metrics_variables
    if len(variables) != len(state):
        raise ValueError(f"the replicas' models have {len(state)} metric variables, the driver's {len(variables)}: "
                         "build() must compile the same metrics every time it is called")
    read = _readers.get(model)
    if read is None:  # traced once per model: a few ms an epoch less than Keras's eager ops
        read = _readers[model] = tf.function(lambda values: _assign_and_read(model, values))
    return {name: _python(value) for name, value in read([np.asarray(s) for s in state]).items()}


_readers: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()


def _assign_and_read(model: Any, values: list) -> dict:
    for v, value in zip(model.metrics_variables, values):
        v.assign(value)
    return model.get_metrics_result()


def _python(value: Any) -> float | np.ndarray:
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array

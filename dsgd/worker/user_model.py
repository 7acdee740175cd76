"""Calling the user's model: its errors named, and what ``get_metrics()`` returns sorted.

Every call dsgd makes into a ``dsgd.Model`` goes through ``call_user``, so an
error names the method and the replica. ``get_metrics()`` is asked once the
graph is built and every variable initialized, so a model may evaluate its
metrics there (Ray 0.6's contract). Entries that are tensors of the graph
are fetched with each step's stats; entries that are numbers are the
model's own to report when the user calls ``get_metrics()`` and are not part
of the stats.
"""

from __future__ import annotations

import logging
import numbers
import traceback
from typing import Any

import numpy as np
import tensorflow as tf

from dsgd.errors import ModelCreatorError
from dsgd.model import Model

logger = logging.getLogger(__name__)


def ask_metrics(graph: tf.Graph, session: tf.compat.v1.Session, model: Model, worker_index: int,
                device_index: int) -> dict[str, tf.Tensor]:
    """The tensors among ``get_metrics()``'s entries; numbers the model evaluated itself are left out.

    Variables that ``get_metrics()`` creates (a ``tf.compat.v1.metrics``
    counter made there) are initialized like the local ones: per replica.
    """
    where = f"worker {worker_index}, device {device_index}"
    before = set(_all_variables(graph))
    metrics = call_user(model, "get_metrics", where)
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        raise ModelCreatorError(
            f"get_metrics() must return a dict of scalar tensors or numbers, got {type(metrics).__name__} "
            f"({_short_repr(metrics)}) on {where}")
    tensors, evaluated = {}, []
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ModelCreatorError(f"get_metrics() must return a dict keyed by metric name (str), got key {name!r} on {where}")
        if isinstance(value, (tf.Tensor, tf.Variable)):
            if value.graph is not graph:
                raise ModelCreatorError(f"get_metrics() entry {name!r} is a tensor of another graph, not the replica's, on {where}")
            tensors[name] = value
        elif _is_number(value):
            evaluated.append(name)
        else:
            raise ModelCreatorError(
                f"get_metrics() entry {name!r} must be a scalar tensor of the replica's graph or a number "
                f"the model evaluated, got {type(value).__name__} ({_short_repr(value)}) on {where}")
    if evaluated and (worker_index, device_index) == (0, 0):
        logger.info("get_metrics() evaluates %s itself: not part of the step's stats; "
                    "read them with foreach_model(lambda m: m.get_metrics())", ", ".join(evaluated))
    created = [v for v in _all_variables(graph) if v not in before]
    if created:
        session.run(tf.compat.v1.variables_initializer(created))
    return tensors


def _all_variables(graph: tf.Graph) -> list:
    return (graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
            + graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES))


def _is_number(value: Any) -> bool:
    """A Python or numpy number, or a numpy array of them (what ``Tensor.eval()`` returns)."""
    if isinstance(value, (bool, numbers.Number, np.number, np.bool_)):
        return True
    return isinstance(value, np.ndarray) and (np.issubdtype(value.dtype, np.number) or value.dtype == bool)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def call_user(model: Model, method: str, where: str):
    """``model.<method>()``, its error turned into one that names the method and the replica."""
    try:
        return getattr(model, method)()
    except Exception as e:
        raise ModelCreatorError(
            f"{type(model).__name__}.{method}() raised on {where}: "
            f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from e

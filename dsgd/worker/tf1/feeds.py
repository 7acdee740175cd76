"""A TF1 step's feeds: every replica's ``get_feed_dict()``, checked to feed the worker's graph."""

from __future__ import annotations

from typing import Callable, ContextManager, Sequence

import tensorflow as tf

from dsgd.errors import DSGDError
from dsgd.worker import user_model
from dsgd.worker.tf1.worker_graph import Replica


def feed_dict(replicas: Sequence[Replica], graph: tf.Graph, context: Callable[[], ContextManager], worker_index: int,
              each_replica: Callable[[Callable, Sequence[Replica]], list]) -> dict:
    """Every replica's ``get_feed_dict()``, checked and merged; each asked inside ``context()`` (the worker's graph
    and session as the defaults), through ``each_replica`` (``ReplicaRuntime.each_replica``)."""
    def replica_feed(replica: Replica) -> dict:
        where = f"worker {worker_index}, device {replica.index}"
        with context():
            part = user_model.call_user(replica.model, "get_feed_dict", where) or {}
            if not isinstance(part, dict):
                raise DSGDError(f"get_feed_dict() must return a dict, got {type(part).__name__} on {where}")
            for key in part:
                _check_feed_key(graph, key, where)
        return part

    feed: dict = {}
    for part in each_replica(replica_feed, replicas):
        feed.update(part)
    return feed


def _check_feed_key(graph: tf.Graph, key, where: str) -> None:
    if isinstance(key, (tf.Tensor, tf.Operation)) and key.graph is graph:
        return
    if isinstance(key, str):
        try:
            graph.as_graph_element(key)
            return
        except (KeyError, ValueError) as e:
            raise DSGDError(f"get_feed_dict() on {where} names {key!r}, which is not a tensor of the model's graph: {e}") from e
    raise DSGDError(
        f"get_feed_dict() on {where} returned key {key!r}, which is not a tensor of the replica's graph; "
        "use placeholders created in the model's __init__")

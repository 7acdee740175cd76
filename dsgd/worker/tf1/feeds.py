"""A TF1 step's feeds: every replica's ``get_feed_dict()``, checked to feed the worker's graph."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ContextManager, Sequence

import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.errors import DSGDError
from dsgd.worker import user_model
from dsgd.worker.tf1.worker_graph import Replica


class Feeder:
    """Asks every replica for its next batch; concurrently with Ray Data input (``config.feed_concurrently``)."""

    def __init__(self, config: WorkerConfig):
        # One thread per replica to ask for batches, with Ray Data input: a
        # streaming split starts an epoch only once every replica has asked.
        self._pool = (ThreadPoolExecutor(config.devices_per_worker, thread_name_prefix="dsgd-feed")
                      if config.feed_concurrently and config.devices_per_worker > 1 else None)

    def feed_dict(self, replicas: Sequence[Replica], graph: tf.Graph, context: Callable[[], ContextManager],
                  worker_index: int) -> dict:
        """Every replica's feeds, merged; each asked inside ``context()`` (the worker's graph and session as the
        defaults), in any thread."""
        def replica_feed(replica: Replica) -> dict:
            where = f"worker {worker_index}, device {replica.index}"
            with context():
                part = user_model.call_user(replica.model, "get_feed_dict", where) or {}
                if not isinstance(part, dict):
                    raise DSGDError(f"get_feed_dict() must return a dict, got {type(part).__name__} on {where}")
                for key in part:
                    _check_feed_key(graph, key, where)
            return part

        parts = self._pool.map(replica_feed, replicas) if self._pool else map(replica_feed, replicas)
        feed: dict = {}
        for part in parts:
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

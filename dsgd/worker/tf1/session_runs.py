"""Session runs of a worker's TF1 graph: traced while a timeline is recorded, or planned ahead.

TensorFlow plans a run the first time it sees its fetches and feeds
(optimizes and partitions the graph: seconds for a large model). ``plan``
does that ahead of time, off the step's path (a resize has the survivors
plan the new exchange's step while a new worker builds its model): a
``PreparedRun``, TensorFlow's callable (``Session::MakeCallable``), which
``run`` takes in place of ``session.run`` when the feeds are the planned ones.
"""

from __future__ import annotations

from typing import ContextManager, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.client import session as session_lib

from dsgd.common import timeline


def run(session: tf.compat.v1.Session, fetches, feed_dict: dict, timed: ContextManager,
        trace: timeline.Recorder | None, prepared: PreparedRun | None = None):
    """``session.run`` inside ``timed``; while tracing (``trace``), with TensorFlow's per-op step stats.

    ``prepared``: ``plan``'s run of these ``fetches``, used instead if it
    was planned for the tensors ``feed_dict`` feeds (and no trace is recorded).
    """
    if prepared is not None and not trace and prepared.feed_names == names_of(session.graph, feed_dict):
        with timed:
            return prepared(feed_dict)
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE) if trace else None
    metadata = tf.compat.v1.RunMetadata() if trace else None
    try:
        with timed:
            return session.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
    finally:
        if trace:
            trace.events += timeline.from_step_stats(metadata.step_stats)


def plan(session: tf.compat.v1.Session, fetches, feed_names: Sequence[str]) -> PreparedRun:
    """Have TensorFlow plan a run of ``fetches`` fed the tensors ``feed_names`` now; for ``run``'s ``prepared``."""
    graph = session.graph
    feeds = [graph.as_graph_element(name) for name in sorted(feed_names)]
    handler = session_lib._FetchHandler(graph, fetches, {})
    options = config_pb2.CallableOptions(feed=[t.name for t in feeds],
                                         fetch=[t.name for t in handler.fetches()],
                                         target=[op.name for op in handler.targets()])
    return PreparedRun(session, feeds, handler, session._make_callable_from_options(options))


def names_of(graph: tf.Graph, feed_dict: dict) -> tuple[str, ...]:
    """The names of the tensors ``feed_dict`` feeds (its keys are tensors or names), sorted."""
    return tuple(sorted(_tensor_name(graph, key) for key in feed_dict))


class PreparedRun:
    """A run TensorFlow planned ahead (``plan``); called with a feed dict, it returns what ``session.run``
    would."""

    def __init__(self, session: tf.compat.v1.Session, feeds: list[tf.Tensor], handler, call):
        self.session = session
        self.feed_names = tuple(t.name for t in feeds)  # the order ``call`` takes their values in
        self.handler = handler  # the fetches' structure
        self.call = call
        self._dtypes = [t.dtype.as_numpy_dtype for t in feeds]

    def __call__(self, feed_dict: dict):
        by_name = {_tensor_name(self.session.graph, key): value for key, value in feed_dict.items()}
        values = [np.asarray(by_name[name], dtype=dtype) for name, dtype in zip(self.feed_names, self._dtypes)]
        return self.handler.build_results(self.session, self.call(*values))


def _tensor_name(graph: tf.Graph, key) -> str:
    """The name of the tensor a feed dict's ``key`` (a tensor or a name) feeds."""
    return key.name if isinstance(key, tf.Tensor) else graph.as_graph_element(key).name

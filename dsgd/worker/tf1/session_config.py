"""The worker's TensorFlow session settings: one device per replica, the worker's CPUs as threads."""

from __future__ import annotations

import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.worker.runtime import thread_counts


def session_config(config: WorkerConfig) -> tf.compat.v1.ConfigProto:
    """A session with one device per replica and the worker's CPUs as threads."""
    intra_op, inter_op = thread_counts(config)
    proto = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra_op,
        inter_op_parallelism_threads=inter_op,
        allow_soft_placement=False)
    # Place (and optimize) only the subgraph a run needs, not the whole graph: a worker's graph
    # holds ops no single run uses (state assigns, other exchanges' applies), and without this
    # the first run of every new subgraph (initializer, weights, step) costs in proportion to
    # the whole graph (seconds at 2000 variables). TensorFlow keeps stateful ops' placement
    # fixed across subgraphs.
    proto.graph_options.place_pruned_graph = True
    # Threads with nothing to run sleep at once instead of spinning: a worker shares its node's cores
    # with the parameter servers (which reserve no CPU), the other workers and its own receives, which
    # wait in threads of the pool. On the 2-core machine, 2-worker "ps" steps took 5-7 % less time
    # (MNIST 5.02 -> 4.69 ms, 4 M floats in 300 variables 28.8 -> 27.4 ms, ResNet-101 at 64 px
    # 26.0 -> 26.7 images/s; docs/performance.md).
    proto.experimental.disable_thread_spinning = True
    if config.gpu:
        proto.gpu_options.allow_growth = True
    else:
        proto.device_count["CPU"] = config.devices_per_worker
        proto.device_count["GPU"] = 0
    return proto

"""The worker's "ps" exchanges: partitions to the parameter servers and their means back.

Both send every partition of the worker's local mean to its server through
the worker's ``ParameterServerClient`` and apply the means it receives (see
``dsgd.exchange.base`` for the protocol and where later features plug in):

- ``PsWorkerPython`` (``use_ops=False``): after the session run that
  computes the gradients, packs and pushes each partition from Python, reads
  the means, then applies them in a second run.
- ``PsWorkerOps`` (the op library, ``dsgd.ops``): one session run.
  Each partition is sent from inside the graph as soon as its gradients
  exist, while back-propagation of earlier layers goes on, and received as
  soon as it is sent; means reach TensorFlow without a copy.

With backup workers (``WorkerConfig.backup_workers``), a step starts by
asking the servers which of its partitions are closed already
(``ParameterServerClient.begin``): if all are, the worker does not compute
the step, it applies their means (``PsWorker.step``). Its result then
says whether it computed and which workers every partition averaged.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import numpy as np
import tensorflow as tf

from dsgd.wire import partitions
from dsgd.common import timeline
from dsgd.worker.tf1 import worker_graph
from dsgd.exchange.base import Exchange
from dsgd.exchange.ps_client import EXCHANGE_TRACK, ParameterServerClient
from dsgd.worker.tf1.step_runner import StepRunner


class PsWorker(Exchange):
    """A "ps" exchange: the step's body is ``_compute``; with backup workers a step closed without this worker
    is caught up instead."""

    def __init__(self, runner: StepRunner, client: ParameterServerClient):
        super().__init__(runner)
        self.client = client
        self.backup = runner.config.backup_workers > 0

    def step(self, step_id: int, fetch_stats: bool, means: Sequence[np.ndarray] | None = None) -> dict:
        if not self.backup:
            return self._compute(step_id, fetch_stats)
        closed = self.client.begin(step_id)
        computed = len(closed) < len(self.client.layout)
        if computed:
            result = self._compute(step_id, fetch_stats)
        else:
            with self.runner.phase("catch up"):
                partition_means = [self.client.read(partition, step_id, closed[partition.index]) for partition in self.client.layout]
            result = self.runner.result({}, self._apply(partition_means), sent_bytes=0)
        result["backup"] = {"computed": computed, "kept": self.client.kept()}
        return result

    def _compute(self, step_id: int, fetch_stats: bool) -> dict:
        raise NotImplementedError

    def _apply(self, partition_means: Sequence[np.ndarray]) -> dict:
        """Apply the step's means, one per partition, through the fed apply."""
        built = self.runner.built
        global_means = partitions.unpack(partition_means, self.client.layout, built.signature.exchange)
        return self.runner.apply({"apply": built.apply_fed}, dict(zip(built.mean_inputs, global_means)))


class PsWorkerPython(PsWorker):
    """Compute, push the partitions from Python, receive their means, apply."""

    def _compute(self, step_id: int, fetch_stats: bool) -> dict:
        runner, client = self.runner, self.client
        built = runner.built
        out = runner.run({"means": built.local_means, "stats": runner.stats_fetches(fetch_stats)},
                         runner.feed_dict(), "compute")
        try:
            with runner.phase("pack and send"):
                for partition in client.layout:
                    client.send_gradients(partition, step_id, out["means"], runner.trace)
            with runner.phase("receive"):
                partition_means = [client.receive(partition, step_id, runner.trace) for partition in client.layout]
        except BaseException:
            client.forget_pushes()
            raise
        return runner.result(out["stats"], self._apply(partition_means), client.sent_bytes)


class PsWorkerOps(PsWorker):
    """One session run: compute, send, receive and apply all happen in the graph."""

    def __init__(self, runner: StepRunner, client: ParameterServerClient):
        super().__init__(runner, client)
        self._callback_error: BaseException | None = None  # TensorFlow wraps a callback's error; kept here
        with runner.default_session():
            self.step_input, self.apply = self._build()

    def _build(self) -> tuple[tf.Tensor, tf.Operation]:
        """The pipelined exchange, inside the graph (see dsgd/ops); the step id's placeholder and the apply.

        Sends run in layout order (each after the previous one) and receive
        k waits for send k, so a worker blocks only on partitions that every
        worker with a longer run of sends has already sent: whichever worker
        has sent the least always gets its means, and no thread budget can
        deadlock. The apply runs once every partition has arrived and passed its non-finite check (one per
        partition, ``worker_graph.finite_partitions``).
        """
        from dsgd import ops

        built, layout = self.runner.built, self.client.layout
        step_input = tf.compat.v1.placeholder(tf.int64, [], name="step_id")
        received, previous = [], []
        for partition in layout:
            with tf.control_dependencies(previous):
                sent = ops.build_send(built.local_means, partition, self._send, [step_input])
            with tf.control_dependencies([sent]):
                received.append(ops.receive_partition(functools.partial(self._receive, partition), partition, [step_input]))
            previous = [sent]
        exchange, config = built.signature.exchange, self.runner.config
        means = ops.unpack(received, layout, exchange)
        checks = worker_graph.finite_partitions(received, layout, exchange, len(built.replicas[0].train_vars), config)
        return step_input, worker_graph.build_apply(built, [means] * len(built.replicas), config, checks)

    @contextlib.contextmanager
    def _callback(self, span: str):
        """The body of a graph callback: traced, and its error kept for ``step`` (TF wraps it)."""
        try:
            with timeline.maybe_span(self.runner.trace, span, EXCHANGE_TRACK):
                yield
        except BaseException as e:
            self._callback_error = e
            raise

    def _send(self, partition: partitions.Partition, arrays: list[np.ndarray], step: np.ndarray) -> None:
        with self._callback(f"send partition {partition.index}"):
            self.client.send(partition, int(step), arrays, self.runner.trace)

    def _receive(self, partition: partitions.Partition, step: np.ndarray) -> np.ndarray:
        with self._callback(f"receive partition {partition.index}"):
            return self.client.receive(partition, int(step), self.runner.trace)

    def _step_fetches(self, fetch_stats: bool) -> dict:
        return {"apply": self.apply, "stats": self.runner.stats_fetches(fetch_stats)}

    def _own_feeds(self) -> list[str]:
        return [self.step_input.name]

    def _compute(self, step_id: int, fetch_stats: bool) -> dict:
        from dsgd import ops

        runner = self.runner
        feed = runner.feed_dict()
        feed[self.step_input] = step_id
        self._callback_error = None
        try:
            out = runner.apply(self._step_fetches(fetch_stats), feed, "compute, exchange and apply",
                               self._prepared.get(fetch_stats))
        except tf.errors.OpError:
            ops.discard_unclaimed()
            self.client.forget_pushes()
            if self._callback_error is not None:
                raise self._callback_error from None  # e.g. a dead parameter server: the driver recovers
            raise
        finally:
            ops.drain_released()
        return runner.result(out.get("stats", {}), out, self.client.sent_bytes)


def ps_worker(runner: StepRunner, client: ParameterServerClient) -> Exchange:
    """The worker's "ps" exchange: through the op library if the driver chose it (``use_ops``), else Python."""
    if runner.config.use_ops:
        return PsWorkerOps(runner, client)
    return PsWorkerPython(runner, client)

"""The worker's "ps" exchanges: partitions to the parameter servers and their means back.

Both send every partition of the worker's local mean to its server through
the worker's ``ParameterServerClient`` and apply the means it receives (see
``dsgd.exchange.base`` for the protocol and where later features plug in):

- ``PsWorkerPython`` (``use_ops=False``): after the runtime computes the
  gradients, hands every partition over, collects the means, then has the
  runtime apply them (two session runs in TF1).
- ``PsWorkerOps`` (the op library, ``dsgd.ops``): one fused step, the
  exchange built into it (``PsWorkerOps.build``). Each partition is handed
  over from inside the step as soon as its gradients exist, while
  back-propagation of earlier layers goes on; means reach TensorFlow
  without a copy.

Neither pushes anything itself: each hands its partitions to the client's
send scheduler (``dsgd.transport.scheduler``) and picks their means up, so
the order and pace of the pushes are the scheduler's policy's
(``dsgd.transport.pacing``), not built into the step, and a new push order
(a worker or server moved node) rebuilds nothing.

With backup workers (``WorkerConfig.backup_workers``), a step starts by
asking the servers which of its partitions are closed already
(``ParameterServerClient.begin``): if all are, the worker does not compute
the step, it applies their means (``PsWorker.step``). Its result then
says whether it computed and which workers every partition averaged. With
Ray Data input it still reads its replicas' batches, and drops them: a
split starts an epoch only once every replica has read its own, so a worker
that skipped batches would hold the others at the next epoch's start.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import numpy as np

from dsgd.common import timeline
from dsgd.common.results import Backup, StepResult
from dsgd.exchange.base import Exchange
from dsgd.exchange.ps_client import EXCHANGE_TRACK, ParameterServerClient
from dsgd.wire import partitions
from dsgd.worker.runtime import RECEIVE_THREADS, ReplicaRuntime


class PsWorker(Exchange):
    """A "ps" exchange: the step's body is ``_compute``; with backup workers a step closed without this worker
    is caught up instead."""

    def __init__(self, runtime: ReplicaRuntime, client: ParameterServerClient):
        super().__init__(runtime)
        self.client = client
        self.backup = runtime.config.backup_workers > 0

    def step(self, step_id: int, fetch_stats: bool, means: Sequence[np.ndarray] | None = None) -> StepResult:
        if not self.backup:
            return self._compute(step_id, fetch_stats)
        closed = self.client.begin(step_id)
        computed = len(closed) < len(self.client.layout)
        if computed:
            result = self._compute(step_id, fetch_stats)
        else:
            if self.runtime.config.feed_concurrently:  # Ray Data input: this worker's splits keep up with the others'
                self.runtime.drop_batches()
            with self.runtime.phase("catch up"):
                partition_means = [self.client.read(partition, step_id, closed[partition.index])
                                   for partition in self.client.layout]
            result = self.runtime.result({}, self._apply(partition_means), sent_bytes=0)
        result.backup = Backup(computed, tuple(self.client.kept()))
        return result

    def _compute(self, step_id: int, fetch_stats: bool) -> StepResult:
        raise NotImplementedError

    def _apply(self, partition_means: Sequence[np.ndarray]) -> dict:
        """Apply the step's means, one per partition, through the runtime's checked apply."""
        global_means = partitions.unpack(partition_means, self.client.layout, self.runtime.signature.exchange)
        return self.runtime.apply(global_means)


class PsWorkerPython(PsWorker):
    """Compute, hand the partitions over from Python, collect their means, apply."""

    def _compute(self, step_id: int, fetch_stats: bool) -> StepResult:
        runtime, client = self.runtime, self.client
        local_means, stats = runtime.compute(fetch_stats)
        try:
            with runtime.phase("pack and send"):  # the scheduler's threads pack and push what is handed over
                for partition in client.layout:
                    client.hand_gradients(partition, step_id, local_means, runtime.trace)
            with runtime.phase("receive"):
                partition_means = [client.collect(partition, step_id, runtime.trace) for partition in client.layout]
        except BaseException:
            client.forget_pushes()
            raise
        return runtime.result(stats, self._apply(partition_means), client.sent_bytes)


class PsWorkerOps(PsWorker):
    """One fused step: compute, hand over, receive and apply (one session run in TF1)."""

    def __init__(self, runtime: ReplicaRuntime, client: ParameterServerClient):
        super().__init__(runtime, client)
        self._callback_error: BaseException | None = None  # TensorFlow wraps a callback's error; kept here
        self.fused = runtime.fused_step(self.build)

    def build(self, local_means: Sequence[Any], step_id: Any) -> tuple[list[Any], list[Any]]:
        """The pipelined exchange of ``local_means`` (tensors) in step ``step_id`` (an int64 scalar tensor), built
        into the runtime's step (a TF1 graph, or traced in a tf.function; see dsgd/ops): the global means (one
        tensor per exchange tensor) and their checks.

        Each partition is handed to the client's send scheduler as soon as its
        gradients exist, and the hand-over returns at once, so no send waits
        for another and none holds a thread; partition j's receive waits for
        its own hand-over, in layout order, at most ``RECEIVE_THREADS`` at
        once (receive k also waits for receive k - ``RECEIVE_THREADS``). The
        apply runs once every partition has arrived and passed its non-finite
        check (one per partition, ``finite_partitions``).
        """
        import tensorflow as tf  # only the op path builds TensorFlow ops; the exchange's logic needs none

        from dsgd import ops
        from dsgd.worker.finite_checks import finite_partitions

        layout, runtime = self.client.layout, self.runtime
        received: list[Any] = []  # the receives built, in layout order
        for partition in layout:
            handed = ops.build_send(local_means, partition, self._hand, [step_id])
            earlier = [received[-RECEIVE_THREADS]] if len(received) >= RECEIVE_THREADS else []
            with tf.control_dependencies([handed] + earlier):
                received.append(ops.receive_partition(functools.partial(self._receive, partition), partition,
                                                      [step_id]))
        exchange = runtime.signature.exchange
        means = ops.unpack(received, layout, exchange)
        return means, finite_partitions(received, layout, exchange, runtime.trainable_count, runtime.config)

    @contextlib.contextmanager
    def _callback(self, span: str):
        """The body of a graph callback: traced, and its error kept for ``step`` (TF wraps it)."""
        try:
            with timeline.maybe_span(self.runtime.trace, span, EXCHANGE_TRACK):
                yield
        except BaseException as e:
            self._callback_error = e
            raise

    def _hand(self, partition: partitions.Partition, arrays: list[np.ndarray], step: np.ndarray) -> None:
        """Hand the partition to the send scheduler; ``arrays`` own their tensors' memory, so they outlive the
        call unchanged (TensorFlow gives a numpy function views that hold a reference to each tensor)."""
        with self._callback(f"hand partition {partition.index} over"):
            self.client.hand(partition, int(step), arrays, self.runtime.trace)

    def _receive(self, partition: partitions.Partition, step: np.ndarray) -> np.ndarray:
        with self._callback(f"receive partition {partition.index}"):
            return self.client.collect(partition, int(step), self.runtime.trace)

    def _compute(self, step_id: int, fetch_stats: bool) -> StepResult:
        import tensorflow as tf

        from dsgd import ops

        self._callback_error = None
        try:
            stats, applied = self.fused.run(step_id, fetch_stats)
        except tf.errors.OpError:
            ops.discard_unclaimed()
            self.client.forget_pushes()
            if self._callback_error is not None:
                raise self._callback_error from None  # e.g. a dead parameter server: the driver recovers
            raise
        finally:
            ops.drain_released()
        return self.runtime.result(stats, applied, self.client.sent_bytes)


def ps_worker(runtime: ReplicaRuntime, client: ParameterServerClient) -> Exchange:
    """The worker's "ps" exchange: through the op library if the driver chose it (``use_ops``), else Python."""
    if runtime.config.use_ops:
        return PsWorkerOps(runtime, client)
    return PsWorkerPython(runtime, client)

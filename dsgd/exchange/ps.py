"""The worker's "ps" exchanges: partitions to the parameter servers and their means back.

Both send every partition of the worker's local mean to its server through
the worker's ``ParameterServerClient`` and apply the means it receives (see
``dsgd.exchange.base`` for the protocol and where later features plug in):

- ``PsWorkerPython`` (``use_ops=False``): after the runtime computes the
  gradients, packs and pushes each partition from Python, reads the means,
  then has the runtime apply them (two session runs in TF1).
- ``PsWorkerOps`` (the op library, ``dsgd.ops``): one fused step, the
  exchange built into it (``PsWorkerOps.build``). Each partition is sent
  from inside the step as soon as its gradients exist, while
  back-propagation of earlier layers goes on, and received as soon as it is
  sent; means reach TensorFlow without a copy.

With backup workers (``WorkerConfig.backup_workers``), a step starts by
asking the servers which of its partitions are closed already
(``ParameterServerClient.begin``): if all are, the worker does not compute
the step, it applies their means (``PsWorker.step``). Its result then
says whether it computed and which workers every partition averaged. With
Ray Data input it still reads its replicas' batches, and drops them: a
split starts an epoch only once every replica has read its own, so a worker
that skipped batches would hold the others at the next epoch's start.

With a send schedule (``ParameterServerClient.scheduled``), both only hand
each partition to the client's send scheduler and pick its mean up: the
order and pace of the pushes are the scheduler's, not built into the step,
so a new push order (a worker or server moved node) rebuilds nothing.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
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
    """Compute, push the partitions from Python, receive their means, apply."""

    def _compute(self, step_id: int, fetch_stats: bool) -> StepResult:
        runtime, client = self.runtime, self.client
        local_means, stats = runtime.compute(fetch_stats)
        send, receive = ((client.hand_gradients, client.collect) if client.scheduled else
                         (client.send_gradients, client.receive))
        try:
            with runtime.phase("pack and send"):
                for j in itertools.chain(*client.rounds):
                    send(client.layout[j], step_id, local_means, runtime.trace)
            with runtime.phase("receive"):
                partition_means = [receive(partition, step_id, runtime.trace) for partition in client.layout]
        except BaseException:
            client.forget_pushes()
            raise
        return runtime.result(stats, self._apply(partition_means), client.sent_bytes)


class PsWorkerOps(PsWorker):
    """One fused step: compute, send, receive and apply (one session run in TF1)."""

    def __init__(self, runtime: ReplicaRuntime, client: ParameterServerClient):
        super().__init__(runtime, client)
        self._callback_error: BaseException | None = None  # TensorFlow wraps a callback's error; kept here
        self.fused = runtime.fused_step(self.build)

    def build(self, local_means: Sequence[Any], step_id: Any) -> tuple[list[Any], list[Any]]:
        """The pipelined exchange of ``local_means`` (tensors) in step ``step_id`` (an int64 scalar tensor), built
        into the runtime's step (a TF1 graph, or traced in a tf.function; see dsgd/ops): the global means (one
        tensor per exchange tensor) and their checks.

        Sends run one after another in the client's rounds
        (``ParameterServerClient.rounds``: the same partitions in every
        worker's round r, in an order of the worker's own), and a round's
        receives wait for its last send; at most ``RECEIVE_THREADS`` receives
        wait at once (receive k also waits for receive k - RECEIVE_THREADS),
        so the sends always have threads. A worker thus waits only for
        partitions of rounds it has sent whole, and which every worker that
        has sent at least as many partitions has sent whole too: whichever
        worker has sent the least always gets its means, and no thread budget
        can deadlock. With a send schedule, each send only hands its partition
        to the scheduler, as soon as its gradients exist, and returns, so no
        send waits for another and none holds a thread; partition j's receive
        waits for its own hand-over, in layout order, at most
        ``RECEIVE_THREADS`` at once. The apply runs once every partition has
        arrived and passed its non-finite check (one per partition,
        ``finite_partitions``).
        """
        import tensorflow as tf  # only the op path builds TensorFlow ops; the exchange's logic needs none

        from dsgd import ops
        from dsgd.worker.finite_checks import finite_partitions

        layout, runtime = self.client.layout, self.runtime
        received: list[Any] = [None] * len(layout)
        receives: list[Any] = []  # the receives built, in order
        if self.client.scheduled:
            rounds: list[list[int]] = [list(range(len(layout)))]
            sent = {j: [ops.build_send(local_means, layout[j], self._hand, [step_id])] for j in rounds[0]}
        else:
            rounds, sent, last_sent = self.client.rounds, {}, []
            for in_round in rounds:
                for j in in_round:
                    with tf.control_dependencies(last_sent):
                        last_sent = [ops.build_send(local_means, layout[j], self._send, [step_id])]
                sent.update(dict.fromkeys(in_round, last_sent))
        for in_round in rounds:
            for j in in_round:
                earlier = [receives[-RECEIVE_THREADS]] if len(receives) >= RECEIVE_THREADS else []
                with tf.control_dependencies(sent[j] + earlier):
                    received[j] = ops.receive_partition(functools.partial(self._receive, layout[j]), layout[j],
                                                        [step_id])
                receives.append(received[j])
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

    def _send(self, partition: partitions.Partition, arrays: list[np.ndarray], step: np.ndarray) -> None:
        with self._callback(f"send partition {partition.index}"):
            self.client.send(partition, int(step), arrays, self.runtime.trace)

    def _hand(self, partition: partitions.Partition, arrays: list[np.ndarray], step: np.ndarray) -> None:
        """Hand the partition to the send scheduler; ``arrays`` own their tensors' memory, so they outlive the
        call unchanged (TensorFlow gives a numpy function views that hold a reference to each tensor)."""
        with self._callback(f"hand partition {partition.index} over"):
            self.client.hand(partition, int(step), arrays, self.runtime.trace)

    def _receive(self, partition: partitions.Partition, step: np.ndarray) -> np.ndarray:
        receive = self.client.collect if self.client.scheduled else self.client.receive
        with self._callback(f"receive partition {partition.index}"):
            return receive(partition, int(step), self.runtime.trace)

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

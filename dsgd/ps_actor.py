"""Parameter-server actor: averages many gradient partitions over the workers.

A server process serves every partition the driver assigns to it (BytePS's
design: few summing processes, many partitions). Each worker pushes each
partition every step: ``push`` says that its copy of the partition is
ready and returns once the step's mean of that partition exists. The push
that completes the set averages every worker's copy (``dsgd.server.sums``)
straight into the server's mean buffer (``dsgd.server.layout``); the pushes
waiting for it wake. When a step closes, and what a late or bad push gets, is
``dsgd.server.steps``'s rule.

Each worker reaches the server through the transport ``attach`` picks for the
pair (``dsgd.server.transports``): shared memory for a worker on the server's
node (a local worker's pushes arrive on its signal channel's thread, no Ray
call), a stream for one on another node, else the object store (the push is
an actor call carrying the worker's segments; the server puts the mean once
per partition and step for all its remote workers). A server also relays
other servers' partitions for its node's workers (``dsgd.server.relays``):
``set_peers`` links it to those servers, whose ``attach_relay`` takes the
partial sums.

Buffers are reused safely without locks because steps are lock-step: a
worker writes step s+1 of a partition only after it has read step s's mean
of it, and the server writes step s's mean into a slot only after every
worker is done with the step that used the slot before (without backup
workers: after every worker has pushed step s). The server's lock
(``changed``) guards the step states, not the buffers.

The actor is threaded (``start``): a push blocks its thread while it waits
for the other workers, so there is a thread for every worker's push of every
partition (a worker's ``begin`` comes before its pushes and uses one of
them), and ``CONTROL_THREADS`` more for ``abort``, ``reset``, ``excuse``,
``trace``, ``attach``, ``set_peers``, ``attach_relay`` and ``identity``
(before steps: ``set_peers`` waits for the other servers' ``attach_relay``
while they wait for ours). A local worker's pushes run on its channel's
thread instead, one after another in the order it sends them (layout order,
the same on every worker, so none waits behind another); a stream's, on its
answering thread likewise, and a relay's partial sums each on a thread of
its own. A push down a stream is taken as it arrives, on the stream's
reading thread (``take``: counted, and summed if it completes its step), so
no sum waits for a mean that an answering thread is still sending.

A partition that every worker pushes down a stream or through shared
memory (no relay, no backup worker, no object store) is summed as its bytes
arrive (``arriving``; a push through shared memory arrives whole): whenever
every worker's push has brought a chunk more, on the thread that brought
the last of it; and its answers down streams go out before the sum is done (``early``):
the mean's bytes follow the sum down each stream (``SummedMean``), so a
round's means leave while its pushes still come in. The mean slot is free
for that: a worker pushes a step only after reading every mean of the step
before.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import ray

from dsgd.common import actor_identity, timeline
from dsgd.errors import DSGDTimeoutError, StepAborted
from dsgd.server import sums
from dsgd.server.diagnostics import Traces, Traffic
from dsgd.server.layout import BufferLayout, partial_sum
from dsgd.server.relays import NodeSums, Relay, RelayedPartition, RelayLinks
from dsgd.server.steps import PartitionSteps, contributors
from dsgd.server.transports import ServerEnd, Transports
from dsgd.transport import object_store, shared_memory, signals
from dsgd.transport.ends import SharedMemoryServerEnd, StreamServerEnd
from dsgd.transport.streams import CHUNK_BYTES
from dsgd.wire.partitions import Partition

CONTROL_THREADS = 3


def start(server_index: int, num_workers: int, partitions: list[Partition], step_timeout_s: float,
          backup_workers: int = 0, relays: Sequence[Relay] = (),
          node_sums: dict[int, Sequence[tuple[int, ...]]] | None = None, generation: int = 0,
          sums_as_arriving: bool = True, **options) -> ray.actor.ActorHandle:
    """A ``ParameterServer`` actor with the threads it needs; ``options`` go to ``.options``."""
    return ray.remote(ParameterServer).options(
        num_cpus=0, max_concurrency=num_workers * (len(partitions) + len(relays)) + CONTROL_THREADS,
        **options).remote(server_index, num_workers, partitions, step_timeout_s, backup_workers, relays, node_sums,
                          generation, sums_as_arriving)


class ParameterServer:
    """Runs as a threaded Ray actor (see ``start``); holds no state that outlives a step."""

    def __init__(self, server_index: int, num_workers: int, partitions: list[Partition], step_timeout_s: float,
                 backup_workers: int = 0, relays: Sequence[Relay] = (),
                 node_sums: dict[int, Sequence[tuple[int, ...]]] | None = None, generation: int = 0,
                 sums_as_arriving: bool = True):
        """``partitions``: the partitions of the layout this server sums.

        ``step_timeout_s`` bounds how long a push waits for the other workers'
        pushes; a step averages the first ``num_workers - backup_workers``.
        ``relays``: the partitions of other servers this one sums for its
        node's workers; ``node_sums[j]``: the worker groups (one per node)
        whose partial sums of partition j come from relays instead of their
        workers' pushes. ``generation``: its group's resets so far (``reset``).
        ``sums_as_arriving``: sum a partition that every worker pushes down a
        stream as its bytes arrive (``arriving``), else once every push is in.
        """
        self.server_index = server_index
        self.name = f"parameter server {server_index}"
        self.num_workers = num_workers
        self.quorum = num_workers - backup_workers
        self.step_timeout_s = step_timeout_s
        self.sums_as_arriving = sums_as_arriving
        self.layout = BufferLayout(server_index, [*partitions, *(r.partition for r in relays)],
                                   2 if backup_workers else 1, shared_memory.available() and signals.available())
        node_sums = {p.index: node_sums.get(p.index, ()) for p in partitions} if node_sums else {}
        places = self.layout.places
        self.partitions = {
            p.index: PartitionSteps(places[p.index], contributors(num_workers, node_sums.get(p.index, ())), self.quorum)
            for p in partitions}
        self.partitions.update({
            r.partition.index: PartitionSteps(places[r.partition.index], {w: (w,) for w in sorted(r.workers)},
                                              len(r.workers))
            for r in relays})
        self.relayed = {r.partition.index: RelayedPartition.of(r) for r in relays}
        self.node_sums = NodeSums(server_index, node_sums, partitions)
        lock = threading.RLock()
        self.changed = threading.Condition(lock)  # guards everything that changes below
        for p in self.partitions.values():
            p.progress = threading.Condition(lock)  # its sums as the pushes arrive (``arriving``)
        # (worker, partition, step, epoch) -> a stream's push taken as it arrived (``take``), for its ``push``
        self._taken: dict[tuple[int, int, int, int | None], tuple] = {}
        self.transports = Transports(server_index, num_workers, ray.get_runtime_context().get_node_id(),
                                     ray.util.get_node_ip_address(), self.layout, step_timeout_s)
        self.links = RelayLinks(server_index, step_timeout_s, self.changed, generation)
        # The group's resets so far, the same on every server of the group: a relay's partial sum says the
        # generation it was summed in, and a server refuses one of another (made before its reset, taken after).
        self.generation = generation
        self.aborted = False
        self.resets = 0  # a push that waited across a reset fails as aborted
        self.begun = {w: -1 for w in range(num_workers)}  # worker -> the last step it began (backup workers)
        self.traces = Traces()
        self.crossings = Traffic()

    def _mean(self, step_id: int, j: int) -> np.ndarray:
        return self.layout.places[j].mean(step_id)

    def _arrivals_of(self, key: int) -> StreamArrivals:
        """What this server does with ``key``'s pushes down a stream as they arrive."""
        return StreamArrivals(self, key)

    def _pushes_of(self, key: int) -> Callable[..., tuple[list, tuple[int, ...]]]:
        """``key``'s pushes as a transport end makes them, ``(step_id, j)`` or, down a stream, ``(step_id, j,
        generation)`` (looked up on each call: tests wrap ``push``)."""
        return lambda step_id, j, generation=None: self.push(step_id, key, j, None, generation)

    # ---- connection --------------------------------------------------------

    def set_peers(self, servers: Sequence) -> None:
        """Every server's actor (index = server index): the relays push their partial sums to them, each server's
        down a stream of this server's (``attach_relay``), or through the object store if the stream cannot
        connect. Streams to the servers before (replaced by a recovery) are closed."""
        homes: dict[int, list[int]] = {}  # server -> the partitions relayed to it
        for j, relayed in self.relayed.items():
            homes.setdefault(relayed.home, []).append(j)
        # One key per server pushed to: a server relays for its own node's workers only.
        self.links.connect(servers, homes, lambda home: min(self.partitions[homes[home][0]].contributors),
                           self.transports.node_id, self._mean)

    def relay_transports(self) -> dict[int, str]:
        """Server -> how this server's relays push to it: "stream" or "object store" (``set_peers``)."""
        with self.changed:
            return {r.home: self.links.transport(r.home) for r in self.relayed.values()}

    def attach(self, worker_index: int, node_id: str | None) -> dict | None:
        """Connect a worker and pick the pair's transport; how the worker reaches this server.

        A worker on this server's node (``node_id`` equal to ours) gets shared
        buffers and a signal channel: ``{"input": address, "mean": address,
        "signal": address, "offsets": {partition: byte offset}, "slots": [byte
        offset of each slot of the mean buffer]}`` (addresses for
        ``shared_memory.attach`` and ``signals.Channel``). A worker on another
        node gets an input buffer here and a stream: ``{"stream": address,
        "slots": 1}`` (for ``streams.Stream``), except with backup workers (a
        worker catching up reads closed steps' means from ``begin``'s reply).
        Those, and ``node_id=None`` (a worker that could not map the buffers
        or reach the stream), push through the object store: ``None``; so do
        all workers on other nodes if Ray's TLS is on but its files cannot
        be used here (else the stream is TLS, ``dsgd.transport.tls``).
        """
        with self.changed:
            return self.transports.attach(worker_index, node_id, self._pushes_of(worker_index), self._mean,
                                          list(self.relayed), self._arrivals_of(worker_index))

    def attach_relay(self, relay: int, key: int, node_id: str | None,
                     indices: Sequence[int]) -> tuple[str, int, bytes] | None:
        """Connect server ``relay``, which pushes its node's partial sums of the partitions ``indices`` as ``key``
        (the node's lowest worker), and pick their transport; how it reaches this server.

        A relay on another node (``node_id``) gets an input buffer here (every
        partial sum pushed here, in float32) and a stream: its address, for
        ``streams.Stream``; the stream it had before is closed. Else (same
        node, backup workers, or ``node_id=None``: it could not reach the
        stream) the object store: ``None``.
        """
        with self.changed:
            for j in indices:
                if j not in self.partitions or not self.node_sums.expects(j, key):
                    raise ValueError(f"{self.name} expects no partial sum of partition {j} as worker {key}'s "
                                     f"(from parameter server {relay})")
            end = self.transports.relay_end(key, node_id, [self.layout.places[j] for j in indices],
                                            self.node_sums.offsets, self.node_sums.nbytes, self._pushes_of(key),
                                            self._mean, self._arrivals_of(key))
            self.node_sums.attach(relay, key, indices, end)
            return end.address()["stream"] if isinstance(end, StreamServerEnd) else None

    # ---- pushes ------------------------------------------------------------

    def push(self, step_id: int, worker_index: int, j: int, stored: list[np.ndarray] | None = None,
             generation: int | None = None) -> tuple[list, tuple[int, ...]]:
        """One worker's copy of partition j for ``step_id`` is ready; wait for the step's mean.

        ``stored`` is what ``object_store.put`` stored (a remote worker's
        call), or None (a local worker's announcement on its signal channel:
        its copy is in its input buffer). Returns the
        transport's reply, ``[ObjectRef]`` of the mean for a remote worker,
        ``[]`` for a local one (the mean is in the shared mean buffer), and
        the workers the mean averages. A push of a step already closed
        (backup workers) is dropped and answered at once. A bad push fails
        the step: it raises, and so do the step's other pushes of the
        partition, at once, instead of waiting for a sum that cannot come.
        A node's partial sum (``worker_index`` its relay's key) comes with
        the ``generation`` its relay summed it in; one of another generation
        was summed before this server's last reset, for the step that failed,
        and is refused (StepAborted) instead of counted in the step run again.
        """
        with self.changed:
            registered = self._taken.pop((worker_index, j, step_id, generation), None)
            if registered is None:
                registered = self._register(step_id, worker_index, j, stored, generation)
            p, start, resets, summed_in, late = registered
            arrived = p.arriving_step == step_id  # a push through shared memory, whole, summed as it arrives
        if arrived:
            self._sum_arrived(p, step_id, resets)
        with self.changed:
            inputs = None
            if not late:
                inputs, averaged = self._wait_closable(p, step_id, resets)
                recorder = self.traces.recorder(step_id)
        if inputs is not None:  # this push closes the step: sum outside the lock, so other partitions go on
            self._sum_and_keep(p, step_id, inputs, averaged, recorder, summed_in, resets)
        with self.changed:
            self._wait_settled(p, step_id, resets)
            what = "late push" if late else "push"
            workers = p.contributors.get(worker_index, (worker_index,))
            who = f"worker {worker_index}'s" if len(workers) == 1 else f"the partial sum of workers {list(workers)}:"
            self.traces.recorder(step_id).add(f"{who} {what} of partition {j} (waits for the sum)",
                                              start, timeline.now_us(), "pushes")
            ref, averaged = p.done[step_id]
            return self._end(p, worker_index).reply(ref), averaged

    def take(self, step_id: int, worker_index: int, j: int, generation: int | None = None) -> None:
        """A push down a stream, as it arrives (its reader's thread, ahead of the answers before it): counted
        now, and summed now if it completes the step, so the step's sum waits for no answer this server still
        has to send; its ``push`` (the stream's answering thread, in order) then only waits for the mean. Raises
        as ``push`` would for a push it cannot take."""
        with self.changed:
            registered = self._register(step_id, worker_index, j, None, generation)
            self._taken[worker_index, j, step_id, generation] = registered
            p, _, resets, summed_in, late = registered
            if late or self._settled(p, step_id) or not p.closes(step_id, self.begun, self.layout.slots):
                return
            inputs, averaged = p.close(step_id)
            recorder = self.traces.recorder(step_id)
        self._sum_and_keep(p, step_id, inputs, averaged, recorder, summed_in, resets)

    # ---- sums as the pushes arrive --------------------------------------------------

    def _sums_as_arriving(self, p: PartitionSteps) -> bool:
        """Whether ``p`` is summed as its pushes arrive: every contributor a worker pushing down a stream or
        through shared memory, one at least down a stream (else there is nothing to overlap), every push in the
        sum (under the lock)."""
        if not (self.sums_as_arriving and self.quorum == self.num_workers and p.index not in self.relayed):
            return False
        ends = [self.transports.ends.get(key) for key in p.contributors]
        return (not any(self.node_sums.expects(p.index, key) for key in p.contributors)
                and all(isinstance(end, (StreamServerEnd, SharedMemoryServerEnd)) for end in ends)
                and any(isinstance(end, StreamServerEnd) for end in ends))

    def arriving(self, step_id: int, key: int, j: int, nbytes: int) -> None:
        """``nbytes`` of ``key``'s push of partition j for ``step_id`` are in (its stream's reading thread): noted,
        and what every worker has sent of the partition summed, a chunk at least, if it is summed as it
        arrives."""
        p = self.partitions.get(j)
        if p is None:
            return  # ``take`` refuses it
        with self.changed:
            if (self.aborted or not self._sums_as_arriving(p) or p.settled(step_id)
                    or p.step_id not in (None, step_id) or key not in p.contributors):
                return
            if p.arrive(step_id, key, nbytes):
                p.progress.notify_all()
            resets = self.resets
        self._sum_arrived(p, step_id, resets)

    def _sum_arrived(self, p: PartitionSteps, step_id: int, resets: int) -> None:
        """Sum what every worker has sent of ``p`` and none summed yet, a chunk at least, unless another thread is
        summing ``p`` (it sums this too: it looks again once it is done)."""
        while p.summing.acquire(blocking=False):
            try:
                with self.changed:
                    span = p.summable(step_id, CHUNK_BYTES) if self.resets == resets else None
                    inputs = None if span is None else [self._end(p, key).read(
                        p.place.partition, p.place.offset, p.place.segments, None) for key in p.contributors]
                if span is not None:
                    self._sum_span(p, step_id, inputs, span)
                    with self.changed:
                        p.summed = span[1]
                        p.progress.notify_all()
            finally:
                p.summing.release()
            with self.changed:  # what came in while the lock was held, whose reader found it taken
                if span is None and (self.resets != resets or p.summable(step_id, CHUNK_BYTES) is None):
                    return

    def _sum_span(self, p: PartitionSteps, step_id: int, inputs: list[list[np.ndarray]], span: tuple[int, int]):
        """Average bytes ``span`` of ``p``'s pushes (every worker's, in worker order) into ``step_id``'s mean slot."""
        itemsize = p.place.partition.wire_dtype.itemsize
        with self.traces.recorder(step_id).span(f"average partition {p.index}, bytes {span[0]}-{span[1]}", "sum"):
            sums.average_span(p.place, step_id, inputs, self.num_workers, span[0] // itemsize, span[1] // itemsize)

    def answers_early(self, j: int) -> bool:
        """Whether a push of partition j down a stream may be answered while it arrives (``early``)."""
        p = self.partitions.get(j)
        with self.changed:
            return p is not None and self._sums_as_arriving(p)

    def early(self, step_id: int, key: int, j: int, generation: int | None) -> tuple | None:
        """``key``'s answer to its push of partition j for ``step_id`` before the step's sum is done, if ``p`` is
        summed as it arrives: once every worker's push has begun, the workers averaged, the mean slot and a
        ``SummedMean`` that says how much of it is summed. None if the usual answer is due (the step done,
        failed or reset already)."""
        p = self.partitions.get(j)
        if p is None:
            return None
        with self.changed:
            if not self._sums_as_arriving(p):
                return None
            resets = self.resets
            begun = lambda: p.arriving_step == step_id and len(p.arrived) == len(p.contributors)  # noqa: E731
            if not p.progress.wait_for(lambda: begun() or self._ended(p, step_id, resets), self.step_timeout_s):
                return None  # the usual answer names who is missing, at its own timeout
            if not begun() or self._ended(p, step_id, resets):
                return None
            averaged = tuple(p.workers_in(p.contributors))
        return averaged, p.place.mean(step_id), SummedMean(self, p, step_id, key, generation, resets)

    def _ended(self, p: PartitionSteps, step_id: int, resets: int) -> bool:
        """Whether ``step_id`` of ``p`` is done, failed, aborted or reset (under the lock)."""
        return self._settled(p, step_id) or self.resets != resets

    def _register(self, step_id: int, worker_index: int, j: int, stored: list[np.ndarray] | None,
                  generation: int | None) -> tuple[PartitionSteps, float, int, int, bool]:
        """Check and count a push (under the lock): its partition, when it came, the resets and generation it
        came in, and whether it is late (its step closed without it)."""
        start = timeline.now_us()
        p = self._partition(j, worker_index)
        self._check_not_aborted(p, step_id)
        self._check_generation(j, step_id, worker_index, generation)
        late = self.quorum < self.num_workers and p.is_late(step_id)
        if not late:
            self._take(p, step_id, worker_index, stored)
            for w in p.contributors[worker_index]:
                self._note_begun(w, step_id)
            if self._sums_as_arriving(p) and p.arrive(step_id, worker_index, p.place.partition.wire_nbytes):
                p.progress.notify_all()  # whole (a stream's push said so chunk by chunk already)
        return p, start, self.resets, self.generation, late

    def _sum_and_keep(self, p: PartitionSteps, step_id: int, inputs: list[list[np.ndarray]],
                      averaged: tuple[int, ...], recorder: timeline.Recorder, summed_in: int, resets: int) -> None:
        """Sum a closed step (outside the lock) and keep its answer, unless a reset came meanwhile; a failure
        fails the step's other pushes now, not at a timeout (e.g. a relay's server died), and is raised."""
        try:
            ref, averaged = self._sum(p, step_id, inputs, averaged, recorder, summed_in)
        except Exception as e:
            with self.changed:
                p.failures[step_id] = e
                self._wake(p)
            raise
        with self.changed:
            if self.resets == resets:
                p.keep(step_id, ref, averaged, self.layout.slots)
            self._wake(p)  # a mean going out as it was summed too: the rest of it

    def _check_generation(self, j: int, step_id: int, key: int, generation: int | None) -> None:
        """Refuse a node's partial sum summed in another generation than this server's (before its reset)."""
        if self.node_sums.expects(j, key) and generation != self.generation:
            raise StepAborted(f"{self.name}: the partial sum of partition {j}, step {step_id} pushed as worker "
                              f"{key}'s was summed before the reset (generation {generation}, now "
                              f"{self.generation}): the step it was for failed")

    def _partition(self, j: int, worker_index: int) -> PartitionSteps:
        if j not in self.partitions:
            raise ValueError(f"{self.name} does not serve partition {j} (worker {worker_index} pushed it); it "
                             f"serves {sorted(self.partitions)}")
        return self.partitions[j]

    def _take(self, p: PartitionSteps, step_id: int, key: int, stored: list | None) -> None:
        """Accept a push (under the lock) into ``p.waiting``, checked (the expected step, sizes and dtype, no second
        push); a bad one fails the step."""
        try:
            p.check(step_id, key, self.name)
            end = self._end(p, key)
            self.crossings.count(p.index, end.crosses_nodes)
            if self.node_sums.expects(p.index, key):  # a node's partial sum
                p.waiting[key] = end.read(partial_sum(p.place.partition), self.node_sums.offsets[p.index],
                                          p.place.segments, stored)
            else:
                p.waiting[key] = end.read(p.place.partition, p.place.offset, p.place.segments, stored)
        except ValueError as e:
            p.failures[step_id] = e
            self._wake(p)
            raise

    def _end(self, p: PartitionSteps, key: int) -> ServerEnd:
        """The transport end a push of ``p`` by ``key`` comes through: a node's partial sum its own (``key``, the
        node's lowest worker, may have a worker's end here too)."""
        end = self.node_sums.end(p.index, key)
        return self.transports.ends[key] if end is None else end

    def _wait_closable(self, p: PartitionSteps, step_id: int, resets: int) -> tuple[list | None, tuple[int, ...]]:
        """Wait (under the lock, bounded) until ``p``'s step settles or closes; if this push closes it, the
        segments to average (the averaged workers' in worker order) and those workers, else ``(None, ())``."""
        self._wait(p, step_id, lambda: (self._settled(p, step_id) or self.resets != resets
                                        or p.closes(step_id, self.begun, self.layout.slots)))
        if self._settled(p, step_id) or self.resets != resets:
            return None, ()
        return p.close(step_id)

    def _wait_settled(self, p: PartitionSteps, step_id: int, resets: int) -> None:
        """Wait (under the lock, bounded) until ``p``'s step has a mean; raise if it failed or was aborted."""
        self._wait(p, step_id, lambda: self._settled(p, step_id) or self.resets != resets)
        if self.resets != resets:
            raise StepAborted(f"{self.name}: step {step_id} was reset")
        self._check_not_aborted(p, step_id)
        if step_id in p.failures:
            raise p.failures[step_id]

    def _wait(self, p: PartitionSteps, step_id: int, condition: Callable[[], bool]) -> None:
        """``changed.wait_for(condition)`` bounded by the step timeout; the timeout names who is missing."""
        if not self.changed.wait_for(condition, self.step_timeout_s):
            raise DSGDTimeoutError(f"{self.name} waited more than {self.step_timeout_s:.0f}s for "
                                   f"{p.stuck(step_id, self.begun)}")

    def _settled(self, p: PartitionSteps, step_id: int) -> bool:
        return p.settled(step_id) or self.aborted

    def _sum(self, p: PartitionSteps, step_id: int, inputs: list[list[np.ndarray]], averaged: tuple[int, ...],
             recorder: timeline.Recorder, generation: int) -> tuple[ray.ObjectRef | None, tuple[int, ...]]:
        """Average the pushes (``averaged``: the workers they stand for) into the step's mean slot, or, relayed,
        sum them and push the sum on, as of ``generation`` (this server's when the pushes came); the mean's ref
        if remote workers read it, and the workers it averages."""
        relayed = self.relayed.get(p.index)
        with recorder.span(f"{'average' if relayed is None else 'sum'} partition {p.index} of workers "
                           f"{list(averaged)}", "sum"):
            if relayed is not None:
                sums.add(relayed.partial(p.place, step_id), p.place, inputs)
            elif p.arriving_step == step_id:  # summed as it arrived: the rest (if any)
                with p.summing:
                    rest = (p.summed, p.place.partition.wire_nbytes)
                    if rest[0] < rest[1]:
                        self._sum_span(p, step_id, inputs, rest)
                        p.summed = rest[1]
            else:
                sums.average(p.place, step_id, inputs, len(averaged))
        if relayed is not None:
            ref, averaged = self.links.push(p.place, relayed, step_id, averaged, recorder, generation)
            if ref is not None:  # through the object store: its server's mean, for workers here on it
                return ref, averaged
        if not (self.node_sums.any_remote(p.index) or self.transports.any_remote()):
            return None, averaged
        with recorder.span(f"put the mean of partition {p.index} for remote workers", "sum"):
            return object_store.put([p.place.mean(step_id)]), averaged

    def traffic(self) -> dict[int, int]:
        """Partition -> how many pushes of it brought their data from another node (down a stream or through the
        object store), since the start; a relayed partition is not counted here but at its server."""
        with self.changed:
            return self.crossings.of(j for j in self.partitions if j not in self.relayed)

    # ---- steps -------------------------------------------------------------

    def begin(self, step_id: int, worker_index: int) -> dict[int, tuple[list, tuple[int, ...]]]:
        """Worker ``worker_index`` starts ``step_id`` (done with every earlier step); the partitions of it already
        closed, each with its answer as ``push`` gives it (backup workers)."""
        with self.changed:
            if self.aborted:
                raise StepAborted(f"{self.name}: step {step_id} was aborted")
            self._note_begun(worker_index, step_id)
            end = self.transports.ends[worker_index]
            return {j: (end.reply(p.done[step_id][0]), p.done[step_id][1])
                    for j, p in self.partitions.items() if step_id in p.done}

    def _note_begun(self, worker_index: int, step_id: int) -> None:
        if step_id > self.begun[worker_index]:
            self.begun[worker_index] = step_id
            self.changed.notify_all()

    def excuse(self, worker_index: int, generation: int) -> None:
        """Close steps without waiting for ``worker_index`` to begin them (it died) until ``reset``; ignored if
        sent before a reset this server already took (``_is_late``)."""
        with self.changed:
            if self._is_late(generation):
                return
            self.begun[worker_index] = float("inf")
            self.changed.notify_all()

    def _check_not_aborted(self, p: PartitionSteps, step_id: int) -> None:
        if self.aborted and step_id not in p.done:
            raise StepAborted(f"{self.name}: step {step_id} was aborted")

    def abort(self, generation: int) -> None:
        """Fail every waiting and future push until ``reset``; ignored if sent before a reset this server already
        took (``_is_late``)."""
        with self.changed:
            if self._is_late(generation):
                return
            self.aborted = True
            self._wake()

    def _wake(self, p: PartitionSteps | None = None) -> None:
        """A step of ``p`` (or of every partition: ``None``) settled, failed, or was aborted or reset: wake every
        wait on the server's lock that it may end, the pushes' and the answers going out as ``p`` is summed."""
        self.changed.notify_all()
        for q in self.partitions.values() if p is None else (p,):
            q.progress.notify_all()

    def _is_late(self, generation: int) -> bool:
        """Whether a call sent in ``generation`` (the group's resets when the driver sent it) comes after a later
        reset. The actor is threaded, so Ray does not keep the order of one caller's calls: an abort sent before
        a reset can run after it, and would otherwise fail the steps the reset made ready."""
        return generation < self.generation

    def reset(self, step_id: int, generation: int) -> None:
        """Forget partial sums and aborted steps; expect ``step_id`` next, in ``generation`` (the group's resets,
        ``ServerGroup.reset``): partial sums of earlier generations are refused from now on."""
        with self.changed:
            self.resets += 1
            self.generation = generation
            for p in self.partitions.values():
                p.reset(step_id)
            self.begun = {w: step_id - 1 for w in range(self.num_workers)}
            self._taken.clear()
            broken = self.links.forget(generation)  # the failed step's answers are dropped, its waits fail
            self.aborted = False
            self._wake()
        if broken:  # a stream that ended with both servers alive (a send cut short): open them anew
            self.set_peers(self.links.peers)

    # ---- diagnostics -------------------------------------------------------

    def trace(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id`` (kept for the last two steps)."""
        with self.changed:
            return self.traces.events(step_id)

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("parameter server", self.server_index)


class StreamArrivals:
    """A parameter server's side of one pusher's stream, as its pushes arrive (``streams.Arrivals``)."""

    def __init__(self, server: ParameterServer, key: int):
        self.server, self.key = server, key

    def arriving(self, step: int, j: int, epoch: int, nbytes: int) -> None:
        self.server.arriving(step, self.key, j, nbytes)

    def take(self, step: int, j: int, epoch: int) -> None:
        self.server.take(step, self.key, j, epoch)

    def answers_early(self, j: int) -> bool:
        return self.server.answers_early(j)

    def early(self, step: int, j: int, epoch: int) -> tuple | None:
        return self.server.early(step, self.key, j, epoch)


class SummedMean:
    """A mean going down a stream as it is summed (``streams.MeanStream``), for ``ParameterServer.early``."""

    def __init__(self, server: ParameterServer, p: PartitionSteps, step_id: int, key: int, generation: int | None,
                 resets: int):
        self.server, self.p, self.step_id, self.key, self.generation, self.resets = (
            server, p, step_id, key, generation, resets)

    def ready(self, sent: int) -> int:
        server, p, step_id = self.server, self.p, self.step_id
        total = p.place.partition.wire_nbytes
        with server.changed:
            def more() -> bool:
                return step_id in p.done or server._ended(p, step_id, self.resets) or (
                    p.arriving_step == step_id and p.summed > sent)
            p.progress.wait_for(more, server.step_timeout_s)
            if step_id in p.done and server.resets == self.resets:
                return total
            if not server._ended(p, step_id, self.resets) and p.arriving_step == step_id and p.summed > sent:
                return p.summed
        raise ConnectionAbortedError(f"{server.name}: step {step_id} of partition {p.index} failed or timed out "
                                     "while its mean went out")

    def finish(self) -> None:
        try:  # the push's bookkeeping, as for an answer sent once the step was done (it is: its mean went whole)
            self.server.push(self.step_id, self.key, self.p.index, None, self.generation)
        except Exception:  # a reset or abort after the mean went out: the step fails through those
            pass

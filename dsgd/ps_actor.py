"""Parameter-server actor: averages many gradient partitions over the workers.

A server process serves every partition the driver assigns to it (BytePS's
design: few summing processes, many partitions). Each worker pushes each
partition every step: ``push`` says that its copy of the partition is
ready and returns once the step's mean of that partition exists. The push
that completes the set averages every worker's copy with
``arrays.average_into`` (worker order, so the mean is bit-for-bit the
same in every run and equals the "simple" strategy's) straight into the
server's mean buffer; the pushes waiting for it wake.

Each worker reaches the server through the transport ``attach`` picks for the
pair (``dsgd.transport.ends``): shared memory for a worker on the server's node
(its input buffer, one mean buffer for all local workers, and a signal
channel on which the worker announces its pushes and ``push`` answers them,
on a thread of the channel: no Ray call), the object store for any other
(the push is an actor call carrying the worker's segments; the server puts
the mean once per partition and step for all its remote workers). Under
wire compression (``dsgd.wire.codec``) pushes and means are 16-bit: the server
sums the pushes into a float32 array beside the mean and rounds the mean
once.

Node-local aggregation (``Relay``, planned by ``dsgd.cluster.server_group.plan_relays``):
on a node without partition j's server that holds several workers, one server
there relays j. Its local workers push j to it through shared memory as to any
local server; once all have, it sums their copies (float32, worker order) and
pushes the node's partial sum to j's server as one push standing for those
workers (keyed by the lowest of them), waits for the mean, and has it in its
mean buffer for them. The push goes down a stream to j's server
(``set_peers`` -> ``attach_relay``: one stream per relaying server and
server it pushes to, the mean read straight into the mean buffer), or, where
the stream cannot connect, through the object store. j's server sums its own
workers' copies and the nodes' partial sums (lowest worker first) and divides
by the number of workers they stand for. So one copy of j per node crosses
each way per step, whatever the node's number of workers.

Backup workers (``backup_workers=b``): a partition's step closes at the
first ``num_workers - b`` pushes (``ParameterServer._closes``); a later push
of a closed step is dropped and answered with the step's mean at once. A
worker calls ``begin`` at the start of each step: it learns which of its
partitions are closed already (a worker that finds all closed applies their
means without computing), and the server learns that the worker is done
with every earlier step. A step t closes only once every worker has begun
step t - 1, so a worker is never more than one step behind; the server
keeps the means of the last two steps (two slots of its mean buffer, by
step parity) for the workers that are.

Buffers are reused safely without locks because steps are lock-step: a
worker writes step s+1 of a partition only after it has read step s's mean
of it, and the server writes step s's mean into a slot only after every
worker is done with the step that used the slot before (without backup
workers: after every worker has pushed step s).

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
its own.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import ray

from dsgd.common import actor_identity, timeline
from dsgd.wire import arrays
from dsgd.transport import object_store, shared_memory, signals, streams
from dsgd.errors import DSGDError, DSGDTimeoutError, StepAborted
from dsgd.wire.partitions import Partition, segments
from dsgd.transport.ends import ObjectStoreServerEnd, SharedMemoryServerEnd, StreamServerEnd, byte_places

ServerEnd = SharedMemoryServerEnd | StreamServerEnd | ObjectStoreServerEnd

CONTROL_THREADS = 3


def start(server_index: int, num_workers: int, partitions: list[Partition], step_timeout_s: float,
          backup_workers: int = 0, relays: Sequence[Relay] = (),
          node_sums: dict[int, Sequence[tuple[int, ...]]] | None = None, **options) -> ray.actor.ActorHandle:
    """A ``ParameterServer`` actor with the threads it needs; ``options`` go to ``.options``."""
    return ray.remote(ParameterServer).options(
        num_cpus=0, max_concurrency=num_workers * (len(partitions) + len(relays)) + CONTROL_THREADS,
        **options).remote(server_index, num_workers, partitions, step_timeout_s, backup_workers, relays, node_sums)


@dataclass(frozen=True)
class Relay:
    """This server sums ``workers``' copies of ``partition`` (its node's workers) and pushes the sum to server ``home``."""

    partition: Partition
    home: int
    workers: tuple[int, ...]


@dataclass
class PartitionState:
    """One partition's place in the server's buffers and the state of its current step."""

    partition: Partition
    offset: int  # bytes into the mean buffer and every worker's input buffer
    segments: list[tuple[int, int]]  # (start, size) of each segment a remote push carries
    means: list[np.ndarray]  # views of the mean buffer in the wire dtype, one per slot (step parity, backup workers)
    total: np.ndarray | None  # a compressed partition's relay: the float32 array the node's pushes are summed in
    # who pushes it: a worker, or a node's relay keyed by its lowest worker -> the workers the push stands for
    contributors: dict[int, tuple[int, ...]]
    quorum: int  # the workers a step is averaged over (or, relayed, summed over)
    home: int | None = None  # relayed: the server its partial sum goes to
    step_id: int | None = None  # the step it sums next
    waiting: dict[int, list[np.ndarray]] = field(default_factory=dict)  # worker -> its segments, in push order
    # step -> (the mean's ref for remote readers, the workers averaged), for the steps whose means are kept
    done: dict[int, tuple[ray.ObjectRef | None, tuple[int, ...]]] = field(default_factory=dict)
    failures: dict[int, Exception] = field(default_factory=dict)
    # the contributors that are relays (a node's lowest worker) -> the end their partial sums come through
    relay_ends: dict[int, StreamServerEnd | ObjectStoreServerEnd] = field(default_factory=dict)
    relay_offset: int = 0  # bytes into a relay stream's input buffer (``attach_relay``): where its partial sum goes
    pushed_from_elsewhere: int = 0  # pushes whose data came from another node (stream or object store), so far

    def workers_in(self, keys) -> list[int]:
        """The workers the pushes of contributors ``keys`` stand for, in order."""
        return sorted(w for k in keys for w in self.contributors[k])

    def mean(self, step_id: int) -> np.ndarray:
        return self.means[step_id % len(self.means)]

    def partial_sum(self) -> Partition:
        """The partition as a node's partial sum of it travels: uncompressed (the sum of its workers' 16-bit copies
        in float32, not rounded again)."""
        return replace(self.partition, compression=None)


class ParameterServer:
    """Runs as a threaded Ray actor (see ``start``); holds no state that outlives a step."""

    def __init__(self, server_index: int, num_workers: int, partitions: list[Partition], step_timeout_s: float,
                 backup_workers: int = 0, relays: Sequence[Relay] = (),
                 node_sums: dict[int, Sequence[tuple[int, ...]]] | None = None):
        """``partitions``: the partitions of the layout this server sums.

        ``step_timeout_s`` bounds how long a push waits for the other workers'
        pushes; a step averages the first ``num_workers - backup_workers``.
        ``relays``: the partitions of other servers this one sums for its
        node's workers; ``node_sums[j]``: the worker groups (one per node)
        whose partial sums of partition j come from relays instead of their
        workers' pushes.
        """
        self.server_index = server_index
        self.num_workers = num_workers
        self.quorum = num_workers - backup_workers
        self.slots = 2 if backup_workers else 1  # the steps whose means are kept
        self.step_timeout_s = step_timeout_s
        self.node_id = ray.get_runtime_context().get_node_id()
        self.host = ray.util.get_node_ip_address()  # where streams from other nodes' workers connect
        offsets, end = [], 0
        for partition in [*partitions, *(r.partition for r in relays)]:
            offsets.append(end)
            end = shared_memory.aligned(end + partition.wire_nbytes)
        self.nbytes = end
        self.shared = shared_memory.available() and signals.available()
        if self.shared:
            self.mean_buffer = shared_memory.SharedBuffer(self.nbytes * self.slots, f"dsgd-ps{server_index}-mean")
            memory = self.mean_buffer.memory
        else:
            memory = bytearray(self.nbytes * self.slots)
        node_sums = node_sums or {}
        self.partitions = {partition.index: self._place(partition, memory, offset, node_sums.get(partition.index, ()))
                           for partition, offset in zip(partitions, offsets)}
        for relay, offset in zip(relays, offsets[len(partitions):]):
            self.partitions[relay.partition.index] = self._place(relay.partition, memory, offset, (), relay)
        self.relay_nbytes = 0  # the input buffer of a relay's stream: every partial sum pushed here, in float32
        for p in self.partitions.values():
            if p.relay_ends:
                p.relay_offset = self.relay_nbytes
                self.relay_nbytes = shared_memory.aligned(self.relay_nbytes + p.partial_sum().wire_nbytes)
        self.relay_sources: dict[int, StreamServerEnd] = {}  # relaying server -> the stream it pushes here down
        self.peers: list = []  # every server's actor, for the relays' pushes (``set_peers``)
        self.relay_streams: dict[int, streams.Stream] = {}  # server -> the stream this one's relays push to it down
        # Each worker's end of its transport; the object store until it attaches on this node.
        self.ends: dict[int, ServerEnd] = {w: ObjectStoreServerEnd(server_index, w) for w in range(num_workers)}
        self.changed = threading.Condition()  # guards everything that changes below
        self.aborted = False
        self.resets = 0  # a push that waited across a reset fails as aborted
        self.begun = {w: -1 for w in range(num_workers)}  # worker -> the last step it began (backup workers)
        self.traces: dict[int, timeline.Recorder] = {}  # the last two steps' events

    def _place(self, partition: Partition, memory, offset: int, node_sums: Sequence[tuple[int, ...]],
               relay: Relay | None = None) -> PartitionState:
        """``partition``'s partition: its mean at ``offset`` of each slot of ``memory``; a float32 sum if a compressed
        partition is relayed.

        Pushed by every worker but those of ``node_sums`` (each group pushed as one by its node's relay), or
        relayed: by ``relay.workers``.
        """
        means = [np.frombuffer(memory, partition.wire_dtype, partition.size, offset + k * self.nbytes)
                 for k in range(self.slots)]
        total = None if relay is None or partition.wire_dtype == partition.dtype else np.zeros(partition.size, partition.dtype)
        if relay is not None:
            contributors = {w: (w,) for w in relay.workers}
        else:
            grouped = {w for group in node_sums for w in group}
            contributors = {w: (w,) for w in range(self.num_workers) if w not in grouped}
            contributors.update({min(group): tuple(group) for group in node_sums})
        quorum = len(relay.workers) if relay is not None else self.quorum
        return PartitionState(partition, offset, [(s.start, s.size) for s in segments(partition)], means, total,
                          dict(sorted(contributors.items())), quorum, None if relay is None else relay.home,
                          relay_ends={min(group): ObjectStoreServerEnd(self.server_index, min(group))
                                      for group in node_sums})

    def set_peers(self, servers: Sequence) -> None:
        """Every server's actor (index = server index): the relays push their partial sums to them, each server's
        down a stream of this server's (``attach_relay``), or through the object store if the stream cannot
        connect. Streams to the servers before (replaced by a recovery) are closed."""
        homes: dict[int, list[int]] = {}  # server -> the partitions relayed to it
        for j, p in self.partitions.items():
            if p.home is not None:
                homes.setdefault(p.home, []).append(j)
        with self.changed:
            self.peers = list(servers)
            old, self.relay_streams = self.relay_streams, {}
        for stream in old.values():
            stream.close()
        # One key per server pushed to: a server relays for its own node's workers only.
        keys = {home: min(self.partitions[partitions[0]].contributors) for home, partitions in homes.items()}
        calls = {home: servers[home].attach_relay.remote(self.server_index, keys[home], self.node_id, partitions)
                 for home, partitions in homes.items()}
        for home, call in calls.items():
            address = self._answer_of(call, home)
            if address is None:
                continue
            try:
                stream = streams.Stream(address, lambda step_id, partition: self.partitions[partition].mean(step_id),
                                        min(self.step_timeout_s, streams.CONNECT_TIMEOUT_S), self.step_timeout_s)
            except OSError:  # no route to it: the object store, as for a worker (``ParameterServerClient._end``)
                self._answer_of(servers[home].attach_relay.remote(self.server_index, keys[home], None, homes[home]),
                                home)
                continue
            with self.changed:
                self.relay_streams[home] = stream

    def _answer_of(self, call: ray.ObjectRef, home: int):
        """``call``'s (to server ``home``) answer, waited for at most the step timeout."""
        try:
            return ray.get(call, timeout=self.step_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DSGDTimeoutError(f"parameter server {self.server_index} waited more than {self.step_timeout_s:.0f}s "
                                   f"for parameter server {home} to take its relays") from None

    def relay_transports(self) -> dict[int, str]:
        """Server -> how this server's relays push to it: "stream" or "object store" (``set_peers``)."""
        with self.changed:
            return {p.home: "stream" if p.home in self.relay_streams else "object store"
                    for p in self.partitions.values() if p.home is not None}

    # ---- connection --------------------------------------------------------

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
        or reach the stream), push through the object store: ``None``.
        """
        with self.changed:
            self.ends[worker_index].close()  # a re-attach after a recovery: an old buffer goes with its fd
            relayed = [j for j, p in self.partitions.items() if p.home is not None]
            if node_id is not None and node_id != self.node_id and self.slots == 1:
                end = self.ends[worker_index] = StreamServerEnd(
                    self.server_index, worker_index, self.host, self.nbytes,
                    {j: byte_places(p.partition, p.offset, p.segments) for j, p in self.partitions.items()},
                    lambda step_id, partition: self.push(step_id, worker_index, partition),
                    lambda step_id, partition: self.partitions[partition].mean(step_id), self.step_timeout_s,
                    relayed=relayed)
                return {**end.address(), "slots": self.slots}
            if not self.shared or node_id != self.node_id:
                self.ends[worker_index] = ObjectStoreServerEnd(self.server_index, worker_index)
                return None
            end = self.ends[worker_index] = SharedMemoryServerEnd(
                self.server_index, worker_index, self.nbytes,
                lambda step_id, partition: self.push(step_id, worker_index, partition), self.step_timeout_s,
                relayed=relayed)
            return {**end.address(), "mean": self.mean_buffer.address(),
                    "offsets": {j: p.offset for j, p in self.partitions.items()},
                    "slots": [k * self.nbytes for k in range(self.slots)]}

    def attach_relay(self, relay: int, key: int, node_id: str | None,
                     partitions: Sequence[int]) -> tuple[str, int, bytes] | None:
        """Connect server ``relay``, which pushes its node's partial sums of ``partitions`` as ``key`` (the node's
        lowest worker), and pick their transport; how it reaches this server.

        A relay on another node (``node_id``) gets an input buffer here (every
        partial sum pushed here, in float32) and a stream: its address, for
        ``streams.Stream``; the stream it had before is closed. Else (same
        node, backup workers, or ``node_id=None``: it could not reach the
        stream) the object store: ``None``.
        """
        with self.changed:
            for j in partitions:
                if j not in self.partitions or key not in self.partitions[j].relay_ends:
                    raise ValueError(f"parameter server {self.server_index} expects no partial sum of partition {j} "
                                     f"as worker {key}'s (from parameter server {relay})")
            old = self.relay_sources.pop(relay, None)
            if old is not None:
                old.close()
            end: StreamServerEnd | ObjectStoreServerEnd
            if node_id is not None and node_id != self.node_id and self.slots == 1:
                end = self.relay_sources[relay] = StreamServerEnd(
                    self.server_index, key, self.host, self.relay_nbytes,
                    {j: byte_places(self.partitions[j].partial_sum(), self.partitions[j].relay_offset,
                                    self.partitions[j].segments) for j in partitions},
                    lambda step_id, partition: self.push(step_id, key, partition),
                    lambda step_id, partition: self.partitions[partition].mean(step_id), self.step_timeout_s,
                    relayed=partitions)  # each answered on a thread of its own: it waits for this node's workers
            else:
                end = ObjectStoreServerEnd(self.server_index, key)
            for j in partitions:
                self.partitions[j].relay_ends[key] = end
            return end.address()["stream"] if isinstance(end, StreamServerEnd) else None

    # ---- pushes ------------------------------------------------------------

    def push(self, step_id: int, worker_index: int, partition: int,
             stored: list[np.ndarray] | None = None) -> tuple[list, tuple[int, ...]]:
        """One worker's copy of ``partition`` for ``step_id`` is ready; wait for the step's mean.

        ``stored`` is what ``object_store.put`` stored (a remote worker's
        call), or None (a local worker's announcement on its signal channel:
        its copy is in its input buffer). Returns the
        transport's reply, ``[ObjectRef]`` of the mean for a remote worker,
        ``[]`` for a local one (the mean is in the shared mean buffer), and
        the workers the mean averages. A push of a step already closed
        (backup workers) is dropped and answered at once. A bad push fails
        the step: it raises, and so do the step's other pushes of the
        partition, at once, instead of waiting for a sum that cannot come.
        """
        start = timeline.now_us()
        inputs = None
        with self.changed:
            p = self._partition(partition, worker_index)
            self._check_not_aborted(p, step_id)
            resets = self.resets
            late = self.quorum < self.num_workers and p.step_id is not None and step_id < p.step_id  # closed
            if not late:
                self._take(p, step_id, worker_index, stored)
                for w in p.contributors[worker_index]:
                    self._note_begun(w, step_id)
                inputs, averaged = self._wait_closable(p, step_id, resets)
                recorder = self._recorder(step_id)
        if inputs is not None:  # this push closes the step: sum outside the lock, so other partitions go on
            try:
                ref, averaged = self._sum(p, step_id, inputs, averaged, recorder)
            except Exception as e:  # e.g. a relay's server died: the step's other pushes fail now, not at a timeout
                with self.changed:
                    p.failures[step_id] = e
                    self.changed.notify_all()
                raise
            with self.changed:
                if self.resets == resets:
                    p.done = {s: d for s, d in p.done.items() if s > step_id - self.slots}
                    p.done[step_id] = (ref, averaged)
                    p.failures.clear()
                self.changed.notify_all()
        with self.changed:
            self._wait_settled(p, step_id, resets)
            what = "late push" if late else "push"
            workers = p.contributors.get(worker_index, (worker_index,))
            who = f"worker {worker_index}'s" if len(workers) == 1 else f"the partial sum of workers {list(workers)}:"
            self._recorder(step_id).add(f"{who} {what} of partition {partition} (waits for the sum)",
                                        start, timeline.now_us(), "pushes")
            ref, averaged = p.done[step_id]
            return self._end(p, worker_index).reply(ref), averaged

    def _take(self, p: PartitionState, step_id: int, worker_index: int, stored: list | None) -> None:
        """Accept a push (under the lock) into ``p.waiting``; a bad one fails the step."""
        try:
            p.waiting[worker_index] = self._accept(p, step_id, worker_index, stored)
        except ValueError as e:
            p.failures[step_id] = e
            self.changed.notify_all()
            raise

    def _wait_closable(self, p: PartitionState, step_id: int, resets: int) -> tuple[list | None, tuple[int, ...]]:
        """Wait (under the lock, bounded) until ``p``'s step settles or closes; if this push closes it, the
        segments to average (the averaged workers' in worker order) and those workers, else ``(None, ())``."""
        self._wait(p, step_id, lambda: self._settled(p, step_id) or self.resets != resets or self._closes(p, step_id))
        if self._settled(p, step_id) or self.resets != resets:
            return None, ()
        keys, count = [], 0
        for key in p.waiting:  # the first pushes to arrive
            if count >= p.quorum:
                break
            keys.append(key)
            count += len(p.contributors[key])
        keys.sort()
        inputs = [p.waiting[key] for key in keys]
        averaged = tuple(p.workers_in(keys))
        p.waiting.clear()  # pushes beyond the first are dropped
        p.step_id = step_id + 1
        return inputs, averaged

    def _closes(self, p: PartitionState, step_id: int) -> bool:
        """Whether ``p``'s step has the pushes it is averaged over: the first ``num_workers - backup_workers``,
        once every worker is done with the step whose mean slot it writes (has begun ``step_id - 1``; without
        backup workers every worker's push says so)."""
        return (p.step_id == step_id and len(p.workers_in(p.waiting)) >= p.quorum
                and (self.slots == 1 or all(begun >= step_id - 1 for begun in self.begun.values())))

    def _note_begun(self, worker_index: int, step_id: int) -> None:
        if step_id > self.begun[worker_index]:
            self.begun[worker_index] = step_id
            self.changed.notify_all()

    def begin(self, step_id: int, worker_index: int) -> dict[int, tuple[list, tuple[int, ...]]]:
        """Worker ``worker_index`` starts ``step_id`` (done with every earlier step); the partitions of it already
        closed, each with its answer as ``push`` gives it (backup workers)."""
        with self.changed:
            if self.aborted:
                raise StepAborted(f"parameter server {self.server_index}: step {step_id} was aborted")
            self._note_begun(worker_index, step_id)
            return {j: (self.ends[worker_index].reply(p.done[step_id][0]), p.done[step_id][1])
                    for j, p in self.partitions.items() if step_id in p.done}

    def excuse(self, worker_index: int) -> None:
        """Close steps without waiting for ``worker_index`` to begin them (it died) until ``reset``."""
        with self.changed:
            self.begun[worker_index] = float("inf")
            self.changed.notify_all()

    def _wait_settled(self, p: PartitionState, step_id: int, resets: int) -> None:
        """Wait (under the lock, bounded) until ``p``'s step has a mean; raise if it failed or was aborted."""
        self._wait(p, step_id, lambda: self._settled(p, step_id) or self.resets != resets)
        if self.resets != resets:
            raise StepAborted(f"parameter server {self.server_index}: step {step_id} was reset")
        self._check_not_aborted(p, step_id)
        if step_id in p.failures:
            raise p.failures[step_id]

    def _wait(self, p: PartitionState, step_id: int, condition) -> None:
        """``changed.wait_for(condition)`` bounded by the step timeout; the timeout names who is missing."""
        if not self.changed.wait_for(condition, self.step_timeout_s):
            missing = p.workers_in(set(p.contributors) - set(p.waiting))
            behind = sorted(w for w, begun in self.begun.items() if begun < step_id - 1)
            raise DSGDTimeoutError(
                f"parameter server {self.server_index} waited more than {self.step_timeout_s:.0f}s for "
                + (f"workers {behind} to begin step {step_id - 1} (it closes step {step_id} of partition "
                   f"{p.partition.index} only then)" if len(p.workers_in(p.waiting)) >= p.quorum else
                   f"workers {missing} to push partition {p.partition.index} of step {step_id}"))

    def _partition(self, index: int, worker_index: int) -> PartitionState:
        if index not in self.partitions:
            raise ValueError(f"parameter server {self.server_index} does not serve partition {index} "
                             f"(worker {worker_index} pushed it); it serves {sorted(self.partitions)}")
        return self.partitions[index]

    def _settled(self, p: PartitionState, step_id: int) -> bool:
        return step_id in p.done or step_id in p.failures or self.aborted

    def _accept(self, p: PartitionState, step_id: int, worker_index: int,
                stored: list[np.ndarray] | None) -> list[np.ndarray]:
        """The pushed segments, checked: the expected step, sizes and dtype, and no second push."""
        if p.step_id is None:
            p.step_id = step_id
        if step_id != p.step_id:
            raise ValueError(f"parameter server {self.server_index} is summing step {p.step_id} of partition "
                             f"{p.partition.index} but worker {worker_index} pushed step {step_id}")
        if worker_index not in p.contributors:
            raise ValueError(f"parameter server {self.server_index} expects partition {p.partition.index} from "
                             f"{sorted(p.contributors)} (a node's relay pushes as its lowest worker), "
                             f"not from worker {worker_index}")
        if worker_index in p.waiting:
            raise ValueError(f"worker {worker_index} pushed partition {p.partition.index} of step {step_id} twice")
        end = self._end(p, worker_index)
        if end.crosses_nodes:
            p.pushed_from_elsewhere += 1
        if worker_index in p.relay_ends:
            return end.read(p.partial_sum(), p.relay_offset, p.segments, stored)
        return end.read(p.partition, p.offset, p.segments, stored)

    def _end(self, p: PartitionState, key: int) -> ServerEnd:
        """The transport end a push of ``p`` by ``key`` comes through: a relay's partial sum its own (``key``, the
        node's lowest worker, may have a worker's end here too)."""
        return p.relay_ends[key] if key in p.relay_ends else self.ends[key]

    def _sum(self, p: PartitionState, step_id: int, inputs: list[list[np.ndarray]], averaged: tuple[int, ...],
             recorder: timeline.Recorder) -> tuple[ray.ObjectRef | None, tuple[int, ...]]:
        """Average the pushes (``averaged``: the workers they stand for) into the step's mean slot; the mean's ref
        if remote workers read it, and the workers the mean averages. A compressed partition is averaged in
        float32 and its mean rounded once to 16 bits. A relayed partition is summed, then pushed on (``_relay``)."""
        mean = p.mean(step_id)
        if p.home is not None:  # a relay: the node's sum, in float32 if compressed
            target, divisor, average = (mean if p.total is None else p.total), 1, arrays.average_into
        else:
            target, divisor = mean, len(averaged)
            compressed = p.partition.wire_dtype != p.partition.dtype
            average = arrays.average_rounded_into if compressed else arrays.average_into
        what = "sum" if p.home is not None else "average"
        with recorder.span(f"{what} partition {p.partition.index} of workers {list(averaged)}", "sum"):
            for k, (start, size) in enumerate(p.segments):
                average(target[start:start + size], [pushed[k] for pushed in inputs], divisor)
        if p.home is not None:
            ref, averaged = self._relay(p, step_id, averaged, recorder)
            if ref is not None:  # through the object store: its server's mean, for workers here on it
                return ref, averaged
        if not any(end.remote for end in [*p.relay_ends.values(), *self.ends.values()]):
            return None, averaged
        with recorder.span(f"put the mean of partition {p.partition.index} for remote workers", "sum"):
            return object_store.put([mean]), averaged

    def _relay(self, p: PartitionState, step_id: int, summed: tuple[int, ...],
               recorder: timeline.Recorder) -> tuple[ray.ObjectRef | None, tuple[int, ...]]:
        """Push the node's partial sum of ``p`` (in its mean slot, or its float32 sum if compressed) to its server
        as workers ``summed`` and wait (bounded) for the mean in the slot: down the stream to that server, which
        sends the mean straight into the slot, else through the object store. The mean's ref if it came through
        the object store (for workers here on it), and the workers it averages."""
        mean = p.mean(step_id)
        home = p.home
        partial = mean if p.total is None else p.total
        parts = [partial[start:start + size] for start, size in p.segments]
        stream = self.relay_streams.get(home)
        timed_out = (f"parameter server {self.server_index} waited more than {self.step_timeout_s:.0f}s for "
                     f"parameter server {home}'s mean of partition {p.partition.index}, step {step_id} (it relays "
                     f"workers {list(summed)}' partial sum)")
        died = (f"parameter server {self.server_index}: parameter server {home}, which sums partition "
                f"{p.partition.index}, died in step {step_id}")
        with recorder.span(f"push the node's partial sum of partition {p.partition.index} (workers {list(summed)}, "
                           f"{partial.nbytes} bytes) to parameter server {home}", "relay"):
            if stream is not None:
                try:
                    epoch = stream.send(step_id, p.partition.index, parts)
                    return None, tuple(stream.wait(step_id, p.partition.index, self.step_timeout_s, epoch))
                except TimeoutError:  # the send's or the wait's; the server's own errors come as they are
                    raise DSGDTimeoutError(timed_out) from None
                except OSError:  # end of file: the server died (or was replaced)
                    raise StepAborted(died) from None
                except streams.Forgotten:
                    raise StepAborted(f"parameter server {self.server_index}: step {step_id} was reset") from None
            call = self.peers[home].push.remote(step_id, min(summed), p.partition.index, object_store.put(parts))
            try:
                [ref], averaged = ray.get(call, timeout=self.step_timeout_s)
                [got] = object_store.join(ray.get(ref, timeout=self.step_timeout_s), [p.partition.size])
            except ray.exceptions.GetTimeoutError:
                raise DSGDTimeoutError(timed_out) from None
            except ray.exceptions.RayActorError:
                raise StepAborted(died) from None
            except ray.exceptions.RayTaskError as e:  # the server's own error (aborted, a bad push): as it is
                raise (e.cause if isinstance(e.cause, (DSGDError, StepAborted, ValueError)) else e) from None
            np.copyto(mean, got)
        return ref, tuple(averaged)

    def traffic(self) -> dict[int, int]:
        """Partition -> how many pushes of it brought their data from another node (down a stream or through the
        object store), since the start; a relayed partition is not counted here but at its server."""
        with self.changed:
            return {j: p.pushed_from_elsewhere for j, p in self.partitions.items() if p.home is None}

    # ---- control -----------------------------------------------------------

    def _check_not_aborted(self, p: PartitionState, step_id: int) -> None:
        if self.aborted and step_id not in p.done:
            raise StepAborted(f"parameter server {self.server_index}: step {step_id} was aborted")

    def abort(self) -> None:
        """Fail every waiting and future push until ``reset``."""
        with self.changed:
            self.aborted = True
            self.changed.notify_all()

    def reset(self, step_id: int) -> None:
        """Forget partial sums and aborted steps; expect ``step_id`` next."""
        with self.changed:
            self.resets += 1
            for p in self.partitions.values():
                p.waiting.clear()
                p.done.clear()
                p.failures.clear()
                p.step_id = step_id
            self.begun = {w: step_id - 1 for w in range(self.num_workers)}
            for stream in self.relay_streams.values():  # the failed step's answers are dropped, its waits fail
                stream.forget()
            broken = any(stream.broken for stream in self.relay_streams.values())
            self.aborted = False
            self.changed.notify_all()
        if broken:  # a stream that ended with both servers alive (a send cut short): open them anew
            self.set_peers(self.peers)

    def _recorder(self, step_id: int) -> timeline.Recorder:
        if step_id not in self.traces:
            self.traces = {k: v for k, v in self.traces.items() if k >= step_id - 1}
            self.traces[step_id] = timeline.Recorder()
        return self.traces[step_id]

    def trace(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id`` (kept for the last two steps)."""
        with self.changed:
            return list(self.traces[step_id].events) if step_id in self.traces else []

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("parameter server", self.server_index)

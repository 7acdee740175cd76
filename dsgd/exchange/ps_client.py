"""The worker's side of the parameter-server protocol (``dsgd.ps_actor`` is the other).

A worker sends each partition of its averaged gradients to the server that
sums it and reads back the mean. ``connect`` attaches to every server and
picks the transport of each worker-server pair (``dsgd.transport.ends``): shared
memory with a server on the worker's own node, a stream with one elsewhere
(the object store where a stream cannot be used).

Per partition and step the worker pushes once and waits (bounded) for the
answer, through its transport end: with shared memory, a message on the
pair's signal channel each way; with a stream, the partition's bytes one way
and the mean's the other; neither makes a Ray call. With the object store,
an actor call (``push``) and a wait for its reply. With backup workers, a
step starts with ``begin``: one call per server, which says which partitions
of the step are closed already.

The step only hands its partitions over (``hand``, ``hand_gradients``) and
picks their means up (``collect``): a ``dsgd.transport.scheduler.SendScheduler``
pushes them (``send``, ``send_gradients``) and reads the answers
(``receive``), a sender and a reader for each server this worker pushes
to, paced by the send schedule's policy (``WorkerConfig.send_schedule``,
``dsgd.transport.pacing``); the client is its lanes (``push``, ``mean``,
``pace``).

No TensorFlow here: the worker's exchanges (``dsgd.exchange.ps``) call in.
"""

from __future__ import annotations

from typing import Any, ContextManager, Sequence, Union

import numpy as np
import ray

from dsgd.transport import pacing, shared_memory, signals, streams, tls
from dsgd.common import timeline
from dsgd.common.calls import peer_errors
from dsgd.config import DEFAULT_SEND_SCHEDULE
from dsgd.errors import ActorFailure, DSGDError
from dsgd.wire.partitions import Partition, segments
from dsgd.transport.ends import ObjectStoreWorkerEnd, SharedMemoryWorkerEnd, StreamWorkerEnd, connect_or_fall_back
from dsgd.transport.scheduler import SendScheduler

WorkerEnd = Union[SharedMemoryWorkerEnd, StreamWorkerEnd, ObjectStoreWorkerEnd]
EXCHANGE_TRACK = "exchange"  # the timeline track of the sends and receives


class ParameterServerClient:
    """Pushes one worker's partitions to their servers and reads back the means."""

    def __init__(self, worker_index: int, layout: Sequence[Partition], placement: Sequence[int],
                 step_timeout_s: float, startup_timeout_s: float, rounds: Sequence[Sequence[int]] | None = None,
                 schedule: str = DEFAULT_SEND_SCHEDULE):
        """``placement[j]``: the index of the server that sums ``layout[j]``; ``rounds``: the partitions'
        indices in the order this worker pushes them, round by round (the driver's
        ``dsgd.cluster.server_plan.send_rounds``; the same round sets on every worker), by default layout order,
        a partition a round. ``schedule``: the send schedule's policy (``dsgd.transport.pacing.policy``).

        ``step_timeout_s`` bounds each wait for a mean, ``startup_timeout_s``
        each wait for a server to attach.
        """
        self.worker_index = worker_index
        self.averaged: dict[int, tuple[int, ...]] = {}  # partition -> the workers its last mean averaged
        self.layout = list(layout)
        self.placement = list(placement)
        self.rounds = self._checked(rounds)
        self.pacing = pacing.policy(schedule)
        self.scheduler: SendScheduler | None = None  # once connected
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.segments = [segments(partition) for partition in self.layout]
        self.sent_bytes = sum(seg.wire_nbytes for parts in self.segments for seg in parts)  # per step
        self.servers: list[Any] = []
        self.server_ends: list[WorkerEnd] = []  # per server: its transport
        self.ends: list[WorkerEnd] = []  # per partition: its route's transport
        self.routes = list(self.placement)  # partition -> the server it is pushed to (``connect``)

    def _checked(self, rounds: Sequence[Sequence[int]] | None) -> list[list[int]]:
        """``rounds`` (by default a partition a round, in layout order), checked to hold every partition once."""
        checked = [[j] for j in range(len(self.layout))] if rounds is None else [list(r) for r in rounds]
        if sorted(j for r in checked for j in r) != list(range(len(self.layout))) or not all(checked):
            raise ValueError(f"worker {self.worker_index}'s send rounds {checked} must hold every partition index "
                             f"0..{len(self.layout) - 1} once, in non-empty rounds")
        return checked

    def connect(self, servers: Sequence[Any], routes: Sequence[int] | None = None,
                rounds: Sequence[Sequence[int]] | None = None) -> int:
        """Attach to every server and pick each pair's transport; the number reached through shared memory.

        ``routes[j]`` (default: the placement): the server partition j is pushed to, its node's relay or its own.
        ``rounds``: a new push order, which the send scheduler takes up.
        """
        if rounds is not None:
            self.rounds = self._checked(rounds)
        self._close_ends()
        self.servers = list(servers)
        self.routes = list(self.placement if routes is None else routes)
        node = ray.get_runtime_context().get_node_id()
        infos = self._wait([s.attach.remote(self.worker_index, node) for s in self.servers],
                           "the parameter servers to attach", self.startup_timeout_s)
        self.server_ends = [self._end(index, server, info)
                            for index, (server, info) in enumerate(zip(self.servers, infos))]
        self.ends = [self.server_ends[server] for server in self.routes]
        if self.scheduler is None:
            self.scheduler = SendScheduler(self, self.routes, self.pacing, self.rounds)
        else:
            self.scheduler.attach(self, self.routes, self.rounds)
        return sum(isinstance(end, SharedMemoryWorkerEnd) for end in self.server_ends)

    def close(self) -> None:
        """Close every transport end (its signal channel) and drop it, unmapping the servers' shared buffers: the
        servers were replaced (a recovery re-attaches, a resize starts new ones); the send scheduler's threads
        end.

        The old exchange's graph ops may keep this client alive, but not its buffers or sockets.
        """
        if self.scheduler is not None:
            self.scheduler.close()
        self._close_ends()

    def _close_ends(self) -> None:
        for end in self.server_ends:
            end.close()
        self.server_ends, self.ends, self.servers = [], [], []

    def _end(self, index: int, server: Any, info: dict | None) -> WorkerEnd:
        """Server ``index``'s transport: the shared buffers or the stream it offered (``info``), else the object
        store."""
        end = connect_or_fall_back(
            info, lambda offer: self._offered_end(index, offer),
            lambda: self._wait(server.attach.remote(self.worker_index, None), "a parameter server to re-attach",
                               self.startup_timeout_s))
        return ObjectStoreWorkerEnd() if end is None else end

    def _offered_end(self, index: int, info: dict) -> StreamWorkerEnd | SharedMemoryWorkerEnd:
        """The end server ``index`` offered; OSError if this process cannot reach it (same node but another PID or
        network namespace, no route to the stream, or Ray's TLS is on and its files cannot make the stream's)."""
        partitions = [p for p, server in zip(self.layout, self.routes) if server == index]
        if "stream" in info:
            return StreamWorkerEnd(info["stream"], info["slots"], partitions,
                                   min(self.startup_timeout_s, streams.CONNECT_TIMEOUT_S), self.step_timeout_s,
                                   tls.ray_client_context())
        return SharedMemoryWorkerEnd(shared_memory.attach(info["input"], writable=True),
                                     shared_memory.attach(info["mean"], writable=False), info["offsets"],
                                     info["slots"], partitions, signals.Channel(info["signal"], self.step_timeout_s))

    def send(self, partition: Partition, step_id: int, arrays: Sequence[np.ndarray]) -> Any:
        """Push ``arrays``, one per segment of ``partition`` (``dsgd.wire.partitions.segments``): the push's ticket
        (its end's)."""
        return self._push(partition, step_id, self.ends[partition.index].write(
            partition, self.segments[partition.index], arrays))

    def send_gradients(self, partition: Partition, step_id: int, grads: Sequence[np.ndarray]) -> Any:
        """Push ``partition``'s pieces of ``grads`` (every exchange tensor, in layout order)."""
        return self._push(partition, step_id, self.ends[partition.index].write_gradients(
            partition, self.segments[partition.index], grads))

    def _push(self, partition: Partition, step_id: int, stored: ray.ObjectRef | None) -> Any:
        server = self.routes[partition.index]
        with self._bounded(f"parameter server {server} to take partition {partition.index}, step {step_id}",
                           self.step_timeout_s):
            return self.ends[partition.index].push(self.servers[server], self.worker_index, partition, step_id,
                                                   stored)

    def receive(self, partition: Partition, step_id: int, ticket: Any = None) -> np.ndarray:
        """The mean of ``partition`` for ``step_id`` (read-only; valid until the next step's push); ``ticket``: the
        push's (``send``'s), if known."""
        what = f"parameter server {self.routes[partition.index]}'s sum of partition {partition.index}, step {step_id}"
        with self._bounded(what, self.step_timeout_s):
            answer = self.ends[partition.index].answer(partition, step_id, self.step_timeout_s, ticket)
        return self.read(partition, step_id, answer)

    # ---- the step's side of the send scheduler, then the scheduler's lanes ----

    def hand(self, partition: Partition, step_id: int, arrays: Sequence[np.ndarray],
             trace: timeline.Recorder | None = None) -> None:
        """Hand ``arrays`` (as for ``send``) to the send scheduler, which pushes them; returns at once. The arrays
        are kept until pushed: they must not change meanwhile."""
        self.scheduler.hand(partition.index, step_id, (False, arrays), trace)

    def hand_gradients(self, partition: Partition, step_id: int, grads: Sequence[np.ndarray],
                       trace: timeline.Recorder | None = None) -> None:
        """Hand ``partition``'s pieces of ``grads`` (as for ``send_gradients``) to the send scheduler."""
        self.scheduler.hand(partition.index, step_id, (True, grads), trace)

    def collect(self, partition: Partition, step_id: int, trace: timeline.Recorder | None = None) -> np.ndarray:
        """The mean of ``partition`` for ``step_id`` once the scheduler has read it (as ``receive`` returns it);
        the step's first error if a push or a read of it failed."""
        what = f"parameter server {self.routes[partition.index]}'s sum of partition {partition.index}, step {step_id}"
        with timeline.maybe_span(trace, f"collect the mean of partition {partition.index}", EXCHANGE_TRACK), \
                self._bounded(what, self.step_timeout_s):
            return self.scheduler.result(partition.index, step_id, self.step_timeout_s)

    def push(self, j: int, step_id: int, payload: tuple[bool, Sequence[np.ndarray]]) -> Any:
        """The scheduler's push of partition ``j``: ``payload`` as ``hand`` or ``hand_gradients`` gave it."""
        gradients, arrays = payload
        send = self.send_gradients if gradients else self.send
        return send(self.layout[j], step_id, arrays)

    def mean(self, j: int, step_id: int, ticket: Any) -> np.ndarray:
        """The scheduler's read of partition ``j``'s mean (bounded as ``receive``)."""
        return self.receive(self.layout[j], step_id, ticket=ticket)

    def crosses_nodes(self, server: int) -> bool:
        """Whether this worker's pushes to ``server`` cross nodes on a stream of their own (one a policy may pace)."""
        return self.server_ends[server].crosses_nodes

    def pace(self, server: int, bytes_per_s: int) -> None:
        """Send at most ``bytes_per_s`` down the stream to ``server``."""
        self.server_ends[server].pace(bytes_per_s)

    def read(self, partition: Partition, step_id: int, answer: tuple[list, tuple[int, ...]]) -> np.ndarray:
        """The mean of ``partition`` for ``step_id`` from its server's ``answer`` (to a push, or from ``begin``)."""
        reply, self.averaged[partition.index] = answer
        return self.ends[partition.index].read_mean(partition, step_id, reply,
                                                lambda ref, mean: self._wait(ref, f"{mean}, step {step_id}"))

    def begin(self, step_id: int) -> dict[int, tuple[list, tuple[int, ...]]]:
        """Tell every server this worker starts ``step_id`` (backup workers); the partitions already closed, each
        with its server's answer for ``read``."""
        answers = self._wait([s.begin.remote(step_id, self.worker_index) for s in self.servers],
                             f"the parameter servers to say which partitions of step {step_id} are closed")
        return {j: answer for per_server in answers for j, answer in per_server.items()}

    def kept(self) -> list[int]:
        """The workers whose gradients every partition of the last step read averaged, in order."""
        return sorted(set.intersection(*(set(a) for a in self.averaged.values())))

    def forget_pushes(self) -> None:
        """Drop the pushes of a failed step and their answers (the driver aborts and resets the servers); open
        anew every stream that ended while its server may live on (a send cut short), so the re-run of the step
        does not fail on it again. A server that does not answer is dead: the recovery replaces it and
        ``connect`` attaches anew."""
        if self.scheduler is not None:
            self.scheduler.forget()
        for end in set(self.ends):  # one end per server, shared by its partitions
            end.forget()
        node = ray.get_runtime_context().get_node_id()
        broken = [index for index, end in enumerate(self.server_ends) if end.broken]
        for index in broken:
            self.server_ends[index].close()
            try:
                info = ray.get(self.servers[index].attach.remote(self.worker_index, node), timeout=self.step_timeout_s)
                self.server_ends[index] = self._end(index, self.servers[index], info)
            except (ray.exceptions.RayError, OSError, DSGDError):
                pass  # left broken: a dead server, which the recovery replaces
        self.ends = [self.server_ends[server] for server in self.routes]
        if self.scheduler is not None and broken:  # new streams: paced anew
            self.scheduler.attach(self, self.routes, self.rounds)

    def _wait(self, refs, what: str, timeout_s: float | None = None):
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        with self._bounded(what, timeout_s):
            return ray.get(refs, timeout=timeout_s)

    def _bounded(self, what: str, timeout_s: float) -> ContextManager[None]:
        """A wait for ``what`` that ran out (TimeoutError) as DSGDTimeoutError, a server whose channel or stream
        closed (ConnectionError: it died) as ActorFailure; both name this worker and ``what``."""
        return peer_errors(f"worker {self.worker_index} waited more than {timeout_s:.0f}s for {what}; "
                           "a worker or parameter server is stuck or dead",
                           lambda e: ActorFailure(f"worker {self.worker_index} lost {what}: {e}"))

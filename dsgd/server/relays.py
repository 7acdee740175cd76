"""Node-local aggregation: a server sums its node's copies of another server's partition and pushes the sum on.

On a node without partition j's server that holds several workers, one
server there relays j (``Relay``, planned by
``dsgd.cluster.server_plan.plan_relays``). Its local workers push j to it
as to any local server; once all have, it sums their copies (float32, worker
order) and pushes the node's partial sum to j's server as one push standing
for those workers (keyed by the lowest of them), waits for the mean, and has
it in its mean slot for them. The push goes down a stream to j's server
(``RelayLinks.connect`` -> the server's ``attach_relay``: one stream per
relaying server and server it pushes to, the mean read straight into the
mean slot) or, where the stream cannot connect, through the object store.
j's server sums its own workers' copies and the nodes' partial sums (lowest
worker first) and divides by the number of workers they stand for
(``NodeSums`` holds the ends the partial sums come through). So one copy of
j per node crosses each way per step, whatever the node's number of workers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import ray

from dsgd.common import timeline
from dsgd.common.calls import peer_errors
from dsgd.errors import DSGDError, StepAborted
from dsgd.server.layout import Place, partial_sum_offsets
from dsgd.transport import object_store, streams, tls
from dsgd.transport.answers import Forgotten
from dsgd.transport.ends import ObjectStoreServerEnd, StreamServerEnd, connect_or_fall_back
from dsgd.wire.partitions import Partition


@dataclass(frozen=True)
class Relay:
    """This server sums ``workers``' copies of ``partition`` (its node's workers) and pushes the sum to server
    ``home``."""

    partition: Partition
    home: int
    workers: tuple[int, ...]


@dataclass(frozen=True)
class RelayedPartition:
    """A partition this server relays: where its partial sum goes, and what it is summed in."""

    home: int  # the server its partial sum goes to
    total: np.ndarray | None  # compressed: the float32 array the node's copies are summed in (else the mean slot)

    @staticmethod
    def of(relay: Relay) -> RelayedPartition:
        partition = relay.partition
        compressed = partition.wire_dtype != partition.dtype
        return RelayedPartition(relay.home, np.zeros(partition.size, partition.dtype) if compressed else None)

    def partial(self, place: Place, step_id: int) -> np.ndarray:
        """The array the node's partial sum of ``step_id`` is summed in."""
        return place.mean(step_id) if self.total is None else self.total


class NodeSums:
    """At a partition's server: the ends the nodes' partial sums come through, and where a stream puts them."""

    def __init__(self, server_index: int, node_sums: Mapping[int, Sequence[tuple[int, ...]]],
                 partitions: Sequence[Partition]):
        """``node_sums[j]``: the worker groups (one per node) whose partial sums of partition j come from relays;
        each arrives through the object store until its relay attaches (``attach``)."""
        self.ends: dict[int, dict[int, StreamServerEnd | ObjectStoreServerEnd]] = {
            j: {min(group): ObjectStoreServerEnd(server_index, min(group)) for group in groups}
            for j, groups in node_sums.items() if groups}  # partition -> relay key (lowest worker) -> its end
        self.offsets, self.nbytes = partial_sum_offsets([p for p in partitions if p.index in self.ends])
        self.sources: dict[int, StreamServerEnd] = {}  # relaying server -> the stream it pushes here down

    def end(self, j: int, key: int) -> StreamServerEnd | ObjectStoreServerEnd | None:
        """The end partition j's partial sum pushed as ``key`` comes through; None if ``key`` pushes no such sum."""
        return self.ends.get(j, {}).get(key)

    def expects(self, j: int, key: int) -> bool:
        return self.end(j, key) is not None

    def attach(self, relay: int, key: int, indices: Sequence[int],
               end: StreamServerEnd | ObjectStoreServerEnd) -> None:
        """Server ``relay``'s partial sums of the partitions ``indices``, pushed as ``key``, come through ``end``
        from now on."""
        old = self.sources.pop(relay, None)
        if old is not None:
            old.close()
        if isinstance(end, StreamServerEnd):
            self.sources[relay] = end
        for j in indices:
            self.ends[j][key] = end

    def any_remote(self, j: int) -> bool:
        """Whether some partial sum of partition j comes through the object store (and so reads its mean there)."""
        return any(end.remote for end in self.ends.get(j, {}).values())


class RelayLinks:
    """A relaying server's links to the servers it pushes partial sums to: a stream each where it connects."""

    def __init__(self, server_index: int, step_timeout_s: float, lock: threading.Condition, generation: int = 0):
        """``lock``: the server's, which guards the streams (``forget`` and ``transport`` are called under it);
        ``generation``: the server's (its streams' epoch, until ``forget``)."""
        self.server_index = server_index
        self.generation = generation
        self.step_timeout_s = step_timeout_s
        self.lock = lock
        self.peers: list = []  # every server's actor, index = server index
        self.streams: dict[int, streams.Stream] = {}  # server -> the stream this one's partial sums go down

    def connect(self, servers: Sequence, homes: Mapping[int, Sequence[int]], key: Callable[[int], int],
                node_id: str, mean: Callable[[int, int], np.ndarray]) -> None:
        """Attach to each server of ``homes`` (server -> the partitions relayed to it) as ``key(server)`` (the
        node's lowest worker) and open the stream it offers, else settle for the object store. ``mean(step_id,
        j)``: where partition j's mean coming back down a stream goes. Streams to the servers before are closed."""
        with self.lock:
            self.peers = list(servers)
        self.close()
        calls = {home: servers[home].attach_relay.remote(self.server_index, key(home), node_id, indices)
                 for home, indices in homes.items()}
        for home, call in calls.items():
            stream = connect_or_fall_back(
                self._answer_of(call, home),
                lambda address: self._stream(address, mean),
                lambda: self._answer_of(servers[home].attach_relay.remote(self.server_index, key(home), None,
                                                                          homes[home]), home))
            if stream is not None:
                with self.lock:
                    self.streams[home] = stream

    def _stream(self, address: tuple[str, int, bytes], mean: Callable[[int, int], np.ndarray]) -> streams.Stream:
        """A stream to the server at ``address`` (over TLS if Ray's is on); OSError if it cannot be opened."""
        return streams.Stream(address, mean, min(self.step_timeout_s, streams.CONNECT_TIMEOUT_S), self.step_timeout_s,
                              self.generation, tls.ray_client_context())

    def _answer_of(self, call: ray.ObjectRef, home: int):
        """``call``'s (to server ``home``) answer, waited for at most the step timeout."""
        with peer_errors(f"parameter server {self.server_index} waited more than {self.step_timeout_s:.0f}s for "
                         f"parameter server {home} to take its relays"):
            return ray.get(call, timeout=self.step_timeout_s)

    def transport(self, home: int) -> str:
        """How partial sums go to server ``home``: "stream" or "object store"."""
        return "stream" if home in self.streams else "object store"

    def forget(self, generation: int) -> bool:
        """Drop the answers of a failed step (its waits fail); pushes from now on are of ``generation``. Whether a
        stream broke and needs opening anew."""
        self.generation = generation
        for stream in self.streams.values():
            stream.forget(generation)
        return any(stream.broken for stream in self.streams.values())

    def close(self) -> None:
        """Close every stream."""
        with self.lock:
            old, self.streams = self.streams, {}
        for stream in old.values():
            stream.close()

    def push(self, place: Place, relayed: RelayedPartition, step_id: int, summed: tuple[int, ...],
             recorder: timeline.Recorder, generation: int) -> tuple[ray.ObjectRef | None, tuple[int, ...]]:
        """Push the node's partial sum of ``place``'s partition as workers ``summed``, summed in ``generation``
        (its server refuses it if that is not its own: it was summed before a reset), to its server and wait
        (bounded) for the mean in the mean slot: down the stream to that server, which sends the mean straight
        into the slot, else through the object store. The mean's ref if it came through the object store (for
        workers here on it), and the workers it averages."""
        partition, home = place.partition, relayed.home
        partial = relayed.partial(place, step_id)
        parts = [partial[start:start + size] for start, size in place.segments]
        timed_out = (f"parameter server {self.server_index} waited more than {self.step_timeout_s:.0f}s for "
                     f"parameter server {home}'s mean of partition {partition.index}, step {step_id} (it relays "
                     f"workers {list(summed)}' partial sum)")
        died = StepAborted(f"parameter server {self.server_index}: parameter server {home}, which sums partition "
                           f"{partition.index}, died in step {step_id}")
        with recorder.span(f"push the node's partial sum of partition {partition.index} (workers {list(summed)}, "
                           f"{partial.nbytes} bytes) to parameter server {home}", "relay"):
            stream = self.streams.get(home)
            if stream is not None:
                try:  # the stream ended (OSError): the server died or was replaced; its own errors come as they are
                    with peer_errors(timed_out, lambda _: died, lambda e: e if isinstance(e, OSError) else None):
                        epoch = stream.send(step_id, partition.index, parts, generation)
                        return None, tuple(stream.wait(step_id, partition.index, self.step_timeout_s, epoch))
                except Forgotten:
                    raise StepAborted(f"parameter server {self.server_index}: step {step_id} was reset") from None
            call = self.peers[home].push.remote(step_id, min(summed), partition.index, object_store.put(parts),
                                                generation)
            try:
                with peer_errors(timed_out, lambda _: died,
                                 lambda e: e if isinstance(e, ray.exceptions.RayActorError) else None):
                    [ref], averaged = ray.get(call, timeout=self.step_timeout_s)
                    [got] = object_store.join(ray.get(ref, timeout=self.step_timeout_s), [partition.size])
            except ray.exceptions.RayTaskError as e:  # the server's own error (aborted, a bad push): as it is
                raise (e.cause if isinstance(e.cause, (DSGDError, StepAborted, ValueError)) else e) from None
            np.copyto(place.mean(step_id), got)
        return ref, tuple(averaged)

"""Each pair's transport, the server's side: which one a worker (or a relaying server) gets, and its end.

A worker on the server's node gets shared buffers and a signal channel, one
on another node an input buffer here and a stream, except with backup
workers (a worker catching up reads closed steps' means from ``begin``'s
reply); those, and a worker that could not map the buffers or reach the
stream, push through the object store (``dsgd.transport.ends`` describes the
three). A relaying server on another node pushes its partial sums down a
stream of its own, else through the object store. When Ray encrypts its
traffic, every stream is TLS with Ray's certificates; if they cannot be
used here, no stream is offered (said once in the log).
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import numpy as np

from dsgd.server.layout import BufferLayout, Place, partial_sum
from dsgd.transport import tls
from dsgd.transport.streams import Arrivals
from dsgd.transport.ends import (ObjectStoreServerEnd, SharedMemoryServerEnd, StreamServerEnd, byte_places,
                                 note_fallback)

ServerEnd = SharedMemoryServerEnd | StreamServerEnd | ObjectStoreServerEnd
Push = Callable[[int, int], tuple[list, tuple[int, ...]]]  # (step, partition index) -> the push's answer
Mean = Callable[[int, int], np.ndarray]  # (step, partition index) -> the mean the answer goes with


class Transports:
    """The server's end of each worker's transport; the object store's until the worker attaches on this node."""

    def __init__(self, server_index: int, num_workers: int, node_id: str, host: str, layout: BufferLayout,
                 step_timeout_s: float):
        """``node_id``: this server's node; ``host``: its address, where streams from other nodes connect."""
        self.server_index = server_index
        self.node_id = node_id
        self.host = host
        self.layout = layout
        self.step_timeout_s = step_timeout_s
        self.ends: dict[int, ServerEnd] = {w: ObjectStoreServerEnd(server_index, w) for w in range(num_workers)}

    def _streams_from(self, node_id: str | None) -> bool:
        """Whether a pusher on ``node_id`` gets a stream: it is on another node, no step is read late, and Ray's
        TLS is off or its files make the stream's (else said once in the log)."""
        if node_id is None or node_id == self.node_id or self.layout.slots != 1:
            return False
        try:
            tls.ray_server_context()
        except tls.TlsUnavailable as e:
            note_fallback(f"parameter server {self.server_index} offers no stream ({e})")
            return False
        return True

    def attach(self, worker_index: int, node_id: str | None, push: Push, mean: Mean,
               relayed: Collection[int], arrivals: Arrivals | None = None) -> dict | None:
        """Pick worker ``worker_index``'s transport and make its end (closing the one before); how the worker
        reaches it (``ParameterServer.attach``). ``push``, ``mean``: the server's push of this worker and the
        mean it answered with; ``relayed``: the partitions whose pushes are answered each on a thread of its own
        (their sums cross to another node and back); ``arrivals``: what the server does with a stream's push as
        it arrives (None: nothing before it is answered)."""
        self.ends[worker_index].close()  # a re-attach after a recovery: an old buffer goes with its fd
        layout = self.layout
        if self._streams_from(node_id):
            end = self.ends[worker_index] = self._stream_end(
                worker_index, layout.nbytes, {j: byte_places(place.partition, place.offset, place.segments)
                                              for j, place in layout.places.items()}, push, mean, relayed, arrivals)
            return {**end.address(), "slots": layout.slots}
        if not layout.shared or node_id != self.node_id:
            self.ends[worker_index] = ObjectStoreServerEnd(self.server_index, worker_index)
            return None
        end = self.ends[worker_index] = SharedMemoryServerEnd(self.server_index, worker_index, layout.nbytes, push,
                                                              self.step_timeout_s, relayed=relayed)
        return {**end.address(), "mean": layout.mean_buffer.address(), "offsets": layout.offsets(),
                "slots": layout.slot_offsets()}

    def relay_end(self, key: int, node_id: str | None, places: Sequence[Place], offsets: dict[int, int],
                  nbytes: int, push: Push, mean: Mean, arrivals: Arrivals) -> StreamServerEnd | ObjectStoreServerEnd:
        """The end the partial sums of ``places``' partitions come through from a relaying server on ``node_id``,
        pushed as ``key``: a stream with an input buffer of ``nbytes``, each partial sum in float32 at its
        ``offsets``, where it can be; else the object store."""
        if not self._streams_from(node_id):
            return ObjectStoreServerEnd(self.server_index, key)
        return self._stream_end(  # each answered on a thread of its own: it waits for this node's workers
            key, nbytes, {p.partition.index: byte_places(partial_sum(p.partition), offsets[p.partition.index],
                                                         p.segments) for p in places},
            push, mean, [p.partition.index for p in places], arrivals)

    def _stream_end(self, key: int, nbytes: int, places: dict[int, list[tuple[int, int]]], push: Push,
                    mean: Mean, relayed: Collection[int], arrivals: Arrivals | None) -> StreamServerEnd:
        """A stream end for ``key``'s pushes, with an input buffer of ``nbytes``: partition j's segments go to
        ``places[j]`` (``byte_places``)."""
        return StreamServerEnd(self.server_index, key, self.host, nbytes, places, push, mean, self.step_timeout_s,
                               relayed=relayed, tls_context=tls.ray_server_context(), arrivals=arrivals)

    def any_remote(self) -> bool:
        """Whether some worker reads its means through the object store."""
        return any(end.remote for end in self.ends.values())

"""How one worker and one parameter server move a partition: the three transports, both ends of each.

A worker and a server pick one transport per pair when the worker attaches
(``ParameterServer.attach``, ``ParameterServerClient.connect``):

- **shared memory**, a worker on the server's node: the server creates an
  input buffer for that worker and one mean buffer for all its local
  workers (``dsgd.transport.shared_memory``), and a signal channel for the pair
  (``dsgd.transport.signals``), once; every step the worker writes its segments into
  its input buffer, says so on the channel, waits there for the server's
  "the mean is ready" and reads the mean in place. No Ray call per
  partition: the server's end answers each announcement with
  ``ParameterServer.push`` on the channel's thread.
- **stream**, a worker on another node (``dsgd.transport.streams``): the server
  gives the worker an input buffer and a TCP stream of the pair's own; every
  step the worker sends each partition's segments down the stream, straight
  from its arrays, the server receives them into the input buffer, sums as
  for a worker on its node and sends the mean back, into a buffer of the
  worker's. No Ray call and no object per partition. When Ray encrypts its
  traffic, so does the stream (``dsgd.transport.tls``). A relaying server's
  partial sums (node-local aggregation, ``dsgd.server.relays``) travel the same
  way to the partition's server on another node (its
  ``ParameterServer.attach_relay`` makes a ``StreamServerEnd``, the relaying
  server holds a ``streams.Stream``), in float32 under compression, their
  means coming back in the wire dtype.
- **object store**, a worker that can reach neither (the stream's connection
  failed, e.g. a firewall between the nodes, or Ray's TLS is on and its
  files cannot make the stream's) and, with backup workers, any
  worker on another node (a worker catching up reads the means of closed
  steps from the server's reply to ``begin``); likewise a relaying server
  whose stream could not connect: a push is an actor call
  carrying the worker's segments as one object (``dsgd.transport.object_store.put``),
  its reply the reference of the mean, which the server puts once per
  partition and step.

The worker's end (``SharedMemoryWorkerEnd``, ``ObjectStoreWorkerEnd``)
writes a partition, pushes it (``push``), waits for the server's answer
(``answer``, bounded) and reads its mean; the server's end
(``SharedMemoryServerEnd``, ``ObjectStoreServerEnd``) reads a push's
segments and answers it. Both ends move a partition in its wire dtype
(``Partition.wire_dtype``): under compression a float32 partition is written
and read in 16-bit form (``dsgd.wire.codec``), converted while it is packed, and
the server sums it into its float32 sum (``dsgd.wire.arrays.average_into``) and
rounds the mean once into its 16-bit mean.

No TensorFlow here: the parameter servers import this module.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any, Callable, Collection, Sequence, TypeVar

import numpy as np
import ray

from dsgd.transport import object_store, shared_memory, signals, streams
from dsgd.wire.partitions import Segment, Partition, pack, segment_arrays

Offer = TypeVar("Offer")
End = TypeVar("End")

logger = logging.getLogger(__name__)
_fell_back = False  # ``note_fallback`` said so already in this process


def note_fallback(why: object) -> None:
    """Log, once per process, that some pair's pushes go through the object store instead of the transport it was
    meant to have, and ``why``; later fallbacks of the process only at debug level."""
    global _fell_back
    logger.log(logging.DEBUG if _fell_back else logging.WARNING,
               "dsgd: %s; those pushes go through Ray's object store instead (which Ray's TLS, if on, encrypts)", why)
    _fell_back = True


def connect_or_fall_back(offer: Offer | None, connect: Callable[[Offer], End],
                         fall_back: Callable[[], Any]) -> End | None:
    """The end ``connect`` opens to what a server offered (``offer``: shared buffers, or a stream); None if it
    offered nothing, or if its offer cannot be reached (``connect`` raises OSError: said once in the log), in
    which case ``fall_back`` tells the server to take the pushes through the object store instead."""
    if offer is None:
        return None
    try:
        return connect(offer)
    except OSError as e:
        note_fallback(f"what a parameter server offered cannot be used from here: {e}")
        fall_back()
        return None


# ---- the worker's end ------------------------------------------------------

class SharedMemoryWorkerEnd:
    """A worker's partitions go into its input buffer on the server, pushes and answers through the pair's
    signal channel; means are read in place."""

    broken = False  # its channel ends only with its server's process, which a recovery replaces
    crosses_nodes = False

    def __init__(self, input_memory, mean_memory, offsets: dict[int, int], slots: Sequence[int],
                 partitions: Sequence[Partition], channel: signals.Channel):
        """``offsets[j]``: byte offset of partition j in both buffers, ``slots``: byte offset of each slot of the
        mean buffer (a step's mean is in slot ``step % len(slots)``; ``ParameterServer.attach``)."""
        self.channel = channel
        self.inputs = {p.index: shared_memory.array(input_memory, p.wire_dtype, offsets[p.index], p.size)
                       for p in partitions}
        self.means = [{p.index: shared_memory.array(mean_memory, p.wire_dtype, slot + offsets[p.index], p.size)
                       for p in partitions} for slot in slots]

    def write(self, partition: Partition, parts: Sequence[Segment], arrays: Sequence[np.ndarray]) -> None:
        """Copy ``arrays`` (one per segment, in the wire dtype) into the input buffer; the push carries nothing."""
        target = self.inputs[partition.index]
        for seg, a in zip(parts, arrays):
            np.copyto(target[seg.start:seg.start + seg.size], a.reshape(-1))

    def write_gradients(self, partition: Partition, parts: Sequence[Segment], grads: Sequence[np.ndarray]) -> None:
        """Pack ``partition``'s pieces of ``grads`` straight into the input buffer, one copy (converting, if compressed)."""
        pack(grads, partition, self.inputs[partition.index])

    def push(self, server: Any, worker_index: int, partition: Partition, step_id: int, stored: None) -> int:
        """Say on the channel that ``partition`` of ``step_id`` is in the input buffer; the push's ticket for
        ``answer`` (the channel's epoch)."""
        return self.channel.send(step_id, partition.index)

    def answer(self, partition: Partition, step_id: int, timeout_s: float,
               ticket: int | None = None) -> tuple[list, tuple[int, ...]]:
        """The server's answer to the push (``ParameterServer.push``'s), or what it raised; TimeoutError after
        ``timeout_s``, ConnectionError if the server died, ``Forgotten`` if the push (its ``ticket``) was
        forgotten meanwhile."""
        return self.channel.wait(step_id, partition.index, timeout_s, ticket)

    def forget(self) -> None:
        """Drop the answers to the pushes so far (a failed step's)."""
        self.channel.forget()

    def close(self) -> None:
        """Close the signal channel (the server's end sees end-of-file); the buffers go with this end."""
        self.channel.close()

    def read_mean(self, partition: Partition, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, in the server's mean buffer (read-only; valid until the next step's push)."""
        return self.means[step_id % len(self.means)][partition.index]


class _Segments:
    """A partition's segments of a worker's gradients: large pieces as views, runs of small ones packed into
    buffers kept for the next step."""

    def __init__(self):
        self._pack_buffers: dict[int, list[np.ndarray | None]] = {}  # partition -> buffers its small runs pack into

    def of(self, partition: Partition, parts: Sequence[Segment], grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        buffers = self._pack_buffers.get(partition.index)
        if buffers is None:
            buffers = self._pack_buffers[partition.index] = [None if seg.view else np.zeros(seg.size, seg.wire_dtype)
                                                         for seg in parts]
        return segment_arrays(grads, parts, buffers)


class StreamWorkerEnd:
    """A worker's partitions go down the pair's stream, straight from its arrays; means come back into buffers
    of its own, one per partition and slot of the server's mean buffer."""

    crosses_nodes = True

    def __init__(self, address: tuple[str, int, bytes], slots: int, partitions: Sequence[Partition],
                 connect_timeout_s: float, send_timeout_s: float, tls_context: ssl.SSLContext | None = None):
        """Connect to the server's stream (``StreamServerEnd.address``), over TLS with ``tls_context``; OSError if
        it cannot be reached."""
        self.means = [{p.index: np.empty(p.size, p.wire_dtype) for p in partitions} for _ in range(slots)]
        self.stream = streams.Stream(address, lambda step, j: self.means[step % slots][j],
                                     connect_timeout_s, send_timeout_s, tls_context=tls_context)
        self.segments = _Segments()

    def write(self, partition: Partition, parts: Sequence[Segment], arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """``arrays`` (one per segment, in the wire dtype) as they are: the push sends them."""
        return arrays

    def write_gradients(self, partition: Partition, parts: Sequence[Segment],
                        grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``partition``'s segments of ``grads``, for the push to send."""
        return self.segments.of(partition, parts, grads)

    def push(self, server: Any, worker_index: int, partition: Partition, step_id: int,
             stored: Sequence[np.ndarray]) -> int:
        """Send the partition's segments (``stored``) down the stream; the push's ticket for ``answer`` (the
        stream's epoch)."""
        return self.stream.send(step_id, partition.index, stored)

    def answer(self, partition: Partition, step_id: int, timeout_s: float,
               ticket: int | None = None) -> tuple[list, tuple[int, ...]]:
        """The server's answer to the push (the workers its mean averages, or what it raised), the mean read
        into this end's buffer; TimeoutError after ``timeout_s``, ConnectionError if the server died,
        ``Forgotten`` if the push (its ``ticket``) was forgotten meanwhile."""
        return [], self.stream.wait(step_id, partition.index, timeout_s, ticket)

    def pace(self, bytes_per_s: int) -> None:
        """Send at most ``bytes_per_s`` down the stream (``streams.Stream.pace``)."""
        self.stream.pace(bytes_per_s)

    def forget(self) -> None:
        """Drop the answers to the pushes so far (a failed step's)."""
        self.stream.forget()

    @property
    def broken(self) -> bool:
        """The stream ended while the server may live on (``ParameterServerClient.forget_pushes`` opens anew)."""
        return self.stream.broken

    def close(self) -> None:
        self.stream.close()

    def read_mean(self, partition: Partition, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, in this end's buffer (valid until the next step's push)."""
        return self.means[step_id % len(self.means)][partition.index]


class ObjectStoreWorkerEnd:
    """A worker's partitions travel as one object per push; the mean comes back as one object."""

    broken = False  # nothing held open between pushes
    crosses_nodes = False  # Ray's object manager moves the bytes: nothing here to pace

    def __init__(self):
        self.segments = _Segments()
        self._pushes: dict[int, ray.ObjectRef] = {}  # partition -> this step's push call

    def write(self, partition: Partition, parts: Sequence[Segment], arrays: Sequence[np.ndarray]) -> ray.ObjectRef:
        """``arrays`` (one per segment, in the wire dtype) as one new object; the push carries its reference."""
        return object_store.put(arrays)

    def write_gradients(self, partition: Partition, parts: Sequence[Segment], grads: Sequence[np.ndarray]) -> ray.ObjectRef:
        """``partition``'s segments of ``grads`` (small pieces packed, large ones as views) as one object."""
        return object_store.put(self.segments.of(partition, parts, grads))

    def push(self, server: Any, worker_index: int, partition: Partition, step_id: int,
             stored: ray.ObjectRef) -> ray.ObjectRef:
        """The push call, carrying the reference of the partition's object (``stored``); its reply's reference
        is the push's ticket for ``answer``."""
        self._pushes[partition.index] = reply = server.push.remote(step_id, worker_index, partition.index, stored)
        return reply

    def answer(self, partition: Partition, step_id: int, timeout_s: float,
               ticket: ray.ObjectRef | None = None) -> tuple[list, tuple[int, ...]]:
        """The push call's reply (the call ``ticket`` names, by default the partition's last); TimeoutError
        (Ray's) after ``timeout_s``."""
        reply = self._pushes.pop(partition.index) if ticket is None else ticket
        return ray.get(reply, timeout=timeout_s)

    def forget(self) -> None:
        """Drop the calls of the pushes so far (a failed step's)."""
        self._pushes.clear()

    def close(self) -> None:
        self.forget()

    def read_mean(self, partition: Partition, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, from the object the push's reply names (``wait``: the bounded ``ray.get``)."""
        [mean] = object_store.join(wait(reply[0], f"the mean of partition {partition.index}"), [partition.size])
        return mean


# ---- the server's end ------------------------------------------------------

def byte_places(partition: Partition, offset: int, parts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where ``partition``'s segments ``parts`` ((start, size) in elements) are in an input buffer that holds the
    partition at byte ``offset`` in its wire dtype: (byte offset, byte count) of each, in order."""
    itemsize = partition.wire_dtype.itemsize
    return [(offset + start * itemsize, size * itemsize) for start, size in parts]


def _input_views(memory, partition: Partition, offset: int, parts: Sequence[tuple[int, int]], stored: list | None,
                 where: str, worker_index: int) -> list[np.ndarray]:
    """A worker's segments of ``partition``, views of its input buffer ``memory`` at ``offset`` (``byte_places``; a
    push through it carries no data: ``stored`` must be None)."""
    if stored is not None:
        raise ValueError(f"worker {worker_index} pushed partition {partition.index} with data, but it "
                         f"writes into its input buffer on {where}")
    itemsize = partition.wire_dtype.itemsize
    return [np.frombuffer(memory, partition.wire_dtype, nbytes // itemsize, place)
            for place, nbytes in byte_places(partition, offset, parts)]


class SharedMemoryServerEnd:
    """The server's end for a worker on its node: the worker's input buffer and the pair's signal channel."""

    remote = False  # answers without a reference to the mean
    crosses_nodes = False

    def __init__(self, server_index: int, worker_index: int, nbytes: int,
                 push: Callable[[int, int], tuple[list, tuple[int, ...]]], connect_timeout_s: float,
                 relayed: Collection[int] = ()):
        """``push(step_id, j)``: the server's push of this worker, called on the channel's thread for each
        announced partition, in order (a ``relayed`` partition's on a thread of its own: its sum crosses to
        another node and back); what it returns or raises is the worker's answer. The worker must connect
        within ``connect_timeout_s``."""
        self.buffer = shared_memory.SharedBuffer(nbytes, f"dsgd-ps{server_index}-w{worker_index}")
        relayed = frozenset(relayed)
        self.signals = signals.ChannelListener(f"ps{server_index}-w{worker_index}", push, connect_timeout_s,
                                               apart=lambda step_id, j: j in relayed)
        self.server_index, self.worker_index = server_index, worker_index

    def address(self) -> dict:
        """How the worker reaches this end: its input buffer (``shared_memory.attach``) and signal channel."""
        return {"input": self.buffer.address(), "signal": self.signals.address}

    def read(self, partition: Partition, offset: int, parts: Sequence[tuple[int, int]], stored: list | None) -> list[np.ndarray]:
        """The worker's segments of ``partition``, views of its input buffer at ``offset``."""
        return _input_views(self.buffer.memory, partition, offset, parts, stored,
                            f"parameter server {self.server_index}", self.worker_index)

    def reply(self, mean: ray.ObjectRef | None) -> list:
        return []

    def close(self) -> None:
        self.buffer.close()
        self.signals.close()


class StreamServerEnd:
    """The server's end for a worker on another node: the worker's input buffer (this process's memory) and the
    pair's stream, which fills it and carries each answer with its mean."""

    remote = False  # the mean goes down the stream, not through the object store
    crosses_nodes = True

    def __init__(self, server_index: int, worker_index: int, host: str, nbytes: int,
                 places: dict[int, list[tuple[int, int]]],
                 push: Callable[[int, int, int], tuple[list, tuple[int, ...]]],
                 mean: Callable[[int, int], np.ndarray], connect_timeout_s: float, relayed: Collection[int] = (),
                 tls_context: ssl.SSLContext | None = None, arrivals: streams.Arrivals | None = None):
        """``places[j]``: where partition j's segments go in the ``nbytes`` of the input buffer, as (byte offset,
        byte count) each, in order (``byte_places``, as ``read`` finds them); ``push`` as for
        ``SharedMemoryServerEnd``, with the epoch the push was sent in (a relaying server's generation) as third
        argument; ``mean(step_id, j)`` the mean it answered with (sent after it); ``arrivals``, if given, what
        the server does with a push as its bytes arrive, before the answers ahead of it
        (``streams.StreamListener``); ``host``: this node's address, where the stream listens, over TLS with
        ``tls_context``."""
        self.buffer = bytearray(nbytes)
        self.places = places
        relayed = frozenset(relayed)
        self.server_index, self.worker_index = server_index, worker_index
        self.listener = streams.StreamListener(
            f"ps{server_index}-w{worker_index}", host, self._target,
            lambda step_id, j, epoch: (push(step_id, j, epoch)[1], mean(step_id, j)),
            connect_timeout_s, apart=lambda step_id, j: j in relayed, tls_context=tls_context, arrivals=arrivals)

    def _target(self, j: int, nbytes: int) -> list[memoryview]:
        """Where the segments of a push of partition j (``nbytes`` in all) go; ValueError for one this server
        does not expect."""
        where = f"parameter server {self.server_index}"
        if j not in self.places:
            raise ValueError(f"{where} does not serve partition {j} (worker {self.worker_index} pushed "
                             f"it); it serves {sorted(self.places)}")
        places = self.places[j]
        expected = sum(n for _, n in places)
        if nbytes != expected:
            raise ValueError(f"{where} expects {expected} bytes of partition {j} from worker "
                             f"{self.worker_index}, it sent {nbytes}")
        memory = memoryview(self.buffer)
        return [memory[offset:offset + n] for offset, n in places]

    def address(self) -> dict:
        """How the worker reaches this end: its stream (``streams.Stream``)."""
        return {"stream": self.listener.address}

    def read(self, partition: Partition, offset: int, parts: Sequence[tuple[int, int]], stored: list | None) -> list[np.ndarray]:
        """The worker's segments of ``partition``, views of its input buffer at ``offset``."""
        return _input_views(self.buffer, partition, offset, parts, stored,
                            f"parameter server {self.server_index}", self.worker_index)

    def reply(self, mean: ray.ObjectRef | None) -> list:
        return []

    def close(self) -> None:
        self.listener.close()


class ObjectStoreServerEnd:
    """The server's end for a worker elsewhere (or one that could not map shared memory)."""

    remote = True  # answers with the reference of the mean, put once for all remote workers
    crosses_nodes = True

    def __init__(self, server_index: int, worker_index: int):
        self.server_index, self.worker_index = server_index, worker_index

    def read(self, partition: Partition, offset: int, parts: Sequence[tuple[int, int]], stored: list | None) -> list[np.ndarray]:
        """The worker's segments of ``partition``, from the object the push carried, checked."""
        name, where = f"partition {partition.index}", f"parameter server {self.server_index}"
        if stored is None:
            raise ValueError(f"worker {self.worker_index} pushed {name} without data, but it has no shared "
                             f"input buffer on {where} (it is not attached on this node)")
        sizes = [size for _, size in parts]
        try:
            arrays = object_store.join(stored, sizes)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where} expects {partition.wire_dtype} segments of sizes {sizes} of {name} "
                             f"from worker {self.worker_index}: {e}") from None
        wrong = [a.dtype for a in arrays if a.dtype != partition.wire_dtype]
        if wrong:
            raise ValueError(f"{where} expects {partition.wire_dtype} segments of {name}, "
                             f"worker {self.worker_index} sent {wrong[0]}")
        return arrays

    def reply(self, mean: ray.ObjectRef | None) -> list:
        return [mean]

    def close(self) -> None:
        pass


"""How one worker and one parameter server move a partition: the two transports, both ends of each.

A worker and a server pick one transport per pair when the worker attaches
(``ParameterServer.attach``, ``ParameterServerClient.connect``):

- **shared memory**, a worker on the server's node: the server creates an
  input buffer for that worker and one mean buffer for all its local
  workers (``dsgd.shared_memory``), and a signal channel for the pair
  (``dsgd.signals``), once; every step the worker writes its segments into
  its input buffer, says so on the channel, waits there for the server's
  "the mean is ready" and reads the mean in place. No Ray call per
  partition: the server's end answers each announcement with
  ``ParameterServer.push`` on the channel's thread.
- **object store**, any other worker: a push is an actor call carrying the
  worker's segments as one object (``dsgd.object_store.put``), its reply the
  reference of the mean, which the server puts once per partition and step.

The worker's end (``SharedMemoryWorkerEnd``, ``ObjectStoreWorkerEnd``)
writes a partition, pushes it (``push``), waits for the server's answer
(``answer``, bounded) and reads its mean; the server's end
(``SharedMemoryServerEnd``, ``ObjectStoreServerEnd``) reads a push's
segments and answers it. Both ends move a partition in its wire dtype
(``Shard.wire_dtype``): under compression a float32 partition is written
and read in 16-bit form (``dsgd.wire``), converted while it is packed, and
the server sums it into its float32 sum (``dsgd.arrays.average_into``) and
rounds the mean once into its 16-bit mean.

No TensorFlow here: the parameter servers import this module.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import numpy as np
import ray

from dsgd import object_store, shared_memory, signals
from dsgd.shards import Segment, Shard, pack, segment_arrays


# ---- the worker's end ------------------------------------------------------

class SharedMemoryWorkerEnd:
    """A worker's partitions go into its input buffer on the server, pushes and answers through the pair's
    signal channel; means are read in place."""

    def __init__(self, input_memory, mean_memory, offsets: dict[int, int], slots: Sequence[int],
                 shards: Sequence[Shard], channel: signals.Channel):
        """``offsets[j]``: byte offset of partition j in both buffers, ``slots``: byte offset of each slot of the
        mean buffer (a step's mean is in slot ``step % len(slots)``; ``ParameterServer.attach``)."""
        self.channel = channel
        self.inputs = {s.index: shared_memory.array(input_memory, s.wire_dtype, offsets[s.index], s.size)
                       for s in shards}
        self.means = [{s.index: shared_memory.array(mean_memory, s.wire_dtype, slot + offsets[s.index], s.size)
                       for s in shards} for slot in slots]

    def write(self, shard: Shard, parts: Sequence[Segment], arrays: Sequence[np.ndarray]) -> None:
        """Copy ``arrays`` (one per segment, in the wire dtype) into the input buffer; the push carries nothing."""
        target = self.inputs[shard.index]
        for seg, a in zip(parts, arrays):
            np.copyto(target[seg.start:seg.start + seg.size], a.reshape(-1))

    def write_gradients(self, shard: Shard, parts: Sequence[Segment], grads: Sequence[np.ndarray]) -> None:
        """Pack ``shard``'s pieces of ``grads`` straight into the input buffer, one copy (converting, if compressed)."""
        pack(grads, shard, self.inputs[shard.index])

    def push(self, server: Any, worker_index: int, shard: Shard, step_id: int, stored: None) -> None:
        """Say on the channel that ``shard``'s partition of ``step_id`` is in the input buffer."""
        self.channel.send(step_id, shard.index)

    def answer(self, shard: Shard, step_id: int, timeout_s: float) -> tuple[list, tuple[int, ...]]:
        """The server's answer to the push (``ParameterServer.push``'s), or what it raised; TimeoutError after
        ``timeout_s``, ConnectionError if the server died."""
        return self.channel.wait(step_id, shard.index, timeout_s)

    def forget(self) -> None:
        """Drop the answers to the pushes so far (a failed step's)."""
        self.channel.forget()

    def close(self) -> None:
        """Close the signal channel (the server's end sees end-of-file); the buffers go with this end."""
        self.channel.close()

    def read_mean(self, shard: Shard, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, in the server's mean buffer (read-only; valid until the next step's push)."""
        return self.means[step_id % len(self.means)][shard.index]


class ObjectStoreWorkerEnd:
    """A worker's partitions travel as one object per push; the mean comes back as one object."""

    def __init__(self):
        self._pack_buffers: dict[int, list[np.ndarray | None]] = {}  # partition -> buffers its small runs pack into
        self._pushes: dict[int, ray.ObjectRef] = {}  # partition -> this step's push call

    def write(self, shard: Shard, parts: Sequence[Segment], arrays: Sequence[np.ndarray]) -> ray.ObjectRef:
        """``arrays`` (one per segment, in the wire dtype) as one new object; the push carries its reference."""
        return object_store.put(arrays)

    def write_gradients(self, shard: Shard, parts: Sequence[Segment], grads: Sequence[np.ndarray]) -> ray.ObjectRef:
        """``shard``'s segments of ``grads`` (small pieces packed, large ones as views) as one object."""
        buffers = self._pack_buffers.get(shard.index)
        if buffers is None:
            buffers = self._pack_buffers[shard.index] = [None if seg.view else np.zeros(seg.size, seg.wire_dtype)
                                                         for seg in parts]
        return object_store.put(segment_arrays(grads, parts, buffers))

    def push(self, server: Any, worker_index: int, shard: Shard, step_id: int, stored: ray.ObjectRef) -> None:
        """The push call, carrying the reference of the partition's object (``stored``)."""
        self._pushes[shard.index] = server.push.remote(step_id, worker_index, shard.index, stored)

    def answer(self, shard: Shard, step_id: int, timeout_s: float) -> tuple[list, tuple[int, ...]]:
        """The push call's reply; TimeoutError (Ray's) after ``timeout_s``."""
        return ray.get(self._pushes.pop(shard.index), timeout=timeout_s)

    def forget(self) -> None:
        """Drop the calls of the pushes so far (a failed step's)."""
        self._pushes.clear()

    def close(self) -> None:
        self.forget()

    def read_mean(self, shard: Shard, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, from the object the push's reply names (``wait``: the bounded ``ray.get``)."""
        [mean] = object_store.join(wait(reply[0], f"the mean of partition {shard.index}"), [shard.size])
        return mean


# ---- the server's end ------------------------------------------------------

class SharedMemoryServerEnd:
    """The server's end for a worker on its node: the worker's input buffer and the pair's signal channel."""

    remote = False  # answers without a reference to the mean

    def __init__(self, server_index: int, worker_index: int, nbytes: int,
                 push: Callable[[int, int], tuple[list, tuple[int, ...]]], connect_timeout_s: float,
                 relayed: Collection[int] = ()):
        """``push(step_id, partition)``: the server's push of this worker, called on the channel's thread for each
        announced partition, in order (a ``relayed`` partition's on a thread of its own: its sum crosses to
        another node and back); what it returns or raises is the worker's answer. The worker must connect
        within ``connect_timeout_s``."""
        self.buffer = shared_memory.SharedBuffer(nbytes, f"dsgd-ps{server_index}-w{worker_index}")
        relayed = frozenset(relayed)
        self.signals = signals.Listener(f"ps{server_index}-w{worker_index}", push, connect_timeout_s,
                                        apart=lambda step_id, partition: partition in relayed)
        self.server_index, self.worker_index = server_index, worker_index

    def address(self) -> dict:
        """How the worker reaches this end: its input buffer (``shared_memory.attach``) and signal channel."""
        return {"input": self.buffer.address(), "signal": self.signals.address}

    def read(self, shard: Shard, offset: int, parts: Sequence[tuple[int, int]], stored: list | None) -> list[np.ndarray]:
        """The worker's segments of ``shard``, views of its input buffer at ``offset``."""
        if stored is not None:
            raise ValueError(f"worker {self.worker_index} pushed partition {shard.index} with data, but it "
                             f"writes into its shared input buffer on parameter server {self.server_index}")
        flat = np.frombuffer(self.buffer.memory, shard.wire_dtype, shard.size, offset)
        return [flat[start:start + size] for start, size in parts]

    def reply(self, mean: ray.ObjectRef | None) -> list:
        return []

    def close(self) -> None:
        self.buffer.close()
        self.signals.close()


class ObjectStoreServerEnd:
    """The server's end for a worker elsewhere (or one that could not map shared memory)."""

    remote = True  # answers with the reference of the mean, put once for all remote workers

    def __init__(self, server_index: int, worker_index: int):
        self.server_index, self.worker_index = server_index, worker_index

    def read(self, shard: Shard, offset: int, parts: Sequence[tuple[int, int]], stored: list | None) -> list[np.ndarray]:
        """The worker's segments of ``shard``, from the object the push carried, checked."""
        name, where = f"partition {shard.index}", f"parameter server {self.server_index}"
        if stored is None:
            raise ValueError(f"worker {self.worker_index} pushed {name} without data, but it has no shared "
                             f"input buffer on {where} (it is not attached on this node)")
        sizes = [size for _, size in parts]
        try:
            arrays = object_store.join(stored, sizes)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where} expects {shard.wire_dtype} segments of sizes {sizes} of {name} "
                             f"from worker {self.worker_index}: {e}") from None
        wrong = [a.dtype for a in arrays if a.dtype != shard.wire_dtype]
        if wrong:
            raise ValueError(f"{where} expects {shard.wire_dtype} segments of {name}, "
                             f"worker {self.worker_index} sent {wrong[0]}")
        return arrays

    def reply(self, mean: ray.ObjectRef | None) -> list:
        return [mean]

    def close(self) -> None:
        pass


"""How one worker and one parameter server move a partition: the two transports, both ends of each.

A worker and a server pick one transport per pair when the worker attaches
(``ParameterServer.attach``, ``ParameterServerClient.connect``):

- **shared memory**, a worker on the server's node: the server creates an
  input buffer for that worker and one mean buffer for all its local
  workers (``dsgd.shared_memory``), once; every step the worker writes its
  segments into its input buffer and reads the mean in place. A push
  carries no data and its reply no reference.
- **object store**, any other worker: a push carries the worker's segments
  as one object (``dsgd.object_store.put``), and the reply the reference of
  the mean, which the server puts once per partition and step.

The worker's end (``SharedMemoryWorkerEnd``, ``ObjectStoreWorkerEnd``)
writes a partition and reads its mean; the server's end
(``SharedMemoryServerEnd``, ``ObjectStoreServerEnd``) reads a push's
segments and answers it. Both ends move a partition in its wire dtype
(``Shard.wire_dtype``): under compression a float32 partition is written
and read in 16-bit form (``dsgd.wire``), converted while it is packed, and
the server sums it into its float32 sum (``dsgd.arrays.average_into``) and
rounds the mean once into its 16-bit mean.

No TensorFlow here: the parameter servers import this module.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import ray

from dsgd import object_store, shared_memory
from dsgd.shards import Segment, Shard, pack, segment_arrays


# ---- the worker's end ------------------------------------------------------

class SharedMemoryWorkerEnd:
    """A worker's partitions go into its input buffer on the server; means are read in place."""

    def __init__(self, input_memory, mean_memory, offsets: dict[int, int], slots: Sequence[int],
                 shards: Sequence[Shard]):
        """``offsets[j]``: byte offset of partition j in both buffers, ``slots``: byte offset of each slot of the
        mean buffer (a step's mean is in slot ``step % len(slots)``; ``ParameterServer.attach``)."""
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

    def read_mean(self, shard: Shard, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, in the server's mean buffer (read-only; valid until the next step's push)."""
        return self.means[step_id % len(self.means)][shard.index]


class ObjectStoreWorkerEnd:
    """A worker's partitions travel as one object per push; the mean comes back as one object."""

    def __init__(self):
        self._pack_buffers: dict[int, list[np.ndarray | None]] = {}  # partition -> buffers its small runs pack into

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

    def read_mean(self, shard: Shard, step_id: int, reply: list,
                  wait: Callable[[ray.ObjectRef, str], list]) -> np.ndarray:
        """The mean in the wire dtype, from the object the push's reply names (``wait``: the bounded ``ray.get``)."""
        [mean] = object_store.join(wait(reply[0], f"the mean of partition {shard.index}"), [shard.size])
        return mean


# ---- the server's end ------------------------------------------------------

class SharedMemoryServerEnd:
    """The server's end for a worker on its node: the worker's input buffer."""

    remote = False  # answers without a reference to the mean

    def __init__(self, server_index: int, worker_index: int, nbytes: int):
        self.buffer = shared_memory.SharedBuffer(nbytes, f"dsgd-ps{server_index}-w{worker_index}")
        self.server_index, self.worker_index = server_index, worker_index

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


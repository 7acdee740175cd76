"""The worker's side of the parameter-server protocol (``dsgd.ps_actor`` is the other).

A worker sends each partition of its averaged gradients to the server that
sums it and reads back the mean. ``connect`` attaches to every server: a
server on the worker's own node hands over shared buffers (the worker's
input buffer and the server's mean buffer, created once, written in place
every step); a server elsewhere is reached through the object store.

Per partition and step the worker makes one call (``push``) and one bounded
wait for its reply, whatever the transport; with shared memory nothing else
touches Ray.

No TensorFlow here: the engine's graph callbacks and its Python exchange
both call ``send`` / ``send_gradients`` and ``receive``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import ray

from dsgd import object_store, shared_memory
from dsgd.errors import DSGDTimeoutError
from dsgd.shards import Shard, pack, segment_arrays, segments


class ParameterServerClient:
    """Pushes one worker's partitions to their servers and reads back the means."""

    def __init__(self, worker_index: int, layout: Sequence[Shard], placement: Sequence[int], timeout_s: float):
        """``placement[j]``: the index of the server that sums ``layout[j]``."""
        self.worker_index = worker_index
        self.layout = list(layout)
        self.placement = list(placement)
        self.timeout_s = timeout_s
        self.segments = [segments(shard) for shard in self.layout]
        self.servers: list[Any] = []
        self.inputs: list[np.ndarray | None] = []  # per partition: our shared input buffer, or None (remote)
        self.means: list[np.ndarray | None] = []  # per partition: the server's shared mean buffer, or None
        self._pack_buffers: list[list[np.ndarray | None]] | None = None  # remote Python sends pack into these
        self._pushes: dict[int, ray.ObjectRef] = {}  # partition -> this step's push call

    def connect(self, servers: Sequence[Any], timeout_s: float) -> int:
        """Attach to every server, each wait bounded by ``timeout_s``; the number reached through shared memory."""
        self.servers = list(servers)
        node = ray.get_runtime_context().get_node_id()
        infos = self._wait([s.attach.remote(self.worker_index, node) for s in self.servers],
                           "the parameter servers to attach", timeout_s)
        shared: dict[int, tuple] = {}
        for j, (server, info) in enumerate(zip(self.servers, infos)):
            if info is None:
                continue
            try:
                shared[j] = (shared_memory.attach(info["input"], writable=True),
                             shared_memory.attach(info["mean"], writable=False), info["offsets"])
            except OSError:  # same node, but another PID namespace: use the object store
                self._wait(server.attach.remote(self.worker_index, None), "a parameter server to re-attach", timeout_s)
        self.inputs, self.means = [], []
        for shard, j in zip(self.layout, self.placement):
            if j in shared:
                input_memory, mean_memory, offsets = shared[j]
                offset = offsets[shard.index]
                self.inputs.append(shared_memory.array(input_memory, shard.dtype, offset, shard.size))
                self.means.append(shared_memory.array(mean_memory, shard.dtype, offset, shard.size))
            else:
                self.inputs.append(None)
                self.means.append(None)
        self._pushes.clear()
        return len(shared)

    def send(self, shard: Shard, step_id: int, arrays: Sequence[np.ndarray]) -> ray.ObjectRef:
        """Push ``arrays``, one per segment of ``shard`` (``dsgd.shards.segments``); the push call."""
        target = self.inputs[shard.index]
        if target is None:
            return self._push(shard, step_id, object_store.put(arrays))
        for seg, a in zip(self.segments[shard.index], arrays):
            np.copyto(target[seg.start:seg.start + seg.size], a.reshape(-1))
        return self._push(shard, step_id, None)

    def send_gradients(self, shard: Shard, step_id: int, grads: Sequence[np.ndarray]) -> None:
        """Push ``shard``'s pieces of ``grads`` (every exchange tensor, in layout order)."""
        target = self.inputs[shard.index]
        if target is not None:
            pack(grads, shard, target)  # straight into the shared buffer, one copy
            self._push(shard, step_id, None)
            return
        if self._pack_buffers is None:
            self._pack_buffers = [[None if seg.view else np.zeros(seg.size, seg.dtype) for seg in parts]
                                  for parts in self.segments]
        parts = self.segments[shard.index]
        self._push(shard, step_id, object_store.put(segment_arrays(grads, parts, self._pack_buffers[shard.index])))

    def _push(self, shard: Shard, step_id: int, stored: ray.ObjectRef | None) -> ray.ObjectRef:
        server = self.servers[self.placement[shard.index]]
        self._pushes[shard.index] = server.push.remote(step_id, self.worker_index, shard.index, stored)
        return self._pushes[shard.index]

    def receive(self, shard: Shard, step_id: int) -> np.ndarray:
        """The mean of ``shard`` for ``step_id`` (read-only; valid until the next step's push)."""
        push = self._pushes.pop(shard.index)
        what = f"parameter server {self.placement[shard.index]}'s sum of partition {shard.index}, step {step_id}"
        reply = self._wait(push, what)
        if self.means[shard.index] is not None:
            return self.means[shard.index]
        [mean] = object_store.join(self._wait(reply[0], f"the mean of partition {shard.index}, step {step_id}"),
                                   [shard.size])
        return mean

    def forget_pushes(self) -> None:
        """Drop the calls of a failed step (the driver aborts and resets the servers)."""
        self._pushes.clear()

    def _wait(self, refs, what: str, timeout_s: float | None = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise DSGDTimeoutError(
                f"worker {self.worker_index} waited more than {timeout_s:.0f}s for {what}; "
                "a worker or parameter server is stuck or dead") from e

"""Parameter-server actor: averages many gradient partitions over all workers.

A server process serves every partition the driver assigns to it (BytePS's
design: few summing processes, many partitions). Each worker makes one call
per partition and step: ``push`` says that its copy of the partition is
ready and returns once the step's mean of that partition exists. The push
that completes the set averages every worker's copy with
``strategies.average_into`` (worker order, so the mean is bit-for-bit the
same in every run and equals the "simple" strategy's) straight into the
server's mean buffer; the pushes waiting for it wake.

Two transports, chosen per worker by ``attach``:

- **shared memory**, for a worker on the server's own node: the server
  creates an input buffer for that worker and one mean buffer for all its
  local workers (``dsgd.shared_memory``), created once and written in place
  every step. The worker copies its gradients into its input buffer, the
  server sums from there into the mean buffer, the worker reads the mean
  from there. No object-store object is created per step.
- **object store**, for a worker on another node: the push carries the
  worker's segments as one object (``object_store.put``), and the server
  puts the mean once per partition and step for all its remote workers.

Buffers are reused safely without locks because steps are lock-step: a
worker writes step s+1 of a partition only after it has read step s's mean
of it, and the server writes step s+1's mean only after every worker has
pushed step s+1.

The actor is threaded (``start``): a push blocks its thread while it waits
for the other workers, so there is a thread for every worker's push of every
partition, and ``CONTROL_THREADS`` more for ``abort``, ``reset``, ``trace``,
``attach`` and ``identity``.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import ray

from dsgd import actor_identity, object_store, shared_memory, strategies, timeline
from dsgd.errors import DSGDTimeoutError
from dsgd.shards import Shard, segments

CONTROL_THREADS = 3


class StepAborted(RuntimeError):
    """The driver aborted the step this call belonged to (another actor failed)."""


def start(server_index: int, num_workers: int, partitions: list[Shard], timeout_s: float,
          **options) -> ray.actor.ActorHandle:
    """A ``ParameterServer`` actor with the threads it needs; ``options`` go to ``.options``."""
    return ray.remote(ParameterServer).options(
        num_cpus=0, max_concurrency=num_workers * len(partitions) + CONTROL_THREADS, **options).remote(
        server_index, num_workers, partitions, timeout_s)


@dataclass
class _Partition:
    """One partition's place in the server's buffers and the state of its current step."""

    shard: Shard
    offset: int  # bytes into the mean buffer and every worker's input buffer
    segments: list[tuple[int, int]]  # (start, size) of each segment a remote push carries
    mean: np.ndarray  # view of the mean buffer
    step_id: int | None = None
    waiting: dict[int, list[np.ndarray]] = field(default_factory=dict)  # worker -> its segments
    done: dict[int, ray.ObjectRef | None] = field(default_factory=dict)  # step -> the mean's ref (remote readers)
    failures: dict[int, ValueError] = field(default_factory=dict)


class ParameterServer:
    """Runs as a threaded Ray actor (see ``start``); holds no state that outlives a step."""

    def __init__(self, server_index: int, num_workers: int, partitions: list[Shard], timeout_s: float):
        """``partitions``: the shards of the layout this server sums.

        ``timeout_s`` bounds how long a push waits for the other workers' pushes.
        """
        self.server_index = server_index
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.node_id = ray.get_runtime_context().get_node_id()
        offsets, end = [], 0
        for shard in partitions:
            offsets.append(end)
            end = shared_memory.aligned(end + shard.nbytes)
        self.nbytes = end
        self.shared = shared_memory.available()
        if self.shared:
            self.mean_buffer = shared_memory.SharedBuffer(self.nbytes, f"dsgd-ps{server_index}-mean")
            memory = self.mean_buffer.memory
        else:
            memory = bytearray(self.nbytes)
        self.partitions = {
            shard.index: _Partition(shard, offset, [(s.start, s.size) for s in segments(shard)],
                                    np.frombuffer(memory, shard.dtype, shard.size, offset))
            for shard, offset in zip(partitions, offsets)}
        self.inputs: dict[int, shared_memory.SharedBuffer] = {}  # local worker -> its input buffer
        self.remote_workers = set(range(num_workers))  # until a worker attaches locally
        self.changed = threading.Condition()  # guards everything that changes below
        self.aborted = False
        self.resets = 0  # a push that waited across a reset fails as aborted
        self.traces: dict[int, timeline.Recorder] = {}  # the last two steps' events

    # ---- connection --------------------------------------------------------

    def attach(self, worker_index: int, node_id: str | None) -> dict | None:
        """Connect a worker; how it exchanges with this server.

        A worker on this server's node (``node_id`` equal to ours) gets shared
        buffers: ``{"input": address, "mean": address, "offsets": {partition:
        byte offset}}`` (addresses for ``shared_memory.attach``). Any other
        worker, or ``node_id=None`` (a worker that could not map them), pushes
        through the object store: ``None``.
        """
        with self.changed:
            previous = self.inputs.pop(worker_index, None)
            if previous is not None:  # a re-attach after a recovery: the old buffer goes with its fd
                previous.close()
            if not self.shared or node_id != self.node_id:
                self.remote_workers.add(worker_index)
                return None
            self.remote_workers.discard(worker_index)
            buffer = shared_memory.SharedBuffer(self.nbytes, f"dsgd-ps{self.server_index}-w{worker_index}")
            self.inputs[worker_index] = buffer
            return {"input": buffer.address(), "mean": self.mean_buffer.address(),
                    "offsets": {j: p.offset for j, p in self.partitions.items()}}

    # ---- pushes ------------------------------------------------------------

    def push(self, step_id: int, worker_index: int, partition: int, stored: list[np.ndarray] | None = None) -> list:
        """One worker's copy of ``partition`` for ``step_id`` is ready; wait for the step's mean.

        ``stored`` is what ``object_store.put`` stored (a remote worker), or
        None (a local worker: its copy is in its input buffer). Returns
        ``[ObjectRef]`` of the mean for a remote worker, ``[]`` for a local
        one (the mean is in the shared mean buffer). A bad push fails the
        step: it raises, and so do the step's other pushes of the partition,
        at once, instead of waiting for a sum that cannot come.
        """
        start = timeline.now_us()
        with self.changed:
            p = self._partition(partition, worker_index)
            self._check_not_aborted(p, step_id)
            resets = self.resets
            try:
                p.waiting[worker_index] = self._accept(p, step_id, worker_index, stored)
            except ValueError as e:
                p.failures[step_id] = e
                self.changed.notify_all()
                raise
            complete = len(p.waiting) == self.num_workers
            if complete:  # sum outside the lock, so other partitions' pushes go on meanwhile
                inputs = [p.waiting.pop(w) for w in range(self.num_workers)]
                p.step_id = step_id + 1
                recorder = self._recorder(step_id)
        if complete:
            ref = self._sum(p, inputs, recorder)
            with self.changed:
                if self.resets == resets:
                    p.done = {step_id: ref}
                    p.failures.clear()
                self.changed.notify_all()
        with self.changed:
            if not self.changed.wait_for(lambda: self._settled(p, step_id) or self.resets != resets,
                                         self.timeout_s):
                missing = sorted(set(range(self.num_workers)) - set(p.waiting))
                raise DSGDTimeoutError(
                    f"parameter server {self.server_index} waited more than {self.timeout_s:.0f}s for "
                    f"workers {missing} to push partition {partition} of step {step_id}")
            if self.resets != resets:
                raise StepAborted(f"parameter server {self.server_index}: step {step_id} was reset")
            self._check_not_aborted(p, step_id)
            if step_id in p.failures:
                raise p.failures[step_id]
            self._recorder(step_id).add(f"worker {worker_index}'s push of partition {partition} (waits for the sum)",
                                        start, timeline.now_us(), "pushes")
            return [p.done[step_id]] if worker_index in self.remote_workers else []

    def _partition(self, index: int, worker_index: int) -> _Partition:
        if index not in self.partitions:
            raise ValueError(f"parameter server {self.server_index} does not serve partition {index} "
                             f"(worker {worker_index} pushed it); it serves {sorted(self.partitions)}")
        return self.partitions[index]

    def _settled(self, p: _Partition, step_id: int) -> bool:
        return step_id in p.done or step_id in p.failures or self.aborted

    def _accept(self, p: _Partition, step_id: int, worker_index: int,
                stored: list[np.ndarray] | None) -> list[np.ndarray]:
        """The pushed segments, checked: the expected step, sizes and dtype, and no second push."""
        name = f"partition {p.shard.index}"
        if p.step_id is None:
            p.step_id = step_id
        if step_id != p.step_id:
            raise ValueError(f"parameter server {self.server_index} is summing step {p.step_id} of {name} "
                             f"but worker {worker_index} pushed step {step_id}")
        if worker_index in p.waiting:
            raise ValueError(f"worker {worker_index} pushed {name} of step {step_id} twice")
        if stored is None:
            if worker_index not in self.inputs:
                raise ValueError(f"worker {worker_index} pushed {name} without data, but it has no shared "
                                 f"input buffer on parameter server {self.server_index} (it is not attached "
                                 "on this node)")
            flat = np.frombuffer(self.inputs[worker_index].memory, p.shard.dtype, p.shard.size, p.offset)
            return [flat[start:start + size] for start, size in p.segments]
        sizes = [size for _, size in p.segments]
        try:
            parts = object_store.join(stored, sizes)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"parameter server {self.server_index} expects {p.shard.dtype} segments of sizes "
                             f"{sizes} of {name} from worker {worker_index}: {e}") from None
        wrong = [a.dtype for a in parts if a.dtype != p.shard.dtype]
        if wrong:
            raise ValueError(f"parameter server {self.server_index} expects {p.shard.dtype} segments of {name}, "
                             f"worker {worker_index} sent {wrong[0]}")
        return parts

    def _sum(self, p: _Partition, inputs: list[list[np.ndarray]],
             recorder: timeline.Recorder) -> ray.ObjectRef | None:
        """Average every worker's segments into the mean buffer; the mean's ref if remote workers read it."""
        with recorder.span(f"average partition {p.shard.index} of {self.num_workers} workers", "sum"):
            for k, (start, size) in enumerate(p.segments):
                strategies.average_into(p.mean[start:start + size], [worker[k] for worker in inputs])
        if not self.remote_workers:
            return None
        with recorder.span(f"put the mean of partition {p.shard.index} for remote workers", "sum"):
            return object_store.put([p.mean])

    # ---- control -----------------------------------------------------------

    def _check_not_aborted(self, p: _Partition, step_id: int) -> None:
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
            self.aborted = False
            self.changed.notify_all()

    def _recorder(self, step_id: int) -> timeline.Recorder:
        if step_id not in self.traces:
            self.traces = {k: v for k, v in self.traces.items() if k >= step_id - 1}
            self.traces[step_id] = timeline.Recorder()
        return self.traces[step_id]

    def trace(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id`` (kept for the last two steps)."""
        with self.changed:
            return list(self.traces[step_id].events) if step_id in self.traces else []

    def waiting_for(self) -> dict[int, list[int]]:
        """For every partition with pushes waiting: the workers that have not pushed yet."""
        with self.changed:
            return {j: sorted(set(range(self.num_workers)) - set(p.waiting))
                    for j, p in self.partitions.items() if p.waiting}

    def identity(self) -> actor_identity.ActorIdentity:
        """Who this actor is (the driver's liveness check and error names)."""
        return actor_identity.current("parameter server", self.server_index)

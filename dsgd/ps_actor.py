"""Parameter-server actor: averages one gradient shard over all workers.

Each worker makes one call per shard per step: ``push`` hands over its
segments of the shard (one object, see ``dsgd.shards.segments``, read as
zero-copy views) and returns once the step's mean exists, as ``[ObjectRef]``
of the mean in the object store. The push that completes the set averages
every worker's segments into a preallocated accumulator in one cache-blocked
pass (per block: worker 0 + worker 1 + ..., then divided by the worker
count) and puts the mean into the object store once; the pushes waiting for
it wake and return the same reference. The order of additions is fixed, so
the mean is bit-for-bit the same in every run and equals the driver's in the
"simple" strategy.

The actor is threaded (``start``): a push blocks its thread while it waits
for the other workers, so there is a thread for every worker's push and
``CONTROL_THREADS`` more that ``abort``, ``reset``, ``trace`` and ``ping``
can always use. A threaded call costs about half the CPU of an asyncio one
(docs/ops.md), and one call per worker and shard, instead of a push and a
pull, halves the calls again.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import ray

from dsgd import object_store, timeline
from dsgd.errors import DSGDTimeoutError

BLOCK_BYTES = 1 << 18  # summed block by block so each stays in cache between the adds and the divide
CONTROL_THREADS = 2  # threads beyond the pushes' (at most num_workers - 1 of them wait at once)


class StepAborted(RuntimeError):
    """The driver aborted the step this call belonged to (another actor failed)."""


def start(shard_index: int, num_workers: int, size: int, dtype: str, segments: list[tuple[int, int]],
          timeout_s: float, **options) -> ray.actor.ActorHandle:
    """A ``ParameterServer`` actor with the threads it needs; ``options`` go to ``.options``."""
    return ray.remote(ParameterServer).options(
        num_cpus=0, max_concurrency=num_workers + CONTROL_THREADS, **options).remote(
        shard_index, num_workers, size, dtype, segments, timeout_s)


class ParameterServer:
    """Runs as a threaded Ray actor (see ``start``); holds no state that outlives a step."""

    def __init__(self, shard_index: int, num_workers: int, size: int, dtype: str,
                 segments: list[tuple[int, int]], timeout_s: float):
        """``segments``: the ``(start, size)`` ranges of the shard that a push carries, in order.

        ``timeout_s`` bounds how long a push waits for the other workers' pushes.
        """
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.dtype = np.dtype(dtype)
        self.accumulator = np.zeros(size, dtype=self.dtype)  # alignment gaps stay zero
        self.segments = [(int(start), int(n)) for start, n in segments]
        self.block = max(1, BLOCK_BYTES // self.dtype.itemsize)
        self.timeout_s = timeout_s
        self.changed = threading.Condition()  # guards everything below
        self.step_id: int | None = None
        self.waiting: dict[int, list[np.ndarray]] = {}
        self.failures: dict[int, ValueError] = {}  # steps a bad push failed
        self.results: dict[int, ray.ObjectRef] = {}
        self.aborted = False
        self.resets = 0  # a push that waited across a reset fails as aborted
        self.traces: dict[int, timeline.Recorder] = {}  # the last two steps' events

    def _recorder(self, step_id: int) -> timeline.Recorder:
        if step_id not in self.traces:
            self.traces = {k: v for k, v in self.traces.items() if k >= step_id - 1}
            self.traces[step_id] = timeline.Recorder()
        return self.traces[step_id]

    def trace(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id`` (kept for the last two steps)."""
        with self.changed:
            return list(self.traces[step_id].events) if step_id in self.traces else []

    def push(self, step_id: int, worker_index: int, stored: list[np.ndarray]) -> list:
        """Take one worker's segments of ``step_id``; return ``[ObjectRef]`` of the step's mean.

        ``stored`` is what ``object_store.put`` stored. A bad push fails the
        step: it raises, and so do the step's other pushes, at once, instead
        of waiting for a sum that cannot come.
        """
        start = timeline.now_us()
        with self.changed:
            self._check_not_aborted(step_id)
            resets = self.resets
            try:
                self.waiting[worker_index] = self._accept(step_id, worker_index, stored)
            except ValueError as e:
                self.failures[step_id] = e
                self.changed.notify_all()
                raise
            if len(self.waiting) == self.num_workers:
                self._sum(step_id)
            elif not self.changed.wait_for(lambda: self._settled(step_id) or self.resets != resets,
                                           self.timeout_s):
                missing = sorted(set(range(self.num_workers)) - set(self.waiting))
                raise DSGDTimeoutError(
                    f"parameter server {self.shard_index} waited more than {self.timeout_s:.0f}s for "
                    f"workers {missing} to push shard {self.shard_index} of step {step_id}")
            if self.resets != resets:
                raise StepAborted(f"parameter server {self.shard_index}: step {step_id} was reset")
            self._check_not_aborted(step_id)
            if step_id in self.failures:
                raise self.failures[step_id]
            self._recorder(step_id).add(f"worker {worker_index}'s push (waits for the sum)", start,
                                        timeline.now_us(), "pushes")
            return [self.results[step_id]]

    def _settled(self, step_id: int) -> bool:
        return step_id in self.results or step_id in self.failures or self.aborted

    def _sum(self, step_id: int) -> None:
        """Average the waiting pushes, put the mean, wake the other pushes of ``step_id``."""
        recorder = self._recorder(step_id)
        with recorder.span(f"average {self.num_workers} workers' shards", "sum"):
            self._average([self.waiting[w] for w in range(self.num_workers)])
        self.waiting.clear()
        with recorder.span("put the mean in the object store", "sum"):
            self.results = {step_id: object_store.put([self.accumulator])}
        self.step_id = step_id + 1
        self.changed.notify_all()

    def _accept(self, step_id: int, worker_index: int, stored: list[np.ndarray]) -> list[np.ndarray]:
        """The pushed segments, checked: the expected step, sizes and dtype, and no second push."""
        if self.step_id is None:
            self.step_id = step_id
        if step_id != self.step_id:
            raise ValueError(
                f"parameter server {self.shard_index} is summing step {self.step_id} "
                f"but worker {worker_index} pushed step {step_id}")
        if worker_index in self.waiting:
            raise ValueError(f"worker {worker_index} pushed shard {self.shard_index} of step {step_id} twice")
        sizes = [n for _, n in self.segments]
        try:
            parts = object_store.join(stored, sizes)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"parameter server {self.shard_index} expects {self.dtype} segments of sizes {sizes} "
                             f"from worker {worker_index}: {e}") from None
        wrong = [a.dtype for a in parts if a.dtype != self.dtype]
        if wrong:
            raise ValueError(f"parameter server {self.shard_index} expects {self.dtype} segments, "
                             f"worker {worker_index} sent {wrong[0]}")
        return parts

    def _average(self, workers: list[list[np.ndarray]]) -> None:
        """accumulator = (w0 + w1 + ...) / num_workers, block by block."""
        first, rest = workers[0], workers[1:]
        for k, (start, size) in enumerate(self.segments):
            for lo in range(0, size, self.block):
                hi = min(lo + self.block, size)
                out = self.accumulator[start + lo:start + hi]
                if rest:
                    np.add(first[k][lo:hi], rest[0][k][lo:hi], out=out)
                    for w in rest[1:]:
                        np.add(out, w[k][lo:hi], out=out)
                else:
                    np.copyto(out, first[k][lo:hi])
                np.divide(out, self.num_workers, out=out)

    def _check_not_aborted(self, step_id: int) -> None:
        if self.aborted and step_id not in self.results:
            raise StepAborted(f"parameter server {self.shard_index}: step {step_id} was aborted")

    def abort(self) -> None:
        """Fail every waiting and future push until ``reset``."""
        with self.changed:
            self.aborted = True
            self.changed.notify_all()

    def reset(self, step_id: int) -> None:
        """Forget partial sums and aborted steps; expect ``step_id`` next."""
        with self.changed:
            self.resets += 1
            self.waiting.clear()
            self.results.clear()
            self.failures.clear()
            self.step_id = step_id
            self.aborted = False
            self.changed.notify_all()

    def ping(self) -> int:
        return self.shard_index

    def pid(self) -> int:
        return os.getpid()

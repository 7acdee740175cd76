"""Parameter-server actor: sums one gradient shard over all workers.

Workers ``push`` their shard for a step; the actor adds it into a
preallocated accumulator in place. Additions happen in worker-index order
(a shard that arrives early waits, zero-copy, for its predecessors), so the
sum is bit-for-bit the same in every run and equals the driver's sum in the
"simple" strategy. When every worker has pushed, the mean is put into the
object store once and every worker's ``pull`` for that step returns its
reference. ``pull`` awaits an asyncio event: no polling, no busy wait.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import ray

from dsgd import timeline


class StepAborted(RuntimeError):
    """The driver aborted the step this call belonged to (another actor failed)."""


class ParameterServer:
    """Runs as an async Ray actor; holds no state that outlives a step."""

    def __init__(self, shard_index: int, num_workers: int, size: int, dtype: str):
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.dtype = np.dtype(dtype)
        self.accumulator = np.zeros(size, dtype=self.dtype)
        self.step_id: int | None = None
        self.waiting: dict[int, np.ndarray] = {}
        self.next_worker = 0
        self.results: dict[int, ray.ObjectRef] = {}
        self.events: dict[int, asyncio.Event] = {}
        self.aborted = False
        self.traces: dict[int, timeline.Recorder] = {}  # the last two steps' events

    def _recorder(self, step_id: int) -> timeline.Recorder:
        if step_id not in self.traces:
            self.traces = {k: v for k, v in self.traces.items() if k >= step_id - 1}
            self.traces[step_id] = timeline.Recorder()
        return self.traces[step_id]

    def trace(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id`` (kept for the last two steps)."""
        return self.traces[step_id].events if step_id in self.traces else []

    def _event(self, step_id: int) -> asyncio.Event:
        return self.events.setdefault(step_id, asyncio.Event())

    async def push(self, step_id: int, worker_index: int, shard: np.ndarray) -> None:
        """Add one worker's shard of ``step_id``."""
        self._check_not_aborted(step_id)
        if self.step_id is None:
            self.step_id = step_id
        if step_id != self.step_id:
            raise ValueError(
                f"parameter server {self.shard_index} is summing step {self.step_id} "
                f"but worker {worker_index} pushed step {step_id}")
        if shard.shape != self.accumulator.shape or shard.dtype != self.dtype:
            raise ValueError(
                f"parameter server {self.shard_index} expects a {self.dtype} shard of "
                f"{self.accumulator.size} elements, worker {worker_index} sent {shard.dtype} {shard.shape}")
        if worker_index in self.waiting or worker_index < self.next_worker:
            raise ValueError(f"worker {worker_index} pushed shard {self.shard_index} of step {step_id} twice")
        self.waiting[worker_index] = shard
        recorder = self._recorder(step_id)
        while self.next_worker in self.waiting:
            part = self.waiting.pop(self.next_worker)
            with recorder.span(f"add worker {self.next_worker}'s shard", "sum"):
                if self.next_worker == 0:
                    np.copyto(self.accumulator, part)
                else:
                    np.add(self.accumulator, part, out=self.accumulator)
            self.next_worker += 1
        if self.next_worker == self.num_workers:
            with recorder.span("mean, put in object store", "sum"):
                np.divide(self.accumulator, self.num_workers, out=self.accumulator)
                self.results = {step_id: ray.put(self.accumulator)}
            self._event(step_id).set()
            self.events = {k: v for k, v in self.events.items() if k > step_id}
            self.step_id = step_id + 1
            self.next_worker = 0

    async def pull(self, step_id: int) -> list:
        """The mean shard of ``step_id``, as ``[ObjectRef]`` so Ray does not copy it."""
        self._check_not_aborted(step_id)
        start = timeline.now_us()
        if step_id not in self.results:
            await self._event(step_id).wait()
        self._check_not_aborted(step_id)
        self._recorder(step_id).add("pull (waits for the sum)", start, timeline.now_us(), "pulls")
        return [self.results[step_id]]

    def _check_not_aborted(self, step_id: int) -> None:
        if self.aborted and step_id not in self.results:
            raise StepAborted(f"parameter server {self.shard_index}: step {step_id} was aborted")

    def abort(self) -> None:
        """Fail every pending and future push and pull until ``reset``."""
        self.aborted = True
        for event in self.events.values():
            event.set()

    def reset(self, step_id: int) -> None:
        """Forget partial sums and aborted steps; expect ``step_id`` next."""
        self.abort()
        self.waiting.clear()
        self.results.clear()
        self.events.clear()
        self.next_worker = 0
        self.step_id = step_id
        self.aborted = False

    def ping(self) -> int:
        return self.shard_index

    def pid(self) -> int:
        return os.getpid()

"""Parameter-server actor: sums one gradient shard over all workers.

Workers ``push`` their shard for a step as one object holding its segments
(see ``dsgd.shards.segments``); the actor reads them as zero-copy views. When
every worker has pushed, the actor averages them into a preallocated
accumulator in one cache-blocked pass (per block: worker 0 + worker 1 + ...,
then divided by the worker count), puts the mean into the object store once,
and every worker's ``pull`` for that step returns its reference. The order of
additions is fixed, so the mean is bit-for-bit the same in every run and
equals the driver's in the "simple" strategy. ``pull`` awaits an asyncio
event: no polling, no busy wait.

This module must not import TensorFlow: a parameter server is a light process.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import ray

from dsgd import object_store, timeline

BLOCK_BYTES = 1 << 18  # summed block by block so each stays in cache between the adds and the divide


class StepAborted(RuntimeError):
    """The driver aborted the step this call belonged to (another actor failed)."""


class ParameterServer:
    """Runs as an async Ray actor; holds no state that outlives a step."""

    def __init__(self, shard_index: int, num_workers: int, size: int, dtype: str,
                 segments: list[tuple[int, int]]):
        """``segments``: the ``(start, size)`` ranges of the shard that a push carries, in order."""
        self.shard_index = shard_index
        self.num_workers = num_workers
        self.dtype = np.dtype(dtype)
        self.accumulator = np.zeros(size, dtype=self.dtype)  # alignment gaps stay zero
        self.segments = [(int(start), int(n)) for start, n in segments]
        self.block = max(1, BLOCK_BYTES // self.dtype.itemsize)
        self.step_id: int | None = None
        self.waiting: dict[int, list[np.ndarray]] = {}
        self.failures: dict[int, ValueError] = {}  # steps a bad push failed
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

    async def push(self, step_id: int, worker_index: int, stored: list[np.ndarray]) -> None:
        """Take one worker's segments of ``step_id`` (as ``object_store.put`` stored them).

        Averages once every worker has pushed. A bad push fails the step:
        its pulls raise the same error instead of waiting for a sum that
        cannot come.
        """
        self._check_not_aborted(step_id)
        try:
            self.waiting[worker_index] = self._accept(step_id, worker_index, stored)
        except ValueError as e:
            self.failures[step_id] = e
            self._event(step_id).set()
            raise
        if len(self.waiting) < self.num_workers:
            return
        recorder = self._recorder(step_id)
        with recorder.span(f"average {self.num_workers} workers' shards", "sum"):
            self._average([self.waiting[w] for w in range(self.num_workers)])
        self.waiting.clear()
        with recorder.span("put the mean in the object store", "sum"):
            self.results = {step_id: object_store.put([self.accumulator])}
        self._event(step_id).set()
        self.events = {k: v for k, v in self.events.items() if k > step_id}
        self.step_id = step_id + 1

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

    async def pull(self, step_id: int) -> list:
        """The mean shard of ``step_id``, as ``[ObjectRef]`` so Ray does not copy it."""
        self._check_not_aborted(step_id)
        start = timeline.now_us()
        if step_id not in self.results:
            await self._event(step_id).wait()
        self._check_not_aborted(step_id)
        if step_id in self.failures:
            raise self.failures[step_id]
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
        self.failures.clear()
        self.step_id = step_id
        self.aborted = False

    def ping(self) -> int:
        return self.shard_index

    def pid(self) -> int:
        return os.getpid()

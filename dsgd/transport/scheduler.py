"""A worker's sends and receives of a step, scheduled per stream: a sender and a reader for each lane.

A lane is one connection the worker pushes through (its end to one server:
a stream, a signal channel over shared memory, or the object store's
calls). The step hands each partition over (``hand``) and returns at once;
the lane's sender takes its partitions in the lane's order, each as soon as
it is handed over and the policy (``dsgd.transport.pacing``) lets it go, so
a lane whose socket is full holds up none of the others; the lane's reader
then takes the answers in the order they were pushed, which is the order
its server answers them, so each mean is read as it arrives and no server
waits on this worker to drain its socket. The step picks each mean up
(``result``), bounded.

A lane's order is the order of its partitions in the worker's rounds
(``dsgd.cluster.server_plan.send_rounds``: layout order on every lane, but
a node's relayed partitions first in each round on the lane to its relay),
the same on every worker of a node: a server answers a channel's pushes in
order, so two workers pushing one server's partitions in different orders
could each wait for the other's; and the rounds policy, which lets one
partition go at a time in the rounds' order, never waits for one queued
behind another on its lane.

A failed send or receive fails the step: every mean not yet read then
raises that error, so the step ends at once, and ``forget`` drops what the
failed step left (the lanes' answers are dropped by their ends' own
``forget``: a reader still waiting sees its request forgotten). ``attach``
takes new lanes (a recovery or a resize re-attached the worker) without
anything above being rebuilt.

No TensorFlow here: the step's callbacks (``dsgd.exchange.ps``) call in.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any, Hashable, Protocol, Sequence

from dsgd.common import timeline
from dsgd.transport.pacing import Paceable, Pacing

Lane = Hashable


class Lanes(Paceable, Protocol):
    """What a scheduler moves partitions through (``dsgd.exchange.ps_client.ParameterServerClient``)."""

    def push(self, j: int, step: int, payload: Any) -> Any:
        """Push partition ``j`` of ``step`` (``payload``: what the step handed over); a ticket for ``mean``."""

    def mean(self, j: int, step: int, ticket: Any) -> Any:
        """The mean of partition ``j`` of ``step``, pushed with ``ticket``; its wait bounded (TimeoutError), and
        ended at once if the push is forgotten."""


class SendScheduler:
    """Sends handed-over partitions down their lanes, each lane on a thread of its own, and reads their means.

    One lock guards the state; each lane's sender and each partition's
    result have a condition of their own on it, so a hand-over, a send or
    a mean wakes only the thread it concerns (the policy names the
    partitions a send lets go).
    """

    def __init__(self, lanes: Lanes, lane_of: Sequence[Lane], pacing: Pacing, rounds: Sequence[Sequence[int]]):
        """``lane_of[j]``: partition j's lane; ``rounds``: the worker's push order, every partition once (each
        lane's order, and the rounds policy's)."""
        self._lanes, self._pacing = lanes, pacing
        self._lock = threading.Lock()  # guards everything below
        self._lane_of: Sequence[Lane] = ()
        self._sendable: dict[Lane, threading.Condition] = {}  # a lane's sender waits on its own
        self._arrived: list[threading.Condition] = []  # partition j's result waits on the j-th
        self._generation = 0  # a failed step's forget starts the next
        self._handed: dict[int, tuple[int, Any, timeline.Recorder | None]] = {}  # j -> (step, payload, trace)
        self._results: dict[int, tuple[int, Any]] = {}  # j -> (step, its mean)
        self._failure: BaseException | None = None  # the step's first error
        self._attachment = 0  # which lanes' threads run: a thread whose attachment is not this one ends
        self.attach(lanes, lane_of, rounds)

    def attach(self, lanes: Lanes, lane_of: Sequence[Lane], rounds: Sequence[Sequence[int]]) -> None:
        """Move partitions through ``lanes`` from now on (``lane_of`` as for the constructor): the old lanes'
        threads end and new ones start, between steps."""
        orders: dict[Lane, list[int]] = {}
        for j in itertools.chain(*rounds):
            orders.setdefault(lane_of[j], []).append(j)
        with self._lock:
            self._wake_all()  # the old lanes' senders see the new attachment and end
            self._lanes, self._lane_of = lanes, list(lane_of)
            self._sendable = {lane: threading.Condition(self._lock) for lane in orders}
            self._arrived = [threading.Condition(self._lock) for _ in lane_of]
            self._attachment += 1
            self._generation += 1
            self._handed.clear()
            self._results.clear()
            self._failure = None
            self._pacing.attach(lanes, list(orders), rounds)
            attachment, sendable = self._attachment, self._sendable
        for lane, order in orders.items():
            answers: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._send_all, args=(lane, order, sendable[lane], answers, attachment),
                             daemon=True, name=f"dsgd sender {lane}").start()
            threading.Thread(target=self._read_all, args=(lane, answers), daemon=True,
                             name=f"dsgd reader {lane}").start()

    def hand(self, j: int, step: int, payload: Any, trace: timeline.Recorder | None = None) -> None:
        """Partition ``j`` of ``step`` is ready: its lane's sender pushes ``payload`` (kept until then)."""
        with self._lock:
            self._handed[j] = step, payload, trace
            self._sendable[self._lane_of[j]].notify()

    def result(self, j: int, step: int, timeout_s: float) -> Any:
        """The mean of partition ``j`` of ``step`` once read; the step's error if one failed; TimeoutError after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._failure is not None:
                    raise self._failure
                found = self._results.get(j)
                if found is not None and found[0] == step:
                    del self._results[j]
                    return found[1]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no mean of partition {j}, step {step} within {timeout_s:.0f}s")
                self._arrived[j].wait(remaining)

    def forget(self) -> None:
        """The step failed: drop what it handed over and read; the lanes start their orders again."""
        with self._lock:
            self._generation += 1
            self._handed.clear()
            self._results.clear()
            self._failure = None
            self._pacing.forget()
            self._wake_all()

    def close(self) -> None:
        """End every lane's threads: a sender at its next look at the state, its reader after the answers it
        was given (the lanes' ends, closed by their owner, end those at once)."""
        with self._lock:
            self._attachment += 1
            self._generation += 1
            self._wake_all()

    # ---- the threads --------------------------------------------------------

    def _send_all(self, lane: Lane, order: list[int], sendable: threading.Condition, answers: queue.SimpleQueue,
                  attachment: int) -> None:
        """The lane's sender: its partitions in order, step after step, until its lanes are replaced or closed;
        it waits on ``sendable``, its lane's condition."""
        k, generation = 0, None
        while True:
            with self._lock:
                while True:
                    if attachment != self._attachment:
                        answers.put(None)
                        return
                    if generation != self._generation:  # a new step order after a failure (or the first)
                        k, generation = 0, self._generation
                    j = order[k]
                    if j in self._handed and self._pacing.may_send(j):
                        break
                    sendable.wait()
                step, payload, trace = self._handed.pop(j)
            start = timeline.now_us()
            ticket, error = None, None
            try:
                ticket = self._lanes.push(j, step, payload)
            except BaseException as e:  # it fails the step, whatever it is
                error = e
            del payload
            if trace is not None:
                trace.add(f"push partition {j}", start, timeline.now_us(), f"lane {lane} sends")
            with self._lock:
                if generation == self._generation:
                    for freed in self._pacing.sent(j):
                        self._sendable[self._lane_of[freed]].notify()
                    if error is not None:
                        self._fail(error)
                    else:
                        answers.put((generation, j, step, ticket, trace, timeline.now_us()))
            k = (k + 1) % len(order)

    def _read_all(self, lane: Lane, answers: queue.SimpleQueue) -> None:
        """The lane's reader: the answers to its pushes, in the order they were pushed."""
        while (item := answers.get()) is not None:  # idle between steps; the sender puts None as it ends
            generation, j, step, ticket, trace, pushed = item
            if generation != self._generation:  # a failed step's: its end dropped the answer
                continue
            mean, error = None, None
            try:
                mean = self._lanes.mean(j, step, ticket)
            except BaseException as e:  # it fails the step, whatever it is
                error = e
            if trace is not None:
                trace.add(f"answer of partition {j}", pushed, timeline.now_us(), f"lane {lane} reads")
            with self._lock:
                if generation == self._generation:
                    if error is not None:
                        self._fail(error)
                    else:
                        self._results[j] = step, mean
                        self._arrived[j].notify_all()

    def _fail(self, error: BaseException) -> None:
        """The step's first error (under the lock): every mean not yet read raises it."""
        if self._failure is None:
            self._failure = error
            for arrived in self._arrived:
                arrived.notify_all()

    def _wake_all(self) -> None:
        """Every sender and every result waiting (under the lock), to look at the state again."""
        for condition in [*self._sendable.values(), *self._arrived]:
            condition.notify_all()

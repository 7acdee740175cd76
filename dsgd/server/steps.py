"""One partition's steps on its server: which pushes a step waits for, when it closes, what it answered.

Every contributor pushes the partition once per step: a worker, or a node's
relay standing for several workers (keyed by the lowest of them). A step
closes at the first pushes that stand for ``quorum`` workers (all of them, or
``num_workers - backup_workers``), and with backup workers only once every
worker is done with the step whose mean slot it writes (has begun
``step_id - 1``); the pushes beyond are dropped. A closed step keeps its
answer (the mean's object-store reference, if any, and the workers averaged)
for as long as its mean slot holds it. A bad push fails the step.

The server's lock guards all of it: these methods are called under it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Collection, Mapping

import numpy as np
import ray

from dsgd.server.layout import Place


@dataclass
class PartitionSteps:
    """The state of one partition's current step."""

    place: Place
    # who pushes it: a worker, or a node's relay keyed by its lowest worker -> the workers the push stands for
    contributors: dict[int, tuple[int, ...]]
    quorum: int  # the workers a step is averaged over (or, relayed, summed over)
    step_id: int | None = None  # the step it sums next
    waiting: dict[int, list[np.ndarray]] = field(default_factory=dict)  # contributor -> its segments, in push order
    # step -> (the mean's ref for remote readers, the workers averaged), for the steps whose means are kept
    done: dict[int, tuple[ray.ObjectRef | None, tuple[int, ...]]] = field(default_factory=dict)
    failures: dict[int, Exception] = field(default_factory=dict)
    # Summed as the pushes arrive (``ParameterServer.arriving``): the step, each contributor's bytes of it in so
    # far, the bytes of its mean summed so far; one thread sums the partition's spans at a time (``summing``),
    # and ``progress`` (on the server's lock) wakes the answers waiting for them.
    arriving_step: int | None = None
    arrived: dict[int, int] = field(default_factory=dict)
    summed: int = 0
    summing: threading.Lock = field(default_factory=threading.Lock)
    progress: threading.Condition | None = None

    @property
    def index(self) -> int:
        return self.place.partition.index

    def workers_in(self, keys: Collection[int]) -> list[int]:
        """The workers the pushes of contributors ``keys`` stand for, in order."""
        return sorted(w for k in keys for w in self.contributors[k])

    def is_late(self, step_id: int) -> bool:
        """Whether ``step_id`` closed already (a backup worker's push, dropped)."""
        return self.step_id is not None and step_id < self.step_id

    def check(self, step_id: int, key: int, server: str) -> None:
        """Raise ValueError for a push ``server`` cannot take: another step, an unknown contributor, a second push."""
        if self.step_id is None:
            self.step_id = step_id
        if step_id != self.step_id:
            raise ValueError(f"{server} is summing step {self.step_id} of partition {self.index} but worker {key} "
                             f"pushed step {step_id}")
        if key not in self.contributors:
            raise ValueError(f"{server} expects partition {self.index} from {sorted(self.contributors)} (a node's "
                             f"relay pushes as its lowest worker), not from worker {key}")
        if key in self.waiting:
            raise ValueError(f"worker {key} pushed partition {self.index} of step {step_id} twice")

    def closes(self, step_id: int, begun: Mapping[int, float], slots: int) -> bool:
        """Whether ``step_id`` has the pushes it is averaged over, once every worker is done with the step whose
        mean slot it writes (``begun``: worker -> the last step it began; without backup workers, one slot,
        every worker's push says so)."""
        return (self.step_id == step_id and len(self.workers_in(self.waiting)) >= self.quorum
                and (slots == 1 or all(b >= step_id - 1 for b in begun.values())))

    def close(self, step_id: int) -> tuple[list[list[np.ndarray]], tuple[int, ...]]:
        """Close ``step_id``: the first pushes that make the quorum (in worker order) and the workers they stand
        for; the others are dropped, and the next step is expected."""
        keys, count = [], 0
        for key in self.waiting:  # in the order they arrived
            if count >= self.quorum:
                break
            keys.append(key)
            count += len(self.contributors[key])
        keys.sort()
        inputs = [self.waiting[key] for key in keys]
        averaged = tuple(self.workers_in(keys))
        self.waiting.clear()
        self.step_id = step_id + 1
        return inputs, averaged

    def arrive(self, step_id: int, key: int, nbytes: int) -> bool:
        """Note ``nbytes`` of ``key``'s push of ``step_id`` in (a new step forgets the last one's); whether every
        contributor's push has now begun."""
        if self.arriving_step != step_id:
            self.arriving_step, self.summed = step_id, 0
            self.arrived.clear()
        self.arrived[key] = nbytes
        return len(self.arrived) == len(self.contributors)

    def summable(self, step_id: int, min_bytes: int) -> tuple[int, int] | None:
        """The bytes of ``step_id``'s mean every contributor has sent and none has summed yet, ``(start, stop)``,
        whole elements, if at least ``min_bytes`` or the rest of the partition; else None."""
        if self.arriving_step != step_id or len(self.arrived) < len(self.contributors):
            return None
        itemsize = self.place.partition.wire_dtype.itemsize
        stop = min(self.arrived.values()) // itemsize * itemsize
        if stop - self.summed < min(min_bytes, self.place.partition.wire_nbytes - self.summed) or stop <= self.summed:
            return None
        return self.summed, stop

    def settled(self, step_id: int) -> bool:
        """Whether ``step_id`` has its answer or failed."""
        return step_id in self.done or step_id in self.failures

    def keep(self, step_id: int, ref: ray.ObjectRef | None, averaged: tuple[int, ...], slots: int) -> None:
        """Record ``step_id``'s answer; forget those whose mean slot it overwrote."""
        self.done = {s: d for s, d in self.done.items() if s > step_id - slots}
        self.done[step_id] = (ref, averaged)
        self.failures.clear()

    def reset(self, step_id: int) -> None:
        """Forget every push and answer; expect ``step_id`` next."""
        self.waiting.clear()
        self.done.clear()
        self.failures.clear()
        self.step_id = step_id
        self.arriving_step, self.summed = None, 0
        self.arrived.clear()

    def stuck(self, step_id: int, begun: Mapping[int, float]) -> str:
        """Who ``step_id`` is waiting for: the workers yet to push, or (it has its pushes) to begin the step before."""
        if len(self.workers_in(self.waiting)) >= self.quorum:
            behind = sorted(w for w, b in begun.items() if b < step_id - 1)
            return (f"workers {behind} to begin step {step_id - 1} (it closes step {step_id} of partition "
                    f"{self.index} only then)")
        missing = self.workers_in(set(self.contributors) - set(self.waiting))
        return f"workers {missing} to push partition {self.index} of step {step_id}"


def contributors(num_workers: int, node_sums: Collection[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """Who pushes a partition to its server: every worker but those of ``node_sums``, each group of which its node's
    relay pushes as one, keyed by its lowest worker; in key order."""
    grouped = {w for group in node_sums for w in group}
    keys = {w: (w,) for w in range(num_workers) if w not in grouped}
    keys.update({min(group): tuple(group) for group in node_sums})
    return dict(sorted(keys.items()))

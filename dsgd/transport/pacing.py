"""How a worker's send scheduler paces its streams: the policies ``dsgd.transport.scheduler`` is given.

A policy says, under the scheduler's lock, whether a stream's next
partition may go now (``may_send``) and hears when one went (``sent``,
which names the partitions that send lets go, so the scheduler wakes
their senders alone); ``attach`` lets it shape the streams themselves (a
kernel pacing rate). It never blocks and holds no thread: the scheduler's
senders wait for it.

- ``FreeStreams`` ("streams", the default): every stream sends as soon as
  its next partition is handed over, whatever the others do.
- ``InRounds`` ("rounds"): one partition on the wire at a time, in the
  worker's rounds (``dsgd.cluster.server_plan.send_rounds``): the order of
  the sends once chained into the step, kept to compare against.
- ``EqualRate``: ``FreeStreams``, each stream that crosses nodes paced by
  the kernel (``SO_MAX_PACING_RATE``) at the link's rate shared equally
  among them, so no flow runs ahead while another lags.

``policy`` makes one from its name (``WorkerConfig.send_schedule``).
"""

from __future__ import annotations

import itertools
from typing import Hashable, Protocol, Sequence

POLICIES = ("rounds", "streams", "equal-rate")


class Paceable(Protocol):
    """The streams a policy may shape: which lanes cross nodes, and a rate for one of them."""

    def crosses_nodes(self, lane: Hashable) -> bool: ...

    def pace(self, lane: Hashable, bytes_per_s: int) -> None: ...


class Pacing(Protocol):
    """A send schedule's policy; called under the scheduler's lock."""

    def attach(self, lanes: Paceable, lane_ids: Sequence[Hashable], rounds: Sequence[Sequence[int]]) -> None:
        """The scheduler's lanes and the worker's rounds, once they are known (again after a re-attach)."""

    def may_send(self, j: int) -> bool:
        """Whether partition ``j``, next on its stream and handed over, may go now."""

    def sent(self, j: int) -> Sequence[int]:
        """Partition ``j`` left (or failed to): the partitions that may go now and could not before."""

    def forget(self) -> None:
        """The step failed: start again with nothing sent."""


class FreeStreams:
    """Every stream on its own: a partition goes once it is handed over and its stream is free."""

    def attach(self, lanes: Paceable, lane_ids: Sequence[Hashable], rounds: Sequence[Sequence[int]]) -> None:
        pass

    def may_send(self, j: int) -> bool:
        return True

    def sent(self, j: int) -> Sequence[int]:
        return ()

    def forget(self) -> None:
        pass


class InRounds:
    """One partition at a time, in the order of the rounds: each waits for the one before it to have left."""

    def __init__(self) -> None:
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._left: set[int] = set()  # positions sent this step

    def attach(self, lanes: Paceable, lane_ids: Sequence[Hashable], rounds: Sequence[Sequence[int]]) -> None:
        self._order = list(itertools.chain(*rounds))
        self._position = {j: k for k, j in enumerate(self._order)}
        self._left.clear()

    def may_send(self, j: int) -> bool:
        k = self._position[j]
        return k == 0 or k - 1 in self._left

    def sent(self, j: int) -> Sequence[int]:
        k = self._position[j]
        self._left.add(k)
        if len(self._left) == len(self._order):  # the step's last: the next step starts afresh
            self._left.clear()
            return ()
        return self._order[k + 1:k + 2]

    def forget(self) -> None:
        self._left.clear()


class EqualRate(FreeStreams):
    """Free streams, each crossing nodes paced at ``link_bytes_per_s`` divided by how many cross."""

    def __init__(self, link_bytes_per_s: int):
        self.link_bytes_per_s = link_bytes_per_s

    def attach(self, lanes: Paceable, lane_ids: Sequence[Hashable], rounds: Sequence[Sequence[int]]) -> None:
        crossing = [lane for lane in lane_ids if lanes.crosses_nodes(lane)]
        for lane in crossing:
            lanes.pace(lane, self.link_bytes_per_s // len(crossing))


def policy(spec: str) -> Pacing:
    """The policy ``spec`` names: "rounds", "streams", or "equal-rate:<Gbit/s of the worker's link>"."""
    name, _, rate = spec.partition(":")
    if name == "rounds" and not rate:
        return InRounds()
    if name == "streams" and not rate:
        return FreeStreams()
    if name == "equal-rate" and rate:
        return EqualRate(int(float(rate) * 1e9 / 8))
    raise ValueError(f"a send schedule is one of {POLICIES} (equal-rate with its link's Gbit/s, "
                     f"'equal-rate:10'), got {spec!r}")

"""What a parameter server records for the driver: the timelines of its last two steps and its cross-node traffic."""

from __future__ import annotations

from collections import Counter

from dsgd.common import timeline


class Traces:
    """The events of the last two steps, one recorder per step."""

    def __init__(self):
        self._recorders: dict[int, timeline.Recorder] = {}

    def recorder(self, step_id: int) -> timeline.Recorder:
        """``step_id``'s recorder, made on first use (the steps before the one before are dropped then)."""
        if step_id not in self._recorders:
            self._recorders = {k: v for k, v in self._recorders.items() if k >= step_id - 1}
            self._recorders[step_id] = timeline.Recorder()
        return self._recorders[step_id]

    def events(self, step_id: int) -> list[timeline.Event]:
        """The events of ``step_id``; [] once it is forgotten."""
        return list(self._recorders[step_id].events) if step_id in self._recorders else []


class Traffic:
    """Per partition, how many pushes brought their data from another node (down a stream or through the object
    store)."""

    def __init__(self):
        self._crossed: Counter[int] = Counter()

    def count(self, j: int, crosses_nodes: bool) -> None:
        """A push of partition j came through an end that ``crosses_nodes`` or not."""
        if crosses_nodes:
            self._crossed[j] += 1

    def of(self, partitions) -> dict[int, int]:
        return {j: self._crossed[j] for j in partitions}

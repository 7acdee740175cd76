"""Where a parameter server keeps its partitions: the mean buffer and its slots, and the input buffers' offsets.

Every partition a server sums or relays has one place, the same byte offset
in its mean buffer and in every worker's input buffer, each partition starting
on an ``ALIGN_BYTES`` boundary. With backup workers the mean buffer holds two
slots (the means of the last two steps, by step parity), else one. A relay
stream's input buffer (``attach_relay``) holds every partial sum pushed to
this server, in float32: it has its own offsets (``partial_sum_offsets``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from dsgd.transport import shared_memory
from dsgd.wire.partitions import Partition, aligned, segments


@dataclass(frozen=True)
class Place:
    """One partition's place in the server's buffers."""

    partition: Partition
    offset: int  # bytes into the mean buffer and every worker's input buffer
    segments: tuple[tuple[int, int], ...]  # (start, size) of each segment a push carries
    means: tuple[np.ndarray, ...]  # views of the mean buffer in the wire dtype, one per slot

    def mean(self, step_id: int) -> np.ndarray:
        """The slot ``step_id``'s mean goes in."""
        return self.means[step_id % len(self.means)]


def partial_sum(partition: Partition) -> Partition:
    """``partition`` as a node's partial sum of it travels: uncompressed (the sum of its workers' 16-bit copies in
    float32, not rounded again)."""
    return replace(partition, compression=None)


class BufferLayout:
    """The mean buffer (shared with the workers on this node where ``shared``) and each partition's place in it."""

    def __init__(self, server_index: int, partitions: Sequence[Partition], slots: int, shared: bool):
        offsets, end = _offsets(partitions)
        self.nbytes = end  # of one slot, and of every worker's input buffer (``bytes_for``)
        self.slots = slots
        self.shared = shared
        if shared:
            self.mean_buffer = shared_memory.SharedBuffer(self.nbytes * slots, f"dsgd-ps{server_index}-mean")
            memory = self.mean_buffer.memory
        else:
            memory = bytearray(self.nbytes * slots)
        self.places = {partition.index: self._place(partition, memory, offset)
                       for partition, offset in zip(partitions, offsets)}

    @staticmethod
    def bytes_for(partitions: Sequence[Partition]) -> int:
        """The bytes of one slot of the mean buffer, and of every worker's input buffer, for ``partitions``."""
        return _offsets(partitions)[1]

    def _place(self, partition: Partition, memory, offset: int) -> Place:
        means = tuple(np.frombuffer(memory, partition.wire_dtype, partition.size, offset + k * self.nbytes)
                      for k in range(self.slots))
        return Place(partition, offset, tuple((s.start, s.size) for s in segments(partition)), means)

    def offsets(self) -> dict[int, int]:
        """Partition -> its byte offset in the mean buffer and the input buffers."""
        return {j: place.offset for j, place in self.places.items()}

    def slot_offsets(self) -> list[int]:
        """The byte offset of each slot of the mean buffer."""
        return [k * self.nbytes for k in range(self.slots)]


def _offsets(partitions: Sequence[Partition]) -> tuple[list[int], int]:
    """Each partition's byte offset in a buffer holding them in turn (in the wire dtype), and its bytes."""
    offsets, end = [], 0
    for partition in partitions:
        offsets.append(end)
        end = aligned(end + partition.wire_nbytes)
    return offsets, end


def partial_sum_offsets(partitions: Sequence[Partition]) -> tuple[dict[int, int], int]:
    """Where each of ``partitions``' partial sums goes in a relay stream's input buffer, and the buffer's bytes."""
    offsets, end = _offsets([partial_sum(p) for p in partitions])
    return dict(zip((p.index for p in partitions), offsets)), end

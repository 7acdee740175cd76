"""Partition layout: how a worker's gradients are packed into flat partition buffers.

Every worker computes the same layout from the same variable list, so a partition
is just a flat 1-D buffer of one dtype; piece ``k`` of partition ``j`` is the slice
``buffer[partition_offset:partition_offset + size]`` holding elements
``[var_offset, var_offset + size)`` of the flattened gradient of variable
``var_index``. Small gradients are concatenated, large ones split, and every
piece starts on an ``ALIGN_BYTES`` boundary so that the read side can hand
TensorFlow aligned views of a received partition without copying.

On the way to its parameter server a partition travels as a list of segments
(``segments``): a piece of at least ``VIEW_BYTES`` is sent as a view of the
gradient itself, so the object store's own copy is the only one; runs of
smaller pieces are packed together first, which keeps the number of arrays
per push small.

Under wire compression (``dsgd.wire.codec``) a float32 partition travels in 16-bit
form: the same layout in elements (so exactly half the bytes), a 2-byte
``wire_dtype``, buffers of ``wire_nbytes``, and every segment packed (the
conversion is the copy), none a view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dsgd.wire import codec

ALIGN_BYTES = 64
VIEW_BYTES = 1 << 16  # pieces this big are sent as views of the gradient, not packed
PARTITIONS_PER_SERVER = 4  # default on one node: enough to pipeline with back-propagation, few enough to stay cheap
PARTITIONS_PER_SERVER_ACROSS_NODES = 16  # default across nodes: the links, not the partitions' count, set the time
MIN_PARTITION_BYTES = 1 << 20  # default: smaller partitions cost more in calls than they gain


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one variable's flattened gradient inside a partition."""

    var_index: int
    var_offset: int
    partition_offset: int
    size: int


@dataclass(frozen=True)
class Partition:
    """One flat buffer of a single dtype, summed by its own parameter server.

    ``dtype`` is the gradients'; ``compression`` (``dsgd.wire.codec``) says how it
    travels, set only on float32 partitions.
    """

    index: int
    dtype: np.dtype
    size: int
    pieces: tuple[Piece, ...]
    compression: str | None = None

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def wire_dtype(self) -> np.dtype:
        """The dtype of the partition's buffers on the wire (``dsgd.wire.codec.wire_dtype``)."""
        return codec.wire_dtype(self.dtype, self.compression)

    @property
    def wire_nbytes(self) -> int:
        """Bytes of the partition on the wire: what a worker writes, and a server's buffers hold."""
        return self.size * self.wire_dtype.itemsize


@dataclass(frozen=True)
class Segment:
    """The range ``[start, start + size)`` of a partition, sent as one array.

    Piece offsets are relative to ``start``. A ``view`` segment is one large
    piece, sent as a view of its gradient; any other segment is packed
    (alignment gaps zeroed) into an array laid out like the partition's range.
    """

    start: int
    size: int
    dtype: np.dtype
    pieces: tuple[Piece, ...]
    view: bool
    wire_dtype: np.dtype  # its partition's (``Partition.wire_dtype``)

    @property
    def wire_nbytes(self) -> int:
        return self.size * self.wire_dtype.itemsize


@dataclass(frozen=True)
class VarSpec:
    """Name, shape and dtype of one trainable variable's gradient."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def spec_difference(ours: Sequence[VarSpec], theirs: Sequence[VarSpec], limit: int = 6) -> str:
    """The variables only one side has (name, shape, dtype), for an error message."""
    differ = sorted(set(map(str, ours)) ^ set(map(str, theirs)))
    return "; ".join(differ[:limit]) + (f" (and {len(differ) - limit} more)" if len(differ) > limit else "")


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the next ``ALIGN_BYTES`` boundary (a partition's place in a server's buffers)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _align(elements: int, itemsize: int) -> int:
    step = max(1, ALIGN_BYTES // itemsize)
    return -(-elements // step) * step


def default_partition_bytes(specs: Sequence[VarSpec], num_servers: int, across_nodes: bool = False) -> int:
    """The partition size dsgd picks: about ``PARTITIONS_PER_SERVER`` per server on one node,
    ``PARTITIONS_PER_SERVER_ACROSS_NODES`` when the workers and servers span nodes; at least 1 MiB.

    On one node each partition costs CPU (a push per worker and step, a
    signal to its server), so a partition is as large as it can be while
    still giving every server a few to pipeline. Across nodes the links set
    a step's time, and a partition's mean leaves its server only once every
    worker has pushed it: the last round's means (1/rounds of the bytes)
    cross after all the pushes. More rounds shrink that tail (4 nodes at
    0.1 Gbit/s: 1.64 x M/B with 4 rounds, 1.49 with 16, servers on nodes of
    their own).
    A variable is split only into as many pieces as there are servers: its
    pieces are ready at the same moment, so splitting gains only when they
    are summed in parallel, and a split variable costs a copy on receive.
    Partitions fill whole rounds of one per server (``assign_partitions``):
    a last round of fewer would have every worker push its few partitions
    to the same few servers at once (8 servers, 17 partitions: all 7 other
    nodes' pushes of the 17th into one node's link), so a count past a
    multiple of the servers is rounded down to it with larger partitions.
    """
    servers = max(1, num_servers)
    total = sum(s.size * np.dtype(s.dtype).itemsize for s in specs)
    largest = max((s.size * np.dtype(s.dtype).itemsize for s in specs), default=0)
    per_server = PARTITIONS_PER_SERVER_ACROSS_NODES if across_nodes else PARTITIONS_PER_SERVER
    size = max(MIN_PARTITION_BYTES, math.ceil(total / (per_server * servers)),
               math.ceil(largest / servers))
    count = math.ceil(total / size)
    if count <= servers or count % servers == 0:
        return size
    return math.ceil(total / (count // servers * servers))


def plan_partitions(specs: Sequence[VarSpec], grad_shard_bytes: int, compression: str | None = None) -> list[Partition]:
    """Split gradients into partitions of about ``grad_shard_bytes`` each.

    Variables are packed in the order given (the engine passes them last
    layer first, the order back-propagation produces them). Each dtype gets
    its own partitions; within a dtype the partition count is
    exactly ``ceil(total_bytes / grad_shard_bytes)`` and the elements are
    spread evenly over them, so partitions (and so parameter servers) carry
    balanced loads.
    ``grad_shard_bytes == 0`` means one partition per dtype. Zero-size variables
    take no room. A variable that fits in one partition is never split (it goes
    whole into the current partition or the next, whichever then ends nearer its
    target), so the read side can hand it to TensorFlow as a view of the
    received partition; only variables larger than a partition are split.
    ``compression`` (``dsgd.wire.codec.COMPRESSIONS``) marks the float32 partitions;
    the layout in elements is float32's, the bytes on the wire half.
    """
    if grad_shard_bytes < 0:
        raise ValueError(f"grad_shard_bytes must be >= 0, got {grad_shard_bytes}")
    partitions: list[Partition] = []
    dtypes = list(dict.fromkeys(np.dtype(s.dtype) for s in specs))
    for dtype in dtypes:
        members = [(i, s) for i, s in enumerate(specs) if np.dtype(s.dtype) == dtype and s.size > 0]
        total = sum(s.size for _, s in members)
        if total == 0:
            continue
        total_bytes = total * dtype.itemsize
        count = 1 if grad_shard_bytes == 0 else max(1, math.ceil(total_bytes / grad_shard_bytes))
        compressed = compression if codec.wire_dtype(dtype, compression) != dtype else None
        partitions.extend(_fill(members, dtype, count, len(partitions), compressed))
    return partitions


def _fill(members, dtype: np.dtype, count: int, first_index: int, compression: str | None) -> list[Partition]:
    """Greedily fill ``count`` partitions, splitting only variables larger than a partition's target.

    Each partition's target is the payload still to place over the partitions still
    to fill, so a partition that ends early or late (a variable kept whole) is
    made up for by the next ones, and the last partition takes whatever remains.
    """
    partitions: list[Partition] = []
    pieces: list[Piece] = []
    remaining = sum(spec.size for _, spec in members)
    used = 0  # payload elements in the current partition
    end = 0  # aligned end of the current partition's buffer
    target = math.ceil(remaining / count)

    def close() -> None:
        nonlocal pieces, used, end, remaining, target
        partitions.append(Partition(first_index + len(partitions), dtype, end, tuple(pieces), compression))
        remaining -= used
        pieces, used, end = [], 0, 0
        left = count - len(partitions)
        target = math.ceil(remaining / left) if left > 1 else remaining

    def place(var_index: int, offset: int, size: int) -> None:
        """Add a piece to the current partition; close the partition once it reaches its target."""
        nonlocal used, end
        start = _align(end, dtype.itemsize)
        pieces.append(Piece(var_index, offset, start, size))
        used += size
        end = start + size
        if used >= target and remaining > used:
            close()

    for var_index, spec in members:
        if spec.size <= target:  # whole, in this partition or the next, whichever ends nearer its target
            if used and used + spec.size - target > target - used:
                close()
            place(var_index, 0, spec.size)
        else:
            offset = 0
            while offset < spec.size:
                take = min(target - used, spec.size - offset)
                place(var_index, offset, take)
                offset += take
    if pieces:
        close()
    return partitions


def segments(partition: Partition, view_bytes: int = VIEW_BYTES) -> tuple[Segment, ...]:
    """How ``partition`` travels: one segment per large piece, one per run of small ones.

    A compressed partition has no views: every piece is converted while it is packed.
    """
    out: list[Segment] = []
    run: list[Piece] = []

    def close_run() -> None:
        if run:
            start = run[0].partition_offset
            end = run[-1].partition_offset + run[-1].size
            relative = tuple(Piece(p.var_index, p.var_offset, p.partition_offset - start, p.size) for p in run)
            out.append(Segment(start, end - start, partition.dtype, relative, False, partition.wire_dtype))
            run.clear()

    for p in partition.pieces:
        if p.size * partition.dtype.itemsize >= view_bytes and partition.compression is None:
            close_run()
            out.append(Segment(p.partition_offset, p.size, partition.dtype,
                               (Piece(p.var_index, p.var_offset, 0, p.size),), True, partition.wire_dtype))
        else:
            run.append(p)
    close_run()
    return tuple(out)


def piece_view(grad: np.ndarray, piece: Piece) -> np.ndarray:
    """The elements of ``grad`` (any shape, C-contiguous) that ``piece`` covers, without a copy."""
    return grad.reshape(-1)[piece.var_offset:piece.var_offset + piece.size]


def segment_arrays(grads: Sequence[np.ndarray], parts: Sequence[Segment],
                   buffers: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """The arrays a worker pushes for one partition, one per segment.

    View segments are views of ``grads``; the others are packed into their
    entry of ``buffers`` (``None`` for view segments).
    """
    return [piece_view(grads[s.pieces[0].var_index], s.pieces[0]) if s.view else pack(grads, s, buf)
            for s, buf in zip(parts, buffers)]


def pack(grads: Sequence[np.ndarray], partition: Partition | Segment, out: np.ndarray) -> np.ndarray:
    """Copy this partition's (or segment's) pieces of ``grads`` into the flat buffer ``out``.

    ``out`` is in the wire dtype: a 16-bit one converts while it copies (``dsgd.wire.codec``).
    """
    for p in partition.pieces:
        codec.convert_into(out[p.partition_offset:p.partition_offset + p.size], piece_view(grads[p.var_index], p))
    return out


def unpack(partitions: Sequence[np.ndarray], layout: Sequence[Partition], specs: Sequence[VarSpec]) -> list[np.ndarray]:
    """Rebuild per-variable gradients from flat partition buffers (inverse of pack; 16-bit ones decoded)."""
    grads = [np.empty(s.shape, dtype=s.dtype) for s in specs]
    for buf, partition in zip(partitions, layout):
        for p in partition.pieces:
            codec.convert_into(grads[p.var_index].reshape(-1)[p.var_offset:p.var_offset + p.size],
                              buf[p.partition_offset:p.partition_offset + p.size])
    return grads

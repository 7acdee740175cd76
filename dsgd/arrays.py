"""TensorFlow-free array arithmetic that both ends of the exchange share.

``average_into(out, inputs)`` computes ``(inputs[0] + inputs[1] + ...) / n``
adding in the order given (worker order), block by block so each block stays
in cache between the adds and the divide. The driver's "simple" average and
every parameter server call it, so the two strategies agree bit for bit.
Inputs in a 16-bit wire form (``dsgd.wire``) are widened to ``out``'s
float32 block by block, so a compressed partition is summed in float32.
``address_range`` is how the op library hands a numpy array's memory to C++.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsgd import wire

BLOCK_BYTES = 1 << 18


def average_into(out: np.ndarray, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """``out[:] = mean of inputs`` (same flat size and dtype, or 16-bit wire forms of a float32 ``out``).

    Summed in the order given.
    """
    n = len(inputs)
    if n == 0:
        raise ValueError("average_into needs at least one input")
    flat_out = out.reshape(-1)
    flat = [_Widened(a.reshape(-1)) if a.dtype != out.dtype else a.reshape(-1) for a in inputs]
    block = max(1, BLOCK_BYTES // max(1, out.dtype.itemsize))
    for lo in range(0, flat_out.size, block):
        hi = min(lo + block, flat_out.size)
        target = flat_out[lo:hi]
        if n == 1:
            np.copyto(target, flat[0][lo:hi])
        else:
            np.add(flat[0][lo:hi], flat[1][lo:hi], out=target)
            for a in flat[2:]:
                np.add(target, a[lo:hi], out=target)
        np.divide(target, n, out=target)
    return out


class _Widened:
    """A 16-bit wire array whose slices are float32 (``dsgd.wire.to_float32``), for the block loop."""

    def __init__(self, wire_array: np.ndarray):
        self.wire_array = wire_array

    def __getitem__(self, key: slice) -> np.ndarray:
        return wire.to_float32(self.wire_array[key])


def address_range(array: np.ndarray) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous array's data."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return array.__array_interface__["data"][0], array.nbytes

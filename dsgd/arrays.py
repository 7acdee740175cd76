"""TensorFlow-free array arithmetic that both ends of the exchange share.

``average_into(out, inputs)`` computes ``(inputs[0] + inputs[1] + ...) / n``
adding in the order given (worker order), block by block so each block stays
in cache between the adds and the divide. The driver's "simple" average and
every parameter server call it, so the two strategies agree bit for bit.
``address_range`` is how the op library hands a numpy array's memory to C++.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

BLOCK_BYTES = 1 << 18


def average_into(out: np.ndarray, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """``out[:] = mean of inputs`` (same flat size and dtype), summed in the order given."""
    n = len(inputs)
    if n == 0:
        raise ValueError("average_into needs at least one input")
    flat_out = out.reshape(-1)
    flat = [a.reshape(-1) for a in inputs]
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


def address_range(array: np.ndarray) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous array's data."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return array.__array_interface__["data"][0], array.nbytes

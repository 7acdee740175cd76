"""TensorFlow-free array arithmetic that both ends of the exchange share.

``average_into(out, inputs)`` computes ``(inputs[0] + inputs[1] + ...) / n``
adding in the order given (worker order), block by block so each block stays
in cache between the adds and the divide; ``divisor`` replaces ``n`` where an
input is already a sum of several workers' (node-local aggregation: a node's
partial sum, divided by the total worker count at its server, or by 1 at the
node's relay, which only sums). The driver's "simple" average and
every parameter server call it, so the two strategies agree bit for bit.
Inputs in a 16-bit wire form (``dsgd.wire.codec``) are widened to float32 block
by block, so a compressed partition is summed in float32;
``average_rounded_into`` rounds that float32 average once into a 16-bit
``out`` (a compressed partition's mean). Averages of float32 or bf16
inputs run in C++ (``dsgd.wire.kernels``) where the wire kernels are built.
``address_range`` is how the op library hands a numpy array's memory to C++.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsgd.wire import codec, kernels

BLOCK_BYTES = 1 << 18


def average_into(out: np.ndarray, inputs: Sequence[np.ndarray], divisor: int | None = None) -> np.ndarray:
    """``out[:] = sum of inputs / divisor`` (same flat size and dtype, or 16-bit wire forms of a float32 ``out``).

    Summed in the order given; ``divisor`` defaults to ``len(inputs)`` (their mean).
    """
    return _average(out, inputs, divisor, out.dtype)


def average_rounded_into(out: np.ndarray, inputs: Sequence[np.ndarray], divisor: int | None = None) -> np.ndarray:
    """As ``average_into``, for an ``out`` in a 16-bit wire form of float32 (``dsgd.wire.codec``): the average is taken
    in float32 and rounded once into ``out``. A compressed partition's mean."""
    if out.dtype not in codec.WIRE_DTYPES:
        raise ValueError(f"average_rounded_into rounds into a 16-bit wire form {codec.WIRE_DTYPES}, not {out.dtype}")
    return _average(out, inputs, divisor, np.dtype(np.float32))


def _average(out: np.ndarray, inputs: Sequence[np.ndarray], divisor: int | None, sum_dtype: np.dtype) -> np.ndarray:
    """The block loop of both averages: summed in ``sum_dtype``, then converted into ``out`` if it differs."""
    n = len(inputs)
    if n == 0:
        raise ValueError("average_into needs at least one input")
    if divisor is None:
        divisor = n
    elif divisor < 1:
        raise ValueError(f"average_into divides by a count of workers, at least 1; got {divisor}")
    flat_out = out.reshape(-1)
    flat = [a.reshape(-1) for a in inputs]
    if sum_dtype == np.float32 and kernels.average_into(flat_out, flat, divisor):
        return out
    flat = [_Widened(a) if a.dtype != sum_dtype else a for a in flat]
    block = max(1, BLOCK_BYTES // max(1, sum_dtype.itemsize))
    scratch = None if sum_dtype == out.dtype else np.empty(min(block, flat_out.size), sum_dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite mean is nan_policy's to judge, not noise
        for lo in range(0, flat_out.size, block):
            hi = min(lo + block, flat_out.size)
            target = flat_out[lo:hi] if scratch is None else scratch[:hi - lo]
            if n == 1:
                np.copyto(target, flat[0][lo:hi])
            else:
                np.add(flat[0][lo:hi], flat[1][lo:hi], out=target)
                for a in flat[2:]:
                    np.add(target, a[lo:hi], out=target)
            if divisor != 1:
                np.divide(target, divisor, out=target)
            if scratch is not None:
                codec.convert_into(flat_out[lo:hi], target)
    return out


class _Widened:
    """A 16-bit wire array whose slices are float32 (``dsgd.wire.codec.to_float32``), for the block loop."""

    def __init__(self, wire_array: np.ndarray):
        self.wire_array = wire_array

    def __getitem__(self, key: slice) -> np.ndarray:
        return codec.to_float32(self.wire_array[key])


def address_range(array: np.ndarray) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous array's data."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return kernels.address(array), array.nbytes

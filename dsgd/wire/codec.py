"""Wire compression: the 16-bit forms float32 partitions travel in, and the conversions.

With ``compression="bf16"`` or ``"fp16"`` a float32 partition travels as
16-bit floats, both to its parameter server and back. numpy has no
bfloat16, so bf16 travels as ``uint16`` holding its bits; fp16 is numpy's
``float16``. Other dtypes travel as they are. Which conversion a copy does
follows from the two dtypes (``convert_into``): float32 -> uint16 rounds to
bf16, float32 -> float16 to fp16, and back is exact.

Both roundings are to nearest, ties to even; a value beyond the 16-bit
range becomes inf (fp16's largest finite value is 65504). The op library
(dsgd/ops/cc) does the same bit for bit, so the Python path and the op path
send the same bytes.

bf16's conversions run in C++ (``dsgd.wire.kernels``, the wire kernels) where
a compiler is found, else in numpy, block by block; the two agree bit for
bit (tests/test_compression.py).

No TensorFlow here: the parameter servers import this module.
"""

from __future__ import annotations

import numpy as np

from dsgd.wire import kernels
from dsgd.wire.dtypes import BF16, FLOAT32, FP16

COMPRESSIONS = (None, "bf16", "fp16")
_WIRE = {"bf16": BF16, "fp16": FP16}
WIRE_DTYPES = tuple(_WIRE.values())


def wire_dtype(dtype: np.dtype, compression: str | None) -> np.dtype:
    """The dtype a partition of ``dtype`` travels in: 16-bit for float32 under compression, else ``dtype``."""
    dtype = np.dtype(dtype)
    return _WIRE[compression] if compression is not None and dtype == FLOAT32 else dtype


def to_float32(wire: np.ndarray) -> np.ndarray:
    """A 16-bit wire array as float32 (exact); a float32 array as it is."""
    if wire.dtype == BF16:
        return (wire.astype(np.uint32) << 16).view(np.float32)
    return wire if wire.dtype == FLOAT32 else wire.astype(np.float32)


BLOCK = 1 << 16  # elements per block of a numpy conversion: its temporaries stay in cache


def _round_to_bf16_into(out: np.ndarray, values: np.ndarray) -> None:
    """``out[:]`` = float32 ``values`` rounded to bf16 (nearest, ties to even), as uint16 bits; a NaN stays a
    (quiet) NaN. In C++ where it can (``dsgd.wire.kernels``), else block by block in numpy, in place in one scratch block:
    on whole partitions, numpy's temporaries made this 6x slower."""
    if kernels.round_bf16(out, values):
        return
    bits = values.view(np.uint32)
    scratch = np.empty(min(BLOCK, values.size), np.uint32)
    for lo in range(0, values.size, BLOCK):
        hi = min(lo + BLOCK, values.size)
        block, t, o = bits[lo:hi], scratch[:hi - lo], out[lo:hi]
        np.right_shift(block, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, block, out=t)  # wraps past 2**32 only for NaNs, fixed below
        np.right_shift(t, 16, out=t)
        np.copyto(o, t, casting="unsafe")
        nan = np.isnan(values[lo:hi])
        if nan.any():
            o[nan] = (block[nan] >> 16).astype(np.uint16) | 0x0040


def _widen_bf16_into(out: np.ndarray, wire_array: np.ndarray) -> None:
    """``out[:]`` = bf16 bits (uint16) as float32, exactly; in C++ where it can, else block by block in numpy in
    ``out`` itself."""
    if kernels.widen_bf16(out, wire_array):
        return
    bits = out.view(np.uint32)
    for lo in range(0, wire_array.size, BLOCK):
        hi = min(lo + BLOCK, wire_array.size)
        np.copyto(bits[lo:hi], wire_array[lo:hi], casting="unsafe")
        np.left_shift(bits[lo:hi], 16, out=bits[lo:hi])


def convert_into(out: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[:] = values`` converted to ``out``'s wire form (or from it); same flat size."""
    out = out.reshape(-1)
    values = values.reshape(-1)
    if out.dtype == values.dtype:
        out[:] = values
    elif out.dtype == BF16 and values.dtype == FLOAT32:
        _round_to_bf16_into(out, values)
    elif values.dtype == BF16 and out.dtype == FLOAT32:
        _widen_bf16_into(out, values)
    else:
        with np.errstate(over="ignore"):  # fp16: beyond its range is inf, as documented
            out[:] = values
    return out

"""The wire kernels: C++ loops for the exchange's array work, loaded through ctypes (no TensorFlow).

``libdsgd_wire.so`` (dsgd/ops/cc/wire_kernels.cc, built by ``dsgd.wire.native``
on first use, or by the install step) does what numpy does in
``dsgd.wire.codec`` and ``dsgd.wire.arrays``, bit for bit, in one vectorized pass:
bf16 rounding and widening, and the parameter servers' averages of float32
or bf16 pushes (summed in worker order in float32, divided, and for bf16
rounded once straight into the mean). Each function returns False, having
done nothing, where the kernels cannot be built or loaded (no compiler:
logged once) or an array is not contiguous; the caller then uses numpy.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Sequence

import numpy as np

from dsgd.wire import native
from dsgd.wire.dtypes import BF16, FLOAT32

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty until first loaded; [None] where they cannot be


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot be built or loaded."""
    with _lock:
        if not _library:
            try:
                lib = ctypes.CDLL(str(native.build_wire()))
            except (native.BuildError, OSError) as e:
                logger.warning("dsgd's wire kernels could not be built or loaded (%s); the exchange's array work "
                               "runs in numpy, slower", str(e).splitlines()[0])
                lib = None
            else:
                _declare(lib)
            _library.append(lib)
        return _library[0]


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    for name in ("dsgd_bf16_round", "dsgd_bf16_widen"):
        getattr(lib, name).argtypes = [ptr, ptr, i64]
    lib.dsgd_bf16_average.argtypes = [ctypes.POINTER(ptr), i64, i64, f32, ptr, ptr]
    lib.dsgd_f32_average.argtypes = [ctypes.POINTER(ptr), i64, i64, f32, ptr]
    for name in ("dsgd_bf16_round", "dsgd_bf16_widen", "dsgd_bf16_average", "dsgd_f32_average"):
        getattr(lib, name).restype = None


def address(array: np.ndarray) -> int:
    """The address of an array's data (``dsgd.wire.arrays.address_range`` hands it to the op library too)."""
    return array.__array_interface__["data"][0]


def _ready(*arrays: np.ndarray) -> ctypes.CDLL | None:
    """The library, if it is loaded and every array is contiguous."""
    if not all(a.flags.c_contiguous for a in arrays):
        return None
    return library()


def round_bf16(out: np.ndarray, values: np.ndarray) -> bool:
    """``out`` (uint16) = float32 ``values`` rounded to bf16 bits (``dsgd.wire.codec``'s rounding)."""
    lib = _ready(out, values)
    if lib is not None:
        lib.dsgd_bf16_round(address(values), address(out), values.size)
    return lib is not None


def widen_bf16(out: np.ndarray, bits: np.ndarray) -> bool:
    """``out`` (float32) = bf16 ``bits`` (uint16) widened, exactly."""
    lib = _ready(out, bits)
    if lib is not None:
        lib.dsgd_bf16_widen(address(bits), address(out), bits.size)
    return lib is not None


def average_into(out: np.ndarray, inputs: Sequence[np.ndarray], divisor: int) -> bool:
    """``out = (inputs[0] + inputs[1] + ...) / divisor`` in float32, for float32 inputs into a float32 ``out``, or
    bf16 inputs into a float32 ``out`` or (rounded once) a bf16 one; False for any other dtypes."""
    dtypes = {a.dtype for a in inputs}
    float32 = dtypes == {FLOAT32} and out.dtype == FLOAT32
    if not float32 and not (dtypes == {BF16} and out.dtype in (FLOAT32, BF16)):
        return False
    lib = _ready(out, *inputs)
    if lib is None:
        return False
    args = [(ctypes.c_void_p * len(inputs))(*[address(a) for a in inputs]), len(inputs), out.size, float(divisor)]
    if float32:
        lib.dsgd_f32_average(*args, address(out))
    elif out.dtype == BF16:  # rounded once into the bf16 out
        lib.dsgd_bf16_average(*args, None, address(out))
    else:
        lib.dsgd_bf16_average(*args, address(out), None)
    return True

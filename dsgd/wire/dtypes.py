"""The dtypes on the wire: float32, and the 16-bit forms a compressed float32 partition travels in."""

from __future__ import annotations

import numpy as np

FLOAT32 = np.dtype(np.float32)
BF16 = np.dtype(np.uint16)  # bf16 travels as its bits: numpy has no bfloat16
FP16 = np.dtype(np.float16)

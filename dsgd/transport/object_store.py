"""The one place dsgd moves gradient arrays through the Ray object store.

Write: ``put`` stores a list of arrays as one object with ``ray.put``. Ray's
pickle-5 serializer copies each array's bytes once, straight from wherever
they live (numpy, or a TensorFlow tensor seen through numpy) into the new
plasma buffer; there is no intermediate copy. Arrays are cut into chunks of
at most ``CHUNK_BYTES`` first: Ray copies a buffer larger than 1 MiB with 6
threads it starts for that copy, which on a busy or small machine takes about
twice the CPU time of one thread and is no faster (memory-bound). Checked
against Ray 2.60 (see docs/ops.md for the measurements), the alternatives
were:

* ``CoreWorker.put_file_like_object`` creates, fills (through a ``readinto``
  callback) and seals an object in one copy, but it is the spilled-object
  restore path: the object is sealed unpinned under an ID the reference
  counter does not own, so every other process fails with "owner is
  unknown". Not usable for sending to a parameter server.
* Ray 2.60 exposes no owned create/seal pair to Python (``CreateOwned`` and
  ``SealOwned`` are only reachable from Cython inside ``_raylet``).
* Mutable objects (``ray.experimental.channel``) reuse one buffer across steps
  but still copy a serialized value in, and need the compiled-graph
  reader/writer protocol on both ends.

Read: ``ray.get`` gives the chunks back as read-only, zero-copy views into the
object (callers do the ``ray.get``, with their own bound and error
messages). ``join`` reassembles each array: Ray places buffers of 2 KiB or more
at 64-byte-aligned offsets one after the other, so the chunks of one array
(all but the last a multiple of 64 bytes) are contiguous and ``join`` returns
one view spanning them. If a Ray version lays them out differently, ``join``
copies them together instead: slower, never wrong.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import ray

CHUNK_BYTES = 1 << 20  # Ray copies buffers up to this size with one thread


def chunks(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Flat views of ``arrays``, cut into pieces of at most ``CHUNK_BYTES`` (no copy)."""
    out = []
    for a in arrays:
        flat = a.reshape(-1)
        step = max(1, CHUNK_BYTES // flat.itemsize)
        out += [flat[i:i + step] for i in range(0, flat.size, step)] or [flat]
    return out


def put(arrays: Sequence[np.ndarray]) -> ray.ObjectRef:
    """Copy ``arrays`` into one new object owned by this process, each byte once."""
    return ray.put(chunks(arrays))


def join(stored: Sequence[np.ndarray], sizes: Sequence[int]) -> list[np.ndarray]:
    """The flat arrays of ``sizes`` elements that ``put`` stored as ``stored`` chunks.

    Raises ValueError if the chunks do not add up to exactly those sizes.
    """
    out, i = [], 0
    for size in sizes:
        group, n = [], 0
        while i < len(stored) and (n < size or not group):
            group.append(stored[i])
            n += stored[i].size
            i += 1
        if n != size:
            break
        out.append(_contiguous(group))
    if len(out) != len(sizes) or i != len(stored):
        raise ValueError(f"expected arrays of sizes {list(sizes)}, got chunks of sizes {[a.size for a in stored]}")
    return out


def _contiguous(group: list[np.ndarray]) -> np.ndarray:
    if len(group) == 1:
        return group[0]
    first = group[0]
    address = first.ctypes.data
    for a in group:
        if a.dtype != first.dtype or a.ctypes.data != address:
            return np.concatenate(group)
        address += a.nbytes
    # One view over the adjacent chunks; it holds `first`, whose base keeps the object mapped.
    return np.lib.stride_tricks.as_strided(first, shape=((address - first.ctypes.data) // first.itemsize,),
                                           strides=(first.itemsize,), writeable=False)


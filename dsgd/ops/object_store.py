"""The one place dsgd touches the Ray object store for gradient shards.

Write: ``put`` stores a packed shard with ``ray.put``: Ray serializes the
array out of band and copies its bytes once, straight into a new plasma
buffer that this process owns and the raylet pins. Checked against Ray 2.60
(see docs/ops.md for the measurements), the alternatives were:

* ``CoreWorker.put_file_like_object`` creates, fills (through a ``readinto``
  callback, so the pack could write into plasma directly) and seals an object
  in one copy, about 2x faster than pack + ``ray.put``. But it is the
  spilled-object restore path: the object is sealed unpinned under an ID the
  reference counter does not own, so every other process fails with "owner is
  unknown". Not usable for sending to a parameter server.
* Ray 2.60 exposes no owned create/seal pair to Python (``CreateOwned`` and
  ``SealOwned`` are only reachable from Cython inside ``_raylet``).
* Mutable objects (``ray.experimental.channel``) reuse one buffer across steps
  but still copy a serialized value in, and need the compiled-graph
  reader/writer protocol on both ends.

Read: ``get`` returns what ``ray.get`` returns for a numpy array: a read-only
view into the plasma buffer (no copy); the buffer stays mapped while the array
lives.
"""

from __future__ import annotations

import numpy as np
import ray


def put(array: np.ndarray) -> ray.ObjectRef:
    """Copy ``array`` into a new object owned by this process (one copy)."""
    return ray.put(array)


def get(ref: ray.ObjectRef, timeout: float | None = None) -> np.ndarray:
    """Return the object's array as a zero-copy view into object-store memory."""
    return ray.get(ref, timeout=timeout)


def address_range(array: np.ndarray) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous array's data."""
    if not array.flags.c_contiguous:
        raise ValueError("array must be C-contiguous")
    return array.__array_interface__["data"][0], array.nbytes

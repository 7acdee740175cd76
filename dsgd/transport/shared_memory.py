"""Shared memory between the processes of one host, reused for the engine's life.

A parameter server and the workers on its node exchange gradients through
buffers created once and written in place every step, so a step costs no
object creation, sealing, pinning or freeing in the Ray object store (the
per-object cost that dominated "ps" steps, see docs/ops.md). Across nodes the
object store is still the transport (``dsgd.exchange.ps_client``).

A buffer is an anonymous memory file (``memfd_create``): it has no name in
/dev/shm, is not limited by /dev/shm's size (Docker's is 64 MB), and the
kernel frees it when the last process holding it exits, even after SIGKILL,
so nothing leaks. Another process on the same host maps it through
``/proc/<pid>/fd/<fd>`` of the creator. Where that is not possible (not
Linux, or another PID namespace), ``available()`` or ``attach`` says so and
the caller falls back to the object store.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

def available() -> bool:
    """Whether this process can create buffers others on the host can map."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedBuffer:
    """A zero-filled buffer of ``nbytes`` that same-host processes map by ``address()``."""

    def __init__(self, nbytes: int, name: str = "dsgd"):
        self.nbytes = max(1, int(nbytes))
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.memory = mmap.mmap(self.fd, self.nbytes)

    def address(self) -> tuple[int, int, int]:
        """``(pid, fd, nbytes)``: what another process passes to ``attach``."""
        return os.getpid(), self.fd, self.nbytes

    def close(self) -> None:
        """Drop this process's handle; the memory lives on while others map it."""
        os.close(self.fd)


def attach(address: tuple[int, int, int], writable: bool) -> mmap.mmap:
    """Map the buffer at ``address`` (from ``SharedBuffer.address``) into this process.

    Raises OSError if this process cannot reach it (another host or PID
    namespace, or no /proc).
    """
    pid, fd, nbytes = address
    flags = os.O_RDWR if writable else os.O_RDONLY
    handle = os.open(f"/proc/{pid}/fd/{fd}", flags)
    try:
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(handle, nbytes, access=access)
    finally:
        os.close(handle)


def array(memory: mmap.mmap, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """A flat numpy view of ``count`` elements at byte ``offset`` of ``memory``.

    Read-only if the mapping is.
    """
    return np.frombuffer(memory, dtype=dtype, count=count, offset=offset)

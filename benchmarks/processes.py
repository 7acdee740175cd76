"""What the processes of a run cost, read from /proc: CPU seconds, resident memory, shared-memory files.

Linux only; a process that exits between listing and reading counts as
nothing. Used by ``benchmarks.scaling`` on a linked cluster's processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """Each process's CPU time so far (user + system), in seconds."""
    seconds = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Fields after the command name, which is in parentheses and may hold spaces.
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds[pid] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return seconds


def rss_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS; shared pages it maps count in full), or 0 if it is gone."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return 0


def title(pid: int) -> str:
    """The process's command line as `ps` shows it (Ray renames its workers "ray::ClassName..."), or ""."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def network_namespace(pid: int) -> int | None:
    """The inode of the process's network namespace (compare with ``os.stat`` of /run/netns/<name>)."""
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    return None


def memfd_bytes(pids: Iterable[int]) -> int:
    """Bytes of the anonymous memory files (``memfd_create``) the processes hold open, each file counted once."""
    files: dict[tuple[int, int], int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).startswith("/memfd:"):
                        stat = os.stat(fd.path)
                        files[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(files.values())


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field ("Shmem", "MemAvailable", ...) in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))

"""Save a checkpoint, then stop half-way through writing the next one over it, until killed.

Run by tests/test_checkpoint.py, which SIGKILLs it there. Usage:
``save_loop_job.py PATH ELEMENTS``. Save i writes one float32 weight of
ELEMENTS values, all equal to i, and applied_steps = i, through
``dsgd.driver.checkpoint.save`` (the function DistributedSGD.save writes with);
once it has returned, the job prints ``SAVED i``. Save 1 stops once it has
written half of the weight's bytes into its temporary file, prints
``HALF-WRITTEN 1`` and waits for the signal that kills it.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

from dsgd.driver import checkpoint


class StopsHalfWay:
    """A file object that pauses the process once ``limit`` bytes went through it (None: never)."""

    def __init__(self, file, limit: int | None, save: int):
        self.file, self.limit, self.save, self.written = file, limit, save, 0

    def write(self, data) -> int:
        count = self.file.write(data)
        self.written += count
        if self.limit is not None and self.written >= self.limit:
            self.file.flush()
            print(f"HALF-WRITTEN {self.save}", flush=True)
            while True:
                signal.pause()
        return count

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)


def main(path: str, elements: int) -> None:
    weight = np.empty(elements, np.float32)
    open_file = os.fdopen
    for i in range(2):
        limit = elements * 4 // 2 if i == 1 else None
        os.fdopen = lambda fd, mode, _i=i, _limit=limit: StopsHalfWay(open_file(fd, mode), _limit, _i)
        weight.fill(i)
        checkpoint.save(path, {"weights": {"w": weight}, "optimizer": {}, "applied_steps": i})
        print(f"SAVED {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Save checkpoints into one path over and over, until killed.

Run by tests/test_checkpoint.py, which SIGKILLs it in the middle of a save.
Usage: ``save_loop_job.py PATH ELEMENTS``. Save i writes one float32 weight
of ELEMENTS values, all equal to i, and applied_steps = i, through
``dsgd.checkpoint.save`` (the function DistributedSGD.save writes with);
once it has returned, the job prints ``SAVED i``.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

from dsgd import checkpoint


def main(path: str, elements: int) -> None:
    weight = np.empty(elements, np.float32)
    for i in itertools.count():
        weight.fill(i)
        checkpoint.save(path, {"weights": {"w": weight}, "optimizer": {}, "applied_steps": i})
        print(f"SAVED {i}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Checkpoint files: a replica's full state in one .npz, written atomically.

A checkpoint path is a file, or a directory (one that exists, or a path
ending in a separator) holding the file ``CHECKPOINT_FILE``: such a directory
is a ``ray.train.Checkpoint`` that other Ray tools (Tune) can move around.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Sequence

import numpy as np

from dsgd.shards import VarSpec

FORMAT_VERSION = 1
GROUPS = ("weights", "optimizer")
CHECKPOINT_FILE = "dsgd_checkpoint.npz"


def file_of(path: str | os.PathLike) -> str:
    """The checkpoint file ``path`` names.

    That is ``path`` itself, or ``CHECKPOINT_FILE`` inside it when ``path`` is
    an existing directory or ends in a path separator.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    separators = tuple(s for s in (os.sep, os.altsep) if s)
    return os.path.join(path, CHECKPOINT_FILE) if os.path.isdir(path) or path.endswith(separators) else path


def save(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` (as SGDWorker.get_state returns it) to ``path``.

    ``path`` is a file, or a directory (created if it ends in a separator)
    that gets ``CHECKPOINT_FILE``. The file is written beside its final
    name and renamed over it, so a crash mid-save leaves the previous
    checkpoint intact, never a half-written one.
    """
    target = file_of(path)
    if target != os.fspath(path):  # a directory
        os.makedirs(os.path.dirname(target), exist_ok=True)
    path = target
    arrays = {f"{group}/{name}": value for group in GROUPS for name, value in state[group].items()}
    meta = {"format": FORMAT_VERSION, "applied_steps": state["applied_steps"]}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".dsgd-checkpoint-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, __meta__=np.array(json.dumps(meta)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load(path: str | os.PathLike, expected: dict[str, Sequence[VarSpec]]) -> dict:
    """Read a checkpoint (a file or a directory ``save`` wrote) and check it matches ``expected`` ({group: specs})."""
    target = file_of(path)
    if target != os.fspath(path) and not os.path.exists(target):
        raise FileNotFoundError(f"{os.fspath(path)} is not a checkpoint: it names a directory and holds no "
                                f"{CHECKPOINT_FILE}; expected a checkpoint file or a directory written by "
                                "DistributedSGD.save")
    path = target
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT_VERSION}")
        state = {group: {} for group in GROUPS}
        for key in f.files:
            if key != "__meta__":
                group, name = key.split("/", 1)
                state[group][name] = f[key]
    problems = []
    for group in GROUPS:
        specs = {s.name: s for s in expected[group]}
        got = state[group]
        problems += [f"missing {group} {n!r}" for n in sorted(specs.keys() - got.keys())]
        problems += [f"unexpected {group} {n!r}" for n in sorted(got.keys() - specs.keys())]
        problems += [f"{group} {n!r} is {got[n].dtype}{list(got[n].shape)}, the model has {s.dtype}{list(s.shape)}"
                     for n, s in specs.items() if n in got and (got[n].shape != s.shape or got[n].dtype != s.dtype)]
    if problems:
        raise ValueError(f"{path} was written by a different model: {'; '.join(problems[:8])}"
                         + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))
    state["applied_steps"] = int(meta["applied_steps"])
    return state

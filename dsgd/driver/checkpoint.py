"""Checkpoint files: a replica's full state in one .npz, written atomically and durably.

A checkpoint path is a file, or a directory (one that exists, or a path
ending in a separator) holding the file ``CHECKPOINT_FILE``: such a directory
is a ``ray.train.Checkpoint`` that other Ray tools (Tune) can move around.

``save`` writes a temporary file beside the checkpoint, fsyncs it, renames
it over the checkpoint and fsyncs the directory (and the parents of any
directory it created), so a crash or a kill at any moment leaves the
previous checkpoint or the new one, whole. A temporary file left by a save
that was killed is removed by the next save to the same path; two processes
must not save to one path at once. ``load`` checks
the file before trusting it: a missing, empty, truncated or corrupt file, an
.npz that dsgd did not write and a checkpoint of another model each get an
error naming the file, the problem and what was expected.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import Sequence

import numpy as np

from dsgd.wire.partitions import VarSpec

FORMAT_VERSION = 1
GROUPS = ("weights", "optimizer")
CHECKPOINT_FILE = "dsgd_checkpoint.npz"
META_KEY = "__meta__"
TEMP_SUFFIX = ".tmp"  # "<dir>/.<checkpoint name>.<random>.tmp" while a save writes it
ZIP_START = b"PK\x03\x04"  # an .npz is a zip archive: it starts with a local file header...
ZIP_END = b"PK\x05\x06"  # ...and ends with the archive's index, within its last 64 KiB + 22 bytes
EXPECTED = "expected a checkpoint written by DistributedSGD.save"


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


def directory_to_save(checkpoint_dir: str | os.PathLike) -> str:
    """``save_checkpoint``'s directory as a path ``save`` writes inside (created if missing); a TypeError or
    NotADirectoryError if it is not a directory's path."""
    directory = _directory_path(checkpoint_dir, "save_checkpoint")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"save_checkpoint expects a directory, got the file {directory!r}; "
                                 "use save(path) to write a checkpoint file")
    return os.path.join(directory, "")  # a trailing separator: save writes inside it


def directory_to_restore(checkpoint_dir: str | os.PathLike) -> str:
    """``restore_checkpoint``'s directory as a path ``load`` reads inside; a TypeError or FileNotFoundError if
    it is not an existing directory."""
    directory = _directory_path(checkpoint_dir, "restore_checkpoint")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"restore_checkpoint expects a directory written by save_checkpoint, "
                                f"got {directory!r}, which is not a directory")
    return os.path.join(directory, "")


def _directory_path(path: object, method: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{method} expects a directory path (str or os.PathLike), got {type(path).__name__}")
    return os.fspath(path)


def save(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` (as SGDWorker.get_state returns it) to ``path``, atomically and durably.

    ``path`` is a file, or a directory (created if it ends in a separator)
    that gets ``CHECKPOINT_FILE``. The file is written and fsynced beside its
    final name, renamed over it, and the directory is fsynced so the rename
    survives a power loss: whenever the process dies, the path holds the
    previous checkpoint or this one, never a half-written file. Then the
    temporary files of earlier saves to ``path`` that were killed are removed.
    """
    target = file_of(path)
    directory = os.path.dirname(os.path.abspath(target))
    if target != os.fspath(path):  # a directory
        _make_directories(directory)
    elif not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save the checkpoint {target}: its directory {directory} does not exist")
    arrays = {f"{group}/{name}": value for group in GROUPS for name, value in state[group].items()}
    meta = {"format": FORMAT_VERSION, "applied_steps": state["applied_steps"]}
    prefix = f".{os.path.basename(target)}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{META_KEY: np.array(json.dumps(meta))}, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_directory(directory)
    _remove_leftovers(directory, prefix)


def _remove_leftovers(directory: str, prefix: str) -> None:
    """Remove the temporary files "<prefix><random>.tmp" that killed saves left in ``directory``.

    The random part never holds a dot, so another checkpoint's files
    (".run.ckpt.old.<random>.tmp" beside ".run.ckpt.<random>.tmp") are kept.
    """
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)):
            continue
        middle = name[len(prefix):-len(TEMP_SUFFIX)]
        if middle and "." not in middle:
            os.unlink(os.path.join(directory, name))


def _make_directories(directory: str) -> None:
    """Create ``directory`` and its missing parents, each entry made durable in its parent."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for created in reversed(missing):
        os.makedirs(created, exist_ok=True)
        _fsync_directory(os.path.dirname(created))


def _fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename into it) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, expected: dict[str, Sequence[VarSpec]]) -> dict:
    """Read a checkpoint (a file or a directory ``save`` wrote) and check it matches ``expected`` ({group: specs}).

    Raises FileNotFoundError when there is no checkpoint file at ``path``,
    and ValueError naming the file when it is not a whole dsgd checkpoint or
    holds another model's variables.
    """
    target = file_of(path)
    if target != os.fspath(path) and not os.path.exists(target):
        directory = os.path.dirname(target)
        held = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise FileNotFoundError(f"{directory} is not a checkpoint: it is a directory that holds no {CHECKPOINT_FILE}"
                                f"{f' (it holds {held[:5]})' if held else ''}; expected a checkpoint file or a "
                                "directory written by DistributedSGD.save")
    if not os.path.isfile(target):
        raise FileNotFoundError(f"no checkpoint at {target}: no such file; {EXPECTED}")
    meta, state = _read(target)
    _check_model(target, state, expected)
    state["applied_steps"] = meta["applied_steps"]
    return state


def _read(path: str) -> tuple[dict, dict]:
    """The metadata and the arrays, by group, of the checkpoint file ``path``; ValueError if it is not one."""
    with open(path, "rb") as f:
        start = f.read(len(ZIP_START))
    if start != ZIP_START:
        problem = "it is empty" if not start else f"it is not an .npz (zip) file: it starts with {start!r}"
        raise ValueError(f"{path} is not a dsgd checkpoint: {problem}; {EXPECTED}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {key: f[key] for key in f.files}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        raise ValueError(f"{path} is {_damage(path, e)}; expected a complete checkpoint written by "
                         "DistributedSGD.save") from e
    if META_KEY not in arrays:
        raise ValueError(f"{path} is an .npz file but not a dsgd checkpoint: it has no {META_KEY!r} entry "
                         f"(it holds {sorted(arrays)[:5]}); {EXPECTED}")
    text = str(arrays.pop(META_KEY))
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        meta = None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT_VERSION
            and isinstance(meta.get("applied_steps"), int)):
        raise ValueError(f"{path} has the metadata {text!r}; expected format {FORMAT_VERSION} with an integer "
                         "applied_steps, as written by DistributedSGD.save")
    state = {group: {} for group in GROUPS}
    for key, value in arrays.items():
        group, _, name = key.partition("/")
        if group not in state or not name:
            raise ValueError(f"{path} holds the entry {key!r}, which is not a dsgd checkpoint's; expected "
                             f"'<group>/<variable>' entries, group one of {list(GROUPS)}, as written by "
                             "DistributedSGD.save")
        state[group][name] = value
    return meta, state


def _damage(path: str, error: BaseException) -> str:
    """What is wrong with a file that starts like an .npz but does not read as one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
    if ZIP_END not in tail:
        return f"truncated: its {size} bytes end before the archive's index, as when a write or a copy is cut short"
    return f"corrupt ({size} bytes): {type(error).__name__}: {error}"


def _check_model(path: str, state: dict, expected: dict[str, Sequence[VarSpec]]) -> None:
    """ValueError naming every variable that differs between the checkpoint and ``expected``."""
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
                         + (f" (and {len(problems) - 8} more)" if len(problems) > 8 else "")
                         + "; expected a checkpoint of this model's variables")

"""TensorFlow's start-up lines, shown only when ``TF_CPP_MIN_LOG_LEVEL`` asks for INFO.

Importing TensorFlow 2.21 writes INFO lines to stderr (absl's "All log
messages before absl::InitializeLog() is called ..." notice, then oneDNN,
``cudart_stub`` and ``cpu_feature_guard`` lines) whatever
``TF_CPP_MIN_LOG_LEVEL`` says: they are logged through absl before
TensorFlow reads the variable. ``install()`` (``import dsgd`` runs it) makes
the process's first import of TensorFlow write stderr through a filter that
drops those lines, and passes everything else on, unless
``TF_CPP_MIN_LOG_LEVEL`` is ``0`` (TensorFlow's "show INFO"). Unset counts as
dsgd's default, 3, the value its workers get (``dsgd.cluster.cluster.worker_env``).
The same hook has a worker skip TensorFlow's eager import of Keras
(``dsgd.worker.keras_preload``).

This module imports only the standard library (and ``dsgd.worker.keras_preload``,
which does too): every dsgd process imports it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile
from typing import Iterator

from dsgd.worker import keras_preload

ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# absl's INFO prefix: I<mmdd> <time> <thread> <file>:<line>] (before absl's log is initialized,
# the time reads 00:00:<seconds since the epoch>)
_INFO_LINE = re.compile(r"I\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_CPU_FEATURES_TAIL = "To enable the following instructions:"  # cpu_feature_guard's second line
# The CUDA platform's error when eager TensorFlow first lists its devices on a machine without a GPU driver.
_NO_CUDA_DRIVER = re.compile(r"E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit")


def _cpp_level() -> str:
    """``TF_CPP_MIN_LOG_LEVEL`` as set, or dsgd's default "3" when unset."""
    return os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3").strip()


def hides_start_up_lines() -> bool:
    """Whether ``TF_CPP_MIN_LOG_LEVEL`` (unset: 3) hides INFO lines."""
    return _cpp_level() != "0"


def python_warnings_follow_cpp_level() -> None:
    """TensorFlow's Python-side warnings follow ``TF_CPP_MIN_LOG_LEVEL`` as its C++ lines do.

    Building a graph logs deprecation warnings through the ``tensorflow``
    logger (tf_keras's batch normalization: "_colocate_with ... is
    deprecated"), one set per worker. At level 2 or 3 (unset: dsgd's 3) that
    logger shows errors only; at 0 or 1 it is left as TensorFlow sets it.
    dsgd's workers call this; a driver's own logger is the user's.
    """
    if _cpp_level() in ("2", "3"):
        logging.getLogger("tensorflow").setLevel(logging.ERROR)


def without_start_up_lines(text: str) -> str:
    """``text`` without absl's pre-initialization notice, INFO lines, cpu_feature_guard's second line and the
    failed ``cuInit`` of a machine without a GPU driver."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if line.rstrip("\r\n") != ABSL_NOTICE and not _INFO_LINE.match(line)
                   and not line.startswith(_CPU_FEATURES_TAIL) and not _NO_CUDA_DRIVER.match(line))


@contextlib.contextmanager
def start_up_lines_hidden() -> Iterator[None]:
    """While the body runs, the process's stderr (file descriptor 2) goes through ``without_start_up_lines``.

    What the body writes reaches stderr when it ends. A no-op when
    ``TF_CPP_MIN_LOG_LEVEL`` is 0.
    """
    if not hides_start_up_lines():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = without_start_up_lines(captured.read().decode(errors="replace")).encode()
            while kept:
                kept = kept[os.write(2, kept):]


class _FilteredLoader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` with TensorFlow's start-up lines hidden."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module keeps its own loader
        with start_up_lines_hidden(), keras_preload.skipped():
            self.loader.exec_module(module)


class _TensorFlowImport(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` once, through the other finders, and hands it to ``_FilteredLoader``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _FilteredLoader(spec.loader)
        return spec


def install() -> None:
    """Hide TensorFlow's start-up lines when this process imports it (no-op if it already has)."""
    if "tensorflow" not in sys.modules and not any(isinstance(f, _TensorFlowImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _TensorFlowImport())

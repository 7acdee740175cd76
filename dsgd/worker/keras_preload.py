"""A dsgd worker imports TensorFlow without TensorFlow's eager import of Keras's optimizers.

Importing TensorFlow 2.21 imports Keras 3's optimizers (``keras.src.optimizers``;
tf_keras's with ``TF_USE_LEGACY_KERAS``) so that they are registered for loading
SavedModels, and with them all of Keras 3 and scikit-learn: 1.2 of the 3.0 s a
process spends importing TensorFlow on our 2-core machine. A worker starting
(at set-up, a grow, a replacement) pays it while every other worker waits.
A worker loads no SavedModel, and a model that uses Keras imports it itself,
so ``skipped()`` makes that one import fail (TensorFlow ignores an
ImportError there) and leaves the modules importable afterwards.

Only processes whose environment sets ``DSGD_SKIP_KERAS_PRELOAD=1`` skip it:
dsgd's workers by default (``dsgd.cluster.cluster.WORKER_ENV_DEFAULTS``), never a
driver unless asked. ``dsgd.worker.tf_logs`` runs ``skipped()`` around the process's
first import of TensorFlow. This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

ENV = "DSGD_SKIP_KERAS_PRELOAD"
PRELOADED = ("keras.src.optimizers", "tf_keras.src.optimizers")  # what TensorFlow's __init__ imports eagerly


@contextlib.contextmanager
def skipped() -> Iterator[None]:
    """While the body runs (TensorFlow's import), importing ``PRELOADED`` (those not imported yet) fails, if
    ``ENV`` is 1."""
    blocked = [name for name in PRELOADED if name not in sys.modules] if os.environ.get(ENV) == "1" else []
    for name in blocked:
        sys.modules[name] = None  # the import system raises ModuleNotFoundError, importing no parent package
    try:
        yield
    finally:
        for name in blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]

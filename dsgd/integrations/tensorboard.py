"""Write training statistics as TensorBoard scalars, from the driver process.

Uses TensorFlow's own event-file writer (``tf.summary.create_file_writer``) in
eager mode, so it needs no ``tensorboard`` package; the scalars carry the
metadata of TensorBoard's scalars plugin, so they show in its Scalars tab.
"""

from __future__ import annotations

import os
from typing import Mapping

import tensorflow as tf

FLUSH_MILLIS = 10_000  # scalars reach the file (and TensorBoard) within 10 s

# What tensorboard.plugins.scalar.metadata attaches to a scalar summary.
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))


class ScalarLogger:
    """Scalars per step into an event file under ``logdir``.

    Usage::

        with ScalarLogger("runs/mnist") as tb:
            tb.log(10, {"loss": 0.31, "accuracy": 0.92, "samples_per_s": 1800.0})
    """

    def __init__(self, logdir: str | os.PathLike):
        if not tf.executing_eagerly():
            raise RuntimeError(
                "ScalarLogger writes with eager TensorFlow; the driver process has eager "
                "execution disabled (tf.compat.v1.disable_eager_execution)")
        self.logdir = os.fspath(logdir)
        self._writer = tf.summary.create_file_writer(self.logdir, flush_millis=FLUSH_MILLIS)

    def log(self, step: int, stats: Mapping[str, float]) -> None:
        """Write every ``name: value`` of ``stats`` as the scalar ``name`` at ``step``."""
        with self._writer.as_default():
            for name, value in stats.items():
                tf.summary.write(name, tf.constant(float(value), tf.float32), step=int(step),
                                 metadata=_SCALAR_METADATA)

    def close(self) -> None:
        """Flush and close the event file. Safe to call twice."""
        self._writer.close()

    def __enter__(self) -> "ScalarLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

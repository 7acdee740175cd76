"""A KerasModel's input from Python: its batches, as ``(x, y)`` numpy structures, pass after pass.

Both Keras front ends read Python batches through ``Batches``: tf_keras's
feeds them to placeholders (``dsgd.integrations.keras``), Keras 3's passes
them to the replica's traced step (``dsgd.integrations.keras3``).
"""

from __future__ import annotations

import collections.abc
from typing import Any, Iterable

import numpy as np
import tensorflow as tf


def split(element: Any, features: Any, label: Any, what: str) -> tuple[Any, Any]:
    """(x, y) from one batch: a pair, or a dict read through ``features`` and ``label`` (keys, or structures
    of keys)."""
    if isinstance(element, collections.abc.Mapping):
        if features is None:
            raise ValueError(f"{what} are dicts with keys {sorted(element)}; pass features= and label= "
                             "to name the model's input and the label among them")
        missing = [k for k in tf.nest.flatten(features) + tf.nest.flatten(label) if k not in element]
        if missing:
            raise KeyError(f"{what} have no key {missing[0]!r} (features={features!r}, "
                           f"label={label!r}); their keys: {sorted(element)}")
        return (tf.nest.map_structure(element.__getitem__, features),
                tf.nest.map_structure(element.__getitem__, label))
    if isinstance(element, (tuple, list)) and len(element) == 2:
        if features is not None:
            raise ValueError(f"{what} are (x, y) pairs: features= and label= only apply to dict batches")
        return element[0], element[1]
    raise TypeError(f"{what} must be (x, y) pairs or dicts of arrays, got {type(element).__name__}")


class Batches:
    """The replica's batches: ``next()`` gives the next ``(x, y)`` of numpy arrays; at the end of the
    iterable, the first of a new pass over it (``epoch`` counts the passes started before the current one,
    ``read`` the batches given). ``first`` is read at once (for its shapes) and given by the first ``next()``.
    """

    def __init__(self, batches: Iterable, features: Any, label: Any):
        if not isinstance(batches, collections.abc.Iterable) or isinstance(batches, (str, bytes, dict)):
            raise TypeError(
                f"KerasModel batches must be an iterable of batches, a tf.data.Dataset or an (x, y) pair of "
                f"tensors, got {type(batches).__name__}")
        self.features, self.label = features, label
        self.epoch = 0
        self.read = 0
        self._batches = batches
        self._iterator = iter(batches)
        self.first = self._read()
        self._pending: tuple[Any, Any] | None = self.first

    def next(self) -> tuple[Any, Any]:
        """The next (x, y)."""
        if self._pending is not None:
            batch, self._pending = self._pending, None
        else:
            batch = self._read()
        self.read += 1
        return batch

    def _read(self) -> tuple[Any, Any]:
        try:
            element = next(self._iterator)
        except StopIteration:
            if self._iterator is self._batches:
                raise RuntimeError(
                    f"KerasModel batches ran out after {self.read} batches and cannot start another "
                    "epoch: it is a one-pass iterator. Pass an iterable that can be iterated again (a list, "
                    "a Ray DataIterator's iter_batches(...)) or an endless generator") from None
            self._iterator = iter(self._batches)
            self.epoch += 1
            try:
                element = next(self._iterator)
            except StopIteration:
                raise RuntimeError("KerasModel batches yielded no batch in a new pass over it") from None
        x, y = split(element, self.features, self.label, "KerasModel batches")
        return tf.nest.map_structure(np.asarray, x), tf.nest.map_structure(np.asarray, y)

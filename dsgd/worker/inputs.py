"""Where a replica's batches for ``evaluate`` and ``predict`` come from: one source, whatever the input.

The driver makes a source once per call and sends it to every worker; each
replica reads its own batches from it (``InputSource.batches``), as numpy,
one pass over its part, or (``repeat``) pass after pass, as training reads
a stream (``dsgd.KerasTrainer`` reads a dataset function's and a Ray
Dataset split's batches here too):

- ``ArrayParts``: arrays (or a tuple, list or dict of them) in the object
  store, each replica a contiguous part of the rows, in replica order
  (worker, then device): the replicas' outputs concatenated in that order
  are the input's rows in order;
- ``RayDataSplits``: a Ray Dataset's streaming split, one per worker, read
  by the worker's first replica (the others read nothing);
- ``DatasetFunction``: ``(worker_index, device_index) -> tf.data.Dataset``,
  each replica's own batches.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import tensorflow as tf

FETCH_TIMEOUT_S = 600  # reading the arrays from the object store (the driver put them there just before)


class InputSource(Protocol):
    """A replica's batches, by where it is."""

    def batches(self, worker_index: int, device_index: int, devices: int, repeat: bool = False) -> Iterator[Any]:
        """The batches of worker ``worker_index``'s replica ``device_index`` (of ``devices``), in order: one pass,
        or with ``repeat`` a new pass after each, without end."""


def passes(one_pass: Callable[[], Iterable[Any]], repeat: bool, what: str) -> Iterator[Any]:
    """``one_pass()``'s batches; with ``repeat``, a new pass after each (an empty pass then is an error, named by
    ``what``: the stream would never give a batch)."""
    while True:
        empty = True
        for batch in one_pass():
            empty = False
            yield batch
        if not repeat:
            return
        if empty:
            raise ValueError(f"{what} has no batches: a stream of it would never give one")


def take(arrays: Any, rows: slice | np.ndarray) -> Any:
    """``rows`` of every array of a structure (``None`` stays ``None``)."""
    return tf.nest.map_structure(lambda a: None if a is None else a[rows], arrays)


def concatenate(parts: Sequence[Any]) -> Any:
    """The rows of several structures of arrays (alike in structure), in order: ``take``'s inverse."""
    return tf.nest.map_structure(lambda *arrays: np.concatenate(arrays), *parts)


def is_text(array: Any) -> bool:
    """Whether ``array`` holds text: numpy ``str`` or ``bytes``, fixed-width or as objects that all are."""
    array = np.asarray(array)
    return array.dtype.kind in "SU" or (array.dtype.kind == "O" and all(isinstance(v, (str, bytes))
                                                                       for v in array.flat))


def num_rows(arrays: Any) -> int:
    """The rows of a structure of arrays, checked to agree."""
    counts = {len(a) for a in tf.nest.flatten(arrays) if a is not None}
    if len(counts) != 1:
        raise ValueError(f"the arrays given have different numbers of rows: {sorted(counts)}; x, y and "
                         "sample_weight need one row per sample")
    return counts.pop()


def contiguous_parts(rows: int, replicas: int) -> list[tuple[int, int]]:
    """``rows`` in ``replicas`` contiguous parts, as equal as they come (the first ones a row longer)."""
    edges = np.linspace(0, rows, replicas + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@dataclasses.dataclass(frozen=True)
class ArrayParts:
    """Arrays in the object store (``ref``), replica r reading rows ``bounds[r]`` in batches of ``batch_size``."""

    ref: Any
    bounds: tuple[tuple[int, int], ...]
    batch_size: int

    @classmethod
    def of(cls, ref: Any, rows: int, replicas: int, batch_size: int) -> ArrayParts:
        """``rows`` rows of arrays in the object store (``ref``), in ``replicas`` contiguous parts, read in
        replicas' parts of global batches of ``batch_size`` (at least a row each)."""
        return cls(ref, tuple(contiguous_parts(rows, replicas)), max(1, batch_size // replicas))

    def batches(self, worker_index: int, device_index: int, devices: int, repeat: bool = False) -> Iterator[Any]:
        import ray

        start, stop = self.bounds[worker_index * devices + device_index]
        if start == stop:
            return
        arrays = ray.get(self.ref, timeout=FETCH_TIMEOUT_S)  # zero-copy from this node's object store
        yield from passes(lambda: (take(arrays, slice(first, min(first + self.batch_size, stop)))
                                   for first in range(start, stop, self.batch_size)),
                          repeat, f"replica {device_index} of worker {worker_index}'s part of the arrays")


@dataclasses.dataclass(frozen=True)
class RayDataSplits:
    """A Ray Dataset's ``streaming_split``, one split per worker, read by its first replica in batches of
    ``batch_size``, each a dict of column arrays made a batch by ``to_batch`` (if given)."""

    splits: list
    batch_size: int
    to_batch: Callable[[dict], Any] | None = None

    @classmethod
    def of(cls, dataset: Any, workers: int, batch_size: int, to_batch: Callable[[dict], Any] | None = None,
           ) -> RayDataSplits:
        return cls(dataset.streaming_split(workers, equal=False), batch_size, to_batch)

    def batches(self, worker_index: int, device_index: int, devices: int, repeat: bool = False) -> Iterator[Any]:
        if device_index:
            return
        yield from split_batches(self.splits[worker_index], self.batch_size, self.to_batch, repeat)


def split_batches(split: Any, batch_size: int, to_batch: Callable[[dict], Any] | None, repeat: bool,
                  ) -> Iterator[Any]:
    """A Ray Dataset split's (a ``DataIterator``'s) batches of ``batch_size`` rows, each a dict of column arrays
    made a batch by ``to_batch`` (if given); with ``repeat``, a new pass (Ray's next epoch) after each."""
    def one_pass() -> Iterator[Any]:
        for columns in split.iter_batches(batch_size=batch_size, batch_format="numpy"):
            yield columns if to_batch is None else to_batch(columns)
    return passes(one_pass, repeat, "a split of the Ray Dataset")


@dataclasses.dataclass(frozen=True)
class DatasetFunction:
    """Each replica's own ``tf.data.Dataset``, from ``dataset_fn(worker_index, device_index)``: its batches, at most
    ``steps`` of them (all if None)."""

    dataset_fn: Callable[[int, int], Any]
    steps: int | None = None

    def batches(self, worker_index: int, device_index: int, devices: int, repeat: bool = False) -> Iterator[Any]:
        dataset = replica_dataset(self.dataset_fn, worker_index, device_index)
        if self.steps is not None:
            dataset = dataset.take(self.steps)
        # A new pass iterates the same dataset again (as tf.data's repeat: a shuffle draws a new order).
        yield from passes(dataset.as_numpy_iterator, repeat,
                          f"the dataset of worker {worker_index}, device {device_index}")


def replica_dataset(dataset_fn: Callable[[int, int], Any], worker_index: int, device_index: int) -> Any:
    """``dataset_fn(worker_index, device_index)``, checked to be a ``tf.data.Dataset``."""
    dataset = dataset_fn(worker_index, device_index)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"the input function gave worker {worker_index}, device {device_index} a "
                        f"{type(dataset).__name__}; expected a tf.data.Dataset of its batches")
    return dataset


def source(x: Any, batch_size: int, steps: int | None, workers: int, devices: int,
           to_batch: Callable[[dict], Any] | None = None) -> InputSource:
    """The source of ``x``'s batches for ``workers`` workers of ``devices`` replicas each, in global batches of
    ``batch_size`` (at most ``steps`` of them): a function ``(worker_index, device_index) -> tf.data.Dataset``, a
    Ray Dataset (its batches of columns made batches by ``to_batch``), or arrays (a structure of them)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (the global batch), got {batch_size!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int (global batches) or None, got {steps!r}")
    if callable(x):
        return DatasetFunction(x, steps)
    if is_ray_dataset(x):
        dataset = x if steps is None else x.limit(steps * batch_size)
        return RayDataSplits.of(dataset, workers, max(1, batch_size // workers), to_batch)
    import ray

    arrays = tf.nest.map_structure(np.asarray, x)
    if steps is not None:
        arrays = take(arrays, slice(0, steps * batch_size))
    return ArrayParts.of(ray.put(arrays), num_rows(arrays), workers * devices, batch_size)


def is_ray_dataset(x: Any) -> bool:
    """Whether ``x`` is a Ray Dataset (without importing Ray Data where none was made)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(x, data.Dataset)

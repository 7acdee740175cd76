"""``dsgd.KerasTrainer``'s input: arrays in the object store, split into each replica's part of each global batch.

``EpochPlan`` says which rows of the arrays make replica r's part of step i
of an epoch, the same on the driver (which counts the steps) and on every
replica (which reads its part). Global batch i is rows ``[i*B, (i+1)*B)``
of the pass's order (the rows as they are, or a permutation drawn from
the plan's seed and the pass when shuffling), each of the R replicas
taking an equal contiguous part of it, in replica order (worker, then
device). A last batch smaller than B is cut to a multiple of R (at most
R - 1 rows of an epoch left out), so every part of a step has the same size
and the mean of the replicas' gradients is the global batch's. An epoch
the driver read from input only it can read (``keras_reader``) keeps that
input's batches instead (``edges``), each cut to a multiple of R.

An epoch is a pass over the arrays, or with ``steps_per_epoch`` a window
of one, as in ``keras.Model.fit``: the next epoch goes on where the last
one stopped, an epoch that reaches the pass's end stops there (fewer
steps), and the epoch after it begins a new pass (``EpochPlan.following``).

``ArrayFeed`` is a replica's ``Feed``: the arrays (read once from the
object store, zero-copy) and the plan, positioned at an epoch's start
(``ArraysStart``), and before every step at the engine's step count
(``seek``): a step run again after a fault, or by a replacement worker,
reads the same rows. ``DatasetFeed`` reads a replica's own
``tf.data.Dataset`` (``DatasetStart``), and ``RayDataFeed`` a replica's split
of a Ray Dataset (``RayDataStart``), each as a stream, read as
``evaluate`` reads them (``dsgd.worker.inputs``), pass after pass.
``Columns`` says which columns of a Ray Dataset are the model's x and y.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import tensorflow as tf

from dsgd.integrations.keras_compiled import BatchSource
from dsgd.worker.inputs import DatasetFunction, split_batches, take


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """The steps of an epoch over ``num_samples`` rows, in global batches of ``batch_size`` over ``replicas``."""

    num_samples: int
    batch_size: int
    replicas: int
    shuffle: bool = False
    seed: int = 0
    steps_per_epoch: int | None = None
    edges: tuple[int, ...] | None = None  # global batch k is rows [edges[k], edges[k+1]), if given (batch_size unused)
    first_batch: int = 0  # the epoch's first global batch in its pass (a window of it, with steps_per_epoch)

    def __post_init__(self):
        if self.edges is not None:
            if not self.kept:
                raise ValueError(f"the input's batches ({self.edges[-1]} rows in {len(self.edges) - 1}) have no batch "
                                 f"of at least {self.replicas} rows, one for each of the engine's replicas")
            return
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (the global batch), got {self.batch_size!r}")
        if self.batch_size % self.replicas:
            raise ValueError(
                f"batch_size {self.batch_size} is the global batch, split equally over the engine's "
                f"{self.replicas} replicas (num_workers x devices_per_worker); it does not divide: use a multiple "
                f"of {self.replicas}")
        if self.num_samples < self.replicas:
            raise ValueError(f"the data has {self.num_samples} samples, fewer than the engine's {self.replicas} "
                             "replicas: each needs at least one")
        if self.steps_per_epoch is not None and not (isinstance(self.steps_per_epoch, int)
                                                      and self.steps_per_epoch >= 1):
            raise ValueError(f"steps_per_epoch must be a positive int, got {self.steps_per_epoch!r}")

    @property
    def batches(self) -> int:
        """Global batches in one pass over the rows (the last one kept if it has a row for every replica)."""
        if self.edges is not None:
            return len(self.kept)
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (rest >= self.replicas)

    @functools.cached_property
    def kept(self) -> tuple[int, ...]:
        """With ``edges``: the batches with a row for every replica, which make the steps."""
        return tuple(k for k in range(len(self.edges) - 1) if self.edges[k + 1] - self.edges[k] >= self.replicas)

    @property
    def steps(self) -> int:
        """The epoch's steps: ``steps_per_epoch``, or fewer where the pass ends."""
        return min(self.steps_per_epoch or self.batches, self.batches - self.first_batch)

    def following(self) -> tuple[EpochPlan, bool]:
        """The next epoch's plan, and whether it begins a new pass (as ``keras.Model.fit`` goes on across epochs
        with ``steps_per_epoch``)."""
        first = self.first_batch + self.steps
        if first < self.batches:
            return dataclasses.replace(self, first_batch=first), False
        return dataclasses.replace(self, first_batch=0), True

    def order(self, pass_number: int) -> np.ndarray | None:
        """A pass's order of the rows: a permutation drawn from the seed and the pass, or None (as they are)."""
        return np.random.default_rng([self.seed, pass_number]).permutation(self.num_samples) if self.shuffle else None

    def part(self, order: np.ndarray | None, step: int, replica: int) -> slice | np.ndarray:
        """The rows of ``replica``'s part of step ``step`` of the epoch, in its pass's ``order`` (``order(pass)``'s):
        a slice, or indices (sorted) when shuffling."""
        batch = self.first_batch + step
        start = self.edges[self.kept[batch]] if self.edges is not None else batch * self.batch_size
        size = self._size(step)
        first = start + replica * size
        if order is None:
            return slice(first, first + size)
        return np.sort(order[first:first + size])

    def _size(self, step: int) -> int:
        """A replica's part of step ``step``: its global batch's rows over the replicas, rounded down."""
        batch = self.first_batch + step
        if self.edges is not None:
            k = self.kept[batch]
            return (self.edges[k + 1] - self.edges[k]) // self.replicas
        start = batch * self.batch_size
        return (min(start + self.batch_size, self.num_samples) - start) // self.replicas


class Feed(BatchSource, Protocol):
    """A trainer replica's batches, ``(x, y, sample_weight)``, positioned by the trainer at each epoch's start."""

    def seek(self, applied_steps: int) -> bool:
        """Move to the step that follows ``applied_steps`` of the engine's steps, if this input can: whether it
        did."""


class EpochStart(Protocol):
    """Where an epoch's input is, for every replica: what the trainer sends each worker as an epoch begins."""

    def feed(self, current: Feed | None, worker_index: int, device_index: int, devices: int) -> Feed:
        """The feed for this epoch of worker ``worker_index``'s replica ``device_index`` (of ``devices``):
        ``current`` moved to it, or a new one."""


@dataclasses.dataclass(frozen=True)
class ArraysStart:
    """An epoch of arrays: the arrays (an object-store reference), the plan, the pass over the arrays it is part
    of (its order's key when shuffling), and the engine's step count as it began (so a step count says which of
    the epoch's steps comes next)."""

    arrays_ref: Any
    plan: EpochPlan
    pass_number: int
    first_step: int

    def feed(self, current: Feed | None, worker_index: int, device_index: int, devices: int) -> Feed:
        replica = worker_index * devices + device_index
        if isinstance(current, ArrayFeed):
            current.begin(self, replica)
            return current
        return ArrayFeed(self, replica)


class ArrayFeed:
    """A replica's batches: its parts of the plan's steps, epoch after epoch, from arrays in the object store."""

    def __init__(self, start: ArraysStart, replica: int):
        self._ref = None
        self.begin(start, replica)

    def begin(self, start: ArraysStart, replica: int) -> None:
        """Read ``start``'s epoch from its first step next, as replica ``replica``."""
        if self._ref != start.arrays_ref:
            import ray

            self._arrays = ray.get(start.arrays_ref, timeout=600)  # zero-copy on the node; put by the driver
            self._ref = start.arrays_ref
        self.start, self.replica, self._pass = start, replica, None
        self._at(start.plan, start.pass_number, 0)

    def seek(self, applied_steps: int) -> bool:
        plan, pass_number, step = self.start.plan, self.start.pass_number, applied_steps - self.start.first_step
        while step >= plan.steps:  # past the epoch: the epochs that follow it, as fit would plan them
            step -= plan.steps
            plan, new_pass = plan.following()
            pass_number += new_pass
        self._at(plan, pass_number, step)
        return True

    def _at(self, plan: EpochPlan, pass_number: int, step: int) -> None:
        if pass_number != self._pass:
            self._order = plan.order(pass_number)
        self._plan, self._pass, self.step = plan, pass_number, step

    def next(self) -> tuple:
        if self.step == self._plan.steps:
            plan, new_pass = self._plan.following()
            self._at(plan, self._pass + new_pass, 0)
        rows = self._plan.part(self._order, self.step, self.replica)
        self.step += 1
        return take(self._arrays, rows)


@dataclasses.dataclass(frozen=True)
class DatasetStart:
    """An epoch of a ``(worker_index, device_index) -> tf.data.Dataset`` of each replica's batches: a replica's
    iterator goes on across epochs, and starts a new pass when the dataset ends (as Keras's ``fit`` with
    ``steps_per_epoch`` reads a dataset)."""

    dataset_fn: Callable[[int, int], Any]
    token: int  # the fit call's: its epochs reach the workers as copies, whose dataset_fn is a new object each time

    def feed(self, current: Feed | None, worker_index: int, device_index: int, devices: int) -> Feed:
        if isinstance(current, DatasetFeed) and current.token == self.token:
            return current
        return DatasetFeed(self.token, DatasetFunction(self.dataset_fn).batches(worker_index, device_index, devices,
                                                                                repeat=True))


class DatasetFeed:
    """A replica's batches from its own ``tf.data.Dataset`` (``batches``: its passes, one after another):
    ``(x, y)`` or ``(x, y, sample_weight)`` elements, as numpy (weights of 1 where none are given)."""

    def __init__(self, token: int, batches: Iterator[Any]):
        self.token, self._batches = token, batches

    def seek(self, applied_steps: int) -> bool:
        return False  # a stream goes on where it is

    def next(self) -> tuple:
        return with_weights(next(self._batches))


@dataclasses.dataclass(frozen=True)
class Columns:
    """Which columns of a Ray Dataset's batches make the model's x and y (as Ray's ``Dataset.to_tf``: a name gives
    that column's array, a list of names a dict of them), and Keras's ``class_weight``, if any."""

    features: str | tuple[str, ...]
    labels: str | tuple[str, ...]
    class_weight: dict | None = None

    @classmethod
    def of(cls, dataset: Any, label_columns: Any, feature_columns: Any, class_weight: dict | None) -> "Columns":
        """The columns named, checked against ``dataset``'s; the features default to every other column."""
        if label_columns is None:
            raise ValueError("x is a Ray Dataset: pass label_columns= (a column name, or a list of them) to say "
                             "which of its columns are the labels (its other columns are the features, or "
                             "feature_columns= names them)")
        have = dataset.columns()
        labels = _names(label_columns, "label_columns")
        features = (_names(feature_columns, "feature_columns") if feature_columns is not None
                    else tuple(c for c in have if c not in tf.nest.flatten(labels)))
        missing = [c for c in tf.nest.flatten(features) + tf.nest.flatten(labels) if c not in have]
        if missing or not features:
            lacks = f"no column {missing[0]!r}" if missing else "no feature column"
            raise ValueError(f"the Ray Dataset has columns {have}; {lacks} "
                             f"(label_columns={label_columns!r}, feature_columns={feature_columns!r})")
        if len(features) == 1 and feature_columns is None:
            features = features[0]
        if class_weight is not None and not isinstance(labels, str):
            raise ValueError("class_weight is for a model with one output (as keras.Model.fit): give one label column")
        return cls(features, labels, class_weight)

    def first(self, dataset: Any) -> tuple:
        """``dataset``'s first row as a batch of one (what builds the driver model's metrics)."""
        return self.batch(dataset.take_batch(1, batch_format="numpy"))

    def batch(self, columns: dict[str, np.ndarray]) -> tuple:
        """A Ray Data batch (a dict of column arrays) as ``(x, y, sample_weight)``."""
        from keras.src.trainers.data_adapters import data_adapter_utils

        def pick(names: str | tuple[str, ...]) -> Any:
            return columns[names] if isinstance(names, str) else {n: columns[n] for n in names}

        x, y = pick(self.features), pick(self.labels)
        if self.class_weight is None:
            return with_weights((x, y))
        return x, y, data_adapter_utils.class_weight_to_sample_weights(y, self.class_weight)


def _names(names: Any, what: str) -> str | tuple[str, ...]:
    if isinstance(names, str):
        return names
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        return tuple(names)
    raise ValueError(f"{what} must be a column name or a list of them, got {names!r}")


DATASET = "fit"  # the name of fit's Ray Dataset among the engine's datasets


@dataclasses.dataclass(frozen=True)
class RayDataStart:
    """An epoch of fit's Ray Dataset (the engine's ``datasets={DATASET: ds}``, split over the replicas as
    ``datasets=`` splits it): each replica reads its split in batches of its part of the global batch, going on
    across epochs (a new pass when the split ends)."""

    columns: Columns
    batch_size: int  # a replica's part of the global batch

    def feed(self, current: Feed | None, worker_index: int, device_index: int, devices: int) -> Feed:
        if isinstance(current, RayDataFeed):
            current.read_at(self.batch_size)
            return current
        return RayDataFeed(self)


class RayDataFeed:
    """A replica's batches from its split of the engine's Ray Dataset (``dsgd.get_dataset_shard``: made while the
    replica is built)."""

    def __init__(self, start: RayDataStart):
        from dsgd.integrations.data import get_dataset_shard

        self._split = get_dataset_shard(DATASET)
        self._columns = start.columns
        self.batch_size = None
        self.read_at(start.batch_size)

    def read_at(self, batch_size: int) -> None:
        """Batches of ``batch_size`` rows from here on: a new pass if that changed (the replicas did)."""
        if batch_size != self.batch_size:
            self._batches = split_batches(self._split, batch_size, self._columns.batch, repeat=True)
            self.batch_size = batch_size

    def seek(self, applied_steps: int) -> bool:
        return False  # a stream goes on where it is

    def next(self) -> tuple:
        return next(self._batches)


def with_weights(element: Any) -> tuple:
    """A batch ``(x, y)`` or ``(x, y, sample_weight)`` as ``(x, y, sample_weight)``, weights of 1 if none."""
    if not isinstance(element, tuple) or len(element) not in (2, 3):
        raise TypeError(f"a batch must be (x, y) or (x, y, sample_weight), got {type(element).__name__}")
    if len(element) == 3:
        return element
    x, y = element
    return x, y, np.ones(len(tf.nest.flatten(x)[0]), np.float32)

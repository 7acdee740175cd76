"""Ray Data input: ``DistributedSGD(datasets=...)`` and ``dsgd.get_dataset_shard``.

The driver has each dataset split over all ``num_workers * devices_per_worker``
replicas with ``Dataset.streaming_split(replicas, equal=True)``, inside a
small ``SplitOwner`` actor (``DatasetSplits`` keeps the current one and its
splits): Ray's coordinator actor, which runs the dataset and deals its
blocks to the replicas, belongs to that owner. Stopping the splits
(``DatasetSplits.stop``: at shutdown, after a fault) shuts the coordinators'
executors down (their tasks cancelled, their progress bars closed), ends the
coordinators and kills the owner, which fails any read waiting on them (after
a fault, a replica may wait at an epoch's start for a replica that is gone). Nothing
is gathered on the driver. Each worker is sent its replicas' splits inside
the model creator (``ShardedModelCreator``), which makes a replica "current"
while ``model_creator`` builds it; ``get_dataset_shard`` reads that.

A split starts an epoch only once every split has asked for it, so a worker
given datasets asks its replicas for their batches concurrently
(``WorkerConfig.feed_concurrently``). A worker builds its replicas one after
another, and a model may read its first batch while it is built (a
``KerasModel`` in its constructor, a ``TF2Model`` in the ``get_batch()`` dsgd
asks at build): so before the first replica is built, every replica's split
has asked for its first epoch (``FirstEpochAskedAhead``), and each replica's
first read finds it started once every worker has begun building.

This module does not import ``ray.data`` (an optional extra) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import ray

if TYPE_CHECKING:
    import ray.data

    from dsgd.model import Model

_INSTALL_HINT = "Ray Data is an optional extra: pip install 'dsgd[data]'"


@dataclass(frozen=True)
class _Replica:
    worker_index: int
    device_index: int
    shards: dict[str, Any] | None  # name -> this replica's DataIterator; None: no datasets= given


_current: _Replica | None = None  # the replica model_creator is building in this process, if any


def get_dataset_shard(name: str) -> "ray.data.DataIterator":
    """This replica's ``ray.data.DataIterator`` over dataset ``name`` of ``DistributedSGD(datasets=...)``.

    Call it inside ``model_creator``. The dataset is split over all replicas:
    in each epoch every replica reads the same number of rows and no row
    twice. Iterating it again after its last batch starts a new epoch;
    Ray starts it once every replica has asked, which with synchronous
    steps happens in one step as long as every replica reads with the same
    batch size.

    Example:
        ```python
        def create(worker_index, device_index):
            shard = dsgd.get_dataset_shard("train")
            return dsgd.KerasModel(net(), loss="sparse_categorical_crossentropy",
                                   optimizer=tf.compat.v1.train.AdamOptimizer(1e-3),
                                   batches=shard.iter_batches(batch_size=32, batch_format="numpy"),
                                   features="image", label="label")

        sgd = dsgd.DistributedSGD(create, num_workers=2, datasets={"train": ray.data.read_parquet(path)})
        ```

    Args:
        name: a key of the ``datasets`` dict given to ``DistributedSGD``.

    Returns:
        This replica's ``ray.data.DataIterator``.

    Raises:
        RuntimeError: called outside ``model_creator``.
        ValueError: the engine was given no ``datasets``, or none named
            ``name`` (the message lists the names there are).
    """
    replica = _current
    if replica is None:
        raise RuntimeError(
            f"dsgd.get_dataset_shard({name!r}) was called outside model_creator; call it inside "
            "model_creator, where it returns that replica's split of DistributedSGD(datasets=...)")
    if replica.shards is None:
        raise ValueError(
            f"dsgd.get_dataset_shard({name!r}): this DistributedSGD was given no datasets; pass "
            f"DistributedSGD(..., datasets={{{name!r}: ray.data.Dataset}})")
    if name not in replica.shards:
        raise ValueError(f"dsgd.get_dataset_shard({name!r}): no dataset named {name!r}; "
                         f"DistributedSGD was given datasets {sorted(replica.shards)}")
    return replica.shards[name]


def check_datasets(datasets: Any) -> dict[str, "ray.data.Dataset"] | None:
    """``datasets`` checked: None, or a non-empty dict of name -> ``ray.data.Dataset``."""
    if datasets is None:
        return None
    if not isinstance(datasets, Mapping):
        raise ValueError(f"datasets must be a dict of name -> ray.data.Dataset, e.g. {{'train': ds}}, "
                         f"got {type(datasets).__name__}")
    if not datasets:
        raise ValueError("datasets={} names no dataset; pass {'train': ds} or leave datasets=None")
    try:
        import ray.data
    except ImportError as e:
        raise ImportError(f"DistributedSGD(datasets=...) needs Ray Data: {e}. {_INSTALL_HINT}") from e
    for name, ds in datasets.items():
        if not isinstance(name, str):
            raise ValueError(f"datasets keys must be names (str), got {name!r}")
        if not isinstance(ds, ray.data.Dataset):
            raise ValueError(f"datasets[{name!r}] must be a ray.data.Dataset, got {type(ds).__name__}")
    return dict(datasets)


# Bound on stopping a dataset's executors before its coordinators are killed anyway.
STOP_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0)
class SplitOwner:
    """Makes the streaming splits; they (their coordinator actors) live as long as this actor."""

    def __init__(self):
        self._coordinators: list = []

    def split(self, datasets: dict[str, "ray.data.Dataset"], nodes: list[str]) -> dict[str, list]:
        """Each dataset split over the replicas (one per entry of ``nodes``, their node ids), streaming, equal."""
        splits = {name: ds.streaming_split(len(nodes), equal=True, locality_hints=list(nodes))
                  for name, ds in datasets.items()}
        # Ray keeps a dataset's coordinator in each of its splits (StreamSplitDataIterator, Ray 2.60).
        self._coordinators += [s[0]._coord_actor for s in splits.values() if hasattr(s[0], "_coord_actor")]
        return splits

    def stop(self) -> None:
        """Shut the coordinators' executors down, let the coordinators exit, kill those that have not.

        An executor that shuts down cancels its tasks and closes its progress
        bars; a coordinator killed mid-epoch leaves them open, and the driver
        redraws them with every line it prints from then on. A coordinator
        that exits (rather than is killed) also reports its tasks' last
        states to Ray first.
        """
        for calls in ([c.shutdown_executor.remote() for c in self._coordinators],
                      [c.__ray_terminate__.remote() for c in self._coordinators]):
            ray.wait(calls, num_returns=len(calls), timeout=STOP_TIMEOUT_S)
        for coordinator in self._coordinators:
            ray.kill(coordinator)
        self._coordinators = []


class DatasetSplits:
    """The driver's side: the current splits of the engine's datasets, and the owner actor they live in."""

    def __init__(self, datasets: dict[str, "ray.data.Dataset"] | None, devices_per_worker: int):
        self.datasets = datasets  # name -> dataset, or None without datasets=
        self.devices_per_worker = devices_per_worker
        self._owner = None  # the SplitOwner actor behind the current splits
        self._splits: dict[str, list] | None = None  # name -> its splits, one per replica

    def split(self, worker_nodes: list[str], wait: Callable[[Any, str], Any]) -> None:
        """Split every dataset over the replicas of workers on ``worker_nodes``, in a new owner actor.

        ``wait(ref, what)`` is the driver's bounded wait. No-op without datasets.
        """
        if not self.datasets:
            return
        from dsgd.cluster.placement import actor_placement

        replica_nodes = [n for n in worker_nodes for _ in range(self.devices_per_worker)]
        self._owner = SplitOwner.options(scheduling_strategy=actor_placement()).remote()
        self._splits = wait(self._owner.split.remote(self.datasets, replica_nodes),
                            "Ray Data to split the datasets over the replicas")

    def for_worker(self, index: int) -> dict[str, list] | None:
        """Worker ``index``'s replicas' splits of every dataset, device order; None without datasets."""
        if self._splits is None:
            return None
        per_worker = self.devices_per_worker
        return {name: splits[index * per_worker:(index + 1) * per_worker] for name, splits in self._splits.items()}

    def stop(self) -> None:
        """Stop the splits (their coordinators) and kill their owner: every read waiting on one fails now.

        Bounded by ``STOP_TIMEOUT_S`` x 3; a no-op without datasets.
        """
        if self._owner is not None:
            ray.wait([self._owner.stop.remote()], timeout=3 * STOP_TIMEOUT_S)
            ray.kill(self._owner)
        self._owner, self._splits = None, None


class FirstEpochAskedAhead:
    """A split's coordinator (Ray's actor handle) whose first ``start_epoch`` was asked when this was made.

    Ray 2.60's split (``StreamSplitDataIterator``) asks its coordinator
    ``start_epoch.remote(split_index)`` at each epoch's start and waits for the
    answer, which comes once every split has asked. Put in place of the
    split's coordinator, this answers the split's first ask with the one asked
    ahead, and every later one (and every other call) through the coordinator.
    """

    def __init__(self, split: Any):
        self._coordinator = split._coord_actor
        self._first_epoch = self._coordinator.start_epoch.remote(split._output_split_idx)

    @property
    def start_epoch(self) -> "FirstEpochAskedAhead":
        return self  # its ``remote`` is ``start_epoch.remote``

    def remote(self, split_index: int) -> ray.ObjectRef:
        """``start_epoch.remote(split_index)``: the first epoch's, asked ahead, then the coordinator's."""
        first, self._first_epoch = self._first_epoch, None
        return first if first is not None else self._coordinator.start_epoch.remote(split_index)

    def __getattr__(self, name: str) -> Any:  # the coordinator's other methods; none of its private names
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._coordinator, name)


def ask_first_epochs_ahead(splits: dict[str, list]) -> None:
    """Every split of ``splits`` (name -> splits) asks for its first epoch now (``FirstEpochAskedAhead``)."""
    for split in (s for named in splits.values() for s in named):
        if not hasattr(split, "_coord_actor"):
            raise TypeError(f"dsgd reads Ray Data through Ray 2.60's streaming splits; this Ray's are "
                            f"{type(split).__name__}, without the coordinator dsgd asks for their first epoch")
        split._coord_actor = FirstEpochAskedAhead(split)


class ShardedModelCreator:
    """``model_creator`` with one worker's dataset splits: each replica is current while it is built.

    ``splits``: name -> this worker's replicas' splits, device order; None
    when no datasets were given (``get_dataset_shard`` then says so). The
    first call (the worker's first replica) has every split ask for its
    first epoch ahead (``ask_first_epochs_ahead``), once: a retry of the
    build (the TF2 way, after the graph's) reads the same first epochs.
    """

    def __init__(self, model_creator: Callable[[int, int], "Model"], splits: dict[str, list] | None):
        self.model_creator = model_creator
        self.splits = splits
        self._asked_ahead = False

    def __call__(self, worker_index: int, device_index: int) -> "Model":
        global _current
        if self.splits is not None and not self._asked_ahead:
            ask_first_epochs_ahead(self.splits)
            self._asked_ahead = True
        shards = None if self.splits is None else {name: s[device_index] for name, s in self.splits.items()}
        previous, _current = _current, _Replica(worker_index, device_index, shards)
        try:
            return self.model_creator(worker_index, device_index)
        finally:
            _current = previous

"""The driver: the public ``DistributedSGD`` facade, its arguments and their delegation.

It checks the options (``dsgd.config``) and hands the rest on: the actors to
``dsgd.cluster.cluster``, the steps (in flight, counted, interrupted, recovered) to
the step ledger (``dsgd.driver.ledger``), resizes to its ``dsgd.driver.resizer``,
the step stats to ``dsgd.driver.step_stats``.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Callable

import numpy as np
import ray

from dsgd.common.results import Evaluation, Means
from dsgd.driver import checkpoint, step_stats
from dsgd.integrations import data
from dsgd.cluster import placement
from dsgd.cluster.cluster import Cluster
from dsgd.config import Options
from dsgd.errors import DSGDError
from dsgd.driver.ledger import Queued, StepLedger
from dsgd.model import Model
from dsgd.sgd_worker import SGDWorker
from dsgd.worker import inputs

logger = logging.getLogger(__name__)


def _init_ray_if_needed() -> None:
    if not ray.is_initialized():
        logger.info("Ray is not initialized; starting a local Ray instance")
        ray.init()


def _scalar_logger(logdir: str | None):
    """A TensorBoard writer for the step stats in ``logdir`` (dsgd.integrations.tensorboard), or None."""
    if logdir is None:
        return None
    from dsgd.integrations.tensorboard import ScalarLogger

    return ScalarLogger(logdir)


class DistributedSGD:
    """Synchronous data-parallel SGD over ``num_workers`` x ``devices_per_worker`` replicas.

    Building the engine starts the worker actors (each builds its replicas
    with ``model_creator``) and, for "ps", the parameter-server actors, then
    broadcasts worker 0, replica 0's initial weights to every replica. It
    starts a local Ray instance if ``ray.init`` was not called. Use it as a
    context manager (``with DistributedSGD(...) as sgd:``) or call
    ``shutdown``.

    Example:
        ```python
        import ray
        import dsgd

        ray.init()
        with dsgd.DistributedSGD(MyModel, num_workers=2, devices_per_worker=1,
                                 strategy="ps") as sgd:
            for i in range(1000):
                stats = sgd.step(fetch_stats=(i % 100 == 0))
                if stats:
                    print(stats["loss"], stats["step_time_s"])
            sgd.save("checkpoints/")
        ```

    Args:
        model_creator: ``(worker_index, device_index) -> dsgd.Model``; must be
            picklable (it runs inside the worker actors).
        num_workers: worker actors, each a Ray actor with its own TF session;
            ``(min, max)`` makes the engine elastic: it starts with as many
            workers as the cluster has room for (at least ``min``, waiting
            up to ``startup_timeout_s``), goes on with the survivors when a
            lost worker cannot be replaced (as long as ``min`` remain), and
            grows toward ``max`` when there is room (see ``resize_interval_s``).
        devices_per_worker: replicas per worker, one per device.
        gpu: place replicas on GPUs (one per replica) instead of virtual CPUs.
        strategy: "ps" (sharded parameter servers) or "simple" (the driver
            averages; a reference for debugging).
        grad_shard_bytes: partition size for "ps": the unit that travels
            to a parameter server and is pipelined with back-propagation.
            ``None`` (default): dsgd picks about 4 partitions per server (16
            when the workers and servers span nodes), at least 1 MiB each,
            and logs its choice; 0 means one partition.
            Never changes how many server processes start.
        all_reduce_alg: local allreduce across a worker's devices: "simple"
            (add_n on device 0) or "nccl" (GPU only).
        num_parameter_servers: server processes for "ps", each summing many
            partitions. ``None`` (default): per node holding workers, one
            for every 2 CPUs those workers leave free, at least one and at
            most one per worker there; logged. An int is spread over those nodes.
        cpus_per_worker: CPUs each worker reserves; also its TF thread count.
        nan_policy: a step whose averaged gradient holds NaN or Inf is
            "raise"d (naming the variable) or "skip"ped, on every replica
            alike; "ignore" applies it unchecked (saves one pass over the
            gradients).
        use_ops: for "ps", move partitions with the C++ op library (dsgd.ops):
            each partition leaves from inside the graph as soon as its gradients
            exist, and averaged partitions reach TensorFlow without a copy.
            ``None`` (default) uses it when it builds and loads, and warns
            otherwise; ``False`` exchanges through Python after the
            gradients are computed (what the benchmark compares against).
        max_failures: dead workers or parameter servers to replace over the
            engine's life before giving up.
        timeout_s: bound on every wait for a step or an actor call.
        startup_timeout_s: bound on building the workers' graphs.
        logdir: if set, every ``step(fetch_stats=True)`` writes its stats
            there as TensorBoard scalars (see dsgd.integrations.tensorboard).
        batch_size: samples in one replica's batch, if you want
            ``samples_per_s`` in the stats (dsgd cannot know it: a model may
            make its batches inside the graph).
        datasets: ``{name: ray.data.Dataset}``, each split over all replicas
            (streaming, equal rows per replica per epoch, disjoint); inside
            ``model_creator``, ``dsgd.get_dataset_shard(name)`` returns the
            replica's ``ray.data.DataIterator``. A worker then asks its
            replicas' ``get_feed_dict`` concurrently, and after a recovery
            every replica starts a new epoch. Needs ``dsgd[data]``.
        compression: for "ps", how float32 partitions travel: ``None``
            (float32), "bf16" or "fp16" (16-bit both ways: half the bytes;
            the servers sum in float32 and round the mean once, and every
            replica applies the same decoded mean). fp16 keeps more mantissa
            but overflows beyond 65504: such a gradient becomes inf, which
            ``nan_policy`` then handles. Other dtypes travel as they are.
        backup_workers: for "ps", ``0 <= b < num_workers``: each partition of
            a step averages the first ``num_workers - b`` workers' gradients to
            reach its server and drops the later ones; a worker that finds
            its next step closed applies its mean without computing it, so
            the slowest workers do not set the pace (the reliability guide,
            "Stragglers: backup workers"). The stats then report
            ``num_replicas`` and ``dropped_gradients``.
        resize_interval_s: an elastic engine below ``max`` looks for room to
            grow before a step, at most this often (counted from the start
            and from the last resize); a grow settles the step in flight and
            adds as many workers as fit.
        server_resource: for "ps", the name of a Ray custom resource that
            marks nodes of the parameter servers' own (e.g. CPU-only nodes
            started with ``ray start --resources='{"dsgd_server": 1}'``):
            the servers run only on live nodes that have it (spread round
            robin; by default one for every 2 CPUs of each such node, at
            least one), and workers never run there. Each worker node's link
            then carries its pushes out and the means in, whatever the node
            count (the performance guide, "Scaling out"). ``None``
            (default): the servers run beside the workers.

    Raises:
        TypeError: ``model_creator`` is not callable, or an option has the
            wrong type.
        ValueError: an option is out of range or does not fit the others
            (the message names the argument and what was expected), e.g.
            ``compression`` or ``backup_workers`` with ``strategy="simple"``,
            ``all_reduce_alg="nccl"`` without ``gpu=True``, an elastic
            ``num_workers`` or ``server_resource`` inside a Ray Tune trial,
            ``server_resource`` with ``strategy="simple"``, or no live node
            with ``server_resource``.
        ModelCreatorError: ``model_creator`` raised (its traceback is part of
            the message) or returned something unusable.
        WorkerMismatchError: replicas built variables that disagree in
            name, shape or dtype.
        DSGDError: the cluster cannot hold the workers (e.g. ``gpu=True``
            with no GPUs, more CPUs than any node has), or the exchange is
            larger than the object store; raised before the actors concerned
            start.
        DSGDTimeoutError: the workers did not start and build their models
            within ``startup_timeout_s``.
    """

    def __init__(
        self,
        model_creator: Callable[[int, int], Model],
        num_workers: int = 1,
        devices_per_worker: int = 1,
        gpu: bool = False,
        strategy: str = "ps",
        grad_shard_bytes: int | None = None,
        all_reduce_alg: str = "simple",
        *,
        num_parameter_servers: int | None = None,
        cpus_per_worker: int = 1,
        nan_policy: str = "raise",
        use_ops: bool | None = None,
        max_failures: int = 3,
        timeout_s: float = 600.0,
        startup_timeout_s: float = 300.0,
        logdir: str | None = None,
        batch_size: int | None = None,
        datasets: dict[str, Any] | None = None,
        compression: str | None = None,
        backup_workers: int = 0,
        resize_interval_s: float = 60.0,
        server_resource: str | None = None,
    ):
        if not callable(model_creator):
            raise TypeError(f"model_creator must be callable (worker_index, device_index) -> dsgd.Model, got {model_creator!r}")
        opts = Options.checked(
            num_workers=num_workers, devices_per_worker=devices_per_worker, gpu=gpu, strategy=strategy,
            grad_shard_bytes=grad_shard_bytes, all_reduce_alg=all_reduce_alg,
            num_parameter_servers=num_parameter_servers, cpus_per_worker=cpus_per_worker, nan_policy=nan_policy,
            use_ops=use_ops, max_failures=max_failures, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s,
            logdir=logdir, batch_size=batch_size, compression=compression, backup_workers=backup_workers,
            resize_interval_s=resize_interval_s, server_resource=server_resource)
        datasets = data.check_datasets(datasets)
        if opts.elastic and placement.in_placement_group():
            raise ValueError(f"num_workers={num_workers!r}: an elastic engine cannot run inside a placement group "
                             "(a Ray Tune trial), whose bundles fix the workers; give an int")
        if opts.server_resource is not None and placement.in_placement_group():
            raise ValueError(f"server_resource={server_resource!r} cannot be used inside a placement group (a Ray "
                             "Tune trial), whose bundles fix where the engine's actors run; leave it None")
        if strategy == "ps" and opts.num_workers == 1:
            logger.warning("strategy='ps' with num_workers=1 has no parameter servers to use: "
                           "the worker averages its replicas locally, as 'simple' does"
                           + (f"; compression={compression!r} has nothing to send" if compression else ""))
        self._scalars = _scalar_logger(opts.logdir)
        _init_ray_if_needed()
        self._cluster = Cluster(opts, model_creator, datasets)
        self._kill_actors = weakref.finalize(self, self._cluster.kill)  # also when garbage-collected
        self._kill_actors.atexit = False  # at exit, ray.shutdown ends them
        self._ledger = StepLedger(self._cluster, opts.max_failures)
        try:
            self._cluster.start()
            self._cluster.match_initial_weights()
        except BaseException:
            self.shutdown()
            raise

    # ---- what the engine is made of ---------------------------------------

    @property
    def strategy(self) -> str:
        """The ``strategy`` given: ``"ps"`` or ``"simple"``."""
        return self.options.strategy

    @property
    def options(self) -> Options:
        """The checked arguments, as given; the count running now is ``num_workers``."""
        return self._cluster.options

    @property
    def num_workers(self) -> int:
        """The workers running now (``resize`` changes it)."""
        return self._cluster.topology.num_workers

    @property
    def devices_per_worker(self) -> int:
        """Replicas per worker, one per device (fixed for the engine's life)."""
        return self.options.devices_per_worker

    @property
    def workers(self) -> list:
        """The worker actors, in worker order."""
        return self._cluster.workers

    @property
    def failures(self) -> int:
        """Failures recovered from so far."""
        return self._ledger.recovery.failures

    @property
    def num_steps(self) -> int:
        """Steps submitted so far (restored checkpoints count theirs)."""
        return self._ledger.num_steps

    # ---- stepping ---------------------------------------------------------

    def step(self, fetch_stats: bool = False, write_timeline: str | None = None) -> dict[str, float] | None:
        """One synchronous step on every replica.

        Every replica computes its gradients on its own batch; every replica
        then applies the mean of all replicas' gradients, so the weights stay
        bit-identical everywhere.

        With ``fetch_stats=True`` waits for the step and returns its stats:
        ``loss`` and every metric of ``get_metrics()`` (means over all
        replicas), ``step_time_s``, ``step`` (the step's id),
        ``num_replicas`` (the replicas whose gradients the step averaged),
        ``dropped_gradients`` (with ``backup_workers``), ``sent_bytes`` (the
        bytes one worker pushed, mean over workers; 0 with one worker),
        ``node_sent_bytes`` ("ps": the most gradient bytes one node sends to
        servers on other nodes per step), ``samples_per_s`` (with
        ``batch_size``) and the workers' mean time per phase (e.g.
        ``get_feed_dict_s``, ``compute_s``, ``apply_s``).
        With ``fetch_stats=False`` returns None once the step is submitted;
        it waits only for the previous step, so at most one step is in
        flight and no barrier is added beyond the strategy's own. A failed
        step's error shows at the next call.

        A worker or parameter server that died is replaced and the step run
        again (up to ``max_failures`` over the engine's life), with a
        warning naming the actor.

        ``write_timeline=path`` runs the step alone (after the previous one)
        and writes a Chrome trace of it to ``path``: the driver, every worker
        (its Python phases and every TensorFlow op, with the partitions' sends and
        receives) and every parameter server (the average, the put of the
        mean, each worker's push waiting for it), on one clock, a track group
        per actor.

        Ctrl-C (KeyboardInterrupt) stops the wait at once and leaves the
        engine usable: the next call (any method but ``shutdown``) first
        settles the interrupted step. If all its calls had been sent, it
        completes; if Ctrl-C came before (e.g. while "simple" gathers the
        gradients), it counts on no replica. Either way the replicas stay
        identical and ``num_steps`` counts the steps applied. To stop for
        good, ``shutdown`` (or leave the ``with`` block): the actors are
        killed at once, without waiting for the step.

        Args:
            fetch_stats: wait for the step and return its stats.
            write_timeline: a file path: write a Chrome trace of this step
                there (open it in ui.perfetto.dev or chrome://tracing).

        Returns:
            The step's stats with ``fetch_stats=True``, else None.

        Raises:
            NonFiniteGradientError: with ``nan_policy="raise"``, the step's
                averaged gradient held NaN or Inf (the message names the
                variable); no replica applied it.
            DSGDTimeoutError: the step did not finish within ``timeout_s``.
            DSGDError: an actor died and could not be replaced (no live node
                has room for it: the message names what is missing; or
                ``max_failures`` recoveries are used up), or the engine was
                shut down.
        """
        with self._ledger.call():
            self._ledger.resizer.grow_if_room()
            if write_timeline is None:
                return self._step(fetch_stats)
            self._ledger.drain()
            with self._ledger.trace.record(write_timeline, self._ledger.num_steps):
                stats = self._step(fetch_stats=True)
            return stats if fetch_stats else None

    def _step(self, fetch_stats: bool) -> dict[str, float] | None:
        start = time.perf_counter()
        step_id, per_worker = self._ledger.step(fetch_stats)
        if per_worker is None:
            return None
        topology = self._cluster.topology
        stats = step_stats.combine(step_id, per_worker, topology, self.devices_per_worker)
        if self._cluster.servers is not None:
            stats["node_sent_bytes"] = float(self._cluster.node_sent_bytes())
        stats["step_time_s"] = time.perf_counter() - start
        if self.options.batch_size is not None:
            samples = self.options.batch_size * topology.num_workers * self.devices_per_worker
            stats["samples_per_s"] = samples / stats["step_time_s"]
        if self._scalars is not None:
            self._scalars.log(step_id, stats)
        stats["step"] = step_id
        return stats

    # ---- weights, state and callbacks ------------------------------------

    def _on_workers(self, method: str, *args, what: str, rerun: bool = True) -> list:
        """``method(*args)`` on every worker after the steps in flight (``StepLedger.on_workers``)."""
        return self._ledger.on_workers(method, *args, what=what, rerun=rerun)

    def _on_worker_0(self, method: str, *args, what: str, rerun: bool = True) -> Any:
        """``method(*args)`` on worker 0, after the steps in flight; its result (a dead worker as in ``_on_workers``)."""
        return self._ledger.on_workers(method, *args, what=what, worker_0_only=True, rerun=rerun)[0]

    def get_weights(self) -> dict[str, np.ndarray]:
        """Worker 0, replica 0's variables, keyed by name without the replica scope (``device_<i>/``).

        The model's global variables, trainable or not (batch-norm moving
        statistics included), as numpy arrays; never local variables. Waits
        for the steps in flight first, so every replica holds these values.

        Example:
            ```python
            weights = sgd.get_weights()   # {"dense/kernel": array(...), ...}
            sgd.set_weights({k: v * 0.5 for k, v in weights.items()})
            ```
        """
        return self._on_worker_0("get_weights", what="worker 0's weights")

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign ``weights`` (as from get_weights) to every replica on every worker.

        Args:
            weights: ``{name: ndarray}`` with exactly the names and shapes
                ``get_weights`` returns.

        Raises:
            TypeError: ``weights`` is not a dict.
            ValueError: names are missing or unknown, or a shape differs
                (the message lists them).
        """
        self._ledger.check_open()
        if not isinstance(weights, dict):
            raise TypeError(f"set_weights expects a dict of name -> ndarray, got {type(weights).__name__}")
        expected = {s.name: s for s in self._cluster.signature.weights}
        missing, unknown = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
        if missing or unknown:
            raise ValueError(f"set_weights: missing variables {missing}, unknown variables {unknown}")
        for name, value in weights.items():
            if np.shape(value) != expected[name].shape:
                raise ValueError(f"set_weights: {name!r} has shape {np.shape(value)}, expected {expected[name].shape}")
        self._on_workers("set_weights", ray.put(weights), what="the workers to set weights")

    def save(self, path: str) -> None:
        """Write weights, optimizer state and step count to ``path``, atomically.

        ``path`` is a file, or a directory (existing, or ending in a separator)
        that gets ``dsgd_checkpoint.npz``: a ``ray.train.Checkpoint`` directory.
        The state is the most advanced live worker's, so a run whose lost
        worker could not be replaced can still be saved. The file is written
        beside the target, fsynced and renamed over it: a crash during
        ``save`` leaves the previous checkpoint intact.

        Args:
            path: a file path, or a directory (existing, or ending in ``/``).

        Raises:
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: the file's directory does not exist.
        """
        checkpoint.save(path, self._ledger.latest_state())

    def restore(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (its file or its directory) onto every replica.

        Restores the weights, the optimizer state (slots, counters) and the
        step count. A refused checkpoint leaves the engine's weights as they
        were.

        Raises:
            FileNotFoundError: no such file, or a directory that holds no
                ``dsgd_checkpoint.npz`` (the message lists what it holds).
            ValueError: the file is empty, not an ``.npz``, truncated,
                corrupt, not written by dsgd, or another model's checkpoint
                (a variable missing, unexpected, or of another shape or
                dtype); the message names the file and the problem.
        """
        self._ledger.check_open()
        signature = self._cluster.signature
        self._restore_state(checkpoint.load(path, {"weights": signature.weights, "optimizer": signature.optimizer}))

    def _restore_state(self, state: dict) -> None:
        """``state`` (``get_state()``'s: weights and optimizer state by name, and the step count) onto every
        replica (a shut-down engine refuses, as every call on the workers does)."""
        self._ledger.restore(state)

    def save_checkpoint(self, checkpoint_dir: str | os.PathLike) -> str:
        """Ray 0.6's name: ``save`` into the directory ``checkpoint_dir`` (created if missing); the file written."""
        target = checkpoint.directory_to_save(checkpoint_dir)
        self.save(target)
        return checkpoint.file_of(target)

    def restore_checkpoint(self, checkpoint_dir: str | os.PathLike) -> None:
        """Ray 0.6's name: ``restore`` from the directory ``save_checkpoint`` wrote."""
        self.restore(checkpoint.directory_to_restore(checkpoint_dir))

    def foreach_worker(self, fn: Callable[[SGDWorker], Any]) -> list:
        """``fn(worker)`` on each worker actor, its session the default; the results, worker order.

        ``worker.sess`` is the worker's ``tf.compat.v1.Session`` and
        ``worker.models`` its replicas in device order. ``fn`` must be
        picklable. Waits for the steps in flight first.

        Raises:
            DSGDError: a worker died while ``fn`` ran; it is replaced, but
                ``fn`` is not run again (it may have run on some workers):
                call again.
        """
        return self._on_workers("apply_fn", fn, what="foreach_worker", rerun=False)

    def _queue_on_workers(self, fn: Callable[[SGDWorker], Any], what: str) -> Queued:
        """``fn(worker)`` sent to each worker behind the steps in flight, not waited for (``StepLedger.queue``)."""
        return self._ledger.queue("apply_fn", fn, what=what)

    def _queued_answers(self, queued: Queued) -> list | None:
        """``_queue_on_workers``'s answers, or None if a failure or resize came since (``StepLedger.queued_answers``)."""
        return self._ledger.queued_answers(queued)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list:
        """``fn(model)`` on every replica, its worker's session the default; a flat list, worker then device order.

        Example:
            ```python
            sgd.foreach_model(lambda m: m.get_metrics())   # numbers a model evaluates itself
            ```

        Raises:
            DSGDError: a worker died while ``fn`` ran (as in ``foreach_worker``).
        """
        per_worker = self._on_workers("foreach_model", fn, what="foreach_model", rerun=False)
        return [r for results in per_worker for r in results]

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        """``fn(model)`` on one replica (worker 0, device 0), its worker's session the default; its result.

        Example:
            ```python
            logits = sgd.for_model(lambda m: m.predict(x_test))   # a dsgd.KerasModel in inference mode
            ```

        Raises:
            DSGDError: worker 0 died while ``fn`` ran (as in ``foreach_worker``).
        """
        return self._on_worker_0("for_model", fn, what="for_model", rerun=False)

    # ---- evaluation and prediction -------------------------------------------

    def evaluate(self, x: Any, batch_size: int = 32, steps: int | None = None) -> dict[str, float]:
        """The model's loss and metrics over ``x``, every replica evaluating its part, reduced once over all of
        them: what one process evaluating all of ``x`` with these weights gets. No weight or state changes.

        A ``dsgd.TF2Model`` is evaluated by its ``get_loss(batch)``: each
        batch's loss and metrics weighted by its rows, so a loss that is a
        mean over the batch gives the mean over every row. A Keras 3
        ``dsgd.KerasModel`` by Keras's own ``evaluate``, its compiled
        metrics' state summed across replicas (an AUC over every row). A
        TF1 ``dsgd.Model`` is refused. Waits for the steps in flight first.

        Example:
            ```python
            sgd.evaluate((x_test, y_test), batch_size=256)   # {"loss": ..., "accuracy": ...}
            ```

        Args:
            x: numpy arrays structured as a batch (as ``get_batch`` returns
                one; for a ``KerasModel``, ``(x, y)`` or ``(x, y,
                sample_weight)``), each replica taking a contiguous part of
                the rows; a Ray Dataset (a split per worker, batches as dicts
                of columns); or a function ``(worker_index, device_index) ->
                tf.data.Dataset`` of each replica's batches.
            batch_size: the global batch; a replica's batches have
                ``batch_size // replicas`` rows (at least 1).
            steps: evaluate at most this many global batches (all if None).
        """
        evaluation = self._evaluate(inputs.source(x, batch_size, steps, self.num_workers, self.devices_per_worker))
        if isinstance(evaluation, Means):
            return evaluation.logs()
        return self._on_worker_0("evaluation_logs", evaluation, what="the evaluation's logs")

    def predict(self, x: Any, batch_size: int = 32) -> Any:
        """The model's outputs for ``x`` (numpy arrays, structured as the model's inputs), every replica
        predicting a contiguous part of the rows; the rows in input order. For a Keras model (Keras's own
        ``predict``, inference mode), or a ``dsgd.TF2Model`` with ``predict_batches(batches)``. Waits for the
        steps in flight first.

        Example:
            ```python
            probabilities = sgd.predict(x_test, batch_size=256)
            ```
        """
        if callable(x) or inputs.is_ray_dataset(x):
            raise TypeError("predict takes numpy arrays (its rows come back in input order), got "
                            f"{type(x).__name__}; for a Ray Dataset, predict inside the dataset's map_batches")
        return self._predict(inputs.source(x, batch_size, None, self.num_workers, self.devices_per_worker))

    def _evaluate(self, source: inputs.InputSource) -> Evaluation:
        """Every replica's evaluation of its batches from ``source``, reduced once."""
        per_worker = self._on_workers("evaluate", source, what="evaluate",
                                      rerun=not isinstance(source, inputs.RayDataSplits))  # a split is read once
        parts = [part for worker in per_worker for part in worker]
        return type(parts[0]).reduce(parts)

    def _predict(self, source: inputs.ArrayParts) -> Any:
        """Every replica's outputs for its part of ``source``'s rows, concatenated in replica order."""
        per_worker = self._on_workers("predict", source, what="predict")
        parts = [part for worker in per_worker for part in worker if part is not None]
        return inputs.concatenate(parts)

    def warmup(self) -> None:
        """Run each worker's forward and backward pass once without applying it.

        Lets TensorFlow plan and allocate the step before timing starts; the
        weights are unchanged.
        """
        self._on_workers("warmup", what="the workers to warm up")

    # ---- elastic training ---------------------------------------------------

    def resize(self, n: int) -> None:
        """Between steps, start or stop workers so that ``n`` run; survivors are not restarted.

        Settles the steps in flight first. New workers are built by
        ``model_creator`` with their own indices and join with the current
        weights, optimizer state and step count; the highest-indexed
        workers are the ones stopped. The parameter servers and the
        partitions are planned for ``n`` workers as at start, and every
        survivor reconnects to them (with one worker, "ps" has none); the
        servers of the count before stay, idle, for a resize back to it. With
        ``datasets=``, every replica gets a new split. A step then averages
        the ``n x devices_per_worker`` replicas; the effective batch changes
        with it, so scale the learning rate yourself if you want.

        Bad ``n`` (not an int, < 1, outside ``num_workers=(min, max)``) is a
        TypeError/ValueError; a size the cluster cannot hold is a DSGDError
        naming what is missing, before any worker starts. If a new worker
        fails to build (its ``model_creator`` raises), the new workers are
        stopped and the error raised. In every such case the engine is as it
        was and keeps stepping. Inside a placement group (a Ray Tune trial,
        whose bundles fix the workers) a resize is refused with a DSGDError.

        Example:
            ```python
            sgd.resize(3)        # start one worker; it joins with the current state
            sgd.resize(1)        # stop workers 2 and 1; worker 0 goes on
            ```

        Args:
            n: the number of workers to run.

        Raises:
            TypeError: ``n`` is not an int.
            ValueError: ``n < 1``, ``n`` outside an elastic engine's
                ``(min, max)``, or ``n <= backup_workers``.
            DSGDError: the cluster has no room for ``n`` workers, a new
                worker failed to build, or the engine runs inside a Ray Tune
                trial.
        """
        self._ledger.check_open()
        n = self.options.check_size(n)
        if placement.in_placement_group():
            raise DSGDError(f"resize({n}) inside a placement group (a Ray Tune trial) is refused: the trial reserved "
                            f"one bundle per worker, {self.num_workers} in all; set num_workers in the trial's "
                            "config or dsgd.tune.trainable's keywords instead")
        self._ledger.resizer.resize(n)

    # ---- teardown ---------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the worker and parameter-server actors, at once, even mid-step. Safe to call twice.

        It returns once they are dead and, called from a driver, once Ray
        lists the workers' CPUs (and GPUs) free again, so that an engine
        built next can be placed on them (each wait bounded by 10 s). In a
        task or actor (a Tune trial) it waits for the deaths only
        (``dsgd.cluster.room.HeldResources`` says why).

        Leaving a ``with`` block calls it, also when a KeyboardInterrupt
        leaves the block. Without it, the engine kills them when it is
        garbage-collected, and Ray when the driver exits. With ``datasets=``,
        the splits' executors are shut down first (their tasks cancelled,
        their progress bars closed), then their coordinators killed.
        """
        self._ledger.close()
        if self._scalars is not None:
            self._scalars.close()
        self._kill_actors()

    def __enter__(self) -> "DistributedSGD":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

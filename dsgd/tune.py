"""Hyperparameter search with Ray Tune: every trial one DistributedSGD.

    from ray import tune
    import dsgd.tune

    trainable = dsgd.tune.trainable(
        lambda config: (lambda w, d: MyModel(w, d, lr=config["lr"])),
        num_workers=2, strategy="ps", steps_per_report=20)
    tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.1, 0.01])},
               tune_config=tune.TuneConfig(metric="loss", mode="min"),
               run_config=tune.RunConfig(stop={"training_iteration": 10})).fit()

A trial reserves its driver (bundle 0: 1 CPU) and its workers (one bundle
each: ``cpus_per_worker`` CPUs, and ``devices_per_worker`` GPUs with
``gpu=True``) as one placement group, and the engine starts its workers and
parameter servers (which reserve no CPU) inside it; so Tune starts only the
trials the cluster can hold, and no trial waits for another's resources.

Keys of ``config`` named like a DistributedSGD option (``num_workers``,
``grad_shard_bytes``, ``batch_size``, ...) set that option for the trial,
over the keyword arguments given to ``trainable``; the resource request
follows them. The whole ``config`` also goes to ``config_to_model_creator``.

This module needs Ray Tune (``pip install "dsgd[tune]"``); ``import dsgd``
does not import it.
"""

from __future__ import annotations

import inspect
import tempfile
from typing import Any, Callable

from ray import tune

from dsgd.config import check_int
from dsgd.model import Model

ModelCreator = Callable[[int, int], Model]
DRIVER_CPUS = 1  # bundle 0: the trial's own process, which runs the engine's driver


def _option_names() -> set[str]:
    """DistributedSGD's keyword options (all its parameters but model_creator)."""
    from dsgd.distributed_sgd import DistributedSGD

    return set(inspect.signature(DistributedSGD).parameters) - {"model_creator"}


class _TrialOptions:
    """The DistributedSGD options of one trial: ``trainable``'s keywords, then config's."""

    def __init__(self, defaults: dict[str, Any], names: set[str]):
        self.defaults = defaults
        self.names = names

    def for_config(self, config: dict) -> dict[str, Any]:
        if not isinstance(config, dict):
            raise TypeError(f"a Tune trial's config must be a dict, got {type(config).__name__}")
        return {**self.defaults, **{k: v for k, v in config.items() if k in self.names}}

    def resources(self, config: dict) -> tune.PlacementGroupFactory:
        """Bundle 0 for the trial's driver, then one bundle per worker."""
        options = self.for_config(config)
        where = " (from the trial's config or dsgd.tune.trainable's keywords)"
        if isinstance(options.get("num_workers"), tuple):
            raise ValueError(f"num_workers={options['num_workers']!r}{where}: elastic engines do not run in Tune "
                             "trials, whose placement group reserves a fixed number of workers; give an int")
        num_workers = check_int("num_workers", options.get("num_workers", 1), 1, where)
        cpus = check_int("cpus_per_worker", options.get("cpus_per_worker", 1), 1, where)
        devices = check_int("devices_per_worker", options.get("devices_per_worker", 1), 1, where)
        worker = {"CPU": cpus, **({"GPU": devices} if options.get("gpu", False) is True else {})}
        return tune.PlacementGroupFactory([{"CPU": DRIVER_CPUS}] + [dict(worker) for _ in range(num_workers)])


def trainable(config_to_model_creator: Callable[[dict], Any], *, steps_per_report: int | None = None,
              checkpoint_every: int = 1, fit: dict[str, Any] | None = None,
              **sgd_options: Any) -> Callable[[dict], None]:
    """A Ray Tune trainable that trains one DistributedSGD per trial.

    Args:
        config_to_model_creator: ``config -> model_creator``; the model
            creator is DistributedSGD's ``(worker_index, device_index) ->
            dsgd.Model``. Both must be picklable. With ``fit``:
            ``config -> build``, a ``dsgd.KerasTrainer``'s ``build`` (a
            function returning a compiled Keras 3 model).
        steps_per_report: engine steps per Tune iteration (without ``fit``): each iteration
            runs this many steps and reports the last one's stats (``loss``,
            the model's metrics, ``step_time_s``, ``samples_per_s`` if
            ``batch_size`` is set, ``step``: that step's id) and
            ``num_steps``, the steps applied so far.
        fit: ``KerasTrainer.fit``'s arguments (``x``, ``y``, ``epochs``,
            ``validation_data``, ...): each trial is a ``KerasTrainer`` of
            ``config_to_model_creator(config)`` and each Tune iteration one
            epoch, reporting Keras's logs of that epoch (``loss``, the
            metrics, ``val_...``) with ``epoch`` and ``num_steps``; a trial
            resumed from a checkpoint goes on from the epoch after it.
        checkpoint_every: save a checkpoint (``DistributedSGD.save`` into a
            ``ray.tune.Checkpoint`` directory) with every this many reports;
            0 never saves. A trial restarted by Tune (``FailureConfig``) or
            by a scheduler such as PBT restores the checkpoint it is given:
            weights, optimizer state and step count. A model's own position
            in its input data is not part of it: its model creator starts
            afresh.
        **sgd_options: DistributedSGD's options (``num_workers``,
            ``strategy``, ...); keys of a trial's ``config`` with the same
            names override them.

    Returns:
        a function trainable with its resource request attached
        (``tune.with_resources``): pass it to ``tune.Tuner``.

    Raises:
        TypeError: ``config_to_model_creator`` is not callable, or a
            keyword is not a ``DistributedSGD`` option (the message names it).
        ValueError: ``steps_per_report`` or ``checkpoint_every`` out of
            range, or ``num_workers=(min, max)`` (a trial's workers are
            fixed by its placement group).

    Example:
        ```python
        from ray import tune
        import dsgd.tune

        trainable = dsgd.tune.trainable(
            lambda config: (lambda w, d: MyModel(w, d, lr=config["lr"])),
            steps_per_report=20, num_workers=2, strategy="ps")
        results = tune.Tuner(
            trainable, param_space={"lr": tune.grid_search([0.1, 0.01])},
            tune_config=tune.TuneConfig(metric="loss", mode="min"),
            run_config=tune.RunConfig(stop={"training_iteration": 10})).fit()
        ```
    """
    if not callable(config_to_model_creator):
        raise TypeError("config_to_model_creator must be callable: config -> model_creator, got "
                        f"{config_to_model_creator!r}")
    if fit is None:
        steps_per_report = check_int("steps_per_report", steps_per_report, 1)
    elif steps_per_report is not None:
        raise ValueError("dsgd.tune.trainable reports every epoch with fit=: give fit= or steps_per_report, not both")
    elif not isinstance(fit, dict) or "callbacks" in fit:
        raise TypeError(f"dsgd.tune.trainable's fit= is a dict of KerasTrainer.fit's arguments, without callbacks "
                        f"(the trial reports to Tune itself), got {fit!r}")
    if fit is not None:
        _check_sendable(fit)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, 0, " (0: no checkpoints)")
    names = _option_names()
    unknown = sorted(set(sgd_options) - names)
    if unknown:
        raise TypeError(f"dsgd.tune.trainable got unknown DistributedSGD options {unknown}; "
                        f"expected some of {sorted(names)}")
    options = _TrialOptions(dict(sgd_options), names)
    options.resources({})  # bad counts fail here, not in every trial

    def dsgd_trial(config: dict) -> None:
        if fit is not None:
            _run_fit_trial(config, config_to_model_creator, options.for_config(config), fit, checkpoint_every)
        else:
            _run_trial(config, config_to_model_creator, options.for_config(config), steps_per_report,
                       checkpoint_every)

    return tune.with_resources(dsgd_trial, options.resources)


def _check_sendable(fit: dict[str, Any]) -> None:
    """Refuse, by name, fit input that only this process can read (a ``tf.data.Dataset``, a generator) and that
    cannot be pickled to a trial."""
    from ray import cloudpickle

    from dsgd.integrations import keras_reader

    for name, value in fit.items():
        if not keras_reader.is_driver_input(value):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as e:  # what each kind raises differs (TypeError, TensorFlow's InvalidArgumentError)
            raise TypeError(f"dsgd.tune.trainable's fit[{name!r}] is a {type(value).__name__}, which cannot be sent "
                            f"to a trial ({type(e).__name__}: {e}); give what a trial can read: numpy arrays, a Ray "
                            "Dataset, or a function (worker_index, device_index) -> tf.data.Dataset of each "
                            "replica's batches (with steps_per_epoch)") from None


def _run_trial(config: dict, config_to_model_creator: Callable[[dict], ModelCreator], options: dict[str, Any],
               steps_per_report: int, checkpoint_every: int) -> None:
    """One trial: build the engine, restore Tune's checkpoint if there is one, train and report until stopped."""
    from dsgd.distributed_sgd import DistributedSGD

    model_creator = config_to_model_creator(config)
    with DistributedSGD(model_creator, **options) as sgd:
        resumed = tune.get_checkpoint()
        if resumed is not None:
            with resumed.as_directory() as directory:
                sgd.restore(directory)
        reports = 0
        while True:  # Tune ends the trial (stop criteria, schedulers)
            for i in range(steps_per_report):
                stats = sgd.step(fetch_stats=i == steps_per_report - 1)
            reports += 1
            metrics = {**stats, "num_steps": sgd.num_steps}
            if checkpoint_every and reports % checkpoint_every == 0:
                with tempfile.TemporaryDirectory(prefix="dsgd-checkpoint-") as directory:
                    sgd.save(directory)
                    tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))
            else:
                tune.report(metrics)


EPOCH_FILE = "keras_epoch.json"  # in a fit trial's checkpoint: the epoch it ended


def _run_fit_trial(config: dict, config_to_build: Callable[[dict], Callable[[], Any]], options: dict[str, Any],
                   fit: dict[str, Any], checkpoint_every: int) -> None:
    """One trial of a KerasTrainer: fit, reporting every epoch's logs; from Tune's checkpoint if there is one."""
    import json
    import os

    from dsgd.integrations.keras_backend import import_keras
    from dsgd.integrations.keras_trainer import KerasTrainer

    keras = import_keras()
    resumed = tune.get_checkpoint()

    class Report(keras.callbacks.Callback):
        """Restores Tune's checkpoint as training begins; reports each epoch (with a checkpoint, as asked)."""

        def on_train_begin(self, logs=None):
            if resumed is not None:
                with resumed.as_directory() as directory:
                    trainer.engine.restore(directory)
                self.model.set_weights(list(trainer.engine.get_weights().values()))

        def on_epoch_end(self, epoch, logs=None):
            metrics = {**(logs or {}), "epoch": epoch, "num_steps": trainer.engine.num_steps}
            if checkpoint_every and (epoch + 1) % checkpoint_every == 0:
                with tempfile.TemporaryDirectory(prefix="dsgd-checkpoint-") as directory:
                    trainer.engine.save(directory)
                    with open(os.path.join(directory, EPOCH_FILE), "w") as f:
                        json.dump({"epoch": epoch}, f)
                    tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))
            else:
                tune.report(metrics)

    initial_epoch = fit.get("initial_epoch", 0)
    if resumed is not None:
        with resumed.as_directory() as directory:
            with open(os.path.join(directory, EPOCH_FILE)) as f:
                initial_epoch = json.load(f)["epoch"] + 1
    with KerasTrainer(config_to_build(config), **options) as trainer:
        trainer.fit(**{"verbose": 0, **fit, "initial_epoch": initial_epoch, "callbacks": [Report()]})

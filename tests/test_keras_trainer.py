"""Keras 3 programs as Keras users write them: dsgd.KerasTrainer's fit, evaluate, predict and callbacks against
one-process Keras, and the Keras 3 replica's step (KerasModel's and KerasTrainer's) against Keras's own."""

from __future__ import annotations

import csv
import functools
import os
import time
import types
import warnings
from typing import Iterator

import keras
import numpy as np
import pytest
import ray

import dsgd
import keras_trainer_models as km
from dsgd.integrations.keras_compiled import CompiledReplica
from dsgd.integrations.keras_feed import EpochPlan
from dsgd_test_models import (actors_started_since, assert_replicas_identical, kill, known_actors, local_worker,
                              ps_actors)

BATCH = 64  # the global batch: 32 a replica on 2 workers


def assert_weights_equal(got: list, expected: list, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(got) == len(expected)
    for k, (a, b) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"weight {k}")


def assert_logs_equal(got: dict, expected: dict, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=rel, abs=1e-6), name


@pytest.fixture(scope="module")
def binary(ray_session) -> Iterator[dsgd.KerasTrainer]:
    """``km.build_binary`` (plain SGD; accuracy, AUC, precision) on 2 workers, "ps", started by a first fit; it
    recovers from the module's five kills (``max_failures``)."""
    with dsgd.KerasTrainer(km.build_binary, num_workers=2, strategy="ps", max_failures=5) as trainer:
        yield trainer


@pytest.fixture
def fresh(binary) -> dsgd.KerasTrainer:
    """``binary`` with build()'s first weights and a new SGD on trainer.model (they reach the engine before the
    next step)."""
    start = km.build_binary()
    binary.model.set_weights(start.get_weights())
    binary.model.optimizer.learning_rate = float(start.optimizer.learning_rate)
    return binary


def test_fit_without_shuffling_equals_one_process_fit_with_validation(fresh):
    x, y = km.binary_data()
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x[:128], y[:128]))
    history = fresh.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:128], y[:128]))
    assert isinstance(history, keras.callbacks.History)
    assert sorted(history.history) == ["accuracy", "auc", "loss", "precision",
                                       "val_accuracy", "val_auc", "val_loss", "val_precision"]
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    assert_weights_equal(list(fresh.engine.get_weights().values()), reference.get_weights())
    assert_replicas_identical(fresh.engine, 2)


@pytest.mark.parametrize("steps_per_epoch, steps", [(5, [5, 3, 5]), (100, [8, 8, 8])])
def test_steps_per_epoch_over_arrays_goes_on_across_epochs_as_keras_fit_does(fresh, steps_per_epoch, steps):
    """8 batches a pass: with 5 steps an epoch, the second epoch goes on where the first stopped and stops at the
    data's end, and the third begins a new pass (5, 3, 5 steps), as keras.Model.fit; with 100, each epoch is a
    pass. Logs and weights equal one process's."""
    x, y = km.binary_data()
    reference = km.build_binary()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "Your input ran out of data" at each epoch cut short
        expected = reference.fit(x, y, batch_size=BATCH, epochs=3, steps_per_epoch=steps_per_epoch, shuffle=False,
                                 verbose=0)
    before = fresh.engine.num_steps
    with pytest.warns(UserWarning, match=f"steps_per_epoch={steps_per_epoch} does not divide the 8 batches"):
        history = fresh.fit(x, y, batch_size=BATCH, epochs=3, steps_per_epoch=steps_per_epoch, shuffle=False,
                            verbose=0)
    assert fresh.engine.num_steps - before == sum(steps)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())


def test_evaluate_sums_the_metric_state_and_equals_one_process_evaluate(fresh):
    x, y = km.binary_data(samples=301, seed=3)  # parts of 151 and 150 rows
    reference = km.build_binary()
    expected = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    got = fresh.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert_logs_equal(got, expected)
    as_list = fresh.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert as_list == pytest.approx(reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


class EvaluateMidEpoch(keras.callbacks.Callback):
    """Evaluates on the engine at batch 2's end (Keras's own evaluate on every replica, mid-epoch)."""

    def __init__(self, trainer: dsgd.KerasTrainer, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.trainer, self.x, self.y, self.logs = trainer, x, y, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.logs = self.trainer.engine.evaluate((self.x, self.y), batch_size=BATCH)


def test_an_evaluation_mid_epoch_leaves_the_epochs_metrics_as_they_were(fresh):
    x, y = km.binary_data()
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    evaluation = EvaluateMidEpoch(fresh, x[:96], y[:96])
    history = fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[evaluation])
    assert sorted(evaluation.logs) == ["accuracy", "auc", "loss", "precision"]
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name


def test_a_replica_evaluates_and_predicts_a_stream_to_its_end_without_keras_ran_out_of_data_warning():
    """In one process: ``CompiledReplica`` evaluates a stream of batches with Keras's own evaluate (its state equal
    to one ``evaluate`` of the rows) and predicts it, with no "ran out of data" warning (the stream's end is the
    call's end), its training metrics as they were."""
    x, y = km.binary_data(samples=70, seed=5)
    batches = [(x[a:a + 32], y[a:a + 32], np.ones(len(x[a:a + 32]), np.float32)) for a in range(0, 70, 32)]
    replica = CompiledReplica(km.build_binary(), types.SimpleNamespace(next=iter(batches).__next__),
                              per_step_metrics=False)
    reference = km.build_binary()
    reference.set_weights(replica.model.get_weights())
    before = replica.metric_state().state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluated = replica.evaluate_batches(iter(batches))
        predicted = replica.predict_batches(iter(b[0] for b in batches))
    assert not [w for w in caught if "ran out of data" in str(w.message)], [str(w.message) for w in caught]
    expected = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert_logs_equal(replica.evaluation_logs(evaluated), expected)
    np.testing.assert_allclose(predicted, reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    for kept, was in zip(replica.metric_state().state, before):
        np.testing.assert_array_equal(kept, was)


def test_predict_returns_every_row_in_input_order(fresh):
    x, _ = km.binary_data(samples=37, seed=4)
    got = fresh.predict(x, batch_size=8, verbose=0)
    np.testing.assert_allclose(got, km.build_binary().predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    assert got.shape == (37, 1)


@pytest.mark.parametrize("weighting", ["sample_weight", "class_weight"])
def test_sample_and_class_weights_train_as_in_one_process(fresh, weighting):
    x, y = km.binary_data(samples=256, seed=5)
    weights = {"sample_weight": np.linspace(0.5, 2.0, len(y)).astype(np.float32), "class_weight": {0: 0.3, 1: 2.0}}
    given = {weighting: weights[weighting]}
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **given)
    history = fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **given)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())


def test_a_tf_data_function_of_each_replicas_batches_trains_as_the_arrays_do(fresh):
    x, y = km.binary_data()
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    history = fresh.fit(km.binary_replica_dataset, steps_per_epoch=len(x) // BATCH, epochs=2, verbose=0)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    with pytest.raises(ValueError, match="needs steps_per_epoch"):
        fresh.fit(km.binary_replica_dataset, epochs=1, verbose=0)
    # evaluate reads the same function: the replicas' datasets together are the first rows, in global batches.
    rows = len(x) // BATCH * BATCH
    assert_logs_equal(fresh.evaluate(km.binary_replica_dataset, verbose=0, return_dict=True),
                      reference.evaluate(x[:rows], y[:rows], batch_size=BATCH, verbose=0, return_dict=True))
    assert_logs_equal(fresh.evaluate(km.binary_replica_dataset, steps=2, verbose=0, return_dict=True),
                      reference.evaluate(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, verbose=0, return_dict=True))


def shuffled_batches(x: np.ndarray, y: np.ndarray, batch: int = BATCH):
    """A tf.data pipeline as Keras users write one: shuffled anew each epoch (seeded), in global batches."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=7).batch(batch)


def test_a_tf_data_dataset_made_on_the_driver_trains_evaluates_and_predicts_as_one_process(fresh):
    import tensorflow as tf

    x, y = km.binary_data()
    xv, yv = x[:128], y[:128]
    reference = km.build_binary()
    expected = reference.fit(shuffled_batches(x, y), epochs=2, verbose=0,
                             validation_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(50))
    history = fresh.fit(shuffled_batches(x, y), epochs=2, verbose=0,
                        validation_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(50))
    # The driver read each epoch's batches, in the order one process reads them (a new shuffle each epoch).
    assert sorted(history.history) == sorted(expected.history)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    assert_replicas_identical(fresh.engine, 2)
    test = tf.data.Dataset.from_tensor_slices((x[:301], y[:301])).batch(40)  # parts of 151 and 150 rows
    assert_logs_equal(fresh.evaluate(test, verbose=0, return_dict=True),
                      reference.evaluate(test, verbose=0, return_dict=True))
    np.testing.assert_allclose(fresh.predict(test.map(lambda features, labels: features), verbose=0),
                               reference.predict(x[:301], verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="give no y"):
        fresh.fit(shuffled_batches(x, y), y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="repeats without end: give steps_per_epoch"):
        fresh.fit(shuffled_batches(x, y).repeat(), epochs=1, verbose=0)


class Batches(keras.utils.PyDataset):
    """A Keras PyDataset of global batches that counts its epochs (Keras calls on_epoch_end)."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.x, self.y, self.epochs = x, y, 0

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, k):
        return self.x[k * BATCH:(k + 1) * BATCH], self.y[k * BATCH:(k + 1) * BATCH]

    def on_epoch_end(self):
        self.epochs += 1


def test_a_pydataset_and_a_generator_train_with_class_weights_and_steps_per_epoch_as_one_process(fresh):
    x, y = km.binary_data()
    weights = {0: 0.5, 1: 1.5}
    reference = km.build_binary()
    expected = reference.fit(Batches(x, y), epochs=2, verbose=0, class_weight=weights, shuffle=False)
    batches = Batches(x, y)
    history = fresh.fit(batches, epochs=2, verbose=0, class_weight=weights, shuffle=False)
    assert batches.epochs == 2
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())

    def endless(x, y):  # 5 steps an epoch of 7 batches a pass: an epoch goes on where the one before stopped
        while True:
            for k in range(7):
                yield x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH]

    expected = reference.fit(endless(x, y), epochs=2, steps_per_epoch=5, verbose=0)
    history = fresh.fit(endless(x, y), epochs=2, steps_per_epoch=5, verbose=0)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    with pytest.raises(ValueError, match="a generator, which has no length: give steps_per_epoch"):
        fresh.fit(endless(x, y), epochs=1, verbose=0)


class StopAfter(keras.callbacks.Callback):
    """Stops training at the end of epoch ``epoch``."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.stop_training = True


def test_the_next_epoch_is_read_while_one_trains_and_a_fit_stopped_early_leaves_no_reader_running(fresh):
    import threading

    x, y = km.binary_data()
    reference = km.build_binary()
    expected = reference.fit(Batches(x, y), epochs=5, shuffle=False, verbose=0, callbacks=[StopAfter(1)])
    batches = Batches(x, y)
    history = fresh.fit(batches, epochs=5, shuffle=False, verbose=0, callbacks=[StopAfter(1)])
    assert len(history.history["loss"]) == 2
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    assert batches.epochs == 3  # the third epoch was read while the second trained, and not trained on
    assert not [t for t in threading.enumerate() if t.name.startswith("dsgd-input")]


def test_an_epoch_read_ahead_is_read_in_the_background_and_read_returns_it():
    import threading

    from dsgd.integrations.keras_reader import DriverEpochs

    x, y = km.binary_data(samples=4 * BATCH)
    begun, go = threading.Event(), threading.Event()

    class Held(Batches):  # its second epoch's first batch waits until the test lets it go
        def __getitem__(self, k):
            if self.epochs == 1 and k == 0:
                begun.set()
                assert go.wait(30)
            return super().__getitem__(k)

    epochs = DriverEpochs(Held(x, y))
    first = epochs.read()
    epochs.read_ahead()
    assert begun.wait(30)  # the next epoch is being read while this thread goes on
    go.set()
    second = epochs.read()
    epochs.close()
    assert first.edges == second.edges == (0, 64, 128, 192, 256)
    np.testing.assert_array_equal(second.arrays[0], x)
    assert not [t for t in threading.enumerate() if t.name.startswith("dsgd-input")]


def test_batches_read_on_the_driver_split_into_equal_parts_and_what_is_left_out_is_said(caplog):
    from dsgd.integrations.keras_reader import DriverEpochs, warn_left_out

    plan = EpochPlan(num_samples=17, batch_size=1, replicas=2, edges=(0, 6, 11, 16, 17))
    assert plan.steps == 3  # the last batch, one row, has none for the second replica: left out
    assert [plan.part(None, 1, r) for r in range(2)] == [slice(6, 8), slice(8, 10)]  # 5 rows: 2 each
    with pytest.raises(ValueError, match="no batch of at least 2 rows"):
        EpochPlan(num_samples=1, batch_size=1, replicas=2, edges=(0, 1))
    x, y = km.binary_data(samples=70)
    import tensorflow as tf

    epoch = DriverEpochs(tf.data.Dataset.from_tensor_slices((x, y)).batch(33)).read()
    assert epoch.edges == (0, 33, 66, 70)
    np.testing.assert_array_equal(epoch.arrays[1], y)
    np.testing.assert_array_equal(epoch.arrays[2], np.ones(70, np.float32))
    with caplog.at_level("WARNING", logger="dsgd.integrations.keras_reader"):
        warn_left_out(epoch, 2)
    assert "leaving out 2 of the epoch's 70 rows; batch it by a multiple of 2" in caplog.text
    with pytest.raises(ValueError, match="gave no batch for this epoch"):
        DriverEpochs(tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(8)).read()


def test_a_model_trained_without_labels_fits_on_x_alone_as_one_process(ray_session):
    x, _ = km.binary_data()
    reference = km.build_reconstruct()
    expected = reference.fit(x, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with dsgd.KerasTrainer(km.build_reconstruct, num_workers=2) as trainer:
        history = trainer.fit(x, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
        assert_weights_equal(trainer.model.get_weights(), reference.get_weights())
        assert trainer.evaluate(x, verbose=0) == pytest.approx(reference.evaluate(x, verbose=0), rel=1e-5)


def test_a_later_fit_whose_batches_differ_from_those_the_step_was_built_for_says_what_to_give(fresh):
    x, y = km.binary_data()
    fresh.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"are \('float32\[8\]', 'int32\[1\]', 'float32\[\]'\), but the engine's step "
                                         r"was built for \('float32\[8\]', 'int32\[\]', 'float32\[\]'\)"):
        fresh.fit(x, y[:, None], batch_size=BATCH, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"are \('string\[\]', 'int32\[\]', 'float32\[\]'\), but the engine's step"):
        fresh.fit(km.text_data(BATCH)[0], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)


def test_text_reaches_the_step_and_a_model_that_vectorizes_it_trains_as_one_process(ray_session):
    """A model whose first layer is a TextVectorization, given a numpy array of str, then a tf.data.Dataset of
    the same text (bytes): fit's weights and every epoch's logs, evaluate and predict equal one process's."""
    import tensorflow as tf

    x, y = km.text_data()
    reference = km.build_text()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected_more = reference.fit(tf.data.Dataset.from_tensor_slices((x.astype(str), y)).batch(BATCH), verbose=0)
    with dsgd.KerasTrainer(km.build_text, num_workers=2) as trainer:
        history = trainer.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        for name, values in expected.history.items():
            assert history.history[name] == pytest.approx(values, rel=1e-5), name
        more = trainer.fit(tf.data.Dataset.from_tensor_slices((x.astype(str), y)).batch(BATCH), verbose=0)
        for name, values in expected_more.history.items():
            assert more.history[name] == pytest.approx(values, rel=1e-5), name
        assert_weights_equal(trainer.model.get_weights(), reference.get_weights())
        assert_logs_equal(trainer.evaluate(x, y, verbose=0, return_dict=True),
                          reference.evaluate(x, y, verbose=0, return_dict=True))
        np.testing.assert_allclose(trainer.predict(x[:50]), reference.predict(x[:50], verbose=0), rtol=1e-5,
                                   atol=1e-6)


class BatchLogs(keras.callbacks.Callback):
    """Records each batch's logs, and the weights trainer.model holds at that batch's end."""

    def __init__(self):
        super().__init__()
        self.logs, self.kernels = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))
        self.kernels.append(self.model.get_weights()[0].copy())


def test_callbacks_see_keras_logs_and_the_engines_weights_and_steer_every_replica(fresh, tmp_path):
    x, y = km.binary_data()
    batch_logs = BatchLogs()
    checkpoint = str(tmp_path / "best.keras")
    csv_path = tmp_path / "log.csv"
    callbacks = [batch_logs,
                 keras.callbacks.ModelCheckpoint(checkpoint, monitor="val_auc", mode="max", save_best_only=True),
                 keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1)),
                 keras.callbacks.CSVLogger(str(csv_path))]
    history = fresh.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks,
                        validation_data=(x[:128], y[:128]))
    # Batch logs are Keras's running means over the epoch so far; trainer.model holds the engine's weights.
    steps = len(x) // BATCH
    assert len(batch_logs.logs) == 3 * steps
    assert batch_logs.logs[steps - 1]["loss"] == pytest.approx(history.history["loss"][0], rel=1e-6)
    assert not np.array_equal(batch_logs.kernels[0], batch_logs.kernels[1])
    # The scheduler's rates reached every replica: the same run in one process with the same schedule.
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                             callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))],
                             validation_data=(x[:128], y[:128]))
    assert history.history["lr" if "lr" in history.history else "learning_rate"] == pytest.approx([0.1, 0.05, 1 / 30])
    assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    rates = fresh.engine.foreach_model(lambda m: float(m.optimizer.learning_rate))
    assert rates == pytest.approx([1 / 30] * 2)
    # The best epoch's model, loadable by Keras, holds that epoch's weights.
    best = int(np.argmax(history.history["val_auc"]))
    loaded = keras.models.load_model(checkpoint)
    assert loaded.evaluate(x[:128], y[:128], verbose=0, return_dict=True)["auc"] == pytest.approx(
        history.history["val_auc"][best], rel=1e-5)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["val_loss"]) for r in rows] == pytest.approx(history.history["val_loss"], rel=1e-5)


def test_a_lambda_callback_at_batch_ends_sees_each_batchs_logs_and_weights(fresh):
    """A LambdaCallback sets its batch hook on itself, not in its class: fit still reads the logs and the
    engine's weights at every batch's end for it."""
    x, y = km.binary_data()
    seen: list = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((dict(logs), fresh.model.get_weights()[0].copy())))
    history = fresh.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    assert len(seen) == len(x) // BATCH
    assert seen[-1][0]["loss"] == pytest.approx(history.history["loss"][0], rel=1e-6)
    assert not np.array_equal(seen[0][1], seen[1][1])


def test_keras_callbacks_set_to_act_at_epochs_do_not_make_fit_read_every_batch(tmp_path):
    """Which callbacks make fit read the logs and the weights at every batch's end (a round trip to the
    workers each): a batch hook of their own, unless Keras's ModelCheckpoint or TensorBoard is set to act at
    epochs only (their defaults), whose batch hooks then read neither."""
    from dsgd.integrations.keras_trainer import _act_at_batches

    path = str(tmp_path / "m.keras")

    class Subclass(keras.callbacks.ModelCheckpoint):
        pass

    at_epochs = [keras.callbacks.ModelCheckpoint(path), keras.callbacks.TensorBoard(str(tmp_path)),
                 keras.callbacks.EarlyStopping(), keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: None)]
    at_batches = [keras.callbacks.ModelCheckpoint(path, save_freq=5),
                  keras.callbacks.TensorBoard(str(tmp_path), update_freq="batch"),
                  keras.callbacks.TensorBoard(str(tmp_path), write_steps_per_second=True),
                  keras.callbacks.TerminateOnNaN(), Subclass(path),
                  keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None), BatchLogs()]
    assert [_act_at_batches([cb], keras) for cb in at_epochs] == [False] * len(at_epochs)
    assert [_act_at_batches([cb], keras) for cb in at_batches] == [True] * len(at_batches)
    assert _act_at_batches(at_epochs + at_batches[:1], keras)


def test_a_csv_logger_reads_only_the_logs_so_the_epochs_end_need_not_stop_the_steps(fresh, tmp_path):
    """Keras's History, progress bar and CSVLogger read only the logs: with them alone nothing reads
    trainer.model during fit, so each epoch's end is queued behind its last step; the CSV holds one-process
    fit's logs."""
    from dsgd.integrations.keras_trainer import _model_callbacks

    csv_path = tmp_path / "log.csv"
    logger, checkpoint = keras.callbacks.CSVLogger(str(csv_path)), keras.callbacks.ModelCheckpoint(
        str(tmp_path / "m.keras"))
    listed = keras.callbacks.CallbackList([logger, checkpoint], add_history=True, add_progbar=True, model=fresh.model)
    assert _model_callbacks(listed, keras) == [checkpoint]
    x, y = km.binary_data()
    expected = km.build_binary().fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    fresh.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.CSVLogger(str(csv_path))])
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    for name, values in expected.history.items():
        assert [float(r[name]) for r in rows] == pytest.approx(values, rel=1e-5), name


class EpochWeights(keras.callbacks.Callback):
    """Records the weights trainer.model holds at each epoch's end (and nothing at batches)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def test_an_epoch_end_callback_reads_that_epochs_weights_on_trainer_model(fresh):
    x, y = km.binary_data()
    seen, expected = EpochWeights(), EpochWeights()
    fresh.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[seen])
    km.build_binary().fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[expected])
    assert len(seen.weights) == 3
    for got, want in zip(seen.weights, expected.weights):
        assert_weights_equal(got, want)


def test_early_stopping_stops_and_restores_the_best_weights_on_every_replica(fresh):
    x, y = km.binary_data()
    flip = 1 - y[:128]  # validation labels the training makes worse: the best epoch is the first
    stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    history = fresh.fit(x, y, batch_size=BATCH, epochs=10, shuffle=False, verbose=0,
                        validation_data=(x[:128], flip), callbacks=[stopping])
    assert len(history.history["loss"]) < 10
    best = int(np.argmin(history.history["val_loss"]))
    got = fresh.evaluate(x[:128], flip, verbose=0, return_dict=True)
    assert got["loss"] == pytest.approx(history.history["val_loss"][best], rel=1e-5)
    assert_weights_equal(list(fresh.engine.get_weights().values()), fresh.model.get_weights(), rtol=0, atol=0)


def test_tensorboard_writes_the_epoch_logs_of_training_and_validation(fresh, tmp_path):
    import tensorflow as tf

    x, y = km.binary_data()
    history = fresh.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(x[:128], y[:128]),
                        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))])

    def scalars(run: str) -> dict[str, list[float]]:
        found: dict[str, list[float]] = {}
        for path in sorted((tmp_path / run).glob("events.out.tfevents.*")):
            for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
                event = tf.compat.v1.Event.FromString(record)
                for value in event.summary.value:
                    if value.tag.startswith("epoch_"):  # the scalars (Keras also writes the model's config as text)
                        found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
        return found

    train, validation = scalars("train"), scalars("validation")
    assert train["epoch_loss"] == pytest.approx(history.history["loss"], rel=1e-6)
    assert train["epoch_auc"] == pytest.approx(history.history["auc"], rel=1e-6)
    assert validation["epoch_loss"] == pytest.approx(history.history["val_loss"], rel=1e-6)


def test_reduce_lr_on_plateau_reaches_every_replica(fresh):
    x, y = km.binary_data()
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", mode="max", factor=0.5, patience=0)
    fresh.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(x[:64], y[:64]),
              callbacks=[plateau])  # mode="max" on a loss that falls: the second epoch is a plateau
    assert fresh.engine.foreach_model(lambda m: float(m.optimizer.learning_rate)) == pytest.approx([0.05] * 2)


def test_a_custom_callback_can_stop_training_after_a_batch(fresh):
    class StopAtThird(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    x, y = km.binary_data()
    steps_before = fresh.engine.num_steps
    history = fresh.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=[StopAtThird()])
    assert fresh.engine.num_steps - steps_before == 3
    assert len(history.history["loss"]) == 1


@pytest.mark.parametrize("given", ["arrays", "a shuffled tf.data.Dataset"])
def test_a_worker_killed_mid_epoch_is_replaced_and_fit_ends_with_the_fault_free_weights_and_logs(fresh, caplog,
                                                                                                  given):
    """Worker 1 killed after the first epoch's fifth step, a parameter server after the second's: each time the
    engine runs the step no worker applied again. The weights are the fault-free ones, and so is every epoch's
    metrics: the replacement goes on from the metric state the lost worker reported with its last step, and the
    step run twice on the survivors counts once. Arrays, or a dataset whose epochs the driver read (the
    replacement reads the epoch under way; the worker only: the module's engine recovers five times at most)."""
    class Kill(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if batch == 4 and (self.epoch == 0 or given == "arrays"):
                killed.append(fresh.engine.workers[1] if self.epoch == 0 else ps_actors(fresh.engine)[0])
                kill(killed[-1])

    killed: list = []
    x, y = km.binary_data()
    fresh.evaluate(x[:BATCH], y[:BATCH], verbose=0)  # the engine started, if no test before started it
    failures = fresh.engine.failures
    reference = km.build_binary()
    data = (lambda: dict(x=x, y=y, batch_size=BATCH, shuffle=False)) if given == "arrays" else (
        lambda: dict(x=shuffled_batches(x, y)))
    expected = reference.fit(**data(), epochs=2, verbose=0)
    with caplog.at_level("WARNING", logger="dsgd.integrations.keras_trainer"):
        history = fresh.fit(**data(), epochs=2, verbose=0, callbacks=[Kill()])
    assert len(killed) == fresh.engine.failures - failures == (2 if given == "arrays" else 1)
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    assert_replicas_identical(fresh.engine, 2)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert not [r.getMessage() for r in caplog.records if "metrics leave out" in r.getMessage()]


@pytest.mark.parametrize("callback", ["reads the logs only", "may read trainer.model"])
def test_a_worker_lost_as_an_epoch_ends_is_replaced_and_the_epochs_logs_are_the_fault_free_ones(fresh, caplog,
                                                                                               callback):
    """Worker 1 killed right after the first epoch's last step, by a callback. If it reads the logs only (a
    History), the epoch's end is queued behind that step and the next epoch's first step submitted before the
    logs are read: the queued call fails on the dead worker, the engine replaces it and runs that first step
    again, and the logs are read from the state each replica kept as the step began. If it may read
    trainer.model, the epoch's end is one call on the workers, which fails on the dead worker: the engine
    replaces it and makes the call again (it reports the same twice). Either way the replacement starts from the
    metric state the lost worker reported with the epoch's last step: the weights and every epoch's logs are the
    fault-free ones."""
    kind = keras.callbacks.History if callback == "reads the logs only" else keras.callbacks.Callback

    class KillAtTheLastBatch(kind):
        def on_epoch_begin(self, epoch, logs=None):
            super().on_epoch_begin(epoch, logs)
            self.epoch_now = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.epoch_now == 0 and batch == steps - 1:
                kill(fresh.engine.workers[1])

    x, y = km.binary_data()
    steps = len(x) // BATCH
    fresh.evaluate(x[:BATCH], y[:BATCH], verbose=0)  # the engine started, if no test before started it
    failures, steps_before = fresh.engine.failures, fresh.engine.num_steps
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with caplog.at_level("WARNING", logger="dsgd.integrations.keras_trainer"):
        history = fresh.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[KillAtTheLastBatch()])
    assert fresh.engine.failures - failures == 1
    assert fresh.engine.num_steps - steps_before == 2 * steps
    assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    assert_replicas_identical(fresh.engine, 2)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert not [r.getMessage() for r in caplog.records if "metrics leave out" in r.getMessage()]


def test_a_callback_resizing_the_engine_between_epochs_leaves_fit_exact(fresh):
    """The global batch is split over the replicas there are at each epoch's start: on 1 worker or 2, one step is
    the mean gradient of the same 64 rows."""
    class ShrinkAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                fresh.engine.resize(1)

    x, y = km.binary_data()
    reference = km.build_binary()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    try:
        history = fresh.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                            callbacks=[ShrinkAfterFirstEpoch()])
        assert fresh.engine.num_workers == 1
        for name, values in expected.history.items():
            assert history.history[name] == pytest.approx(values, rel=1e-5), name
        assert_weights_equal(fresh.model.get_weights(), reference.get_weights())
    finally:
        fresh.engine.resize(2)


@pytest.mark.slow  # its own engine of 3 workers: about 100 s here
def test_backup_workers_and_bf16_compression_hold_under_fit(ray_session):
    """3 workers, any 2 of which make a step (backup_workers=1), bf16 on the wire: each global batch is 3 copies
    of 32 rows, so whichever replicas a step averages, its mean gradient is one-process fit's of that batch."""
    x, y = km.binary_data()
    parts = len(x) // 32
    x3, y3 = (np.repeat(a.reshape(parts, 1, 32, *a.shape[1:]), 3, axis=1).reshape(-1, *a.shape[1:]) for a in (x, y))
    reference = km.build_binary()
    expected = reference.fit(x3, y3, batch_size=96, epochs=2, shuffle=False, verbose=0)
    with dsgd.KerasTrainer(km.build_binary, num_workers=3, backup_workers=1, compression="bf16") as trainer:
        history = trainer.fit(x3, y3, batch_size=96, epochs=2, shuffle=False, verbose=0)
        assert trainer.engine.options.backup_workers == 1 and trainer.engine.options.compression == "bf16"
        assert_replicas_identical(trainer.engine, 3)
        assert_weights_equal(list(trainer.engine.get_weights().values()), trainer.model.get_weights())
        # bf16 rounds every gradient to 8 significant bits on the wire: close to, not equal to, float32 Keras.
        assert_weights_equal(trainer.model.get_weights(), reference.get_weights(), rtol=2e-2, atol=2e-3)
        assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=2e-2)


def test_a_global_batch_the_replicas_do_not_divide_and_other_misuse_are_refused_by_name(binary):
    x, y = km.binary_data()
    with pytest.raises(ValueError, match="batch_size 63 is the global batch.* 2 replicas.*multiple of 2"):
        binary.fit(x, y, batch_size=63, verbose=0)
    with pytest.raises(ValueError, match="different numbers of rows"):
        binary.fit(x, y[:10], batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive int, got 0"):
        binary.fit(x, y, batch_size=BATCH, steps_per_epoch=0, verbose=0)


def test_a_trainer_on_another_keras_backend_is_refused_naming_the_variable_to_set(ray_session):
    result = ray.get(trainer_on_backend.options(runtime_env={"env_vars": {"KERAS_BACKEND": "jax"}}).remote(),
                     timeout=120)
    assert "Keras backend is 'jax'" in result and "set KERAS_BACKEND=tensorflow" in result


@ray.remote(num_cpus=0)
def trainer_on_backend() -> str:
    """What KerasTrainer says in a process whose Keras backend is JAX (not even installed here), before build()."""
    try:
        dsgd.KerasTrainer(lambda: None, num_workers=1)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_model_not_compiled_or_with_its_own_train_step_or_synchronized_batch_norm_is_refused():
    with pytest.raises(ValueError, match="not compiled; call model.compile"):
        dsgd.KerasTrainer(km.build_uncompiled)
    with pytest.raises(TypeError, match="OwnTrainStep overrides train_step.*override compute_loss"):
        dsgd.KerasTrainer(km.build_own_train_step)
    with pytest.raises(ValueError, match=r"synchronized=True\) in layer\(s\) synced_bn"):
        dsgd.KerasTrainer(km.build_synchronized)


@pytest.fixture(scope="module")
def classes(ray_session) -> Iterator[dsgd.KerasTrainer]:
    """``km.build_classes`` (Adam, 3 classes) on 2 workers, "simple"."""
    with dsgd.KerasTrainer(km.build_classes, num_workers=2, strategy="simple") as trainer:
        yield trainer


def test_adam_and_sparse_labels_fit_and_evaluate_as_in_one_process(classes):
    x, y = km.classes_data()
    reference = km.build_classes()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    history = classes.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name, values in expected.history.items():
        assert history.history[name] == pytest.approx(values, rel=1e-5), name
    assert_weights_equal(classes.model.get_weights(), reference.get_weights())
    x_test, y_test = km.classes_data(samples=200, seed=6)
    reference.set_weights(classes.model.get_weights())
    assert_logs_equal(classes.evaluate(x_test, y_test, verbose=0, return_dict=True),
                      reference.evaluate(x_test, y_test, verbose=0, return_dict=True))


def test_two_outputs_fit_validate_and_evaluate_with_each_outputs_loss_and_metrics_as_one_process(ray_session):
    """Each output's loss and metrics (``value_loss``, ``label_accuracy``, ...), in training, validation and
    ``evaluate``, equal one process's; in evaluation they were counted once a batch, not once a sample. With a
    last batch smaller than the others they are the mean over every sample, which Keras gives when its batches
    are whole (Keras counts each output's loss of a partial batch once: it traces the step for an unknown batch
    size)."""
    x, y = km.binary_data(samples=256)
    labels = km.two_outputs_labels(x, y)
    x_val, y_val = km.binary_data(samples=200, seed=3)
    validation = (x_val[:192], km.two_outputs_labels(x_val[:192], y_val[:192]))
    reference = km.build_two_outputs()
    expected = reference.fit(x, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                             validation_data=validation)
    with dsgd.KerasTrainer(km.build_two_outputs, num_workers=2) as trainer:
        history = trainer.fit(x, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                              validation_data=validation)
        assert "val_value_loss" in history.history and "val_label_accuracy" in history.history
        for name, values in expected.history.items():
            assert history.history[name] == pytest.approx(values, rel=1e-5), name
        assert_weights_equal(trainer.model.get_weights(), reference.get_weights())
        test = (x_val, km.two_outputs_labels(x_val, y_val))
        assert_logs_equal(trainer.evaluate(*test, batch_size=50, verbose=0, return_dict=True),
                          reference.evaluate(*test, batch_size=50, verbose=0, return_dict=True))
        assert_logs_equal(trainer.evaluate(*test, batch_size=BATCH, verbose=0, return_dict=True),
                          reference.evaluate(*test, batch_size=len(x_val), verbose=0, return_dict=True))


def test_a_model_a_callback_saves_holds_the_engines_optimizer_state_and_state_set_on_it_reaches_the_replicas(
        classes, tmp_path):
    """ModelCheckpoint's .keras file holds Adam's state as the replicas have it (one-process fit's), not the
    driver's optimizer's, which never steps; Adam's state set on trainer.model (here: a fresh one, after the
    tests before trained) reaches every replica before the next step."""
    start = km.build_classes()
    start.optimizer.build(start.trainable_variables)
    classes.model.set_weights(start.get_weights())
    for variable, value in zip(classes.model.optimizer.variables, start.optimizer.variables):
        variable.assign(value)
    x, y = km.classes_data()
    reference = km.build_classes()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    path = str(tmp_path / "last.keras")
    classes.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.ModelCheckpoint(path)])
    saved = keras.models.load_model(path)
    assert int(saved.optimizer.iterations) == 2 * (len(x) // BATCH)
    assert_weights_equal([v.numpy() for v in saved.optimizer.variables],
                         [v.numpy() for v in reference.optimizer.variables])
    assert_weights_equal(saved.get_weights(), reference.get_weights())


def test_a_checkpoint_restored_onto_the_engine_as_training_begins_keeps_its_optimizer_state(classes, tmp_path):
    """What dsgd.tune's trials do when resumed: a new engine, restored from engine.save's checkpoint in
    on_train_begin (trainer.model given its weights, its optimizer left fresh): Adam's moments and step count come
    from the checkpoint, not from trainer.model's fresh optimizer, so one epoch more equals two in one process."""
    def reset_to_build() -> None:
        start = km.build_classes()
        start.optimizer.build(start.trainable_variables)
        classes.model.set_weights(start.get_weights())
        for variable, value in zip(classes.model.optimizer.variables, start.optimizer.variables):
            variable.assign(value)

    class RestoreAsTuneDoes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            classes.engine.restore(str(checkpoint))
            self.model.set_weights(list(classes.engine.get_weights().values()))

    x, y = km.classes_data()
    checkpoint = tmp_path / "checkpoint.npz"
    reset_to_build()
    classes.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    classes.engine.save(str(checkpoint))
    classes.shutdown()
    reset_to_build()  # a new trial's trainer.model: build()'s weights, a fresh Adam
    classes.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[RestoreAsTuneDoes()])
    reference = km.build_classes()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_equal(classes.model.get_weights(), reference.get_weights())
    assert int(classes.model.optimizer.iterations) == int(reference.optimizer.iterations)


def test_backup_and_restore_resumes_an_interrupted_fit_with_the_weights_and_optimizer_state_it_saved(ray_session,
                                                                                                      tmp_path):
    """keras.callbacks.BackupAndRestore as Keras documents it: a fit interrupted as its third epoch begins, then
    the program run again (a new trainer, from build()'s weights and a fresh Adam) resumes at the third epoch with
    the weights and Adam's state saved after the second: the weights equal one uninterrupted one-process fit."""
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    x, y = km.classes_data()
    backup = str(tmp_path / "backup")
    reference = km.build_classes()
    reference.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    with dsgd.KerasTrainer(km.build_classes, num_workers=2) as trainer:
        with pytest.raises(RuntimeError, match="interrupted"):
            trainer.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    with dsgd.KerasTrainer(km.build_classes, num_workers=2) as restarted:
        history = restarted.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0,
                                callbacks=[keras.callbacks.BackupAndRestore(backup)])
        assert len(history.history["loss"]) == 2  # the third and fourth epochs
        assert_weights_equal(restarted.model.get_weights(), reference.get_weights())
        assert_weights_equal(list(restarted.engine.get_weights().values()), reference.get_weights())
        assert int(restarted.model.optimizer.iterations) == int(reference.optimizer.iterations)
    assert not os.path.exists(backup)  # deleted as the fit ended, as Keras does


def test_an_error_a_worker_raises_in_a_step_names_the_worker_and_the_error_and_fit_can_go_on(classes):
    """Labels outside the model's classes: TensorFlow's error on the worker, led by which worker raised what
    (its traceback, which ends with why, follows); a fit with good labels then trains."""
    x, y = km.classes_data()
    with pytest.raises(dsgd.DSGDError, match=r"^failed while waiting for [^:]*step \d+: worker \d \(pid \d+ on "
                                             r"node \w+\) raised InvalidArgumentError:(.|\n)*outside the valid range"):
        classes.fit(x, y + km.CLASSES, batch_size=BATCH, epochs=1, verbose=0)
    history = classes.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_ema_weights_are_finalized_at_the_end_of_fit_and_swapped_in_for_validation_as_keras_does(ray_session):
    """use_ema: the weights after fit are the finalized averages; with SwapEMAWeights the validation, evaluate
    and predict run on the averages (swapped onto trainer.model by the callback, then onto the replicas) and the
    training goes on from the weights, as in one process."""
    x, y = km.binary_data(samples=128)
    target = x @ np.linspace(-1, 1, km.FEATURES).astype(np.float32)
    validation = (x[:64], target[:64])
    reference = km.build_ema()
    expected = reference.fit(x, target, batch_size=32, epochs=3, shuffle=False, verbose=0, validation_data=validation,
                             callbacks=[keras.callbacks.SwapEMAWeights()])
    with dsgd.KerasTrainer(km.build_ema, num_workers=1, devices_per_worker=1) as trainer:
        history = trainer.fit(x, target, batch_size=32, epochs=3, shuffle=False, verbose=0,
                              validation_data=validation, callbacks=[keras.callbacks.SwapEMAWeights()])
        for name, values in expected.history.items():  # the swaps add and subtract: equal to rounding
            assert history.history[name] == pytest.approx(values, rel=1e-4), name
        assert_weights_equal(trainer.model.get_weights(), reference.get_weights(), rtol=1e-4, atol=1e-5)
        assert_weights_equal(list(trainer.engine.get_weights().values()), reference.get_weights(), rtol=1e-4,
                             atol=1e-5)
        swapped = reference.evaluate(*validation, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights()])
        assert trainer.evaluate(*validation, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights()]) == \
            pytest.approx(swapped, rel=1e-4)
        assert_weights_equal(list(trainer.engine.get_weights().values()), reference.get_weights(), rtol=1e-4,
                             atol=1e-5)


# ---- the Keras 3 replica's step against Keras's own train_on_batch (no Ray: a worker in this process) ----------

class ListSource:
    def __init__(self, batches: list):
        self.batches, self.read = batches, 0

    def next(self):
        batch = self.batches[self.read % len(self.batches)]
        self.read += 1
        return batch


def compiled_creator(build, batches: list):
    return lambda worker_index, device_index: CompiledReplica(build(), ListSource(batches), per_step_metrics=True)


def assert_steps_like_keras(build, batches: list, rel: float = 1e-5) -> None:
    """Each step's loss and metrics and the final weights of a dsgd worker of ``build()`` equal Keras's
    ``train_on_batch`` on the same batches."""
    worker = local_worker(compiled_creator(build, batches))
    reference = build()
    for step, batch in enumerate(batches):
        x, y, *weight = batch
        expected = reference.train_on_batch(x, y, sample_weight=weight[0] if weight else None, return_dict=True)
        stats = worker.step(step, fetch_stats=True).floats()
        for name, value in expected.items():
            assert stats[name] == pytest.approx(float(value), rel=rel, abs=1e-6), (step, name)
    assert_weights_equal(list(worker.get_weights().values()), reference.get_weights(), rtol=rel, atol=1e-6)


@pytest.mark.parametrize("kind", ["loss_scale_factor", "loss_scale_optimizer", "mixed_float16"])
def test_a_scaled_loss_trains_as_keras_does(kind):
    x, y = km.binary_data(samples=64)
    target = (x[:, :1] * 2.0).astype(np.float32)
    try:
        if kind == "mixed_float16":
            keras.mixed_precision.set_global_policy("mixed_float16")
        build = functools.partial(km.build_scaled, kind)
        if kind == "mixed_float16":
            assert isinstance(build().optimizer, keras.optimizers.LossScaleOptimizer)  # compile wrapped it
        assert_steps_like_keras(build, [(x[:32], target[:32]), (x[32:], target[32:])] * 2,
                                rel=1e-3 if kind == "mixed_float16" else 1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_masked_padding_is_left_out_of_the_loss_and_accuracy():
    x, y = km.sequence_data()
    assert_steps_like_keras(km.build_masked, [(x[:32], y[:32]), (x[32:], y[32:])])


def test_two_outputs_get_their_own_loss_weights_and_metrics():
    x, y = km.binary_data(samples=64)
    labels = km.two_outputs_labels(x, y)
    first = {k: v[:32] for k, v in labels.items()}
    second = {k: v[32:] for k, v in labels.items()}
    assert_steps_like_keras(km.build_two_outputs, [(x[:32], first), (x[32:], second)])


def test_cosine_similarity_as_a_metric_keeps_its_sign_and_sample_weights_count():
    x, _ = km.binary_data(samples=64)
    y = x[:, :4] * 3.0
    weight = np.linspace(0.0, 1.0, 32).astype(np.float32)
    assert_steps_like_keras(km.build_cosine, [(x[:32], y[:32], weight), (x[32:], y[32:], weight)])


def test_an_overridden_compute_loss_is_what_dsgd_trains():
    x, _ = km.binary_data(samples=64)
    y = x[:, :1]
    assert_steps_like_keras(km.build_own_loss, [(x[:32], y[:32]), (x[32:], y[32:])])


def test_keras_model_compiles_through_keras_int_labels_a_loss_name_and_a_metric_object():
    """KerasModel's own arguments, IMDB's shapes: int32 labels of shape (N,), an output of shape (N, 1)."""
    x, y = km.binary_data(samples=64)

    def net():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((km.FEATURES,)), keras.layers.Dense(1, activation="sigmoid")])

    metrics = ["accuracy", keras.metrics.BinaryAccuracy(threshold=0.7, name="sure")]
    worker = local_worker(lambda w, d: dsgd.KerasModel(net(), loss="binary_crossentropy",
                                                       optimizer=keras.optimizers.SGD(0.1), metrics=metrics,
                                                       batches=[(x, y)]))
    reference = net()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                      metrics=["accuracy", keras.metrics.BinaryAccuracy(threshold=0.7, name="sure")])
    for step in range(2):
        expected = reference.train_on_batch(x, y, return_dict=True)
        stats = worker.step(step, fetch_stats=True).floats()
        for name in ("loss", "accuracy", "sure"):
            assert stats[name] == pytest.approx(float(expected[name]), rel=1e-5), name


def test_keras_model_steps_on_batches_of_text_as_keras_does():
    """dsgd.KerasModel given batches of str, which a TextVectorization in the model turns into tokens: each step's
    loss and accuracy are Keras's train_on_batch's."""
    x, y = km.text_data(samples=64)
    worker = local_worker(lambda w, d: dsgd.KerasModel(km.text_net(), loss="binary_crossentropy",
                                                       optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"],
                                                       batches=[(x, y)]))
    reference = km.text_net()
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy", metrics=["accuracy"])
    for step in range(2):
        expected = reference.train_on_batch(x, y, return_dict=True)
        stats = worker.step(step, fetch_stats=True).floats()
        for name in ("loss", "accuracy"):
            assert stats[name] == pytest.approx(float(expected[name]), rel=1e-5), name


def test_the_epoch_plan_splits_each_global_batch_into_equal_contiguous_parts():
    plan = EpochPlan(num_samples=10, batch_size=4, replicas=2)
    assert plan.steps == 3  # the last batch of 2 rows has one for each replica
    assert [plan.part(None, 0, r) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert [plan.part(None, 2, r) for r in range(2)] == [slice(8, 9), slice(9, 10)]
    assert EpochPlan(num_samples=9, batch_size=4, replicas=2).steps == 2  # a last row alone is left out
    window, walked = EpochPlan(num_samples=32, batch_size=4, replicas=2, steps_per_epoch=3), []
    for _ in range(4):  # 8 batches a pass in epochs of 3: 3, 3, 2, then a new pass
        walked.append((window.first_batch, window.steps))
        window, new_pass = window.following()
        walked.append(new_pass)
    assert walked == [(0, 3), False, (3, 3), False, (6, 2), True, (0, 3), False]
    assert EpochPlan(num_samples=32, batch_size=4, replicas=2, steps_per_epoch=3, first_batch=6).part(None, 1, 1) \
        == slice(30, 32)
    shuffled = EpochPlan(num_samples=10, batch_size=4, replicas=2, shuffle=True, seed=3)
    rows = np.concatenate([shuffled.part(shuffled.order(1), s, r) for s in range(3) for r in range(2)])
    assert sorted(rows) == list(range(10))
    assert not np.array_equal(shuffled.order(1), shuffled.order(2))


def test_a_dataset_feed_goes_on_across_the_epochs_of_one_fit_whose_starts_reach_the_workers_as_copies():
    import cloudpickle
    import tensorflow as tf

    from dsgd.integrations.keras_feed import DatasetStart

    def batches(worker_index, device_index):
        return tf.data.Dataset.from_tensor_slices((np.arange(6.0)[:, None], np.arange(6.0))).batch(2)

    start = DatasetStart(batches, token=1)
    feed = start.feed(None, 0, 0, 1)
    assert feed.next()[1].tolist() == [0.0, 1.0]
    next_epoch = cloudpickle.loads(cloudpickle.dumps(start))  # as foreach_worker sends it
    assert next_epoch.feed(feed, 0, 0, 1) is feed
    assert feed.next()[1].tolist() == [2.0, 3.0]
    assert DatasetStart(batches, token=2).feed(feed, 0, 0, 1) is not feed  # another fit: a new stream
    assert feed.next()[1].tolist() == [4.0, 5.0]
    assert feed.next()[1].tolist() == [0.0, 1.0]  # the dataset ended: a new pass over it, as fit reads one


def test_a_dataset_feed_of_an_empty_dataset_says_so_instead_of_waiting_for_a_batch():
    import tensorflow as tf

    from dsgd.integrations.keras_feed import DatasetStart

    def batches(worker_index, device_index):
        return tf.data.Dataset.from_tensor_slices((np.zeros((0, 1)), np.zeros(0))).batch(2)

    feed = DatasetStart(batches, token=1).feed(None, 1, 0, 1)
    with pytest.raises(ValueError, match="the dataset of worker 1, device 0 has no batches"):
        feed.next()


# ---- a Ray Dataset as input ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows(ray_session) -> Iterator[tuple[dsgd.KerasTrainer, object]]:
    """``km.build_rows`` on 2 workers and ``km.rows_data()`` as a Ray Dataset (columns x, y), which the trainer's
    first fit gives its engine."""
    ray_data = pytest.importorskip("ray.data", reason="Ray Data is the optional extra dsgd[data]")
    ray_data.DataContext.get_current().enable_progress_bars = False
    x, y = km.rows_data()
    dataset = ray_data.from_items([{"x": x[i], "y": y[i]} for i in range(len(x))])
    with dsgd.KerasTrainer(km.build_rows, num_workers=2) as trainer:
        yield trainer, dataset


def test_a_ray_dataset_split_over_the_replicas_trains_full_batches_as_one_process(rows):
    trainer, dataset = rows
    x, y = km.rows_data()
    reference = km.build_rows()
    expected = reference.fit(x, y, batch_size=len(x), epochs=3, shuffle=False, verbose=0)
    trainer.model.set_weights(km.build_rows().get_weights())
    # One global batch an epoch: whatever rows each replica's split holds, their mean gradient is the batch's.
    history = trainer.fit(dataset, label_columns="y", batch_size=len(x), epochs=3, verbose=0)
    for name in ("loss", "label_sum", "label_squares"):
        assert history.history[name] == pytest.approx(expected.history[name], rel=1e-5), name
    assert_weights_equal(trainer.model.get_weights(), reference.get_weights())


def test_every_epoch_of_a_ray_dataset_reads_each_row_once_and_evaluate_reads_it_on_the_workers(rows):
    trainer, dataset = rows
    x, y = km.rows_data()
    history = trainer.fit(dataset, label_columns="y", feature_columns="x", batch_size=BATCH, epochs=2, verbose=0,
                          validation_data=dataset)
    for prefix in ("", "val_"):
        assert history.history[f"{prefix}label_sum"] == pytest.approx([y.sum()] * 2, rel=1e-6), prefix
        assert history.history[f"{prefix}label_squares"] == pytest.approx([(y ** 2).sum()] * 2, rel=1e-5), prefix
    expected = trainer.model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    before = known_actors()
    assert_logs_equal(trainer.evaluate(dataset, label_columns="y", batch_size=BATCH, return_dict=True,
                                       verbose=0), expected)
    assert_weights_equal(trainer.engine.get_weights().values(), trainer.model.get_weights())
    assert_replicas_identical(trainer.engine, 2)
    # The evaluation's split of the dataset (its coordinator actor) ends with it: an epoch's validation leaks none.
    deadline = time.monotonic() + 60
    while True:
        split = [state for name, state in actors_started_since(before) if name == "SplitCoordinator"]
        if split == ["DEAD"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert split == ["DEAD"], split


def test_a_ray_dataset_trainer_names_what_its_engine_reads_and_what_a_dataset_needs(rows):
    trainer, dataset = rows
    x, y = km.rows_data()
    with pytest.raises(ValueError, match="label_columns="):
        trainer.fit(dataset, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"columns \['x', 'y'\]; no column 'label'"):
        trainer.fit(dataset, label_columns="label", batch_size=BATCH)
    with pytest.raises(ValueError, match="reads the Ray Dataset the fit that started it gave.*trainer.shutdown"):
        trainer.fit(x, y, batch_size=BATCH)
    with pytest.raises(ValueError, match="give no y"):
        trainer.fit(dataset, y, label_columns="y", batch_size=BATCH)
    with pytest.raises(TypeError, match="map_batches"):
        trainer.predict(dataset)

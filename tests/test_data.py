"""Ray Data input: DistributedSGD(datasets=...) and dsgd.get_dataset_shard."""

import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

import dsgd
import data_test_models as dm
from dsgd.integrations.data import ShardedModelCreator
from dsgd_test_models import Gate, actor_pids, assert_replicas_identical, kill, modules_a_user_imports

ray_data = pytest.importorskip("ray.data", reason="Ray Data is the optional extra dsgd[data]")

ROWS = 203  # not a multiple of the replicas: equal splits leave some rows out
STEPS_PER_EPOCH = ROWS // 4 // dm.BATCH  # row_ids' 2 x 2 replicas: 50 rows each, batches of 10


@pytest.fixture(scope="module", autouse=True)
def quiet_ray_data(ray_session):
    ray_data.DataContext.get_current().enable_progress_bars = False


def engine(creator, datasets, **kwargs):
    kwargs = {"strategy": "ps", "timeout_s": 120, "startup_timeout_s": 120, **kwargs}
    return dsgd.DistributedSGD(creator, datasets=datasets, **kwargs)


@pytest.fixture(scope="module")
def die_flag(tmp_path_factory) -> Path:
    """Worker 1 of ``row_ids``'s engine dies at its next epoch's start while this file is missing (and makes it)."""
    return tmp_path_factory.mktemp("row_ids") / "died"


@pytest.fixture(scope="module")
def row_id_engine(ray_session, die_flag):
    die_flag.touch()
    with engine(dm.row_id_creator(ROWS, die_flag=str(die_flag)), {"train": ray_data.range(ROWS)}, num_workers=2,
                devices_per_worker=2) as sgd:
        yield sgd


@pytest.fixture
def row_ids(row_id_engine, die_flag) -> dsgd.DistributedSGD:
    """The module's engine of RowIdRegression replicas over ``range(ROWS)``: 2 workers x 2 devices, none set to die.
    Its splits are where the tests before left them (``finish_epoch``)."""
    die_flag.touch()
    if row_id_engine.num_workers != 2:
        row_id_engine.resize(2)
    return row_id_engine


def finish_epoch(sgd) -> int:
    """Step ``row_ids``' engine until its replicas have read their splits' current epoch to its end (none if none
    begun): the next step begins a new one. How many epochs the replicas have begun."""
    seen = sgd.for_model(lambda model: model.seen)
    for _ in range(STEPS_PER_EPOCH - len(seen[-1]) // dm.BATCH if seen else 0):
        sgd.step()
    return len(seen)


def test_every_epoch_splits_the_rows_disjoint_and_equal_over_all_replicas(row_ids):
    sgd = row_ids
    begun = finish_epoch(sgd)
    for _ in range(2 * STEPS_PER_EPOCH + 1):
        sgd.step()
    seen = [s[begun:] for s in sgd.foreach_model(lambda model: model.seen)]
    assert [len(s) for s in seen] == [3] * 4  # two whole epochs read, the third begun
    for epoch in range(2):
        dm.assert_disjoint_equal_cover([s[epoch] for s in seen], ROWS)
        assert all(len(s[epoch]) == STEPS_PER_EPOCH * dm.BATCH for s in seen)
    assert all(len(s[2]) == dm.BATCH for s in seen)
    assert_replicas_identical(sgd, 4)


def test_a_model_that_reads_its_first_batch_at_build_gets_every_replicas_own_rows_on_two_devices(ray_session):
    """A TF2Model, whose first ``get_batch()`` dsgd asks while it builds the replicas one after another: each
    replica's first read waits for the epoch's start, which Ray Data holds until every replica has asked. Each
    replica reads its own split, and every step trains on the batches read, the first at build."""
    rows = 80  # 4 replicas x 20 rows: 2 steps an epoch
    with engine(dm.row_id_tf2_creator(rows), {"train": ray_data.range(rows)}, num_workers=2, devices_per_worker=2,
                startup_timeout_s=60) as sgd:  # without the epochs asked ahead: a DSGDTimeoutError here
        for _ in range(3):
            sgd.step()
        seen = sgd.foreach_model(lambda model: model.split.seen)
        assert [[len(ids) for ids in s] for s in seen] == [[2 * dm.BATCH, dm.BATCH]] * 4
        dm.assert_disjoint_equal_cover([s[0] for s in seen], rows)
        w = np.zeros(2)
        for step in range(3):  # step k: each replica's k-th batch
            w = dm.numpy_step(w, [(s[0] + s[1])[step * dm.BATCH:(step + 1) * dm.BATCH] for s in seen], rows)
        np.testing.assert_allclose(sgd.get_weights()["w"], w, rtol=1e-5)
        assert_replicas_identical(sgd, 4)


def test_keras_model_trains_on_its_split_and_replicas_stay_identical(ray_session):
    """Every epoch, the 2 replicas read disjoint halves of the 240 rows that cover them all."""
    with engine(dm.keras_creator, {"train": dm.xy_dataset(240)}, num_workers=2, devices_per_worker=1, strategy="simple") as sgd:
        first = sgd.step(fetch_stats=True)
        for _ in range(40):  # 3 epochs of 12 batches per replica, and a bit
            stats = sgd.step(fetch_stats=True)
        assert stats["loss"] < first["loss"]
        assert stats["accuracy"] > 0.8
        assert sgd.foreach_model(lambda model: model.epoch) == [3, 3]
        seen = sgd.foreach_model(lambda model: model.rows.seen)
        assert [[len(ids) for ids in s] for s in seen] == [[120, 120, 120, 5 * dm.BATCH]] * 2
        for epoch in range(3):
            dm.assert_disjoint_equal_cover([s[epoch] for s in seen], 240)
        assert_replicas_identical(sgd, 2)


def test_after_a_worker_is_replaced_every_replica_reads_a_new_split_from_the_state_it_had(row_ids, caplog):
    caplog.set_level(logging.WARNING, logger="dsgd")
    sgd = row_ids
    sgd.step()
    before = sgd.get_weights()["w"]
    kill(sgd.workers[1])
    sgd.step(fetch_stats=True)  # fails, recovers, and is run again on the replicas' new splits
    assert "worker 1 is dead" in caplog.text
    seen = sgd.foreach_model(lambda model: model.seen)
    assert [[len(ids) for ids in s] for s in seen] == [[dm.BATCH]] * 4  # every replica was rebuilt
    # The survivor kept its weights through its rebuild: one step from them.
    np.testing.assert_allclose(sgd.get_weights()["w"], dm.numpy_step(before, [s[0] for s in seen], ROWS), rtol=1e-5)
    for _ in range(STEPS_PER_EPOCH + 1):  # through the end of the new epoch and into the next
        sgd.step()
    seen = sgd.foreach_model(lambda model: model.seen)
    dm.assert_disjoint_equal_cover([s[0] for s in seen], ROWS)
    assert [len(s[0]) for s in seen] == [STEPS_PER_EPOCH * dm.BATCH] * 4
    assert [len(s[1]) for s in seen] == [2 * dm.BATCH] * 4
    assert_replicas_identical(sgd, 4)


@pytest.mark.slow  # the suite's time budget (19 s); a replaced worker's split by default: the state-it-had test
def test_a_worker_lost_at_an_epochs_start_does_not_leave_the_survivor_waiting_for_it(row_ids, die_flag):
    """Worker 1 dies before asking for its next epoch; worker 0 waits in Ray's epoch barrier until recovery."""
    sgd = row_ids
    sgd.step()  # an epoch begun
    finish_epoch(sgd)
    failures = sgd.failures
    die_flag.unlink()
    stats = sgd.step(fetch_stats=True)  # worker 1 dies here
    assert die_flag.exists() and np.isfinite(stats["loss"]) and sgd.failures == failures + 1
    for _ in range(STEPS_PER_EPOCH):
        sgd.step()
    seen = sgd.foreach_model(lambda model: model.seen)
    dm.assert_disjoint_equal_cover([s[0] for s in seen], ROWS)
    assert_replicas_identical(sgd, 4)


@pytest.fixture
def driver_reads(monkeypatch) -> list[str]:
    """Every call, in this process (the driver's), of a method of a Ray Dataset or DataIterator that would bring
    its rows here (iterate, take, convert, materialize) or split it: recorded, and refused."""
    calls = []

    def refused(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"the driver called {name}")
        return call

    for cls in (ray_data.Dataset, ray_data.DataIterator):
        for name in dir(cls):
            if name.startswith(("iter", "take", "to_", "split", "streaming_split", "train_test_split",
                                "streaming_train_test_split", "materialize", "show", "get_internal_block_refs")):
                monkeypatch.setattr(cls, name, refused(f"{cls.__name__}.{name}"))
    return calls


def test_with_a_ray_dataset_every_replica_reads_a_new_split_after_a_resize(row_ids, driver_reads):
    """2 -> 3 -> 1 workers of 2 devices. The rows never reach the driver: it neither splits the dataset (each
    resize splits it anew) nor reads a row of it (``driver_reads``)."""
    sgd = row_ids
    sgd.step()
    pids = actor_pids(*sgd.workers)
    sgd.resize(3)
    assert actor_pids(*sgd.workers[:2]) == pids
    before = sgd.get_weights()["w"]
    sgd.step()
    first_batches = [seen[0] for seen in sgd.foreach_model(lambda model: model.seen)]
    assert [len(ids) for ids in first_batches] == [dm.BATCH] * 6  # every replica started a new split
    np.testing.assert_allclose(sgd.get_weights()["w"], dm.numpy_step(before, first_batches, ROWS), rtol=1e-5)
    for _ in range(3):  # the rest of the epoch: 33 rows, in batches of 10, 10, 10 and 3
        sgd.step()
    seen = [s[0] for s in sgd.foreach_model(lambda model: model.seen)]
    assert [len(s) for s in seen] == [ROWS // 6] * 6
    dm.assert_disjoint_equal_cover(seen, ROWS)
    sgd.resize(1)
    for _ in range(2):
        stats = sgd.step(fetch_stats=True)
    assert stats["num_replicas"] == 2
    assert [len(s[0]) for s in sgd.foreach_model(lambda model: model.seen)] == [2 * dm.BATCH] * 2
    assert driver_reads == []


@pytest.mark.slow  # the suite's time budget (32 s); Ray Data with a backup worker by default: test 43 of
# docs/features.md (test_features_together[tf1])
def test_a_backup_worker_that_catches_up_reads_its_batch_so_the_next_epoch_does_not_wait_for_it(ray_session,
                                                                                                  tmp_path):
    """Worker 2 is held at a gate once it has read its first batch, while the others take two steps without it
    (their whole first epoch); let go, it catches up on the second without computing it, but reads (and drops)
    that step's batch: a split starts an epoch only once every replica has asked for it, so a worker a batch
    short would hold the others there (the step's quorum never met: a timeout)."""
    rows = 60  # 3 replicas x 20 rows: 2 steps an epoch
    gate = Gate(str(tmp_path / "gate"))
    gate.close()
    with engine(dm.row_id_creator(rows, held=gate), {"train": ray_data.range(rows)}, num_workers=3,
                backup_workers=1, timeout_s=30) as sgd:
        for _ in range(2):
            assert sgd.step(fetch_stats=True)["dropped_gradients"] == 1
            gate.wait_arrived()  # worker 2 is still at the gate: the step closed without it
        gate.open()
        for _ in range(4):  # the second and third epochs
            sgd.step()
        seen = sgd.foreach_model(lambda model: model.seen)
        assert [len(s) for s in seen] == [3] * 3
        for epoch in range(3):
            dm.assert_disjoint_equal_cover([s[epoch] for s in seen], rows)
        assert_replicas_identical(sgd, 3)


def test_unknown_name_says_which_datasets_there_are(ray_session):
    with pytest.raises(dsgd.ModelCreatorError, match=r"no dataset named 'test'.*datasets \['train'\]"):
        engine(dm.asks_for("test"), {"train": ray_data.range(8)}, num_workers=1)


def test_missing_datasets_says_to_pass_them():
    """On the creator a worker is given without datasets=, in this process (the error reaches the driver as the
    test above's does)."""
    create = ShardedModelCreator(dm.asks_for("train"), None)
    with pytest.raises(ValueError, match=r"given no datasets; pass DistributedSGD\(\.\.\., datasets="):
        create(0, 0)


def test_outside_model_creator_is_refused():
    with pytest.raises(RuntimeError, match="called outside model_creator; call it inside model_creator"):
        dsgd.get_dataset_shard("train")


@pytest.mark.parametrize("datasets, message", [
    ([1, 2], "datasets must be a dict of name -> ray.data.Dataset"),
    ({}, "names no dataset"),
    ({"train": [1, 2, 3]}, r"datasets\['train'\] must be a ray.data.Dataset, got list"),
    ({0: None}, "datasets keys must be names"),
])
def test_datasets_that_are_not_a_dict_of_datasets_are_refused(datasets, message):
    with pytest.raises(ValueError, match=message):
        dsgd.DistributedSGD(dm.keras_creator, datasets=datasets)


def test_importing_dsgd_does_not_import_ray_data():
    assert "ray.data" not in modules_a_user_imports()


@pytest.mark.slow  # a full run of an example (the suite's time budget: 70 s); Keras 3 on Ray Data is
# test_features_together's Tune trial, the example's model test_tf2's README model
def test_keras_example_trains_on_its_ray_dataset_at_reduced_steps(ray_session):
    """examples/mnist_keras.py as a user runs it on a running cluster (this session's), on the offline digits,
    60 steps. (test_output runs examples/mnist.py, which starts its own Ray as the Keras example does.)"""
    example = Path(__file__).resolve().parent.parent / "examples" / "mnist_keras.py"
    out = subprocess.run([sys.executable, str(example), "--steps", "60", "--log-every", "30",
                          "--address", ray.get_runtime_context().gcs_address],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    # The last step's batch accuracy (training mode) shows the replicas learned: 0.98 in three runs by hand.
    *_, trained = re.findall(r"60/60 .*accuracy ([0-9.]+)", out.stdout + out.stderr)
    assert float(trained) > 0.75
    # The test set runs in inference mode, on batch norm's moving statistics, which after 60 steps (momentum
    # 0.99) have gone 45 % of the way from their start: 0.84-0.92 in three runs, 0.42 once. Ten classes: chance 0.1.
    accuracy = float(re.search(r"test accuracy ([0-9.]+) after 60 steps", out.stdout).group(1))
    assert accuracy > 0.25
    # Its batch-norm layers build through a deprecated TensorFlow call; the workers keep that quiet.
    assert "is deprecated" not in out.stdout + out.stderr, out.stderr[-3000:]

"""Models written for Ray 0.6's DistributedSGD train on dsgd (SPEC: "Scripts written for Ray 0.6").

Local variables (a cached batch, tf.compat.v1.metrics counters) are
initialized and stay each replica's own; get_metrics() may return numbers
the model evaluated itself; save_checkpoint/restore_checkpoint are the Ray
0.6 names for a checkpoint directory.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import dsgd
from dsgd_test_models import assert_replicas_identical, local_worker
from ray06_test_models import (BATCH, LR, SLOPE, CachedBatchNet, EvaluatedMetricsNet, LateWeightNormNet,
                               ListMetricsNet, MixedMetricsNet, StringMetricNet)

STEPS = 20
WEIGHT_NAMES = {"dense/w", "dense/b"}


def flat(weights: dict) -> np.ndarray:
    """get_weights() in the order the models' flat-weights helper uses ([w, b])."""
    return np.concatenate([np.ravel(weights["dense/w"]), np.ravel(weights["dense/b"])])


def cached_batch_engine(strategy: str) -> dsgd.DistributedSGD:
    return dsgd.DistributedSGD(CachedBatchNet, num_workers=2, devices_per_worker=1, strategy=strategy)


@pytest.fixture(scope="module")
def simple_cached_batch_engine(ray_session):
    """A "simple" engine of CachedBatchNet, shared with the checkpoint-directory test, which does not step it."""
    with cached_batch_engine("simple") as sgd:
        yield sgd


@pytest.mark.parametrize("strategy", ["simple", "ps"])
def test_cached_batch_model_trains_and_checkpoints(request, tmp_path, strategy):
    with contextlib.ExitStack() as own:
        if strategy == "simple":
            sgd = request.getfixturevalue("simple_cached_batch_engine")
        else:
            sgd = own.enter_context(cached_batch_engine(strategy))
        first = sgd.step(fetch_stats=True)
        for _ in range(STEPS - 2):
            sgd.step()
        last = sgd.step(fetch_stats=True)
        assert last["loss"] < first["loss"]
        assert 0.0 <= last["accuracy"] <= 1.0

        # Local variables are neither weights nor identical across replicas.
        assert set(sgd.get_weights()) == WEIGHT_NAMES
        assert_replicas_identical(sgd, 2)
        cached = sgd.foreach_model(lambda m: m.cached.eval())
        assert not np.array_equal(cached[0], cached[1])
        # The accuracy's update runs with the stats: two steps fetched them.
        assert sgd.foreach_model(lambda m: m.metric_counts()) == [2 * BATCH] * 2

        # A helper built from the default session in model_creator, and the optional hooks.
        flats = sgd.foreach_model(lambda m: m.variables.get_flat())
        assert np.array_equal(flats[0], flats[1])
        assert np.array_equal(flats[0], flat(sgd.get_weights()))
        assert np.array_equal(sgd.for_model(lambda m: m.get_weights()), flats[0])

        directory = tmp_path / "checkpoint"  # does not exist yet: save_checkpoint creates it
        written = sgd.save_checkpoint(str(directory))
        saved = sgd.get_weights()
        for _ in range(3):
            sgd.step()
        assert not np.array_equal(sgd.get_weights()["dense/w"], saved["dense/w"])
        sgd.restore_checkpoint(str(directory))
        restored = sgd.get_weights()
        assert all(np.array_equal(restored[k], saved[k]) for k in WEIGHT_NAMES)
        assert_replicas_identical(sgd, 2)
        assert np.isfinite(sgd.step(fetch_stats=True)["loss"])

    with np.load(written) as f:
        stored = [k for k in f.files if k != "__meta__"]
    assert stored and not [k for k in stored if "cached_batch" in k or "train_accuracy" in k]


def test_get_metrics_that_evaluates_returns_numbers(ray_session):
    with dsgd.DistributedSGD(EvaluatedMetricsNet, num_workers=2, devices_per_worker=1, strategy="ps") as sgd:
        for _ in range(5):
            stats = sgd.step(fetch_stats=True)
        assert "test_accuracy" not in stats and np.isfinite(stats["loss"])
        metrics = sgd.foreach_model(lambda m: m.get_metrics())
        accuracies = [m["test_accuracy"] for m in metrics]
        assert all(0.0 <= a <= 1.0 for a in accuracies)
        assert len(set(accuracies)) == 1  # identical replicas score identically
        assert sgd.for_model(lambda m: m.get_metrics()) == metrics[0]


def test_metric_tensors_are_stats_and_numbers_are_not():
    worker = local_worker(MixedMetricsNet)
    assert worker.runtime.signature.metrics == ("accuracy",)
    stats = worker.step(0, fetch_stats=True).floats()
    assert 0.0 <= stats["accuracy"] <= 1.0 and "test_accuracy" not in stats
    assert set(worker.get_weights()) == WEIGHT_NAMES


def test_a_metric_that_reads_a_weight_is_computed_before_the_apply_writes_it():
    """A fused step (compute and apply in one session run) fetching stats: the apply waits for the metric tensors,
    so a metric that reads a variable sees the weights its step's loss saw, not the ones the apply wrote."""
    worker = local_worker(LateWeightNormNet)
    for k in range(6):
        stats = worker.step(k, fetch_stats=True).floats()
        assert stats["weight_sum"] == pytest.approx(LateWeightNormNet.W0.sum() - k * LR * SLOPE.sum()), k
    assert worker.get_weights()["w"] == pytest.approx(LateWeightNormNet.W0 - 6 * LR * SLOPE)


def test_metrics_neither_tensors_nor_numbers_are_refused_by_name():
    with pytest.raises(dsgd.ModelCreatorError,
                       match=r"get_metrics\(\) entry 'accuracy' must be a scalar tensor .* or a number .*got str \('high'\)"):
        local_worker(StringMetricNet)
    with pytest.raises(dsgd.ModelCreatorError, match=r"get_metrics\(\) must return a dict .*got list"):
        local_worker(ListMetricsNet)


def test_save_checkpoint_needs_a_directory(simple_cached_batch_engine, tmp_path):
    sgd = simple_cached_batch_engine
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="save_checkpoint expects a directory, got the file"):
        sgd.save_checkpoint(str(file))
    with pytest.raises(FileNotFoundError, match="restore_checkpoint expects a directory"):
        sgd.restore_checkpoint(str(tmp_path / "missing"))

"""The SPEC's features together in one engine, for every kind of model (the feature matrix, docs/features.md).

Each run is one elastic engine, ``num_workers=(2, 3)`` of 2 devices, with
``nan_policy="skip"`` and a TensorBoard ``logdir``; the "ps" runs add bf16
partitions and a backup worker, and the runs of a TF1 ``dsgd.Model`` and of a
``dsgd.TF2Model`` read a Ray Dataset. It goes through a traced step, a step
whose mean is not finite, a checkpoint, a killed worker, a shrink, a restore
and a grow back, and after each the replicas are bit-identical. A Ray Tune
trial takes every feature a trial can (not a resize: its placement group
fixes the workers), for each Keras. Runs that show a defect not fixed yet
are marked ``xfail`` (strict: they fail once it is fixed, to be unmarked).
"""

import ast
import functools
import logging
import re
from pathlib import Path

import numpy as np
import pytest

import data_test_models as dm
import dsgd
import keras_test_models as km
import tf2_test_models as m
from dsgd_test_models import assert_replicas_identical, kill, ps_actors, server_group
from readers import load_trace, read_scalars
from tune_test_models import final_state, run

ray_data = pytest.importorskip("ray.data", reason="Ray Data is the optional extra dsgd[data]")

TESTS = Path(__file__).resolve().parent
DEVICES = 2
ROWS = 600  # ray.data.range(ROWS): 10 steps an epoch for 6 replicas
INTERVAL_S = 3600.0  # resize_interval_s: the test moves the engine's clock, not the wall clock

# run -> (model_creator, strategy, whether its models read a Ray Dataset)
RUNS = {
    "tf1": (dm.row_id_creator(ROWS), "ps", True),
    "tf1-simple": (dm.row_id_creator(ROWS), "simple", True),
    "tf_keras": (km.dense_creator, "ps", False),
    "keras3": (m.keras_creator("sequential", "sgd"), "ps", False),
    "tf2": (dm.row_id_tf2_creator(ROWS), "ps", True),
}

# run -> what one worker pushes in a "ps" step: its gradients (and Keras 3's moving statistics) in one partition,
# last layer first, each variable from a 64-byte boundary (16 values), as bf16, 2 bytes a value
BF16_SENT_BYTES = {
    "tf1": 2 * 2,  # RowIdRegression's w (2)
    "tf_keras": 2 * (1 + 15 + 4 + 12 + 4 + 12 + 12),  # dense_net: Dense(1)'s bias and kernel (4 x 1), Dense(4)'s
                                                      # bias and kernel (3 x 4), with their gaps
    "keras3": 2 * (3 + 13 + 16 * 3 + 16 + 16 + 16 + 6 * 16 + 16 + 16),  # Dense(3)'s bias, kernel (16 x 3); batch
                                         # normalization's beta, gamma; Dense(16)'s bias, kernel (6 x 16); the
                                         # moving mean and variance
    "tf2": 2 * 2,  # RowIdTF2Regression's w (2)
}


def a_kernel(weights: dict) -> str:
    """The name of a trainable weight every forward pass reads."""
    return next(name for name in sorted(weights) if name.split("/")[-1] in ("kernel", "w"))


@pytest.mark.parametrize("run", [
    "tf1",
    pytest.param("tf1-simple", marks=pytest.mark.slow),  # each run takes 20 to 60 s: one in the default suite
    pytest.param("tf_keras", marks=pytest.mark.slow),
    pytest.param("keras3", marks=pytest.mark.slow),
    pytest.param("tf2", marks=pytest.mark.slow),
])
def test_every_feature_in_one_elastic_engine_keeps_the_replicas_identical(ray_session, tmp_path, caplog, run):
    caplog.set_level(logging.WARNING, logger="dsgd")
    ray_data.DataContext.get_current().enable_progress_bars = False
    creator, strategy, reads_data = RUNS[run]
    ps = strategy == "ps"
    options = dict(compression="bf16", backup_workers=1) if ps else {}
    if reads_data:
        options["datasets"] = {"train": ray_data.range(ROWS)}
    fetched = []  # num_replicas of every step whose stats were fetched, as the TensorBoard logdir should hold them

    def step(sgd, **kwargs) -> dict:
        stats = sgd.step(fetch_stats=True, **kwargs)
        fetched.append(stats["num_replicas"])
        return stats

    def replicas_averaged(workers: int) -> int:  # a "ps" step averages all workers but the backup one
        return (workers - 1 if ps else workers) * DEVICES

    with dsgd.DistributedSGD(creator, num_workers=(2, 3), devices_per_worker=DEVICES, strategy=strategy,
                             nan_policy="skip", logdir=str(tmp_path / "logs"), resize_interval_s=INTERVAL_S,
                             timeout_s=120, startup_timeout_s=300, **options) as sgd:
        assert sgd.num_workers == 3  # the session's Ray has room for the maximum

        # A traced step: every worker and parameter server on the trace; "ps": 16-bit partitions, one dropped.
        stats = step(sgd, write_timeline=str(tmp_path / "step.json"))
        processes, _ = load_trace(tmp_path / "step.json")
        every_actor = sorted(["driver"] + [f"worker {w}" for w in range(3)]
                             + [f"parameter server {j}" for j in range(len(ps_actors(sgd)))])
        assert sorted(processes.values()) == every_actor
        assert stats["num_replicas"] == replicas_averaged(3)
        if ps:
            layout = server_group(sgd).layout
            assert all(partition.wire_nbytes * 2 == partition.nbytes for partition in layout)
            assert stats["sent_bytes"] == BF16_SENT_BYTES[run]
            assert stats["dropped_gradients"] >= 1
        assert_replicas_identical(sgd, 3 * DEVICES)

        # A weight made NaN: the step's mean is not finite, so every replica skips it (a backup worker that
        # catches up on it too). The step is traced: the skipped step's trace holds every actor's spans.
        good = sgd.get_weights()
        poisoned = {**good, a_kernel(good): np.full_like(good[a_kernel(good)], np.nan)}
        sgd.set_weights(poisoned)
        step(sgd, write_timeline=str(tmp_path / "skipped.json"))
        assert "skipped a step (nan_policy='skip')" in caplog.text
        after = sgd.get_weights()
        assert all(np.array_equal(after[k], poisoned[k], equal_nan=True) for k in poisoned)
        processes, spans = load_trace(tmp_path / "skipped.json")
        assert sorted(processes.values()) == every_actor and all(spans[name] for name in every_actor)
        sgd.set_weights(good)

        # A checkpoint, then a killed worker: replaced (there is room), the replicas identical.
        step(sgd)
        sgd.save(str(tmp_path / "ckpt"))
        saved, saved_steps = sgd.get_weights(), sgd.num_steps
        kill(sgd.workers[1])
        for _ in range(3):  # with a backup worker the steps go on without it; it is replaced before one of them
            assert np.isfinite(step(sgd)["loss"])
        assert sgd.failures == 1 and sgd.num_workers == 3
        assert_replicas_identical(sgd, 3 * DEVICES)

        # A shrink, a restore of the checkpoint taken at 3 workers, a grow back once resize_interval_s has passed.
        sgd.resize(2)
        assert step(sgd)["num_replicas"] == replicas_averaged(2)
        assert_replicas_identical(sgd, 2 * DEVICES)
        sgd.restore(str(tmp_path / "ckpt"))
        assert sgd.num_steps == saved_steps
        restored = sgd.get_weights()
        assert all(np.array_equal(restored[k], saved[k]) for k in saved)
        sgd._ledger.resizer._last_look -= INTERVAL_S
        assert step(sgd)["num_replicas"] == replicas_averaged(3) and sgd.num_workers == 3
        assert_replicas_identical(sgd, 3 * DEVICES)
    assert [value for _, value, _ in read_scalars(tmp_path / "logs")["num_replicas"]] == fetched


def tune_model_creator(config: dict):
    """A Tune config -> a model_creator of its "kind" of Keras classifier reading dataset "train", every replica's
    first batch NaN."""
    creator = {"tf_keras": dm.keras_creator, "keras3": dm.keras3_creator}[config["kind"]]
    return functools.partial(creator, first_batch_nan=True)


@pytest.mark.slow
def test_a_tune_trial_reads_ray_data_with_bf16_a_backup_worker_and_skips_a_non_finite_step(ray_session, tmp_path):
    """Two trials at once, a tf_keras and a Keras 3 model: 2 workers of 2 devices reading a Ray Dataset, "ps" with
    bf16 partitions and one backup worker, a TensorBoard logdir each. Every replica's first batch is NaN: under
    nan_policy="skip" that step is skipped on every replica (applied, the weights would be NaN; raised, the trial
    would fail)."""
    from ray import tune

    import dsgd.tune as dsgd_tune

    trainable = dsgd_tune.trainable(tune_model_creator, steps_per_report=3, num_workers=2, devices_per_worker=DEVICES,
                                    strategy="ps", compression="bf16", backup_workers=1, nan_policy="skip",
                                    datasets={"train": dm.xy_dataset()}, timeout_s=120, startup_timeout_s=300)
    results = run(trainable, {"kind": tune.grid_search(["tf_keras", "keras3"]),
                              "logdir": tune.sample_from(lambda spec: str(tmp_path / spec.config.kind))},
                  tmp_path, iterations=2)
    assert sorted(r.config["kind"] for r in results) == ["keras3", "tf_keras"]
    for result in results:
        history = result.metrics_dataframe.sort_values("training_iteration")
        assert list(history["num_steps"]) == [3, 6]
        # each step averages the first worker's 2 replicas, and drops the other worker's
        assert list(history["num_replicas"]) == [2, 2] and list(history["dropped_gradients"]) == [1, 1]
        assert np.isfinite(history["loss"]).all()
        weights = {k: v for k, v in final_state(result).items() if k.startswith("weights/")}
        assert weights and all(np.isfinite(v).all() for v in weights.values())
        assert [step for step, _, _ in read_scalars(tmp_path / result.config["kind"])["num_replicas"]] == [2, 5]


def test_the_feature_matrix_cites_tests_that_exist_and_lists_every_number_it_uses():
    """docs/features.md: every test it names (``tests/<file>::<function>[<run>]``) is a test function of that file
    (a run of this file's parametrized test), and every number in its table is a row of its list of tests."""
    page = (TESTS.parent / "docs" / "features.md").read_text()
    cited = set(re.findall(r"`tests/(\w+\.py)::(\w+)(?:\[([\w-]+)\])?`", page))
    assert len(cited) > 40
    for file, name, run_name in cited:
        functions = {node.name for node in ast.parse((TESTS / file).read_text()).body
                     if isinstance(node, ast.FunctionDef)}
        assert name in functions, f"docs/features.md cites tests/{file}::{name}, which does not exist"
        assert not run_name or (file == Path(__file__).name and run_name in RUNS), f"{file}::{name}[{run_name}]"
    listed = re.findall(r"^\| (\d+) \| `tests/", page, re.MULTILINE)
    assert listed == [str(i) for i in range(1, len(listed) + 1)]
    matrix = [line for line in page.splitlines() if line.startswith("| **")]
    assert len(matrix) == 18  # 19 features, each pair once
    numbers = {cell.strip() for line in matrix for cell in line.split("|")[2:] if cell.strip().isdigit()}
    assert numbers <= set(listed) and len(numbers) > 40

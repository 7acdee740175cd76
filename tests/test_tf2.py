"""The TF2 way: Keras 3 models and dsgd.TF2Model, against an eager single-process reference."""

import contextlib
import dataclasses
import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import ray
import tensorflow as tf

import dsgd
import tf2_test_models as m
from dsgd.cluster import room
from dsgd.worker.tf2.runtime import Tf2Runtime
from dsgd_test_models import (actor_pids, assert_replicas_identical, assert_warmup_and_a_skipped_step_change_nothing, kill,
                              local_worker, ps_actors)

STEPS = 3
SHARED_KERAS3 = ("sequential", "adam", "ps", 2)  # (net, optimizer, strategy, devices) of the engine keras3_engine holds


@dataclasses.dataclass(frozen=True)
class SharedEngine:
    """An engine several tests use, and a checkpoint of its state before its first step."""

    sgd: dsgd.DistributedSGD
    start: str

    def restart(self) -> int:
        """Back to the start's weights and optimizer state; the step (``m.batch``'s) whose batches the replicas
        read next. Their batches go on from where they are: ``batches_read`` counts the batch a replica reads when
        built, which the fixture's first step took."""
        self.sgd.restore(self.start)
        [read] = set(self.sgd.foreach_model(lambda mm: mm.batches_read))
        return read


@pytest.fixture(scope="module")
def keras3_engine(ray_session, tmp_path_factory) -> Iterator[SharedEngine]:
    """The Keras 3 Sequential with batch normalization and Adam on 2 workers x 2 devices, "ps", nan_policy="skip"
    (``SHARED_KERAS3``), for the tests of that configuration."""
    net_name, optimizer_name, strategy, devices = SHARED_KERAS3
    with dsgd.DistributedSGD(m.keras_creator(net_name, optimizer_name), num_workers=2, devices_per_worker=devices,
                             strategy=strategy, nan_policy="skip") as sgd:
        start = str(tmp_path_factory.mktemp("keras3") / "start")
        sgd.save(start)
        sgd.step()
        yield SharedEngine(sgd, start)


def replicas(workers: int, devices: int) -> list[tuple[int, int]]:
    return [(w, d) for w in range(workers) for d in range(devices)]


def run_against_reference(sgd, net_name: str, optimizer_name: str, workers: int, devices: int,
                          first_step: int) -> list[dict]:
    """``STEPS`` steps of ``sgd`` (its optimizer state new, its replicas at the batches of ``first_step``) against
    the eager reference."""
    start = sgd.get_weights()
    stats = [sgd.step(fetch_stats=True) for _ in range(STEPS)]
    expected, losses = m.reference_run(net_name, optimizer_name, start, replicas(workers, devices), STEPS,
                                       first_step)
    got = sgd.get_weights()
    assert list(got) == list(expected)
    for name in got:
        np.testing.assert_allclose(got[name], expected[name], rtol=2e-5, atol=2e-6, err_msg=name)
    # The first step's loss is the mean replica loss from the same weights (regularization counted once).
    assert stats[0]["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert_replicas_identical(sgd, workers * devices)
    return stats


@contextlib.contextmanager
def keras3_engine_of(request, net_name: str, optimizer_name: str, strategy: str,
                     devices: int) -> Iterator[tuple[dsgd.DistributedSGD, int]]:
    """An engine of ``m.keras_creator(net_name, optimizer_name)`` on 2 workers, its optimizer state new, and the
    step whose batches its replicas read next: ``keras3_engine`` restarted for its configuration, else a new one."""
    if (net_name, optimizer_name, strategy, devices) == SHARED_KERAS3:
        shared = request.getfixturevalue("keras3_engine")
        yield shared.sgd, shared.restart()
        return
    with dsgd.DistributedSGD(m.keras_creator(net_name, optimizer_name), num_workers=2, devices_per_worker=devices,
                             strategy=strategy) as sgd:
        yield sgd, 0


@pytest.mark.parametrize("net_name, optimizer_name, strategy, devices", [
    SHARED_KERAS3,
    ("functional", "sgd", "simple", 1),
    ("subclassed", "adam", "ps", 1),
])
def test_keras3_models_train_like_the_eager_reference_with_identical_replicas(
        ray_session, request, net_name, optimizer_name, strategy, devices):
    with keras3_engine_of(request, net_name, optimizer_name, strategy, devices) as (sgd, first_step):
        stats = run_against_reference(sgd, net_name, optimizer_name, 2, devices, first_step)
        assert 0 <= stats[-1]["accuracy" if net_name != "functional" else "a_accuracy"] <= 1
        moving = [k for k in sgd.get_weights() if "moving_mean" in k]
        assert moving and np.any(sgd.get_weights()[moving[0]] != 0)  # the statistics moved, averaged


def test_keras3_checkpoint_round_trip_restores_weights_and_adam_state(keras3_engine, tmp_path):
    sgd = keras3_engine.sgd
    sgd.step()
    path = str(tmp_path / "ckpt")
    sgd.save(path)
    saved = sgd.foreach_worker(lambda w: w.get_state())[0]
    assert any(k.endswith("iteration") for k in saved["optimizer"])
    for _ in range(2):
        sgd.step()
    sgd.restore(path)
    restored = sgd.foreach_worker(lambda w: w.get_state())
    for state in restored:
        for group in ("weights", "optimizer"):
            assert list(state[group]) == list(saved[group])
            for name in saved[group]:
                np.testing.assert_array_equal(state[group][name], saved[group][name], err_msg=name)


def test_a_keras3_model_evaluates_by_its_metric_state_and_predicts_rows_in_input_order(keras3_engine):
    """``evaluate`` and ``predict`` of a Keras 3 ``KerasModel`` on 2 workers x 2 devices (batch normalization):
    Keras's own evaluate on each replica's part, the metric states summed, equal one process's ``evaluate`` and
    ``predict`` with the engine's weights; no weight (moving statistics included) changes."""
    sgd = keras3_engine.sgd
    weights = sgd.get_weights()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, m.FEATURES)).astype(np.float32)
    y = np.abs(x[:, :m.CLASSES]).argmax(1)
    reference = m.NETS["sequential"]()
    reference.compile(loss=m.loss_of("sequential"), metrics=m.metrics_of("sequential"))
    reference.set_weights(list(weights.values()))
    expected = reference.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert sgd.evaluate((x, y), batch_size=32) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(sgd.predict(x, batch_size=16), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    for name, value in sgd.get_weights().items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)


def test_tf2_model_reports_its_metrics_and_trains_like_the_reference(ray_session):
    with dsgd.DistributedSGD(m.Regression, num_workers=2, devices_per_worker=2, strategy="ps") as sgd:
        assert list(sgd.get_weights()) == ["w", "b"]
        start = sgd.get_weights()
        stats = [sgd.step(fetch_stats=True) for _ in range(STEPS)]
        expected = m.regression_reference(start, replicas(2, 2), STEPS)
        for name, value in sgd.get_weights().items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
        assert stats[0]["mae"] > 0 and stats[0]["num_replicas"] == 4
        assert sgd.foreach_worker(lambda w: w.sess) == [None, None]


def test_tf2_model_with_bf16_compression_is_within_16_bit_rounding_of_float32(ray_session):
    with dsgd.DistributedSGD(m.Regression, num_workers=2, strategy="ps", compression="bf16") as sgd:
        start = sgd.get_weights()
        for _ in range(STEPS):
            sgd.step()
        expected = m.regression_reference(start, replicas(2, 1), STEPS)
        got = sgd.get_weights()
        np.testing.assert_allclose(got["w"], expected["w"], rtol=2e-2, atol=2e-3)
        assert not np.allclose(got["w"], expected["w"], rtol=1e-6, atol=1e-7)  # it did round


@pytest.fixture(scope="module")
def fixed_regression_engine(ray_session) -> Iterator[dsgd.DistributedSGD]:
    """``m.NaNOnCue`` (``FixedRegression``, its batches finite unless a test cues a NaN) on 2 workers, "ps",
    nan_policy="skip", for the tests that kill, resize or poison such an engine: each starts from the weights
    it finds (the model reads the same batches every step) on 2 workers (``on_two_workers``)."""
    with dsgd.DistributedSGD(m.NaNOnCue, num_workers=2, strategy="ps", nan_policy="skip") as sgd:
        yield sgd


def on_two_workers(sgd: dsgd.DistributedSGD) -> dsgd.DistributedSGD:
    if sgd.num_workers != 2:
        sgd.resize(2)
    return sgd


def test_a_tf2_model_evaluates_its_loss_and_metrics_over_every_row_on_the_workers(fixed_regression_engine):
    """``evaluate`` of a ``TF2Model`` by its ``get_loss``: arrays split over the replicas (101 rows: unequal parts, a
    short last batch) and a tf.data function of each replica's batches both give the means over every row, as
    numpy computes them from the engine's weights, which it leaves as they were."""
    sgd = on_two_workers(fixed_regression_engine)
    sgd.step()
    weights = sgd.get_weights()
    rng = np.random.default_rng(7)
    x = rng.normal(size=(101, m.FEATURES)).astype(np.float32)
    y = rng.normal(size=101).astype(np.float32)

    def expected(rows: slice) -> dict:
        err = x[rows].astype(np.float64) @ weights["w"] + float(weights["b"]) - y[rows]
        return {"loss": np.mean(err ** 2), "mae": np.mean(np.abs(err))}

    got = sgd.evaluate({"x": x, "y": y}, batch_size=16)
    assert got == pytest.approx(expected(slice(None)), rel=1e-5)
    assert sgd.evaluate({"x": x, "y": y}, batch_size=16, steps=2) == pytest.approx(expected(slice(0, 32)), rel=1e-5)
    halves = {0: slice(0, 60), 1: slice(60, 101)}  # worker w's replica reads rows halves[w], in batches of 7
    by_function = sgd.evaluate(lambda w, d: tf.data.Dataset.from_tensor_slices(
        {"x": x[halves[w]], "y": y[halves[w]]}).batch(7))
    assert by_function == pytest.approx(expected(slice(None)), rel=1e-5)
    for name, value in sgd.get_weights().items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    with pytest.raises(dsgd.DSGDError, match="predict needs a model with outputs: NaNOnCue has no predict_batches"):
        sgd.predict(x)


def test_tf2_killed_worker_and_server_are_replaced_and_training_matches_the_reference(fixed_regression_engine):
    sgd = on_two_workers(fixed_regression_engine)
    start = sgd.get_weights()
    sgd.step()
    sgd.get_weights()
    old = actor_pids(sgd.workers[1], ps_actors(sgd)[0])
    kill(sgd.workers[1])
    sgd.step()
    kill(ps_actors(sgd)[0])
    sgd.step()
    assert set(actor_pids(sgd.workers[1], ps_actors(sgd)[0])).isdisjoint(old)  # both were replaced
    expected = m.regression_reference(start, replicas(2, 1), 3, fixed=True)
    for name, value in sgd.get_weights().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
    assert_replicas_identical(sgd, 2)


def test_a_replacement_worker_starts_from_the_local_state_its_lost_predecessor_reported(fixed_regression_engine):
    """A replica's local state (``TF2Model._dsgd_local_state``: ``NaNOnCue.computed``, the steps it computed)
    comes back with each step's result; the replacement for a killed worker starts from what the lost one
    reported with its last step, then computes the step run again."""
    sgd = on_two_workers(fixed_regression_engine)
    sgd.step()
    before = sgd.foreach_model(lambda m: float(m.computed.numpy()))
    assert before[1] >= 1
    kill(sgd.workers[1])
    sgd.step()
    assert sgd.foreach_model(lambda m: float(m.computed.numpy()))[1] == before[1] + 1


@pytest.mark.parametrize("strategy", ["ps", "simple"])
def test_tf2_non_finite_mean_is_skipped_on_every_worker_under_nan_policy_skip(ray_session, request, strategy):
    with contextlib.ExitStack() as new:
        if strategy == "ps":
            sgd = on_two_workers(request.getfixturevalue("fixed_regression_engine"))
        else:
            sgd = new.enter_context(dsgd.DistributedSGD(m.NaNOnCue, num_workers=2, strategy=strategy,
                                                        nan_policy="skip"))
        start = sgd.get_weights()
        applied = sgd.foreach_worker(lambda w: w.applied_steps_count())
        sgd.step()
        sgd.foreach_model(lambda mm: setattr(mm, "nan_next", mm.worker_index == 1))
        sgd.step()  # worker 1's gradient is NaN: skipped on both workers
        sgd.step()
        expected = m.regression_reference(start, replicas(2, 1), 2, fixed=True)  # the NaN step applied nowhere
        for name, value in sgd.get_weights().items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
        assert sgd.foreach_worker(lambda w: w.applied_steps_count()) == [n + 3 for n in applied]  # skipped counted


def test_tf2_engine_resizes_and_trains_on_like_the_reference(fixed_regression_engine):
    sgd = on_two_workers(fixed_regression_engine)
    start = sgd.get_weights()
    sgd.step()
    sgd.resize(3)
    sgd.step()
    sgd.resize(1)
    sgd.step()
    expected = m.regression_reference(start, replicas(2, 1), 1, fixed=True)
    expected = m.regression_reference(expected, replicas(3, 1), 1, fixed=True)
    expected = m.regression_reference(expected, replicas(1, 1), 1, fixed=True)
    for name, value in sgd.get_weights().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_tf2_elastic_engine_starts_at_max_goes_on_without_a_lost_worker_and_grows_back(ray_session, monkeypatch,
                                                                                       caplog):
    """num_workers=(1, 2): it starts at 2 (the session's Ray has room); worker 0 is lost while the node has room
    for one worker only (its CPUs seen as 1, as after a node is lost), so the survivor goes on alone as worker 0,
    still reading its own batches; with the room back, once resize_interval_s has passed it grows back to 2. Each
    step averages the replicas alive at it, as the reference does, and the replicas stay identical."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    interval = 3600.0  # the test moves the engine's clock, not the wall clock
    with dsgd.DistributedSGD(m.FixedRegression, num_workers=(1, 2), strategy="ps", resize_interval_s=interval,
                             timeout_s=60, startup_timeout_s=60) as sgd:
        assert sgd.num_workers == 2
        start = sgd.get_weights()
        expected = m.regression_reference(start, replicas(2, 1), 1, fixed=True)
        assert sgd.step(fetch_stats=True)["num_replicas"] == 2
        survivor = actor_pids(sgd.workers[1])
        with monkeypatch.context() as patch:
            real = room.live_node_resources
            patch.setattr(room, "live_node_resources", lambda: {node: {**have, "CPU": 1.0}
                                                                 for node, have in real().items()})
            kill(sgd.workers[0])
            assert sgd.step(fetch_stats=True)["num_replicas"] == 1
        assert "going on with 1 workers" in caplog.text
        assert sgd.num_workers == 1 and actor_pids(*sgd.workers) == survivor
        assert sgd.foreach_model(lambda model: model.worker_index) == [1]  # worker 1's batches, as worker 0
        sgd.step()
        expected = m.regression_reference(expected, [(1, 0)], 2, fixed=True)
        sgd._ledger.resizer._last_look -= interval  # resize_interval_s has passed since the engine last looked
        assert sgd.step(fetch_stats=True)["num_replicas"] == 2 and sgd.num_workers == 2
        expected = m.regression_reference(expected, [(1, 0), (1, 0)], 1, fixed=True)  # the new worker 1 reads 1's
        assert sgd.foreach_model(lambda model: model.worker_index) == [1, 1]
        assert_replicas_identical(sgd, 2)
        for name, value in sgd.get_weights().items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_keras3_creator_with_eager_only_code_before_the_model_trains():
    """The TF1 graph a worker tries first cannot make a tf.data iterator; the worker builds eagerly instead. The
    worker is built in this process (``local_worker``: ``SGDWorker.setup``, as an engine's worker runs it)."""
    worker = local_worker(m.tf_data_creator)
    assert type(worker.runtime).__name__ == "Tf2Runtime"
    losses = [worker.step(step, fetch_stats=True).floats()["loss"] for step in range(20)]
    assert np.mean(losses[-5:]) < losses[0] / 4, losses  # a noise-free linear target: batch losses fall to ~0


def test_a_batch_of_another_size_runs_on_the_first_trace_and_trains_like_the_reference(monkeypatch):
    """The step is traced once, for the first batch's structure and dtypes with the batch size free: a later
    batch of another size (an epoch's last) runs on that trace, and each step applies the gradient of what the
    replica read. Built in this process (``local_worker``)."""
    traced = []
    trace = Tf2Runtime._trace

    def counted(self, body, specs):
        traced.append([tuple(spec.shape) for spec in specs])
        return trace(self, body, specs)

    monkeypatch.setattr(Tf2Runtime, "_trace", counted)
    worker = local_worker(m.SizedRegression)  # one replica: this process's TensorFlow may have one CPU device
    start = worker.get_weights()
    for step in range(len(m.SIZES)):
        worker.step(step, fetch_stats=False)
    assert traced == [[(None, m.FEATURES), (None,), ()]]  # the batch's x and y, and the step id
    expected = m.regression_reference(start, [(0, 0)], len(m.SIZES), sizes=m.SIZES)
    for name, value in worker.get_weights().items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("creator, message, eager_message", [
    (m.BrokenTF1, "KeyError: .the user's TF1 bug", None),  # a TF1 model: the graph's error alone
    (m.raises_in_graph_and_eagerly, "ValueError: graph-only bug", "Built eagerly .*ValueError: eager-only bug"),
], ids=["tf1-model", "both-ways"])
def test_a_creator_that_raises_in_the_graph_is_reported_with_what_it_raised_eagerly(creator, message, eager_message):
    """Built in this process as an engine's worker builds it (``SGDWorker.setup``); the next test sends such an
    error through an engine."""
    with pytest.raises(dsgd.ModelCreatorError, match=f"model_creator raised on worker 0, device 0: {message}") as e:
        local_worker(creator)
    if eager_message is None:
        assert "Built eagerly" not in str(e.value)
    else:
        assert re.search(eager_message, str(e.value), re.DOTALL), str(e.value)


def test_an_engine_reports_a_creator_that_raised_in_the_graph_and_eagerly_with_both_errors(ray_session):
    with pytest.raises(dsgd.ModelCreatorError, match="(?s)model_creator raised on worker 0, device 0: ValueError: "
                                                     "graph-only bug.*Built eagerly .*ValueError: eager-only bug"):
        dsgd.DistributedSGD(m.raises_in_graph_and_eagerly, num_workers=1, strategy="simple")


def test_a_tf1_model_and_a_tf2_model_in_one_engine_are_refused(ray_session):
    """The error names both sides: what worker 1 built (TF2) and what worker 0 did (TF1)."""
    with pytest.raises(dsgd.WorkerMismatchError, match=re.escape(
            "worker 1 built a TF2 model (dsgd.TF2Model or a Keras 3 KerasModel), worker 0 a TF1 dsgd.Model (or "
            "tf_keras KerasModel): build one kind of model in an engine")):
        dsgd.DistributedSGD(tf1_then_tf2, num_workers=2, strategy="simple")


def tf1_then_tf2(worker_index: int, device_index: int):
    from dsgd_test_models import TanhNet

    return TanhNet(worker_index, device_index) if worker_index == 0 else m.Regression(worker_index, device_index)


def test_a_tf1_optimizer_with_a_keras3_model_is_refused_naming_the_keras_one(ray_session):
    with pytest.raises(dsgd.ModelCreatorError,
                       match="needs a Keras 3 optimizer, got .*GradientDescentOptimizer; use keras.optimizers.SGD"):
        dsgd.DistributedSGD(keras3_with_tf1_optimizer, num_workers=1)


def keras3_with_tf1_optimizer(worker_index: int, device_index: int):
    return dsgd.KerasModel(m.sequential(), loss="mse", optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                           batches=m.batches(worker_index, device_index))


class NonScalarLoss(m.Regression):
    def get_loss(self, batch):
        return tf.linalg.matvec(batch["x"], self.w)


class UnreachedLoss(m.Regression):
    def get_loss(self, batch):
        return tf.reduce_sum(batch["x"])


@pytest.mark.parametrize("model, message", [(NonScalarLoss, "must return a scalar loss, got shape"),
                                            (UnreachedLoss, "depends on none of the variables")])
def test_a_loss_that_is_not_a_scalar_or_reaches_no_variable_is_refused_at_the_first_step(model, message):
    """In a worker built in this process (``SGDWorker``, one device: each replica's loss is checked alike)."""
    worker = local_worker(model)
    with pytest.raises(dsgd.ModelCreatorError, match=f"on worker 0, device 0 {message}"):
        worker.step(0, fetch_stats=True)  # the step is traced on first use


def test_a_ps_engine_refuses_a_non_scalar_loss_at_its_first_step_naming_the_replica(ray_session):
    with dsgd.DistributedSGD(NonScalarLoss, num_workers=2, strategy="ps") as sgd:  # traced with the exchange in it
        with pytest.raises(dsgd.ModelCreatorError, match="on worker [01], device 0 must return a scalar loss"):
            sgd.step(fetch_stats=True)


def test_a_keras3_model_on_another_backend_is_refused_naming_the_variable_to_set(ray_session):
    result = ray.get(backend_check.options(runtime_env={"env_vars": {"KERAS_BACKEND": "jax"}}).remote(), timeout=120)
    assert "Keras backend is 'jax'" in result and "set KERAS_BACKEND=tensorflow" in result


@ray.remote(num_cpus=0)
def backend_check() -> str:
    """What a Keras 3 model gets in a process whose Keras backend is JAX (here jax is not even installed)."""
    from dsgd.integrations import keras_backend

    try:
        keras_backend.import_keras()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_tf2_backup_workers_timeline_and_logdir_work_together(ray_session, tmp_path):
    from readers import load_trace, names, read_scalars

    # One partition: the 2 workers it averages are the step's kept ones (with several, each may keep others).
    # Both steps traced: the server's span names the workers it averaged, the replicas the reference averages.
    with dsgd.DistributedSGD(m.Regression, num_workers=3, strategy="ps", backup_workers=1, grad_shard_bytes=0,
                             logdir=str(tmp_path / "logs")) as sgd:
        start = sgd.get_weights()
        sgd.step(write_timeline=str(tmp_path / "step0.json"))
        stats = sgd.step(fetch_stats=True, write_timeline=str(tmp_path / "step.json"))
        assert stats["num_replicas"] == 2 and stats["dropped_gradients"] == 1 and stats["mae"] > 0
        assert_replicas_identical(sgd, 3)
        got = sgd.get_weights()
    expected = start
    for step, trace in enumerate(["step0.json", "step.json"]):
        _, spans = load_trace(tmp_path / trace)
        [averaged] = [re.fullmatch(r"average partition 0 of workers \[(\d+), (\d+)\]", e["name"])
                      for e in spans["parameter server 0"] if e["name"].startswith("average partition")]
        kept = [(int(w), 0) for w in averaged.groups()]
        expected = m.regression_reference(expected, kept, 1, first_step=step)
    for name, value in got.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    _, spans = load_trace(tmp_path / "step.json")
    pushed = [w for w in range(3) if "hand partition 0 over" in names(spans[f"worker {w}"])]
    assert len(pushed) >= 2  # the step's hand-overs, from inside the traced TF2 step
    assert {"get_batch", "compute, exchange and apply"} <= names(spans[f"worker {pushed[0]}"])
    scalars = read_scalars(tmp_path / "logs")
    assert {"loss", "mae", "num_replicas"} <= set(scalars)
    assert [s for s, _, _ in scalars["loss"]] == [0, 1]  # a traced step's stats are fetched, so written


def test_keras3_warmup_and_a_skipped_step_leave_every_variable_of_every_replica_as_it_was(keras3_engine, caplog):
    """A Keras 3 model with batch normalization, whose forward pass writes its moving statistics, on 2 workers x 2
    devices with Adam (``keras3_engine``): a warmup, and a step whose mean is NaN (a kernel set to NaN) skipped
    under nan_policy="skip", change no weight, statistic or optimizer variable (Adam's iteration and moments) of
    any replica; the steps after them train on, the replicas identical."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    assert_warmup_and_a_skipped_step_change_nothing(keras3_engine.sgd, lambda: caplog.text, 4)


def test_tf2_model_trains_as_a_tune_trial_and_checkpoints(ray_session, tmp_path):
    """Each report's stats (its last step's) and the last checkpoint's weights are the numpy reference's, from
    Regression's zeros."""
    from ray import tune

    import dsgd.tune as dsgd_tune
    from tune_test_models import final_state, run

    trainable = dsgd_tune.trainable(m.regression_creator, num_workers=2, steps_per_report=2, checkpoint_every=1,
                                    strategy="simple", startup_timeout_s=120, timeout_s=60)  # "ps": test_tune's
    [result] = run(trainable, {"lr": tune.grid_search([0.05])}, tmp_path, iterations=2)
    history = result.metrics_dataframe.sort_values("training_iteration")
    assert list(history["num_steps"]) == [2, 4]
    reps, zeros = replicas(2, 1), {"w": np.zeros(m.FEATURES), "b": np.float64(0.0)}
    for report, last_step in enumerate([1, 3]):  # the step whose stats each report carries
        expected = m.regression_stats(m.regression_reference(zeros, reps, last_step), reps, last_step)
        for name, value in expected.items():
            assert history[name].iloc[report] == pytest.approx(value, rel=1e-5), (report, name)
    saved, expected = final_state(result), m.regression_reference(zeros, reps, 4)
    for name in ("w", "b"):
        np.testing.assert_allclose(saved[f"weights/{name}"], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


# All in the slow tier (the suite's time budget: 40 s for the smallest); the default run's batch-norm models are
# the small ones of test_keras3_models_train_like_the_eager_reference_with_identical_replicas
@pytest.mark.parametrize("name", [pytest.param("MobileNetV2", marks=pytest.mark.slow),
                                  pytest.param("ResNet50", marks=pytest.mark.slow),
                                  pytest.param("EfficientNetB0", marks=pytest.mark.slow)])
def test_keras_applications_with_batch_norm_train_with_identical_replicas(ray_session, name):
    with dsgd.DistributedSGD(m.application_creator(name), num_workers=1, devices_per_worker=2,
                             startup_timeout_s=600, timeout_s=600) as sgd:
        before = sgd.get_weights()
        for _ in range(2):
            sgd.step()
        after = sgd.get_weights()
        trainable = set(sgd.foreach_model(lambda mm: [v.path for v in mm.model.trainable_weights])[0])
        moved = {k for k in after if not np.array_equal(after[k], before[k])}
        assert trainable <= moved  # every trainable weight had a gradient applied
        assert any("moving_mean" in k for k in moved - trainable)  # and the statistics were averaged in
        assert_replicas_identical(sgd, 2)


def test_the_readmes_keras3_models_run_as_written_and_learn_their_targets(ray_session, capsys):
    """The README's minimal models, a KerasTrainer program and a KerasModel in a step() loop, run as written (the
    loop's 200 steps cut to 60)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.index("## A minimal model")
    blocks = []
    for _ in range(2):
        start = readme.index("```python", section) + len("```python")
        section = readme.index("```", start)
        blocks.append(readme[start:section])
    trainer_code, loop_code = blocks
    assert "ray.init()" in trainer_code and "dsgd.KerasTrainer(build" in trainer_code
    assert "range(200)" in loop_code and "print(sgd.get_weights())" in loop_code
    printed = []

    def print_and_keep(*args, **kwargs):
        printed.append(args)
        print(*args, **kwargs)

    namespace = {"print": print_and_keep}
    exec(compile(trainer_code.replace("ray.init()", "pass"), "README.md", "exec"), namespace)
    [results] = printed[-1]  # trainer.evaluate's dict on the held-out samples
    assert sorted(results) == ["accuracy", "auc", "loss"] and results["accuracy"] > 0.9 and results["auc"] > 0.95
    exec(compile(loop_code.replace("range(200)", "range(60)"), "README.md", "exec"), namespace)
    assert "'mae':" in capsys.readouterr().out
    [weights] = printed[-1]  # what its last line printed: the trained engine's weights
    np.testing.assert_allclose(weights["sequential/dense/kernel"][:, 0], [1.0, -2.0, 0.5], atol=1e-3)


class WiderOnDevice1(m.Regression):
    def __init__(self, worker_index: int, device_index: int):
        super().__init__(worker_index, device_index)
        if device_index == 1:
            self.w = tf.Variable(tf.zeros([m.FEATURES + 1]), name="w")


def test_replicas_whose_variables_disagree_are_refused_naming_the_variable(ray_session):
    with pytest.raises(dsgd.WorkerMismatchError, match="replica 1 on worker 0 built different variables.*'w'"):
        dsgd.DistributedSGD(WiderOnDevice1, num_workers=1, devices_per_worker=2)


def test_a_batch_array_of_text_gets_a_string_spec_and_other_objects_are_refused_by_name():
    from dsgd.errors import ModelCreatorError
    from dsgd.worker.tf2.runtime import _spec

    assert _spec(np.array(["a b", "c"]), 0, 0) == tf.TensorSpec([None], tf.string)
    assert _spec(np.array([[b"a"], ["b"]], dtype=object), 0, 0) == tf.TensorSpec([None, 1], tf.string)
    with pytest.raises(ModelCreatorError, match=r"worker 1, device 0 returned an array of dtype object; expected "
                                                r"numbers or strings"):
        _spec(np.array([{"a": 1}, None], dtype=object), 1, 0)

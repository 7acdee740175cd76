"""Semantics of DistributedSGD: identical replicas, correct averaged steps."""

import contextlib
import importlib
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import ray

import dsgd
from dsgd import ops
from dsgd.cluster.cluster import WORKER_ENV_DEFAULTS, worker_env
from dsgd.cluster.placement import actor_state
from dsgd_test_models import (BatchNormNet, PerReplicaInitNet, TanhNet, actor_pids, assert_all_identical,
                              assert_replicas_identical, assert_weights_close, batch, numpy_forward, numpy_step,
                              replica_weights, set_start_weights)

from dsgd_test_models import ps_actors, server_group  # the engine's internals

WORKERS, DEVICES = 2, 2
REPLICAS = [(w, d) for w in range(WORKERS) for d in range(DEVICES)]


def assert_all_four_identical(sgd):
    assert_replicas_identical(sgd, WORKERS * DEVICES)


INITIAL: dict[str, list[dict[str, np.ndarray]]] = {}  # every replica's weights as each engine was built


@pytest.fixture(scope="module")
def engines(ray_session):
    """One 2x2 engine per exchange; "ps" with tiny partitions so variables get split.

    "ps" moves partitions with the C++ ops (the default), "ps-python" without.
    """
    options = {"simple": dict(strategy="simple"),
               "ps": dict(strategy="ps", grad_shard_bytes=24, use_ops=True),
               "ps-python": dict(strategy="ps", grad_shard_bytes=24, use_ops=False)}
    built = {}
    try:
        for name, kwargs in options.items():
            built[name] = dsgd.DistributedSGD(TanhNet, num_workers=WORKERS, devices_per_worker=DEVICES, **kwargs)
            INITIAL[name] = replica_weights(built[name])  # before any test sets weights or steps
        yield built
    finally:
        for sgd in built.values():
            sgd.shutdown()



def test_tf1_workers_at_level_2_log_no_failed_cuinit(engines):
    """The session's workers run at TF_CPP_MIN_LOG_LEVEL=2 (conftest), where TensorFlow shows ERROR lines: a TF1
    worker lists its devices before its session does (CUDA's probe, which fails with "failed call to cuInit" on a
    machine without GPUs) with its start-up lines hidden, so its log holds no such line."""
    sgd = engines["ps"]
    sgd.step(fetch_stats=True)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    pids = actor_pids(*sgd.workers)
    files = [f for pid in pids for f in logs.glob(f"worker-*-{pid}.err")]
    assert len(files) == len(pids), sorted(p.name for p in logs.glob("worker-*.err"))
    assert not [f.name for f in files if "cuInit" in f.read_text()]

def test_a_workers_session_runs_on_its_cpus_and_its_idle_threads_sleep():
    """Threads: the worker's CPUs for each op, RECEIVE_THREADS more for the receives that wait; idle threads do
    not spin (they would take the cores the parameter servers share); only the subgraph a run needs is placed."""
    from dsgd.worker.tf1 import session_config
    from dsgd.worker.runtime import RECEIVE_THREADS
    from dsgd.config import WorkerConfig

    config = WorkerConfig(exchange="ps", devices_per_worker=2, gpu=False, all_reduce_alg="simple", cpus_per_worker=3,
                          step_timeout_s=10, startup_timeout_s=10)
    proto = session_config.session_config(config)
    assert proto.intra_op_parallelism_threads == 3
    assert proto.inter_op_parallelism_threads == 3 + RECEIVE_THREADS
    assert proto.experimental.disable_thread_spinning and proto.graph_options.place_pruned_graph
    assert proto.device_count["CPU"] == 2 and proto.device_count["GPU"] == 0


@pytest.fixture(scope="module")
def per_replica_init_engine(ray_session):
    """A 2x2 "ps" engine of PerReplicaInitNet, and the CPUs Ray listed free before it was built.

    Its two tests run before ``engines`` holds its workers' CPUs, in file
    order: the second shuts it down.
    """
    free = ray.available_resources().get("CPU", 0)
    sgd = dsgd.DistributedSGD(PerReplicaInitNet, num_workers=WORKERS, devices_per_worker=DEVICES, strategy="ps")
    yield sgd, free
    sgd.shutdown()


def test_initial_weights_are_assigned_only_where_a_replica_differs(per_replica_init_engine):
    """Replicas start identical; a worker builds and runs assigns only for the variables that differed."""
    sgd, _ = per_replica_init_engine
    replicas = replica_weights(sgd)
    assert_all_identical(replicas)
    assert np.all(replicas[0]["layer/w"] == 0) and np.all(replicas[0]["out/v"] == 0.5)  # worker 0, replica 0's

    def assigned(worker):  # the state ops are built on first use, one placeholder per variable written
        return sorted(op.name for op in worker.sess.graph.get_operations()
                      if op.type == "Placeholder" and op.name.startswith("set_weights/"))
    assert [len(names) for names in sgd.foreach_worker(assigned)] == [1, 1]  # 'layer/w' alone
    # Built on first use, they write any weights bit for bit (every variable's ops now).
    weights = set_start_weights(sgd)
    got = sgd.get_weights()
    assert all(np.array_equal(got[name], value) for name, value in weights.items())
    assert_all_four_identical(sgd)
    assert [len(names) for names in sgd.foreach_worker(assigned)] == [3, 3]


def test_shutdown_returns_once_its_actors_are_dead_and_their_cpus_free(per_replica_init_engine):
    """No wait after ``shutdown()``: an engine built right after is placed on every CPU this one held."""
    sgd, free = per_replica_init_engine
    actors = sgd._cluster.workers + ps_actors(sgd)
    assert len(actors) > WORKERS
    assert ray.available_resources().get("CPU", 0) == free - WORKERS  # what the workers hold
    sgd.shutdown()
    assert ray.available_resources().get("CPU", 0) == free
    assert [actor_state(a) for a in actors] == ["DEAD"] * len(actors)


@pytest.mark.parametrize("strategy", ["simple", "ps", "ps-python"])
def test_random_init_is_broadcast_to_every_replica(engines, strategy):
    replicas = INITIAL[strategy]
    assert len(replicas) == WORKERS * DEVICES
    assert_all_identical(replicas)
    assert np.all(replicas[0]["layer/b"] != 0)  # a random initializer ran: the same values came to every replica


def test_ps_serves_many_partitions_per_server_through_shared_memory(engines):
    # 5*4 + 4 + 4 float32 = 112 bytes in 24-byte partitions: ceil(112 / 24) = 5 partitions, on the
    # default servers: one node of 8 CPUs holding two 1-CPU workers -> 2 servers, not 5.
    sgd = engines["ps"]
    assert len(server_group(sgd).layout) == 5
    assert len(ps_actors(sgd)) == 2
    assert sorted(set(server_group(sgd).placement)) == [0, 1]
    # Workers and servers share one node: every partition travels through shared memory.
    assert sgd.foreach_worker(lambda w: [type(e).__name__ == "SharedMemoryWorkerEnd" for e in w.client.ends]) == [[True] * 5] * 2


def test_a_same_node_ps_step_pushes_through_signal_channels_without_an_actor_call(engines):
    """Every push of a step arrives on a worker's signal channel (its thread in the server), none as a Ray call."""
    sgd = engines["ps"]

    def record_pushes(ps):  # runs in each server (nested: pickled by value); the channels call ps.push
        import threading

        ps.pushes_seen = []
        push = type(ps).push

        def recorded(step_id, worker_index, partition, stored=None, generation=None):
            ps.pushes_seen.append((worker_index, partition, threading.current_thread().name))
            return push(ps, step_id, worker_index, partition, stored, generation)
        ps.push = recorded

    def stop_recording(ps):
        del ps.push
        return ps.pushes_seen

    servers = ps_actors(sgd)
    ray.get([s.__ray_call__.remote(record_pushes) for s in servers], timeout=30)
    try:
        for _ in range(2):
            sgd.step(fetch_stats=True)
    finally:
        seen = [push for pushes in ray.get([s.__ray_call__.remote(stop_recording) for s in servers], timeout=30)
                for push in pushes]
    partitions = len(server_group(sgd).layout)
    assert sorted((w, j) for w, j, _ in seen) == sorted([(w, j) for w in range(WORKERS) for j in range(partitions)] * 2)
    assert {thread.split(" ps")[0] for _, _, thread in seen} == {"dsgd signals"}


def steps_against_numpy(sgd, replicas: list, steps: int) -> None:
    """Run ``steps`` steps from known weights; the weights equal the numpy reference's, on every replica."""
    expected = {k: v.astype(np.float64) for k, v in set_start_weights(sgd).items()}
    for step in range(steps):
        sgd.step()
        expected = numpy_step(expected, replicas, step)
    got = sgd.get_weights()
    assert_replicas_identical(sgd, len(replicas))
    assert_weights_close(got, expected)


@pytest.fixture(scope="module")
def one_server_engine(ray_session):
    """A 2x2 "ps" engine on one parameter server, with dsgd's default partitions and exchange (use_ops unset).

    Its two tests run in file order: the second shuts it down, giving its
    CPUs back to the engines built after it (``engines`` holds six of eight).
    """
    with dsgd.DistributedSGD(TanhNet, num_workers=WORKERS, devices_per_worker=DEVICES, strategy="ps",
                             num_parameter_servers=1) as sgd:
        yield sgd


def test_explicit_server_count_is_honoured_and_default_partitions_train_correctly(one_server_engine):
    sgd = one_server_engine
    assert len(ps_actors(sgd)) == 1
    assert len(server_group(sgd).layout) == 1  # 112 bytes: one partition (dsgd's default is at least 1 MiB)
    steps_against_numpy(sgd, REPLICAS, 2)


def test_foreach_model_is_flat_in_worker_then_device_order(engines):
    assert engines["ps"].foreach_model(lambda m: (m.worker_index, m.device_index)) == REPLICAS


def _loss_by_eval(model):
    """The replica's loss on the first batch, by ``Tensor.eval()``: it needs a default session."""
    x, y = batch(0, 0, 0)
    return float(model.loss.eval(feed_dict={model.x: x, model.y: y}))


def _default_session_is_the_workers(worker):
    import tensorflow as tf

    return tf.compat.v1.get_default_session() is worker.sess


def test_for_model_runs_on_worker_0_device_0_in_the_workers_session(engines):
    sgd = engines["simple"]
    assert sgd.for_model(lambda m: (m.worker_index, m.device_index)) == (0, 0)
    _, _, expected, _ = numpy_forward(sgd.get_weights(), *batch(0, 0, 0))
    assert sgd.for_model(_loss_by_eval) == pytest.approx(expected, rel=1e-5)
    assert sgd.foreach_model(_loss_by_eval) == [pytest.approx(expected, rel=1e-5)] * len(REPLICAS)
    assert sgd.foreach_worker(_default_session_is_the_workers) == [True] * WORKERS


def test_evaluate_and_predict_refuse_a_tf1_model_by_name(engines):
    sgd = engines["simple"]
    x = np.zeros((8, 4), np.float32)
    with pytest.raises(dsgd.DSGDError, match="evaluate needs a TF2 model .*TanhNet is a TF1 dsgd.Model.*foreach_model"):
        sgd.evaluate(x)
    with pytest.raises(dsgd.DSGDError, match="predict needs a model with outputs: TanhNet has no predict_batches"):
        sgd.predict(x)
    with pytest.raises(ValueError, match="batch_size must be a positive int .*got 0"):
        sgd.evaluate(x, batch_size=0)
    with pytest.raises(TypeError, match="predict takes numpy arrays .*got function"):
        sgd.predict(lambda w, d: None)


@pytest.mark.parametrize("strategy", ["simple", "ps", "ps-python"])
def test_steps_equal_numpy_reference_and_keep_replicas_identical(engines, strategy):
    """And what a step sends: "simple", a worker's float32 gradients to the driver; "ps", its partitions."""
    sgd = engines[strategy]
    start = {k: v.astype(np.float64) for k, v in set_start_weights(sgd).items()}
    expected = start
    # TanhNet's float32 gradients: w (5 x 4), b (4) and v (4). "simple" sends them as they are, 112 bytes. "ps"
    # sends its partitions of grad_shard_bytes=24, every piece starting on a 64-byte boundary: b, 12 floats of
    # gap and v (20 floats), then w's 20 in 4 partitions of 5: 160 bytes.
    sent_bytes = {"simple": 4 * (20 + 4 + 4), "ps": 4 * (4 + 12 + 4 + 20), "ps-python": 4 * (4 + 12 + 4 + 20)}
    for step in range(3):
        fetch = step % 2 == 0
        stats = sgd.step(fetch_stats=fetch)
        if fetch:
            assert stats["sent_bytes"] == sent_bytes[strategy]
        expected = numpy_step(expected, REPLICAS, step)
        assert_all_four_identical(sgd)
        assert_weights_close(sgd.get_weights(), expected)


def test_strategies_give_the_same_weights(engines):
    for sgd in engines.values():
        set_start_weights(sgd)
        for _ in range(4):
            sgd.step()
    simple = engines["simple"].get_weights()
    for other in ("ps", "ps-python"):
        weights = engines[other].get_weights()
        for name in simple:
            # One averaging function (dsgd.wire.arrays.average_into) in the same order: bit for bit.
            assert np.array_equal(weights[name], simple[name]), f"{other} {name}"


OPS_PHASE = "compute_exchange_and_apply_s"  # the ops run compute, exchange and apply in one session call
PYTHON_PHASES = {"compute_s", "pack_and_send_s", "receive_s"}  # Python moves the partitions between runs


def exchange_path(stats: dict) -> str:
    """Which exchange a "ps" step ran, from the phases its stats report."""
    phases = set(stats)
    if OPS_PHASE in phases and not phases & PYTHON_PHASES:
        return "ops"
    if PYTHON_PHASES <= phases and OPS_PHASE not in phases:
        return "python"
    return f"neither: {sorted(phases)}"


@pytest.mark.parametrize("use_ops, path", [(True, "ops"), (False, "python"), (None, "ops")],
                         ids=["use_ops=True", "use_ops=False", "use_ops=None"])
def test_ps_exchange_runs_through_the_ops_unless_told_not_to(request, use_ops, path):
    """Through the ops a worker checks each received partition and keeps no fed apply (it is built unchecked, for
    the optimizer's slots alone); through Python it applies fed means, checked per variable."""
    built = {"ops": ("PsWorkerOps", True, False, ["partitions"]),
             "python": ("PsWorkerPython", False, True, ["gradients"])}[path]
    if use_ops is None:  # the default: the ops whenever the library builds and loads, as `make install` ensures
        assert ops.is_available()
        with request.getfixturevalue("one_server_engine") as sgd:  # built with use_ops unset
            assert exchange_path(sgd.step(fetch_stats=True)) == path
            assert sgd.foreach_worker(_exchange_and_its_ops) == [built] * WORKERS
        return
    sgd = request.getfixturevalue("engines")["ps" if use_ops else "ps-python"]
    assert exchange_path(sgd.step(fetch_stats=True)) == path
    assert sgd.foreach_worker(_exchange_and_its_ops) == [built] * WORKERS


def _exchange_and_its_ops(worker) -> tuple[str, bool, bool, list[str]]:
    """The worker's exchange class, whether its graph holds the op library's ops (DsgdPack), whether it keeps a
    fed apply, and what its non-finite checks check (their name scopes: gradients, values, partitions)."""
    from dsgd.worker.finite_checks import FINITE_SCOPE

    ops = worker.sess.graph.get_operations()
    checked = {op.name.split("/")[0].removeprefix(FINITE_SCOPE + "_").split("_")[0]
               for op in ops if op.name.startswith(FINITE_SCOPE)}
    return (type(worker.exchange).__name__, any(op.type == "DsgdPack" for op in ops),
            worker.runtime.worker_graph.apply_fed is not None, sorted(checked))


@pytest.mark.parametrize("strategy", ["simple", "ps", "ps-python"])
def test_fetch_stats_reports_means_over_replicas(engines, strategy):
    sgd = engines[strategy]
    weights = set_start_weights(sgd)
    per_replica = [numpy_forward(weights, *batch(w, d, 0)) for w, d in REPLICAS]
    stats = sgd.step(fetch_stats=True)
    assert stats["loss"] == pytest.approx(np.mean([r[2] for r in per_replica]), rel=1e-5)
    assert stats["abs_error"] == pytest.approx(np.mean([r[3] for r in per_replica]), rel=1e-5)
    assert stats["step_time_s"] > 0
    assert isinstance(stats["step"], int)
    phases = {"simple": ["get_feed_dict_s", "compute_s", "apply_s"],  # the apply is the step's second call
              "ps": ["get_feed_dict_s", "compute_exchange_and_apply_s"],
              "ps-python": ["get_feed_dict_s", "compute_s", "pack_and_send_s", "receive_s", "apply_s"]}[strategy]
    assert all(0 <= stats[p] < stats["step_time_s"] for p in phases), stats


def test_step_without_stats_returns_none_and_still_applies(engines):
    sgd = engines["ps"]
    before = sgd.get_weights()
    assert sgd.step(fetch_stats=False) is None
    after = sgd.get_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    assert_all_four_identical(sgd)


def test_warmup_does_not_change_weights(engines):
    sgd = engines["ps"]
    before = sgd.get_weights()
    sgd.warmup()
    after = sgd.get_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_weights_are_keyed_without_device_scope(engines):
    weights = engines["simple"].get_weights()
    assert sorted(weights) == ["layer/b", "layer/w", "out/v"]
    assert weights["layer/w"].shape == (5, 4)


def test_set_weights_rejects_wrong_names_and_shapes(engines):
    sgd = engines["simple"]
    weights = sgd.get_weights()
    with pytest.raises(ValueError, match="missing variables \\['out/v'\\]"):
        sgd.set_weights({k: v for k, v in weights.items() if k != "out/v"})
    with pytest.raises(ValueError, match="unknown variables \\['extra'\\]"):
        sgd.set_weights({**weights, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match="'layer/b' has shape \\(3,\\), expected \\(4,\\)"):
        sgd.set_weights({**weights, "layer/b": np.zeros(3, np.float32)})


def test_moving_statistics_stay_identical_across_replicas(ray_session):
    with dsgd.DistributedSGD(BatchNormNet, num_workers=WORKERS, devices_per_worker=DEVICES,
                             strategy="ps") as sgd:
        for _ in range(2):
            sgd.step()
        assert_all_four_identical(sgd)
        # The statistics' means arrive in received buffers: assigned to the variables, they must be copied,
        # or a variable would share (and keep alive) the buffer, whose next write would change it.
        assert sgd.foreach_worker(lambda w: (w.config.use_ops, ops.live_buffers())) == [(True, 0)] * WORKERS
        moving = sgd.get_weights()["moving_mean"]
        assert np.any(moving != 0)
        # Every replica's update is averaged: 0.1 * mean of all replicas' batch means.
        expected = 0.1 * np.mean([batch(w, d, 0)[0].mean(0) for w, d in REPLICAS], axis=0)
        expected = 0.9 * expected + 0.1 * np.mean([batch(w, d, 1)[0].mean(0) for w, d in REPLICAS], axis=0)
        np.testing.assert_allclose(moving, expected, rtol=1e-5)


def process_environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_workers_run_with_dsgds_environment_the_drivers_variables_first(engines, monkeypatch):
    for pid in actor_pids(*engines["ps"].workers):
        env = process_environment(pid)
        assert {name: env.get(name) for name in WORKER_ENV_DEFAULTS} == worker_env()
        assert env["TF_CPU_ALLOCATOR_USE_BFC"] == "true" and env["TF_CPP_MIN_LOG_LEVEL"] == "2"  # conftest sets 2
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "false")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    assert worker_env() == {"TF_CPU_ALLOCATOR_USE_BFC": "false", "TF_CPP_MIN_LOG_LEVEL": "3",
                            "DSGD_SKIP_KERAS_PRELOAD": "1"}


def test_workers_import_tensorflow_without_keras_and_a_model_can_still_import_it(engines, monkeypatch):
    sgd = engines["ps"]
    assert sgd.foreach_worker(lambda w: [name for name in sys.modules if name.split(".")[0] == "keras"]) == [
        []] * WORKERS
    assert sgd.foreach_worker(lambda w: importlib.import_module("keras.src.optimizers").__name__) == [
        "keras.src.optimizers"] * WORKERS

    from dsgd.worker import keras_preload
    monkeypatch.setenv(keras_preload.ENV, "1")
    monkeypatch.delitem(sys.modules, "keras.src.optimizers", raising=False)
    already = sys.modules.get("tf_keras.src.optimizers") or types.ModuleType("tf_keras.src.optimizers")
    monkeypatch.setitem(sys.modules, "tf_keras.src.optimizers", already)  # one imported: the other still skipped
    with keras_preload.skipped():
        with pytest.raises(ImportError):
            importlib.import_module("keras.src.optimizers")
    assert "keras.src.optimizers" not in sys.modules  # importable again
    assert sys.modules["tf_keras.src.optimizers"] is already


class LoggedMessages(logging.Handler):
    """Keeps the message of every record it handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def single_worker_ps(ray_session):
    """A 1-worker "ps" engine of two devices, and the warnings dsgd logged while building it.

    Shared by the two tests below, in file order: the second shuts it down.
    """
    logged = LoggedMessages()
    logger = logging.getLogger("dsgd")
    logger.addHandler(logged)
    try:
        sgd = dsgd.DistributedSGD(TanhNet, num_workers=1, devices_per_worker=DEVICES, strategy="ps")
    finally:
        logger.removeHandler(logged)
    yield sgd, logged.messages
    sgd.shutdown()


# "simple" in the slow tier (the suite's time budget): one worker's "ps" runs as "simple" does, and says so
@pytest.mark.parametrize("strategy", [pytest.param("simple", marks=pytest.mark.slow), "ps"])
def test_single_worker_steps_equal_numpy_reference(request, strategy):
    with contextlib.ExitStack() as own:
        if strategy == "ps":
            sgd, _ = request.getfixturevalue("single_worker_ps")
        else:
            sgd = own.enter_context(dsgd.DistributedSGD(TanhNet, num_workers=1, devices_per_worker=DEVICES,
                                                        strategy=strategy))
        steps_against_numpy(sgd, [(0, d) for d in range(DEVICES)], 3)


def test_single_worker_ps_says_it_runs_like_simple_and_closes(single_worker_ps):
    sgd, warnings = single_worker_ps
    assert ps_actors(sgd) == []
    assert sgd.step(fetch_stats=True)["loss"] > 0
    assert any("num_workers=1" in message for message in warnings)
    with sgd:  # leaving the with block shuts it down
        pass
    with pytest.raises(dsgd.DSGDError, match="shut down"):
        sgd.step()

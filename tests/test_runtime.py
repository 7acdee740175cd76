"""The replica-runtime seam: exchanges drive any ``ReplicaRuntime``; the TF1 runtime's arithmetic by hand.

The first tests drive the exchanges in-process through a runtime of numpy
arrays (no TensorFlow session, graph or feed), so they fail if an exchange
reaches past the runtime's interface. The last ones check the TF1 runtime
(``Tf1Runtime``) against means computed by hand on a tiny model.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dsgd.common.results import Backup, StepResult, Value
from dsgd.config import WorkerConfig
from dsgd.errors import NonFiniteGradientError
from dsgd.exchange import registry
from dsgd.exchange.ps import PsWorkerOps, PsWorkerPython
from dsgd.wire import partitions
from dsgd.worker import nonfinite
from dsgd.worker.runtime import FusedStep, ReplicaRuntime
from dsgd.worker.signature import WorkerSignature

SPECS = (partitions.VarSpec("out/v", (3,), np.dtype(np.float32)), partitions.VarSpec("layer/w", (2, 5), np.dtype(np.float32)))


def config(exchange: str = "simple", nan_policy: str = "raise", devices: int = 1, **kwargs) -> WorkerConfig:
    return WorkerConfig(exchange=exchange, devices_per_worker=devices, gpu=False, all_reduce_alg="simple",
                        cpus_per_worker=1, step_timeout_s=10, startup_timeout_s=10, nan_policy=nan_policy, **kwargs)


def arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [rng.randn(*s.shape).astype(s.dtype) for s in SPECS]


class NumpyRuntime(ReplicaRuntime):
    """A runtime of numpy arrays: every step computes ``local`` as its local means (loss 1.5); ``apply`` records
    the means it is given, checked for non-finite values as a real runtime's checks would."""

    def __init__(self, worker_config: WorkerConfig, local: list[np.ndarray]):
        super().__init__(0, worker_config)
        self.local = local
        self.applies: list[list[np.ndarray]] = []
        self.fused_steps: list[NumpyFusedStep] = []
        self.dropped = 0  # steps whose batches were read without computing (drop_batches)

    def build(self, model_creator, state=None):
        return self.signature

    is_built = True
    signature = WorkerSignature(weights=SPECS, exchange=SPECS, optimizer=(), metrics=())
    trainable_count = len(SPECS)
    models = []
    feed_names = ("x:0",)

    def user_context(self):
        raise AssertionError("an exchange has no business with the user's context")

    def compute(self, fetch_stats):
        self.start_step()
        with self.phase("compute"):
            return [m.copy() for m in self.local], (self.replica_stats([1.0, 2.0], {}) if fetch_stats else {})

    def apply(self, means):
        with self.phase("apply"):
            for spec, mean in zip(SPECS, means):
                if not np.all(np.isfinite(mean)):  # what a check's failed run says
                    return self.skipped(f"assertion failed: [{nonfinite.message('gradient', spec.name)}]")
            self.applies.append([np.array(m) for m in means])
        self.applied_steps += 1
        return {}

    def fused_step(self, exchange=None):
        assert exchange is None, "only the op library's exchange builds into the step, and it needs TensorFlow"
        self.fused_steps.append(NumpyFusedStep(self))
        return self.fused_steps[-1]

    def drop_batches(self):
        self.start_step()
        self.dropped += 1

    def warmup(self):
        pass

    def get_weights(self):
        return {}

    def replica_weights(self):
        return [{}]

    def set_group(self, group, values):
        pass

    def get_groups(self):
        return {"weights": {}, "optimizer": {}}


class NumpyFusedStep(FusedStep):
    def __init__(self, runtime: NumpyRuntime):
        self.runtime = runtime
        self.planned: list[tuple[bool, tuple[str, ...]]] = []

    def run(self, step_id, fetch_stats):
        means, stats = self.runtime.compute(fetch_stats)
        return stats, self.runtime.apply(means)

    def prepare(self, fetch_stats, feed_names):
        self.planned.append((fetch_stats, tuple(feed_names)))


class NumpyServers:
    """A ``ParameterServerClient``'s step side (hand-overs to its send scheduler, and the means collected) over the
    servers' arithmetic: each partition's mean is that of what this worker handed over and what ``peer`` (another
    worker's local means) would."""

    def __init__(self, layout: list[partitions.Partition], peer: list[np.ndarray]):
        self.layout = layout
        self.peer = peer
        self.handed: dict[int, np.ndarray] = {}
        self.steps: list[int] = []  # of the op library's hand-overs
        self.calls: list[tuple[str, int]] = []  # ("hand" or "collect", partition index), in order
        self.sent_bytes = sum(p.size * p.dtype.itemsize for p in layout)
        self.forgotten = 0

    def hand_gradients(self, partition, step_id, grads, trace=None):
        self.handed[partition.index] = partitions.pack(grads, partition, np.zeros(partition.size, partition.dtype))
        self.calls.append(("hand", partition.index))

    def hand(self, partition, step_id, segment_arrays, trace=None):
        """The op library's hand-over: one array per segment."""
        self.handed[partition.index] = flat = np.zeros(partition.size, partition.dtype)
        for segment, array in zip(partitions.segments(partition), segment_arrays):
            flat[segment.start:segment.start + segment.size] = array
        self.steps.append(step_id)
        self.calls.append(("hand", partition.index))

    def collect(self, partition, step_id, trace=None):
        self.calls.append(("collect", partition.index))
        peer = partitions.pack(self.peer, partition, np.zeros(partition.size, partition.dtype))
        return (self.handed.pop(partition.index) + peer) / 2

    def check_each_handed_over_once_before_collected(self) -> None:
        assert sorted(j for call, j in self.calls if call == "hand") == list(range(len(self.layout)))
        for j in range(len(self.layout)):
            assert self.calls.index(("hand", j)) < self.calls.index(("collect", j)), (j, self.calls)

    def forget_pushes(self):
        self.forgotten += 1


class ClosedStepServers(NumpyServers):
    """Servers that closed every partition of each step without this worker (backup workers): ``begin`` answers
    with the means of workers 1 and 2, which are ``peer``."""

    def begin(self, step_id):
        return {p.index: "closed" for p in self.layout}

    def read(self, partition, step_id, answer):
        assert answer == "closed"
        return partitions.pack(self.peer, partition, np.zeros(partition.size, partition.dtype))

    def kept(self):
        return [1, 2]


def test_the_exchanges_and_the_runtime_interface_import_no_tensorflow():
    """What an exchange needs is the runtime's interface: importing every exchange, and the interface, loads no
    TensorFlow (only the op library's in-step exchange builds TensorFlow ops, when the runtime traces it)."""
    code = ("import sys\n"
            "import dsgd.exchange.registry, dsgd.exchange.alone, dsgd.exchange.simple, dsgd.exchange.ps\n"
            "import dsgd.worker.runtime\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_simple_returns_the_runtimes_local_means_then_applies_the_drivers_mean():
    local = arrays(0)
    runtime = NumpyRuntime(config("simple"), local)
    exchange = registry.worker_half("simple", runtime)
    means = exchange.step(3, fetch_stats=True)
    assert all(np.array_equal(m, l) for m, l in zip(means, local))
    driver_mean = arrays(1)
    result = exchange.step(3, True, driver_mean)
    assert [np.array_equal(a, m) for a, m in zip(runtime.applies[0], driver_mean)] == [True, True]
    assert result.values["loss"] == Value.mean([1.0, 2.0]) and runtime.applied_steps == 1
    stats = result.floats()
    assert stats["loss"] == 1.5 and stats["sent_bytes"] == sum(m.nbytes for m in local)
    assert {"compute_s", "apply_s"} <= set(stats)  # the phases of both calls



def test_the_python_ps_exchange_hands_every_partition_over_and_applies_the_servers_means():
    local, peer = arrays(0), arrays(1)
    layout = partitions.plan_partitions(SPECS, 16)  # tiny partitions: variables are split across several
    assert len(layout) > len(SPECS)
    runtime = NumpyRuntime(config("ps"), local)
    servers = NumpyServers(layout, peer)
    exchange = registry.worker_half("ps", runtime, servers)
    assert isinstance(exchange, PsWorkerPython)
    result = exchange.step(0, fetch_stats=True).floats()
    for applied, mine, theirs in zip(runtime.applies[0], local, peer):
        np.testing.assert_allclose(applied, (mine + theirs) / 2, rtol=1e-6)
    assert result["sent_bytes"] == servers.sent_bytes and result["loss"] == 1.5
    assert {"compute_s", "pack_and_send_s", "receive_s", "apply_s"} <= set(result)
    servers.check_each_handed_over_once_before_collected()
    assert exchange.step(1, fetch_stats=False) == StepResult() and runtime.applied_steps == 2


@pytest.mark.parametrize("ray_data", [False, True], ids=["own input", "Ray Data input"])
def test_a_backup_worker_catching_up_applies_the_closed_means_and_reads_its_batches_only_with_ray_data(ray_data):
    """A worker that finds its step closed does not compute it; with Ray Data input (``feed_concurrently``) it still
    reads its replicas' batches, so that its splits reach the next epoch with the others'."""
    peer = arrays(1)
    runtime = NumpyRuntime(config("ps", backup_workers=1, feed_concurrently=ray_data), arrays(0))
    exchange = registry.worker_half("ps", runtime, ClosedStepServers(partitions.plan_partitions(SPECS, 16), peer))
    assert exchange.step(0, fetch_stats=False) == StepResult(backup=Backup(computed=False, kept=(1, 2)))
    assert [np.array_equal(a, m) for a, m in zip(runtime.applies[0], peer)] == [True, True]
    assert runtime.dropped == (1 if ray_data else 0)


def test_a_failed_exchange_forgets_its_pushes():
    runtime = NumpyRuntime(config("ps"), arrays(0))
    servers = NumpyServers(partitions.plan_partitions(SPECS, 16), arrays(1))
    servers.collect = lambda *args: (_ for _ in ()).throw(TimeoutError("no answer"))
    exchange = registry.worker_half("ps", runtime, servers)
    with pytest.raises(TimeoutError):
        exchange.step(0, fetch_stats=False)
    assert servers.forgotten == 1 and runtime.applies == [] and runtime.applied_steps == 0


def test_alone_runs_one_fused_step_which_a_resize_plans_ahead():
    runtime = NumpyRuntime(config("alone"), arrays(0))
    exchange = registry.worker_half("alone", runtime)
    exchange.prepare(True, runtime.feed_names)
    assert runtime.fused_steps[0].planned == [(True, ("x:0",))]
    result = exchange.step(0, fetch_stats=True).floats()
    assert result["sent_bytes"] == 0 and result["loss"] == 1.5
    assert all(np.array_equal(a, m) for a, m in zip(runtime.applies[0], runtime.local))


def test_the_op_librarys_in_step_exchange_traces_in_a_tf_function_and_hands_every_partition_over():
    """The "ps" exchange built into a step (``PsWorkerOps.build``) is TensorFlow code a runtime traces: here in
    a tf.function, as a TF2 runtime would, instead of the TF1 runtime's graph. It hands each partition to the
    client's send scheduler, and collects a partition's mean only once it is handed over."""
    import tensorflow as tf

    from dsgd import ops

    if not ops.is_available():
        pytest.skip("the op library is not built")
    local, peer = arrays(0), arrays(1)
    layout = partitions.plan_partitions(SPECS, 16)
    runtime = NumpyRuntime(config("ps", use_ops=True), local)
    in_step = []
    runtime.fused_step = lambda exchange=None: in_step.append(exchange) or NumpyFusedStep(runtime)
    servers = NumpyServers(layout, peer)
    assert isinstance(registry.worker_half("ps", runtime, servers), PsWorkerOps)

    @tf.function
    def step(step_id):
        means, checks = in_step[0]([tf.constant(a) for a in local], step_id)
        with tf.control_dependencies(checks):
            return [tf.identity(m) for m in means]

    got = step(tf.constant(5, tf.int64))
    for mean, mine, theirs in zip(got, local, peer):
        np.testing.assert_allclose(mean.numpy(), (mine + theirs) / 2, rtol=1e-6)
    assert servers.steps == [5] * len(layout)
    servers.check_each_handed_over_once_before_collected()
    del got
    ops.drain_released()


# ---- the TF1 runtime --------------------------------------------------------------

LR = 0.1
X = {0: np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]], np.float32),
     1: np.array([[-2.0, 1.0], [1.0, 1.0], [0.0, 4.0]], np.float32)}  # each device's batch
Y = {0: np.array([1.0, 0.0, 2.0], np.float32), 1: np.array([0.5, -1.0, 1.0], np.float32)}
W0, B0 = np.array([0.3, -0.2], np.float32), np.float32(0.1)


def linear_net(worker_index: int, device_index: int):
    """loss = mean((x w + b - y)^2) on the device's fixed batch, plain SGD."""
    import tensorflow as tf

    import dsgd

    class Linear(dsgd.Model):
        def __init__(self):
            self.x = tf.compat.v1.placeholder(tf.float32, [None, 2])
            self.y = tf.compat.v1.placeholder(tf.float32, [None])
            w = tf.compat.v1.get_variable("w", initializer=W0)
            b = tf.compat.v1.get_variable("b", initializer=B0)
            self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(self.x, w) + b - self.y))

        def get_loss(self):
            return self.loss

        def get_optimizer(self):
            return tf.compat.v1.train.GradientDescentOptimizer(LR)

        def get_feed_dict(self):
            return {self.x: X[device_index], self.y: Y[device_index]}

    return Linear()


def by_hand() -> tuple[dict[str, np.ndarray], float]:
    """The mean over both devices of each variable's gradient, and of the loss, at (W0, B0)."""
    grads, losses = {"w": [], "b": []}, []
    for d in (0, 1):
        err = X[d] @ W0 + B0 - Y[d]
        grads["w"].append(2 * X[d].T @ err / len(err))
        grads["b"].append(2 * err.mean())
        losses.append(np.mean(err ** 2))
    return {k: np.mean(v, axis=0) for k, v in grads.items()}, float(np.mean(losses))


def tf1_runtime(model_creator=None, **kwargs):
    """A TF1 runtime of 2 replicas of ``model_creator`` (``linear_net`` if none)."""
    from dsgd.worker.tf1.runtime import Tf1Runtime

    runtime = Tf1Runtime(0, config(devices=2, **kwargs))
    runtime.build(model_creator or linear_net)
    return runtime


def test_the_tf1_runtime_computes_the_local_mean_and_applies_a_given_mean_on_every_replica():
    runtime = tf1_runtime()
    mean, loss = by_hand()
    names = [s.name for s in runtime.signature.exchange]
    assert sorted(names) == ["b", "w"] and runtime.trainable_count == 2
    local, stats = runtime.compute(fetch_stats=True)
    for name, got in zip(names, local):
        np.testing.assert_allclose(got, mean[name], rtol=1e-5)
    assert stats["loss"].result() == pytest.approx(loss, rel=1e-5) and stats["loss"].count == 2  # both replicas'
    assert runtime.feed_names is not None and len(runtime.feed_names) == 4  # x and y of both replicas
    given = {"w": np.array([1.0, -2.0], np.float32), "b": np.float32(0.5)}
    assert runtime.apply([np.asarray(given[n]) for n in names]) == {} and runtime.applied_steps == 1
    for replica in runtime.replica_weights():
        np.testing.assert_allclose(replica["w"], W0 - LR * given["w"], rtol=1e-6)
        np.testing.assert_allclose(replica["b"], B0 - LR * given["b"], rtol=1e-6)
    state = runtime.get_state()
    assert state["applied_steps"] == 1 and sorted(state["weights"]) == ["b", "w"]


def test_the_tf1_runtime_checks_the_means_it_applies():
    runtime = tf1_runtime(nan_policy="skip")
    means = [np.full(s.shape, np.inf if s.name == "w" else 1.0, s.dtype) for s in runtime.signature.exchange]
    assert runtime.apply(means) == {"skipped": "non-finite gradient of variable 'w' in step 0"}
    assert runtime.applied_steps == 1
    for replica in runtime.replica_weights():
        np.testing.assert_array_equal(replica["w"], W0)  # no replica applied any of it
        assert replica["b"] == B0


@pytest.mark.parametrize("nan_policy", ["raise", "skip"])
def test_a_non_finite_mean_raises_or_skips_the_step_by_nan_policy(nan_policy):
    """The "simple" exchange's worker half over a TF1 runtime: a mean with a NaN in 'w', as the driver would send
    it, fails the runtime's own check, which raises or skips the step by nan_policy; no replica applies any of it."""
    runtime = tf1_runtime(nan_policy=nan_policy)
    exchange = registry.worker_half("simple", runtime)
    local = exchange.step(0, fetch_stats=True)
    bad = [np.array(m) for m in local]
    bad[[s.name for s in runtime.signature.exchange].index("w")][0] = np.nan
    if nan_policy == "raise":
        with pytest.raises(NonFiniteGradientError, match="non-finite gradient of variable 'w' in step 0"):
            exchange.step(0, True, bad)
        assert runtime.applied_steps == 0
    else:
        result = exchange.step(0, True, bad)
        assert result.skipped == "non-finite gradient of variable 'w' in step 0"
        assert runtime.applied_steps == 1  # every worker skips it and counts it alike
    for replica in runtime.replica_weights():
        np.testing.assert_array_equal(replica["w"], W0)
        assert replica["b"] == B0


def test_the_tf1_runtime_puts_back_what_update_ops_write_unless_the_step_is_applied():
    """A dsgd.Model's UPDATE_OPS write its moving mean from each replica's own batch: what they write is the
    exchanged value, but a warmup, a compute and a skipped apply leave both replicas' moving mean as it was; an
    applied step gives both the mean."""
    from dsgd_test_models import BatchNormNet, assert_all_identical, batch

    runtime = tf1_runtime(BatchNormNet, nan_policy="skip")
    runtime.set_group("weights", runtime.get_weights())  # as the engine's broadcast makes them: identical
    names = [s.name for s in runtime.signature.exchange]
    start = runtime.get_weights()
    assert not start["moving_mean"].any()  # zeros: written, it is 0.1 of the batch's mean
    runtime.warmup()  # the replicas' batches of step 0
    local, _ = runtime.compute(fetch_stats=False)  # of step 1
    written = local[names.index("moving_mean")]
    np.testing.assert_allclose(written, np.mean([0.1 * batch(0, d, 1)[0].mean(0) for d in (0, 1)], 0), rtol=1e-5)
    skipped = runtime.apply([np.full_like(m, np.nan) if n == "moving_mean" else m for n, m in zip(names, local)])
    assert skipped == {"skipped": "non-finite value of variable 'moving_mean' in step 0"}
    assert_all_identical([start, *runtime.replica_weights()])
    assert runtime.apply(local) == {}
    for replica in runtime.replica_weights():
        np.testing.assert_array_equal(replica["moving_mean"], written)
    assert_all_identical(runtime.replica_weights())


def test_the_tf1_runtime_builds_an_in_step_exchange_into_one_fused_step_and_plans_it():
    """The exchange's callback gets the local means and the step id as tensors; its means are applied."""
    import tensorflow as tf

    runtime = tf1_runtime()
    steps_seen = []

    def times_three(local_means, step_id):  # stands for the op library's sends and receives
        def seen(step):
            steps_seen.append(int(step))
            return np.int64(step)

        token = tf.numpy_function(seen, [step_id], tf.int64, stateful=True)
        with tf.control_dependencies([token]):
            return [3.0 * m for m in local_means], []

    fused = runtime.fused_step(times_three)
    stats, applied = fused.run(7, fetch_stats=True)
    mean, loss = by_hand()
    assert steps_seen == [7] and applied == {} and stats["loss"].result() == pytest.approx(loss, rel=1e-5)
    for replica in runtime.replica_weights():
        np.testing.assert_allclose(replica["w"], W0 - LR * 3 * mean["w"], rtol=1e-5)
        np.testing.assert_allclose(replica["b"], B0 - LR * 3 * mean["b"], rtol=1e-5)
    fused.prepare(False, runtime.feed_names)
    prepared = fused._prepared[False]
    calls = []
    original = prepared.call
    prepared.call = lambda *values: calls.append(1) or original(*values)
    assert fused.run(8, fetch_stats=False) == ({}, {})
    assert calls == [1] and steps_seen == [7, 8] and runtime.applied_steps == 2

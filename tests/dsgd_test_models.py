"""Small models for the tests, with a numpy twin to check dsgd's arithmetic."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

import dsgd

IN, HIDDEN, BATCH, LR = 5, 4, 6, 0.1


@functools.cache
def modules_a_user_imports() -> frozenset[str]:
    """The modules a new process holds after ``import dsgd`` and a touch of its public names (DistributedSGD, Model,
    KerasModel's module, get_dataset_shard): what importing dsgd costs a user. One process for every test asking."""
    code = ("import json, sys, dsgd; dsgd.DistributedSGD, dsgd.Model, dsgd.get_dataset_shard, "
            "dsgd.KerasModel.__module__; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return frozenset(json.loads(out.stdout))


def batch(worker_index: int, device_index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed batch replica (worker, device) sees at a given step."""
    rng = np.random.RandomState(1000 * step + 10 * worker_index + device_index)
    return rng.randn(BATCH, IN).astype(np.float32), rng.randn(BATCH).astype(np.float32)


class TanhNet(dsgd.Model):
    """pred = tanh(x W + b) v; squared error; randomly initialized variables."""

    def __init__(self, worker_index: int, device_index: int):
        self.worker_index, self.device_index, self.step = worker_index, device_index, 0
        self.x = tf.compat.v1.placeholder(tf.float32, [None, IN])
        self.y = tf.compat.v1.placeholder(tf.float32, [None])
        w = tf.compat.v1.get_variable("layer/w", [IN, HIDDEN], initializer=self.initializer("layer/w"))
        b = tf.compat.v1.get_variable("layer/b", [HIDDEN], initializer=self.initializer("layer/b"))
        v = tf.compat.v1.get_variable("out/v", [HIDDEN], initializer=self.initializer("out/v"))
        pred = tf.linalg.matvec(tf.tanh(tf.matmul(self.x, w) + b), v)
        self.loss = tf.reduce_mean(tf.square(pred - self.y))
        self.abs_error = tf.reduce_mean(tf.abs(pred - self.y))

    def initializer(self, name: str):
        """Variable ``name``'s initializer (None: TensorFlow's default, random)."""
        return tf.compat.v1.random_normal_initializer() if name == "layer/b" else None

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(LR)

    def get_metrics(self):
        return {"abs_error": self.abs_error}

    def get_feed_dict(self):
        x, y = batch(self.worker_index, self.device_index, self.step)
        self.step += 1
        return {self.x: x, self.y: y}


class PerReplicaInitNet(TanhNet):
    """TanhNet whose 'layer/w' starts at a value of its replica's own (worker + device / 10), the rest at 0.5 everywhere."""

    def initializer(self, name: str):
        if name == "layer/w":
            return tf.compat.v1.constant_initializer(self.worker_index + self.device_index / 10)
        return tf.compat.v1.constant_initializer(0.5)


def reset_data(model: TanhNet) -> None:
    model.step = 0


REPLICAS_2x1 = [(0, 0), (1, 0)]  # (worker, device) of 2 workers x 1 device


def assert_weights_close(got: dict, expected: dict) -> None:
    """Every variable of ``expected`` equals ``got``'s up to float32 rounding."""
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def weights_from_json(weights: dict) -> dict[str, np.ndarray]:
    """Weights a subprocess job printed as nested lists, as float32 arrays."""
    return {k: np.array(v, np.float32) for k, v in weights.items()}


def replica_weights(sgd) -> list[dict[str, np.ndarray]]:
    """Every replica's weights, worker then device order, read from the workers' replicas (TF1 or TF2)."""
    per_worker = sgd.foreach_worker(lambda w: w.runtime.replica_weights())
    return [r for replicas in per_worker for r in replicas]


def assert_replicas_identical(sgd, num_replicas: int) -> None:
    """Every replica on every worker holds bit-identical weights."""
    replicas = replica_weights(sgd)
    assert len(replicas) == num_replicas
    assert_all_identical(replicas)


def every_variable(worker) -> list[dict[str, np.ndarray]]:
    """Each of ``worker``'s replicas' variables (TF1 or TF2): its weights (batch-norm statistics too) and its
    optimizer's."""
    runtime = worker.runtime
    if runtime.sess is None:  # the TF2 way: eager variables
        optimizer = [{k: v.numpy() for k, v in zip(runtime.names.optimizer, r.optimizer_vars)}
                     for r in runtime.replicas]
    else:
        optimizer = runtime.sess.run([dict(o) for o in runtime.worker_graph.state_vars["optimizer"]])
    return [{**{f"weights/{k}": v for k, v in weights.items()}, **{f"optimizer/{k}": v for k, v in o.items()}}
            for weights, o in zip(runtime.replica_weights(), optimizer, strict=True)]


def assert_every_variable_unchanged_by(sgd, action: Callable[[], Any]) -> None:
    """``action()`` leaves every variable of every replica bit-identical (NaN equal to NaN)."""
    before = sgd.foreach_worker(every_variable)
    action()
    after = sgd.foreach_worker(every_variable)
    for worker_before, worker_after in zip(before, after, strict=True):
        for replica_before, replica_after in zip(worker_before, worker_after, strict=True):
            assert list(replica_after) == list(replica_before)
            for name, value in replica_before.items():
                np.testing.assert_array_equal(replica_after[name], value, err_msg=name)


def assert_warmup_and_a_skipped_step_change_nothing(sgd, log_text: Callable[[], str], num_replicas: int) -> None:
    """On an engine of a model with batch normalization under nan_policy="skip", after a first step: a warmup,
    and a step whose mean is NaN (a kernel set to NaN) skipped, change no weight, moving statistic or optimizer
    variable of any replica; the step after them trains on, the replicas identical. ``log_text()``: the dsgd
    log so far (pytest's ``caplog.text``)."""
    sgd.step()
    assert_every_variable_unchanged_by(sgd, sgd.warmup)
    good = sgd.get_weights()
    kernel = next(k for k in good if k.endswith("kernel"))
    sgd.set_weights({**good, kernel: np.full_like(good[kernel], np.nan)})
    assert_every_variable_unchanged_by(sgd, lambda: sgd.step(fetch_stats=True))
    assert "skipped a step (nan_policy='skip')" in log_text()
    sgd.set_weights(good)
    assert np.isfinite(sgd.step(fetch_stats=True)["loss"])
    assert_replicas_identical(sgd, num_replicas)


def assert_all_identical(replicas: list[dict[str, np.ndarray]]) -> None:
    """Every replica's weights (a list as ``replica_weights`` returns it) equal the first's, bit for bit."""
    for i, other in enumerate(replicas[1:], start=1):
        assert other.keys() == replicas[0].keys()
        for name in replicas[0]:
            assert np.array_equal(other[name], replicas[0][name]), f"replica {i} differs in {name}"


def set_start_weights(sgd, seed: int = 7) -> dict:
    """Fixed random weights on every replica and data counters at step 0; returns the weights."""
    rng = np.random.RandomState(seed)
    weights = {k: rng.randn(*v.shape).astype(np.float32) for k, v in sgd.get_weights().items()}
    sgd.set_weights(weights)
    sgd.foreach_model(reset_data)
    return weights


def numpy_forward(weights: dict, x: np.ndarray, y: np.ndarray):
    h = np.tanh(x @ weights["layer/w"] + weights["layer/b"])
    pred = h @ weights["out/v"]
    return h, pred, float(np.mean((pred - y) ** 2)), float(np.mean(np.abs(pred - y)))


def numpy_gradients(weights: dict, x: np.ndarray, y: np.ndarray) -> dict:
    h, pred, _, _ = numpy_forward(weights, x, y)
    dpred = 2 * (pred - y) / len(y)
    dz = np.outer(dpred, weights["out/v"]) * (1 - h ** 2)
    return {"layer/w": x.T @ dz, "layer/b": dz.sum(0), "out/v": h.T @ dpred}


def numpy_step(weights: dict, replicas: list[tuple[int, int]], step: int) -> dict:
    """Plain SGD with the mean gradient of every replica's batch, in float64."""
    grads = [numpy_gradients(weights, *batch(w, d, step)) for w, d in replicas]
    return {k: weights[k] - LR * np.mean([g[k] for g in grads], axis=0) for k in weights}


class BatchNormNet(dsgd.Model):
    """A model with a moving statistic updated through UPDATE_OPS."""

    def __init__(self, worker_index: int, device_index: int):
        self.worker_index, self.device_index, self.step = worker_index, device_index, 0
        self.x = tf.compat.v1.placeholder(tf.float32, [None, IN])
        self.y = tf.compat.v1.placeholder(tf.float32, [None])
        w = tf.compat.v1.get_variable("w", [IN])
        moving = tf.compat.v1.get_variable("moving_mean", [IN], trainable=False,
                                           initializer=tf.compat.v1.zeros_initializer())
        update = moving.assign(0.9 * moving + 0.1 * tf.reduce_mean(self.x, 0))
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, update)
        pred = tf.linalg.matvec(self.x - moving, w)
        self.loss = tf.reduce_mean(tf.square(pred - self.y))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.MomentumOptimizer(LR, 0.9)

    def get_feed_dict(self):
        x, y = batch(self.worker_index, self.device_index, self.step)
        self.step += 1
        return {self.x: x, self.y: y}


MOMENTUM = 0.9


class FixedDataMomentumNet(TanhNet):
    """Same batch every step and momentum SGD: a fault must not change the result."""

    def get_optimizer(self):
        return tf.compat.v1.train.MomentumOptimizer(LR, MOMENTUM)

    def get_feed_dict(self):
        x, y = batch(self.worker_index, self.device_index, 0)
        return {self.x: x, self.y: y}


def identical_job_replicas(replicas: list[dict], count: int) -> dict[str, np.ndarray]:
    """A job's reported replicas (JSON weights, as ``replica_weights`` lists them): ``count`` of them, bit-identical;
    their weights."""
    got = [weights_from_json(r) for r in replicas]
    assert len(got) == count
    assert_all_identical(got)
    return got[0]


def assert_job_replicas_identical_and_numpy_like(job: dict, replicas: list[tuple[int, int]]) -> None:
    """A job's reported replicas (``job["replicas"]``) are bit-identical and equal ``numpy_step`` run from its
    ``start`` weights for its ``steps``."""
    got = [weights_from_json(r) for r in job["replicas"]]
    for name in got[0]:
        for other in got[1:]:
            assert np.array_equal(other[name], got[0][name]), name
    expected = {k: np.array(v, np.float64) for k, v in job["start"].items()}
    for step in range(job["steps"]):
        expected = numpy_step(expected, replicas, step)
    assert_weights_close(got[0], expected)


def numpy_momentum_run(weights: dict, replicas: list[tuple[int, int]], steps: int) -> dict:
    """``steps`` momentum-SGD steps on FixedDataMomentumNet's fixed batches."""
    return numpy_momentum_stages(weights, [(steps, replicas)])


def numpy_momentum_stages(weights: dict, stages: list[tuple[int, list[tuple[int, int]]]]) -> dict:
    """Momentum SGD on FixedDataMomentumNet's fixed batches, in stages of (steps, the replicas each step
    averages); the momentum carries over from stage to stage (a resized engine)."""
    accum = {k: np.zeros_like(v) for k, v in weights.items()}
    for steps, replicas in stages:
        for _ in range(steps):
            grads = [numpy_gradients(weights, *batch(w, d, 0)) for w, d in replicas]
            for k in weights:
                accum[k] = MOMENTUM * accum[k] + np.mean([g[k] for g in grads], axis=0)
            weights = {k: weights[k] - LR * accum[k] for k in weights}
    return weights


class Gate:
    """A file-backed gate that holds worker code at a chosen point until the test lets it on.

    While the gate is closed, ``pass_through`` (called inside a worker)
    marks that it has arrived, then waits, at most ``MAX_WAIT_S``, until the
    test opens it. The test waits for the arrival (``wait_arrived``), so a
    fault it injects then lands while the worker is provably at that point.
    """

    MAX_WAIT_S = 120.0

    def __init__(self, path: str):
        self.path = path
        self.arrived = path + ".arrived"

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.arrived)
        open(self.path, "w").close()

    def open(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def pass_through(self) -> None:
        if not os.path.exists(self.path):
            return
        open(self.arrived, "w").close()
        deadline = time.monotonic() + self.MAX_WAIT_S
        while os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.path} stayed closed for {self.MAX_WAIT_S:.0f} s")
            time.sleep(0.01)

    def wait_arrived(self, timeout_s: float = 60.0) -> None:
        wait_until(lambda: os.path.exists(self.arrived), timeout_s)


def steps_applied(sgd) -> list[int]:
    """How many steps each worker has applied, asked of the workers directly: each answers once the step it
    is running is done, without the driver's drain (which would launch nothing but wait for everything)."""
    import ray

    return ray.get([w.applied_steps_count.remote() for w in sgd.workers], timeout=60)


class GatedWorker1Net(FixedDataMomentumNet):
    """Worker 1 passes ``gate`` before feeding each batch: held there while the test keeps it closed."""

    def __init__(self, worker_index: int, device_index: int, gate: Gate):
        super().__init__(worker_index, device_index)
        self.gate = gate

    def get_feed_dict(self):
        if self.worker_index == 1:
            self.gate.pass_through()
        return super().get_feed_dict()


class GatedStragglerNet(TanhNet):
    """Worker ``SLOW_WORKER`` passes the gate ``<gates>-<n>`` (a ``Gate``) before its n-th batch: held there for
    as long as the test keeps that gate closed, however many steps that is, instead of for a time. A test may
    hold other workers too: worker w passes ``<held[w]>-<n>``."""

    SLOW_WORKER = 2

    def __init__(self, worker_index: int, device_index: int, gates: str):
        super().__init__(worker_index, device_index)
        self.held = {self.SLOW_WORKER: gates}  # worker -> its gates' path before "-<n>"

    def get_feed_dict(self):
        if self.worker_index in self.held:
            Gate(f"{self.held[self.worker_index]}-{self.step}").pass_through()
        return super().get_feed_dict()


def held_to_build_on_worker_1(gate: Gate):
    """A model_creator of TanhNet replicas; worker 1 passes ``gate`` before building its own."""
    def create(worker_index: int, device_index: int) -> TanhNet:
        if worker_index == 1:
            gate.pass_through()
        return TanhNet(worker_index, device_index)
    return create


def fails_to_build_from_worker_2(worker_index: int, device_index: int) -> FixedDataMomentumNet:
    """FixedDataMomentumNet replicas; worker 2 (a worker added by a resize to 3) cannot build its own."""
    if worker_index >= 2:
        raise RuntimeError(f"no model for worker {worker_index}")
    return FixedDataMomentumNet(worker_index, device_index)


class KillCue:
    """A file naming a process for a worker to SIGKILL once: a fault at a point that only code inside the worker reaches.

    The test ``arm``s it with a pid; the first ``fire`` after that, in any
    worker, claims the file (a rename, so only one caller wins), kills the
    process and writes down when (``fired_at``).
    """

    def __init__(self, path: str):
        self.path = path
        self.claimed = path + ".fired"

    def arm(self, pid: int) -> None:
        with open(self.path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(self.path + ".tmp", self.path)

    def is_armed(self) -> bool:
        return os.path.exists(self.path)

    def fire(self) -> None:
        try:
            os.rename(self.path, self.claimed)
        except FileNotFoundError:
            return  # not armed, or another caller fired it
        with open(self.claimed) as f:
            pid = int(f.read())
        os.kill(pid, signal.SIGKILL)
        with open(self.claimed, "w") as f:
            f.write(repr(time.time()))

    def fired_at(self) -> float:
        """When ``fire`` killed the process (``time.time()``)."""
        with open(self.claimed) as f:
            return float(f.read())


class KillOnCue(FixedDataMomentumNet):
    """Worker 1 fires ``cue`` when it builds this model (``at="build"``) or, after a pause, feeds a batch (``at="feed"``).

    Armed after the engine started, the cue fires at "build" only in a
    replacement worker 1, during recovery. The pause at "feed" (only while
    the cue is armed) lets the driver go on into its next call first.
    """

    PAUSE_S = 2.0

    def __init__(self, worker_index: int, device_index: int, cue: KillCue, at: str):
        super().__init__(worker_index, device_index)
        self.cue, self.at = cue, at
        if at == "build" and worker_index == 1:
            cue.fire()

    def get_feed_dict(self):
        if self.at == "feed" and self.worker_index == 1 and self.cue.is_armed():
            time.sleep(self.PAUSE_S)
            self.cue.fire()
        return super().get_feed_dict()


class AdamNet(TanhNet):
    def get_optimizer(self):
        return tf.compat.v1.train.AdamOptimizer(0.01)


class NaNOnWorker1AtStep1(TanhNet):
    """Worker 1 feeds a NaN input at its second step."""

    def get_feed_dict(self):
        feed = super().get_feed_dict()
        if self.worker_index == 1 and self.step == 2:
            feed[self.x] = np.full_like(feed[self.x], np.nan)
        return feed


def known_actors() -> dict[str, tuple[str, str]]:
    """Every actor the Ray cluster has registered, alive or dead: actor id -> (class name, state).

    Read from the GCS actor table (``ray._private.state.actors``), which keeps
    dead actors too, so an actor started and killed within a call still
    counts. Ray's public state API (``ray.util.state.list_actors``) is served
    by the dashboard, which the tests start without (``include_dashboard=False``).
    """
    import ray

    return {actor_id: (info["ActorClassName"], info["State"]) for actor_id, info in ray._private.state.actors().items()}


def actors_started_since(before: dict[str, tuple[str, str]]) -> list[tuple[str, str]]:
    """(class name, state) of every actor registered after ``before = known_actors()``, sorted."""
    return sorted(info for actor_id, info in known_actors().items() if actor_id not in before)


def pushes_waiting(server) -> dict[int, list[int]]:
    """Partition -> workers it still waits for, on one parameter server ({} when nothing is in flight)."""
    import ray

    def waiting(ps) -> dict[int, list[int]]:  # runs in the server (nested: pickled by value)
        with ps.changed:
            return {j: sorted(set(range(ps.num_workers)) - set(p.waiting))
                    for j, p in ps.partitions.items() if p.waiting}

    return ray.get(server.__ray_call__.remote(waiting), timeout=30)


def server_group(sgd):
    """The engine's ``dsgd.cluster.server_group.ServerGroup`` ("ps" with several workers; else None)."""
    return sgd._cluster.servers


def ps_actors(sgd) -> list:
    """The engine's parameter-server actors, server order ([] without servers)."""
    group = server_group(sgd)
    return list(group.actors) if group else []


def wait_until(condition, timeout_s: float = 30.0, poll_s: float = 0.05) -> None:
    """Poll ``condition()`` every ``poll_s`` until it is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(poll_s)


def actor_pids(*actors) -> list[int]:
    """The processes of ``actors`` (ask a worker between steps: during one it answers only after it)."""
    import ray

    return [i.pid for i in ray.get([a.identity.remote() for a in actors], timeout=30)]


def is_dead(actor) -> bool:
    """Ray reports ``actor`` dead (a live one answers within 5 s)."""
    import ray

    try:
        ray.get(actor.identity.remote(), timeout=5)
        return False
    except ray.exceptions.RayActorError:
        return True


def kill(*actors, pids: list[int] | None = None) -> None:
    """SIGKILL the actors' processes together (``pids``, asked now if None) and wait until Ray sees each dead."""
    for pid in actor_pids(*actors) if pids is None else pids:
        os.kill(pid, signal.SIGKILL)
    for actor in actors:
        wait_until(lambda: is_dead(actor))


def engine_options(**given: Any):
    """The ``Options`` ``DistributedSGD(model_creator, **given)`` checks, every argument not given at its default."""
    import inspect

    from dsgd.config import Options

    defaults = {name: p.default for name, p in inspect.signature(dsgd.DistributedSGD).parameters.items()
                if p.default is not inspect.Parameter.empty and name != "datasets"}  # datasets: checked apart
    return Options.checked(**{**defaults, **given})


def local_worker(model_creator: Callable, devices_per_worker: int = 1, state: dict | None = None):
    """A dsgd worker built in this process (no Ray) as a worker actor builds it (``SGDWorker.setup``), from
    ``state`` if given: exchange "alone", so a step applies its replicas' mean. ``setup`` freezes the heap for a
    worker process's life; this process's heap is unfrozen again (its graphs can be freed)."""
    import gc

    from dsgd.config import WorkerConfig
    from dsgd.sgd_worker import SGDWorker

    worker = SGDWorker(0, WorkerConfig(exchange="alone", devices_per_worker=devices_per_worker, gpu=False,
                                       all_reduce_alg="simple", cpus_per_worker=1, step_timeout_s=60.0,
                                       startup_timeout_s=60.0))
    try:
        worker.setup(model_creator, state)
    finally:
        gc.unfreeze()
    return worker

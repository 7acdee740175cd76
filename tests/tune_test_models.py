"""A TF1 model for Ray Tune trials with its numpy twin, and how the tests run Tune and read a trial's checkpoint.

Worker processes import this module by name (tests/ is on their PYTHONPATH).
"""

import os
import signal

import numpy as np
import tensorflow as tf
from ray import tune

import dsgd
from dsgd.driver import checkpoint
from dsgd_test_models import batch

W_TRUE = np.array([1.0, -2.0, 0.5, 3.0, -1.0], np.float32)
TIME_BUDGET_S = 240  # bound on each Tune run; the runs here take seconds


class Regression(dsgd.Model):
    """y = x . W_TRUE on a fixed batch per replica, w from zero, momentum SGD at config's lr.

    With ``kill_at`` set, worker 1 SIGKILLs its own process at that call of
    get_feed_dict (its step id), once: it leaves ``marker`` behind. With
    ``marker`` set, worker 0 appends a line to ``calls_file(config)`` at every
    call: the batches it computed, across restarts of its trial.
    """

    def __init__(self, worker_index, device_index, config):
        self.worker_index, self.calls = worker_index, 0
        self.kill_at, self.marker = config.get("kill_at"), config.get("marker")
        self.x_value, _ = batch(worker_index, device_index, 0)
        self.x = tf.compat.v1.placeholder(tf.float32, [None, len(W_TRUE)])
        self.y = tf.compat.v1.placeholder(tf.float32, [None])
        w = tf.compat.v1.get_variable("w", [len(W_TRUE)], initializer=tf.compat.v1.zeros_initializer())
        self.loss = tf.reduce_mean(tf.square(tf.linalg.matvec(self.x, w) - self.y))
        self.optimizer = tf.compat.v1.train.MomentumOptimizer(config["lr"], config.get("momentum", 0.0))

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return self.optimizer

    def get_metrics(self):
        return {"rmse": tf.sqrt(self.loss)}

    def get_feed_dict(self):
        if self.worker_index == 1 and self.calls == self.kill_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.calls += 1
        if self.worker_index == 0 and self.marker:
            with open(calls_file(self.kill_at, self.marker), "a") as f:
                f.write("batch\n")
        return {self.x: self.x_value, self.y: self.x_value @ W_TRUE}


def calls_file(kill_at, marker) -> str:
    return f"{marker}.worker-0-batches.kill-at-{kill_at}"


def regression_creator(config):
    return lambda worker_index, device_index: Regression(worker_index, device_index, config)


def numpy_descent(lr: float, replicas: list, steps: int, momentum: float = 0.0) -> tuple[np.ndarray, list[float]]:
    """Gradient descent with momentum (TF1's MomentumOptimizer) on Regression, on the mean of the replicas'
    gradients: the weights after ``steps`` steps, and the mean loss over replicas before each step."""
    xs = [batch(w, d, 0)[0].astype(np.float64) for w, d in replicas]
    w, velocity, losses = np.zeros(len(W_TRUE)), np.zeros(len(W_TRUE)), []
    for _ in range(steps):
        residuals = [x @ w - x @ W_TRUE for x in xs]
        losses.append(float(np.mean([np.mean(r ** 2) for r in residuals])))
        velocity = momentum * velocity + np.mean([2 * x.T @ r / len(r) for x, r in zip(xs, residuals)], axis=0)
        w = w - lr * velocity
    return w, losses


def run(trainable, param_space, tmp_path, iterations, callbacks=(), **tune_config):
    """Tuner.fit with a stop, a time budget, one restart of a failed trial, quiet output and Tune ``callbacks``; the
    ResultGrid, its trials in config order."""
    tuner = tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(metric="loss", mode="min", time_budget_s=TIME_BUDGET_S, **tune_config),
        run_config=tune.RunConfig(name="run", storage_path=str(tmp_path), verbose=0, callbacks=list(callbacks),
                                  stop={"training_iteration": iterations},
                                  failure_config=tune.FailureConfig(max_failures=1)))
    handler = signal.getsignal(signal.SIGINT)
    try:
        results = tuner.fit()
    finally:  # Tune leaves its own SIGINT handler installed in the test process
        signal.signal(signal.SIGINT, handler)
    assert results.num_errors == 0, [r.error for r in results]
    return results


def final_state(result) -> dict:
    with result.checkpoint.as_directory() as directory:
        with np.load(os.path.join(directory, checkpoint.CHECKPOINT_FILE)) as f:
            return {k: f[k] for k in f.files}

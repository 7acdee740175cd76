"""Misuse gets a clear error that names what was wrong, quickly, never a hang."""

import numpy as np
import pytest
import tensorflow as tf

import dsgd
from dsgd_test_models import TanhNet, actors_started_since, known_actors, local_worker


def case(message, **kwargs):
    """A bad-argument case, named by its arguments (``num_workers=0``)."""
    return pytest.param(kwargs, message, id=",".join(f"{k}={v!r}" for k, v in kwargs.items()))


@pytest.mark.parametrize("kwargs, message", [
    case("strategy must be one of \\('ps', 'simple'\\), got 'allreduce'", strategy="allreduce"),
    case("num_workers must be an integer >= 1, got 0", num_workers=0),
    case("num_workers must be an integer >= 1, got 1.5", num_workers=1.5),
    case("num_workers must be an int or a tuple \\(min, max\\)", num_workers=(1, 2, 3)),
    case("num_workers must be an integer >= 1, got 0 as min of num_workers=\\(min, max\\)", num_workers=(0, 2)),
    case("num_workers=\\(min, max\\) needs min <= max, got \\(3, 2\\)", num_workers=(3, 2)),
    case("resize_interval_s must be a positive number of seconds, got 0", resize_interval_s=0),
    case("devices_per_worker must be an integer >= 1, got 0", devices_per_worker=0),
    case("gpu must be True or False, got 1", gpu=1),
    case("grad_shard_bytes must be an integer >= 0, got -1", grad_shard_bytes=-1),
    case("all_reduce_alg must be one of \\('simple', 'nccl'\\), got 'ring'", all_reduce_alg="ring"),
    case("all_reduce_alg='nccl' needs gpu=True", all_reduce_alg="nccl"),
    case("num_parameter_servers must be an integer >= 1, got 0", num_parameter_servers=0),
    case("nan_policy must be one of \\('raise', 'skip', 'ignore'\\), got 'drop'", nan_policy="drop"),
    case("use_ops must be None, True or False, got 'yes'", use_ops="yes"),
    case("use_ops must be None, True or False, got 1", use_ops=1),
    case("max_failures must be an integer >= 0, got -1", max_failures=-1),
    case("timeout_s must be a positive number of seconds, got 0", timeout_s=0),
    case("startup_timeout_s must be a positive number of seconds, got -5", startup_timeout_s=-5),
    case("logdir must be a directory path \\(str\\) or None, got 3", logdir=3),
    case("batch_size must be an integer >= 1, got 0", batch_size=0),
    case("server_resource must be None or the name of a Ray custom resource", server_resource=""),
    case("server_resource must name a custom resource .* not Ray's own 'CPU'", server_resource="CPU"),
    case("server_resource needs strategy='ps' .* got server_resource='dsgd_server' with strategy='simple'",
         server_resource="dsgd_server", strategy="simple"),
    # Checked against the Ray cluster (8 CPUs, no GPU), still before any actor starts.
    case("gpu=True with 1 workers x 1 GPU.*largest Ray node has 0", gpu=True),
    case("each worker needs 64 CPU on one node, but the largest Ray node has 8", cpus_per_worker=64),
    case("needs 10 CPU in all, but the Ray cluster has 8", num_workers=5, cpus_per_worker=2),
    case("server_resource='dsgd_server': no live Ray node has that resource, so the parameter servers have no "
         "node of their own", num_workers=2, server_resource="dsgd_server"),
])
def test_bad_arguments_fail_fast_naming_the_argument(ray_session, kwargs, message):
    before = known_actors()
    with pytest.raises(ValueError, match=message):
        dsgd.DistributedSGD(TanhNet, **kwargs)
    assert actors_started_since(before) == []  # refused before asking Ray for any actor


def test_model_creator_must_be_callable(ray_session):
    with pytest.raises(TypeError, match="model_creator must be callable"):
        dsgd.DistributedSGD("TanhNet")


def broken_creator(worker_index, device_index):
    raise RuntimeError("no such dataset: /data/imagenet")


def returns_a_dict(worker_index, device_index):
    return {"loss": 0}


class NoVariables(dsgd.Model):
    def __init__(self, worker_index, device_index):
        self.loss = tf.constant(1.0)

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.GradientDescentOptimizer(0.1)


class Wide(TanhNet):
    """Adds a variable whose shape depends on where the replica is."""

    def __init__(self, worker_index, device_index):
        super().__init__(worker_index, device_index)
        width = 3 + worker_index + (device_index if self.by_device else 0)
        extra = tf.compat.v1.get_variable("extra", [width])
        self.loss = self.loss + tf.reduce_sum(extra)


class WideByDevice(Wide):
    by_device = True


class WideByWorker(Wide):
    by_device = False


class FeedsForeignTensor(TanhNet):
    def get_feed_dict(self):
        return {**super().get_feed_dict(), "no_such_tensor:0": np.zeros(1)}


def test_model_creator_error_shows_user_message_and_traceback(ray_session):
    with pytest.raises(dsgd.ModelCreatorError) as info:
        dsgd.DistributedSGD(broken_creator, num_workers=1)
    text = str(info.value)
    assert "model_creator raised on worker 0, device 0" in text
    assert "RuntimeError: no such dataset: /data/imagenet" in text
    assert "in broken_creator" in text  # the user's own frame


# The worker's own refusals, on a worker built in this process as an actor builds it (``local_worker``); that the
# engine raises a worker's refusal is the test above's (and tests/test_model_checks.py's).

def test_model_creator_must_return_a_model():
    with pytest.raises(dsgd.ModelCreatorError, match="must return a dsgd.Model, got dict"):
        local_worker(returns_a_dict)


def test_model_without_trainable_variables_is_rejected():
    with pytest.raises(dsgd.ModelCreatorError, match="has no trainable variables"):
        local_worker(NoVariables)


def test_replicas_with_different_variables_are_rejected():
    with pytest.raises(dsgd.WorkerMismatchError, match="replica 1 on worker 0 built different variables.*extra"):
        local_worker(WideByDevice, devices_per_worker=2)


def test_workers_with_different_variables_are_rejected(ray_session):
    with pytest.raises(dsgd.WorkerMismatchError, match="worker 1 built a model that differs from worker 0's.*extra"):
        dsgd.DistributedSGD(WideByWorker, num_workers=2)


def test_feed_of_unknown_tensor_names_it(ray_session):
    message = "names 'no_such_tensor:0', which is not a tensor of the model's graph"
    with dsgd.DistributedSGD(FeedsForeignTensor, num_workers=1) as sgd:
        with pytest.raises(dsgd.DSGDError, match=message):
            sgd.step(fetch_stats=True)
        # A step submitted without stats reports its failure on the next call.
        assert sgd.step() is None
        with pytest.raises(dsgd.DSGDError, match=message):
            sgd.get_weights()

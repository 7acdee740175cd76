"""The worker process's TensorFlow settings for the TF2 runtime: one device per replica, the CPUs as threads.

Eager TensorFlow takes its devices and thread pools once per process,
when its context starts; ``configure`` sets them before that, and checks
them if the context started already (a model import that ran an op).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from dsgd.config import WorkerConfig
from dsgd.errors import ModelCreatorError
from dsgd.worker import tf_logs
from dsgd.worker.runtime import thread_counts

logger = logging.getLogger(__name__)


def configure(config: WorkerConfig) -> None:
    """Logical CPU devices, one per replica (GPUs: memory growth), and the worker's CPUs as threads."""
    intra_op, inter_op = thread_counts(config)
    kind = "GPU" if config.gpu else "CPU"
    with tf_logs.start_up_lines_hidden():  # the devices listed, the context starts: CUDA's probe, on any machine
        _set_devices(config, intra_op, inter_op)
        have = len(tf.config.list_logical_devices(kind))
    if have < config.devices_per_worker:
        raise ModelCreatorError(
            f"the worker has {have} {kind} devices for devices_per_worker={config.devices_per_worker}: TensorFlow "
            "started in this worker process before dsgd could set up one device per replica (an op run at "
            "import?); run TensorFlow only inside model_creator")


def _set_devices(config: WorkerConfig, intra_op: int, inter_op: int) -> None:
    try:
        if config.gpu:
            for gpu in tf.config.list_physical_devices("GPU"):
                tf.config.experimental.set_memory_growth(gpu, True)
        else:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * config.devices_per_worker)
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError as e:  # the context started already: it must have the devices
        logger.debug("TensorFlow's context started before the worker configured it: %s", e)

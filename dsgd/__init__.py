"""dsgd: synchronous sharded-parameter-server SGD for TensorFlow models on Ray.

Names are imported on first use, so that processes which need only a light
module (the parameter-server actors import ``dsgd.ps_actor``) do not pay for
importing TensorFlow. Importing dsgd before TensorFlow keeps TensorFlow's
start-up lines out of stderr unless ``TF_CPP_MIN_LOG_LEVEL=0`` (``dsgd.worker.tf_logs``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsgd.worker import tf_logs

tf_logs.install()

_EXPORTS = {
    "DistributedSGD": "dsgd.distributed_sgd",
    "Model": "dsgd.model",
    "TF2Model": "dsgd.model",
    "KerasModel": "dsgd.integrations.keras",
    "KerasTrainer": "dsgd.integrations.keras_trainer",  # Keras 3: compile, fit, evaluate, predict, callbacks  # needs tf_keras (pip install 'dsgd[keras]') only when used
    "get_dataset_shard": "dsgd.integrations.data",  # DistributedSGD(datasets=...) needs Ray Data (pip install 'dsgd[data]')
    "ActorFailure": "dsgd.errors",
    "DSGDError": "dsgd.errors",
    "DSGDTimeoutError": "dsgd.errors",
    "ModelCreatorError": "dsgd.errors",
    "NonFiniteGradientError": "dsgd.errors",
    "WorkerMismatchError": "dsgd.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dsgd.integrations.data import get_dataset_shard
    from dsgd.distributed_sgd import DistributedSGD
    from dsgd.errors import (ActorFailure, DSGDError, DSGDTimeoutError, ModelCreatorError,
                             NonFiniteGradientError, WorkerMismatchError)
    from dsgd.integrations.keras import KerasModel
    from dsgd.integrations.keras_trainer import KerasTrainer
    from dsgd.model import Model, TF2Model


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

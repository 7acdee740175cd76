"""dsgd: synchronous sharded-parameter-server SGD for TensorFlow models on Ray."""

from dsgd.distributed_sgd import DistributedSGD
from dsgd.errors import DSGDError, ModelCreatorError, WorkerMismatchError
from dsgd.model import Model

__all__ = ["DistributedSGD", "DSGDError", "Model", "ModelCreatorError", "WorkerMismatchError"]

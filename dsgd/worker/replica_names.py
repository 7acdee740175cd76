"""The names of a worker's replicas: the one place that knows the scope names.

Variables are named ``device_<i>/<name>`` in the worker and ``<name>`` to the
user; a replica's apply ops (and the optimizer's slots made there) live under
``device_<i>_apply``.
"""

from __future__ import annotations

import re

from dsgd.errors import ModelCreatorError

_REPLICA_PREFIX = re.compile(r"^device_\d+(_apply)?/")


def replica_scope(device_index: int) -> str:
    """The variable scope of a replica: 'device_1'."""
    return f"device_{device_index}"


def apply_scope(device_index: int) -> str:
    """The name scope of a replica's apply ops (and the optimizer's slots made there)."""
    return f"{replica_scope(device_index)}_apply"


def strip_scope(name: str, device_index: int) -> str:
    """'device_1/dense/kernel:0' -> 'dense/kernel'; a variable outside the replica's scope is an error."""
    prefix = replica_scope(device_index) + "/"
    name = name.split(":")[0]
    if not name.startswith(prefix):
        raise ModelCreatorError(
            f"variable {name!r} of replica {device_index} was created outside its "
            f"variable scope {prefix!r}; create variables inside model_creator "
            "without opening an absolute scope")
    return name[len(prefix):]


def strip_any_scope(name: str) -> str:
    """'device_0_apply/w/Momentum:0' -> 'w/Momentum': an optimizer variable's name to the user."""
    return _REPLICA_PREFIX.sub("", name.split(":")[0])


def device(index: int, gpu: bool) -> str:
    """The TensorFlow device of replica ``index``."""
    return f"/gpu:{index}" if gpu else f"/cpu:{index}"

"""A TF2 worker's replicas: the user's ``TF2Model`` per device, built eagerly and checked.

``build`` calls ``model_creator`` once per device under ``tf.device``,
checks what it returns (a ``TF2Model``, a Keras 3 optimizer, variables on
the replica's device, the same variables on every replica) and builds each
optimizer's state, its updates on TensorFlow's fused kernels where they
compute the same (``fused_updates``). Variables are matched across replicas and workers by
position: Keras names every replica's layers anew (``dense``, then
``dense_1``), so the names users see (``Names``) are worker 0's first
replica's.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from dsgd.errors import ModelCreatorError, WorkerMismatchError
from dsgd.model import Model, TF1ModelOutsideGraph, TF2Model
from dsgd.wire import partitions
from dsgd.worker.replica_names import device


@dataclass(frozen=True)
class Tf2Replica:
    """One device's replica; ``train_vars`` in exchange order (back-propagation's: last layers first)."""

    index: int
    device: str
    model: TF2Model
    optimizer: Any
    train_vars: tuple  # get_variables(), reversed
    state_vars: tuple  # get_state_variables()
    weights: tuple  # what get_weights holds (TF2Model._dsgd_weights)
    first_batch: Any  # its first get_batch(), read at build for the step's input signature

    @property
    def optimizer_vars(self) -> list:
        return list(self.optimizer.variables)


@dataclass(frozen=True)
class Names:
    """The users' names of a replica's weights, exchange tensors and optimizer variables, by position."""

    weights: tuple[str, ...]
    exchange: tuple[str, ...]
    optimizer: tuple[str, ...]

    @classmethod
    def of(cls, replica: Tf2Replica) -> "Names":
        return cls(_unique(_name(v) for v in replica.weights),
                   _unique(_name(v) for v in replica.train_vars + replica.state_vars),
                   _unique(_name(v) for v in replica.optimizer_vars))


def build(worker_index: int, devices: int, gpu: bool, model_creator: Callable[[int, int], Any]) -> list[Tf2Replica]:
    """Every device's replica, checked to agree with replica 0 by position (shape and dtype)."""
    replicas = [_build_replica(worker_index, i, device(i, gpu), model_creator) for i in range(devices)]
    names = Names.of(replicas[0])
    expected = specs(replicas[0], names)
    for r in replicas[1:]:
        got = specs(r, names)
        if _shapes(got) != _shapes(expected):
            raise WorkerMismatchError(
                f"replica {r.index} on worker {worker_index} built different variables than replica 0: "
                f"{partitions.spec_difference(sum(got, ()), sum(expected, ()))}")
    return replicas


def specs(replica: Tf2Replica, names: Names) -> tuple[tuple[partitions.VarSpec, ...], ...]:
    """The replica's weights, exchange tensors and optimizer variables as specs named by ``names``."""
    return (tuple(_spec(n, v) for n, v in zip(names.weights, replica.weights)),
            tuple(_spec(n, v) for n, v in zip(names.exchange, replica.train_vars + replica.state_vars)),
            tuple(_spec(n, v) for n, v in zip(names.optimizer, replica.optimizer_vars)))


def _build_replica(worker_index: int, i: int, where_device: str, model_creator: Callable) -> Tf2Replica:
    where = f"worker {worker_index}, device {i}"
    with tf.device(where_device):
        try:
            model = model_creator(worker_index, i)
        except TF1ModelOutsideGraph:
            if i == 0:
                raise  # a TF1 model: the worker builds it in a graph
            raise ModelCreatorError(f"model_creator returned a TF2 model on device 0 and made a TF1 dsgd.Model on "
                                    f"{where}: build one kind of model in an engine") from None
        except Exception as e:
            raise ModelCreatorError(f"model_creator raised on {where}: {type(e).__name__}: {e}\n"
                                    f"{traceback.format_exc()}") from e
        if isinstance(model, Model):
            raise ModelCreatorError(
                f"model_creator returned a TF1 dsgd.Model ({type(model).__name__}) on {where}, where replica 0 "
                "is a TF2 model (dsgd.TF2Model or a Keras 3 KerasModel): build one kind of model in an engine")
        if not isinstance(model, TF2Model):
            raise ModelCreatorError(f"model_creator must return a dsgd.Model, a dsgd.TF2Model or a "
                                    f"dsgd.KerasModel, got {type(model).__name__} on {where}")
        train_vars = _variables(model, "get_variables", where)
        state_vars = _variables(model, "get_state_variables", where)
        if not train_vars:
            raise ModelCreatorError(f"get_variables() returned no variables on {where}: return the trainable "
                                    "variables the loss depends on")
        weights = _variables(model, "_dsgd_weights", where)
        optimizer = _call(model, "get_optimizer", where)
        from dsgd.integrations.keras_backend import check_optimizer  # Keras only where a TF2 model is built
        from dsgd.worker.tf2.fused_updates import fuse_updates

        check_optimizer(optimizer, f"get_optimizer() on {where}")
        optimizer.build(list(train_vars))
        fuse_updates(optimizer)
        first_batch = _call(model, "get_batch", where)
    for v in weights + state_vars + train_vars:
        _check_device(v, where_device, where)
    return Tf2Replica(i, where_device, model, optimizer, tuple(reversed(train_vars)), tuple(state_vars),
                      tuple(weights), first_batch)


def _call(model: TF2Model, method: str, where: str, *args: Any) -> Any:
    try:
        return getattr(model, method)(*args)
    except Exception as e:
        raise ModelCreatorError(f"{type(model).__name__}.{method}() raised on {where}: "
                                f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from e


def _variables(model: TF2Model, method: str, where: str) -> list:
    found = list(_call(model, method, where) or [])
    for v in found:
        if not isinstance(tf_variable(v), tf.Variable):
            raise ModelCreatorError(
                f"{type(model).__name__}.{method}() on {where} returned {type(v).__name__}, not a variable "
                "(tf.Variable or a Keras variable on the TensorFlow backend)")
    return found


def tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` of ``v``: itself, or a Keras 3 variable's value."""
    return v if isinstance(v, tf.Variable) else getattr(v, "value", None)


def _check_device(v: Any, where_device: str, where: str) -> None:
    wanted = tf.DeviceSpec.from_string(where_device)
    have = tf.DeviceSpec.from_string(tf_variable(v).device)
    if (have.device_type or "").upper() != wanted.device_type.upper() or have.device_index != wanted.device_index:
        raise ModelCreatorError(
            f"variable {_name(v)!r} on {where} lives on {tf_variable(v).device}, not the replica's device "
            f"{where_device}: create every variable inside model_creator, once per call (a model or "
            "variable made before, e.g. in the driver, or shared between replicas?)")


def _name(v: Any) -> str:
    """A Keras variable's path, or a tf.Variable's name without ':0'."""
    return getattr(v, "path", None) or v.name.split(":")[0]


def _unique(names) -> tuple[str, ...]:
    """``names`` with repeats numbered (eager ``tf.Variable``s made without a name are all 'Variable')."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, -1) + 1
        out.append(n if seen[n] == 0 else f"{n}_{seen[n]}")
    return tuple(out)


def _spec(name: str, v: Any) -> partitions.VarSpec:
    return partitions.VarSpec(name, tuple(v.shape), np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype))


def _shapes(groups: Sequence[Sequence[partitions.VarSpec]]) -> list:
    return [[(s.shape, s.dtype) for s in group] for group in groups]

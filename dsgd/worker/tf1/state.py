"""A worker's state in its TF1 graph: initializing the variables, the optimizer's, and writing state groups.

The state groups are "weights" (the variables each replica's
``model_creator`` call created) and "optimizer" (its optimizer's slots and
counters), per replica, keyed by name without the replica scope.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from dsgd.errors import DSGDError, ModelCreatorError
from dsgd.worker.replica_names import strip_any_scope


def optimizer_state(optimizer: tf.compat.v1.train.Optimizer, replica_index: int) -> dict[str, tf.Variable]:
    """The optimizer's slots and counters, keyed like 'w/Momentum', 'beta1_power'."""
    state = {}
    for v in optimizer.variables():
        name = strip_any_scope(v.name)
        if name in state:
            raise ModelCreatorError(f"two optimizer variables of replica {replica_index} are both named {name!r}")
        state[name] = v
    return state


class StateAssigns:
    """Writes state groups onto every replica: per variable, a placeholder and its assigns, built on first use.

    Only loading state runs them (``set_weights``, a restore, a recovery's
    copy, a new worker's initial weights when they differ), never a step, so
    they are not built with the graph; a worker that never loads state never
    builds them. A worker built from a state loads it without them, through
    its initializers (``initial_feeds``).
    """

    def __init__(self, graph: tf.Graph, state_vars: dict[str, tuple[dict[str, tf.Variable], ...]]):
        self._graph = graph
        self._state_vars = state_vars
        self._built: dict[tuple[str, str], tuple[tf.Tensor, list[tf.Operation]]] = {}  # (group, name) -> ...

    def run(self, session: tf.compat.v1.Session, group: str, values: dict[str, np.ndarray]) -> None:
        """Assign ``values`` (name -> array) of ``group`` on every replica, in one session run."""
        if not values:
            return
        feeds, targets = {}, []
        for name, value in values.items():
            placeholder, assigns = self._assigns(group, name)
            feeds[placeholder] = value
            targets += assigns
        session.run(targets, feed_dict=feeds)

    def initial_feeds(self, state: dict) -> tuple[dict[tf.Tensor, np.ndarray], dict[str, dict[str, np.ndarray]]]:
        """Feeds of the initializers' value inputs that load ``state`` (``get_state()``'s groups) onto every
        replica as the variables are initialized, and the values (by group, then name) that must be assigned
        (``run``) after initializing instead."""
        inputs: dict[str, list[tuple[tf.Tensor | None, str, np.ndarray]]] = {}
        for group, per_replica in self._state_vars.items():
            values = state[group]
            missing, unknown = sorted(set(per_replica[0]) - set(values)), sorted(set(values) - set(per_replica[0]))
            if missing or unknown:
                raise DSGDError(f"the state to start from is of another model: its {group} lack {missing} and have "
                                f"{unknown}, which this model does not")
            inputs[group] = [(_initial_value_input(variable), name, values[name])
                             for variables in per_replica for name, variable in variables.items()]
        counts = collections.Counter(tensor for entries in inputs.values() for tensor, _, _ in entries)
        feeds, assigned_after = {}, {}
        for group, entries in inputs.items():
            for tensor, name, value in entries:
                if tensor is not None and counts[tensor] == 1:
                    feeds[tensor] = value
                else:
                    assigned_after.setdefault(group, {})[name] = value
        return feeds, assigned_after

    def _assigns(self, group: str, name: str) -> tuple[tf.Tensor, list[tf.Operation]]:
        key = group, name
        if key not in self._built:
            per_replica = self._state_vars[group]
            first = per_replica[0][name]
            with self._graph.as_default(), tf.compat.v1.name_scope(f"set_{group}/"):  # the one scope, reentered
                placeholder = tf.compat.v1.placeholder(first.dtype.base_dtype, first.shape)
                self._built[key] = placeholder, [variables[name].assign(placeholder).op for variables in per_replica]
        return self._built[key]


def initialize(session: tf.compat.v1.Session, graph: tf.Graph, state_assigns: StateAssigns,
               state: dict | None) -> None:
    """Initialize every variable of ``graph``: the global ones, then local variables and tables.

    Local variables and tables come second because their initial values may
    read a weight (e.g. a cached copy of one). With ``state``, the global
    initializer is fed ``state``'s value as each state variable's initial
    value: the variables start from it in the same run, with no random
    initial values drawn and no assign ops built. A variable whose
    initializer cannot be fed so (its initial value shared with another
    variable, or an initializer of another kind) is assigned afterwards.
    """
    feeds, assigned_after = state_assigns.initial_feeds(state) if state is not None else ({}, {})
    with graph.as_default():
        session.run(tf.compat.v1.global_variables_initializer(), feed_dict=feeds)
        for group, values in assigned_after.items():
            state_assigns.run(session, group, values)
        session.run(tf.group(tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()))


def _initial_value_input(variable: tf.Variable) -> tf.Tensor | None:
    """The tensor ``variable``'s initializer assigns (feeding it sets the initial value), None if not a plain
    assign."""
    init = variable.initializer
    if init.type in ("AssignVariableOp", "Assign") and len(init.inputs) == 2:
        return init.inputs[1]
    return None

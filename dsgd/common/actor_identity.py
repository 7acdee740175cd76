"""Who an actor is: what every dsgd actor answers when the driver asks.

The driver names actors in its errors ("worker 1 failed ... (pid 4242 on node
3fa2c1e0)") by matching the actor id a Ray error carries against these
answers, and plans parameter servers from the workers' nodes. The same call
is the liveness check, so it stays cheap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class ActorIdentity:
    kind: str  # "worker" or "parameter server"
    index: int
    actor_id: str  # hex, as Ray errors report it
    node_id: str
    pid: int

    def __str__(self) -> str:
        return f"{self.kind} {self.index}"

    @property
    def where(self) -> str:
        return f"pid {self.pid} on node {self.node_id[:8]}"


def current(kind: str, index: int) -> ActorIdentity:
    """The identity of the actor this runs in."""
    context = ray.get_runtime_context()
    return ActorIdentity(kind, index, context.get_actor_id(), context.get_node_id(), os.getpid())

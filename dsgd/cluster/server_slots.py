"""The engine's parameter-server groups, the slots they move through, and connecting the workers to them.

A group (``dsgd.cluster.server_group.ServerGroup``) sits in one of three slots:

- ``current``: the group the workers push to (None without servers);
- ``staged``: a grow's, started while its new workers build, made current
  by ``promote_staged`` once they are in, or killed by ``drop_staged`` if the
  grow fails;
- ``kept``: the group of the count before the last resize, idle, made
  current again by ``reuse_kept`` on a resize back (a server holds nothing
  across steps, so two groups of one plan are interchangeable).

``vacate`` then ``retire`` move the group the workers leave to ``kept``
(killing the group kept before). Connecting is two calls that overlap: the relaying servers
learn the others (``connect_relays``) while every worker attaches to the
group (``connect_workers``).
"""

from __future__ import annotations

from typing import Sequence

from dsgd.cluster.room import check_server_memory
from dsgd.cluster.server_group import ServerGroup
from dsgd.common.calls import Calls
from dsgd.common.stopwatch import Phases


class ServerSlots:
    """The current, staged and kept server groups of one engine."""

    def __init__(self, calls: Calls):
        self.calls = calls
        self.current: ServerGroup | None = None
        self.staged: ServerGroup | None = None
        self.kept: ServerGroup | None = None

    # ---- transitions ------------------------------------------------------

    def stage(self, group: ServerGroup) -> None:
        """``group`` (planned for a grow's count) starts while the new workers build; ``promote_staged`` takes
        it up."""
        self.staged = group
        group.start()

    def drop_staged(self) -> None:
        """A grow failed: kill its group (no-op without one)."""
        if self.staged is not None:
            self.staged.kill()
            self.staged = None

    def promote_staged(self) -> bool:
        """The staged group becomes current; whether there was one."""
        if self.staged is None:
            return False
        self.current, self.staged = self.staged, None
        return True

    def vacate(self) -> ServerGroup | None:
        """The workers leave the current group (a new count's exchange comes): it is returned, for ``retire``;
        no group is current until one is connected."""
        previous, self.current = self.current, None
        return previous

    def retire(self, group: ServerGroup | None) -> None:
        """Keep ``group``, which the workers left, idle for a resize back; the group kept before is killed."""
        if self.kept is not None and self.kept is not self.current:
            self.kept.kill()
        self.kept = group if group is not self.current else None

    def reuse_kept(self, planned: ServerGroup) -> ServerGroup | None:
        """The kept group if ``planned`` plans the same and all its servers answer (a resize back), else None
        (and it is killed)."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        if kept.plan() == planned.plan() and not self.calls.unresponsive(kept.actors):
            return kept
        kept.kill()
        return None

    def actors(self) -> list:
        """The server actors of every group, in every slot."""
        groups = {id(g): g for g in (self.current, self.staged, self.kept) if g is not None}
        return [actor for g in groups.values() for actor in g.actors if actor is not None]

    def kill(self) -> None:
        """Kill every group, in every slot."""
        if self.current is not None:
            self.current.kill()
        self.drop_staged()
        self.retire(None)
        self.current = None

    # ---- connecting -----------------------------------------------------------

    def start_current(self, planned: ServerGroup, workers: Sequence, phases: Phases) -> None:
        """``planned`` (or the kept group of its plan, ``reuse_kept``) becomes current, and the workers connect.

        A group started anew is checked against its nodes' free memory first (``room.check_server_memory``).

        The workers are asked to connect as soon as the servers are asked to
        start: each builds its exchange's graph while the server processes
        start, then attaches to them (a bounded wait in the worker). So
        "connect" includes the wait for new servers to start.
        """
        with phases("start servers"):
            self.current = self.reuse_kept(planned)
            started = None
            if self.current is None:
                check_server_memory(planned, workers, self.calls)
                self.current = planned
                started = planned.start()
        with phases("connect"):
            connecting = self.connect_workers(workers)
            if started is not None:
                self.calls.identify(started)
            self.connect_relays()
            self.calls.call_startup(connecting, "the workers to connect to the parameter servers")

    def connect(self, workers: Sequence) -> None:
        """The relaying servers, then every worker, connect to the current group (after servers were replaced)."""
        self.connect_relays()
        self.calls.call_startup(self.connect_workers(workers), "the workers to connect to the parameter servers")

    def connect_relays(self) -> None:
        self.calls.call_startup(self.current.connect_relays(), "the parameter servers that relay to learn the others")

    def connect_workers(self, workers: Sequence) -> list:
        """Refs of every worker's ``connect`` to the current group."""
        group = self.current
        return [w.connect.remote(group.layout, group.placement, group.actors, group.routes(i), group.rounds[i])
                for i, w in enumerate(workers)]

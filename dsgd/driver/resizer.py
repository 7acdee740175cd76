"""Elastic resizing from the driver's side: when to resize, and the steps around ``Cluster.resize``.

``resize`` settles the steps in flight, has the cluster start or stop
workers and re-plan the parameter servers, gives the new workers the
survivors' state, and goes on from ``num_steps``. An elastic engine below
its maximum grows into the room there is, at most every
``resize_interval_s`` (``grow_if_room``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dsgd.common.stopwatch import Phases
from dsgd.errors import ActorFailure, DSGDError

if TYPE_CHECKING:
    from dsgd.driver.ledger import StepLedger

logger = logging.getLogger(__name__)


def _log_resize(old: int, n: int, phases: Phases) -> None:
    """A resize's log line (INFO for a grow, WARNING for a shrink) with its phases' times, which the record
    also holds as ``resize_phases`` (``{phase: seconds}``)."""
    if n > old:
        what = f"grew from {old} to {n} workers: started workers {list(range(old, n))}"
    else:
        what = f"shrank from {old} to {n} workers: stopped workers {list(range(n, old))}"
    logger.log(logging.INFO if n > old else logging.WARNING, "%s in %.2f s (%s)", what, phases.total(),
               phases.describe(), extra={"resize_phases": dict(phases.seconds)})


class Resizer:
    """The resizes of one engine's ``ledger``; ``pending`` while one is not finished (``finish``)."""

    def __init__(self, ledger: StepLedger):
        self.ledger = ledger
        self.cluster = ledger.cluster
        self.joining: set[int] | None = None  # a resize not finished: workers replaced during it, not given the state
        self._phases = Phases()  # the last resize's, for its log line
        self._old = 0  # the last resize's old count
        self._last_look = time.monotonic()  # an elastic engine last looked for room to grow

    @property
    def pending(self) -> bool:
        return self.joining is not None

    def resize(self, n: int) -> None:
        """After the steps in flight, start or stop workers so that ``n`` run; steps go on from ``num_steps``.

        New workers build from worker 0's state, read as they start. If they
        cannot start or build (``Cluster.resize``), the engine is unchanged and
        the error raised; if an actor dies meanwhile (worker 0 before its state
        is read, a new worker while it builds), the dead are replaced as after
        a failed step and the grow tried again. Once they are built, the
        resize is done: a worker that dies while the exchange is re-planned is
        replaced as after a failed step.
        """
        ledger, cluster = self.ledger, self.cluster
        with ledger.call():
            phases = self._phases = Phases()
            with phases("settle"):
                ledger.drain()
            if n == len(cluster.workers):
                return
            self._old = len(cluster.workers)
            while not self._resized(n, phases):  # an actor died during a grow: replaced, the grow tried again
                pass
            self.finish()
            self._last_look = time.monotonic()  # an elastic engine grows again only resize_interval_s later

    def _resized(self, n: int, phases: Phases) -> bool:
        """One try at ``cluster.resize(n)``; False if an actor died during a grow, which left the engine as it
        was: the dead are then replaced (a recovery, counted against ``max_failures``) for the next try."""
        ledger, cluster = self.ledger, self.cluster
        state = None
        if n > self._old:  # worker 0's state, read while the new workers start: they build from it
            source = cluster.workers[0]
            state = source.get_state.remote()
            ledger.recovery.early_state = source, state
        self.joining = set()  # until finish is done, the next call finishes the resize
        try:
            cluster.resize(n, state, phases, ledger.fetch_stats)
        except BaseException as e:
            if cluster.topology.num_workers != n:  # a grow that failed: the engine is as it was
                self.joining = ledger.recovery.early_state = None
                if not isinstance(e, ActorFailure):
                    raise
                ledger.recover(e, [])
                return False
            if not isinstance(e, ActorFailure):
                raise
            # a survivor died after the shrink: finishing the resize replaces it
        return True

    def grow_if_room(self) -> None:
        """An elastic engine below its maximum: at most every ``resize_interval_s``, grow into the room there is.

        A grow that fails (a node lost meanwhile, a worker that cannot
        build) is logged; the engine goes on at its size and looks again later.
        """
        opts, num_workers = self.cluster.options, self.cluster.topology.num_workers
        if not opts.elastic or num_workers >= opts.max_workers:
            return
        if time.monotonic() - self._last_look < opts.resize_interval_s:
            return
        self._last_look = time.monotonic()
        room = self.cluster.room.to_grow(self.cluster.worker_nodes)
        if room:
            try:
                self.resize(num_workers + room)
            except (DSGDError, ValueError) as e:  # ValueError: the object store too small for the exchange
                logger.warning("could not grow to %d workers; going on with %d: %s",
                               num_workers + room, num_workers, e)

    def finish(self) -> None:
        """Every worker on the new count's exchange; those that replaced a worker dead meanwhile (``joining``)
        given the survivors' state."""
        ledger, recovery = self.ledger, self.ledger.recovery
        failed = False  # an actor died in the last try: the dead are replaced first (again, if one dies meanwhile)
        while True:
            try:
                if failed:
                    self.joining |= self.cluster.replace_dead()
                self.cluster.connect_exchange(self._phases)
                with self._phases("resynchronize"):
                    ledger.num_steps = recovery.resynchronize(self.joining)
                self.joining = recovery.early_state = None
                _log_resize(self._old, self.cluster.topology.num_workers, self._phases)
                return
            except ActorFailure as e:
                recovery.count(e)
                failed = True

"""The step ledger: one object owns the steps in flight, the step count and interrupts.

``DistributedSGD`` hands every call to its ``StepLedger``. The ledger
submits steps through the driver's half of the exchange of the engine's
topology now (``dsgd.exchange.registry.driver_half``), keeps at most one
step in flight beyond the one waited for, and settles the replicas whenever
a call fails:

- a dead actor (``ActorFailure``): ``recover`` aborts the steps in flight,
  has ``dsgd.driver.recovery`` replace the dead actors and bring every
  worker to the most advanced survivor's state, then runs again the steps no
  worker applied;
- Ctrl-C (KeyboardInterrupt) inside a call: the next call first settles the
  interrupted step (``settle_interrupted``);
- another dsgd error: the replicas are brought to one state and it is raised.

With backup workers (``backup_workers=b``), ``step`` waits for a step only
until the topology's quorum (``num_workers - b`` workers) has computed it
(``_wait_quorum``); the calls of the workers behind are kept, and every
other call (a drain: ``get_weights``, ``save``, ``foreach_*``...) waits for
them too, so the replicas are identical whenever user code can look. A
worker that dies meanwhile does not stop the step if the others can close
it (the servers are told not to wait for it, ``ServerGroup.excuse``); its
failure is recovered from before the next step, as any other.

Resizing is ``dsgd.driver.resizer``; the step's timeline ``dsgd.driver.tracing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Iterator, Sequence

import ray

from dsgd.exchange import registry
from dsgd.exchange.base import DriverHalf
from dsgd.common.calls import sending
from dsgd.common.results import StepResult
from dsgd.cluster.cluster import Cluster
from dsgd.driver.recovery import Recovery
from dsgd.driver.resizer import Resizer
from dsgd.driver.tracing import StepTrace
from dsgd.errors import ActorFailure, DSGDError, DSGDTimeoutError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Queued:
    """Calls sent to every worker behind the steps then in flight (``StepLedger.queue``), not yet waited for."""

    refs: list[ray.ObjectRef]
    what: str
    workers: list  # the actors sent to
    failures: int  # the failures recovered from when sent


def warn_if_skipped(results: Sequence[StepResult]) -> None:
    """Log the reason when the workers' results say they skipped the step (nan_policy="skip")."""
    skipped = [r.skipped for r in results if isinstance(r, StepResult) and r.skipped is not None]
    if skipped:
        logger.warning("skipped a step (nan_policy='skip'): %s", skipped[0])


class StepLedger:
    """The steps of one engine's ``cluster``: submitted, in flight, applied, recovered."""

    def __init__(self, cluster: Cluster, max_failures: int):
        self.cluster = cluster
        self.recovery = Recovery(cluster, max_failures)
        self.resizer = Resizer(self)
        self.trace = StepTrace(cluster)
        self.num_steps = 0  # steps submitted; step ids count from 0
        self.closed = False
        self._in_flight: list[tuple[int, list]] = []  # (step id, its calls) not yet waited for
        self._newest: tuple[int, list] | None = None  # the newest step submitted and its calls (its stats)
        self._behind: list[ray.ObjectRef] = []  # calls of steps already closed, of workers behind (backup workers)
        self._interrupted = False  # Ctrl-C stopped a call that waited on the workers; the next call settles
        self.fetch_stats = True  # whether the last step fetched stats: the step a grow's survivors prepare
        self._half: tuple[str, DriverHalf] | None = None  # (its exchange kind, the half), see driver_half

    @property
    def driver_half(self) -> DriverHalf:
        """The driver's half of the exchange of the engine's topology now (made again when its kind changes)."""
        kind = self.cluster.topology.exchange
        if self._half is None or self._half[0] != kind:
            self._half = kind, registry.driver_half(kind, self.cluster.calls.call, self.trace.span)
        return self._half[1]

    # ---- every call ---------------------------------------------------------

    def check_open(self) -> None:
        """Refuse calls after ``close``; settle a step that Ctrl-C interrupted, finish a resize an error cut short."""
        if self.closed:
            raise DSGDError("this DistributedSGD has been shut down; create a new one")
        if self._interrupted or self.resizer.pending:
            self.settle_interrupted()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """The body of a public call, after ``check_open``.

        A KeyboardInterrupt in the body goes on up; the engine's next call settles the replicas first.
        """
        self.check_open()
        try:
            yield
        except KeyboardInterrupt:
            self._interrupted = True
            raise

    def settle_interrupted(self) -> None:
        """Bring every replica to one state after a KeyboardInterrupt in ``step`` (or a recovery, a restore...).

        The steps whose calls were all sent complete, as without the
        interrupt, and a resize past building its new workers is finished.
        A step that Ctrl-C cut short before all its calls were sent (the
        "simple" driver's gather, or between two workers' calls)
        cannot: the parameter servers abort what of it waits, and the most
        advanced worker's state goes to every worker behind it, so it counts
        on every replica or on none (``num_steps`` says which). An actor
        that died meanwhile is replaced as after any failure.
        """
        self.drain()
        if self.resizer.pending:  # Ctrl-C during a resize, after the new workers were built
            self.resizer.finish()
        try:
            self.num_steps = self.recovery.settle([])
        except ActorFailure as e:
            self.recover(e, [])
        self._interrupted = False
        logger.info("settled the step interrupted by KeyboardInterrupt: %d steps applied on every replica",
                    self.num_steps)

    def close(self) -> None:
        """Refuse every later call; forget the steps in flight (their actors are being killed)."""
        self.closed = True
        self._in_flight = []
        self._newest = None
        self._behind = []

    # ---- steps --------------------------------------------------------------

    def step(self, fetch_stats: bool) -> tuple[int, list | None]:
        """Submit one step; its id, and with ``fetch_stats`` its per-worker results once done (those of the
        survivors if recovery found the step applied; [] if none of them returned), else None while in flight."""
        if self._behind:
            self._guarded(self._collect_behind)  # a worker behind that failed is replaced before the next step
        step_id = self.num_steps
        self.num_steps += 1
        self.fetch_stats = fetch_stats

        def submit() -> None:
            with self.trace.span("submit"):
                self._newest = step_id, self.driver_half.submit(self.cluster.workers, step_id, fetch_stats)
                self._in_flight.append(self._newest)

        per_worker = self._guarded(submit)  # None, unless recovery completed the step
        if per_worker is None:
            with self.trace.span("wait for the workers"):
                per_worker = self.drain(keep_last=not fetch_stats, everyone=False)
        return step_id, ((per_worker or []) if fetch_stats else None)

    def drain(self, keep_last: bool = False, everyone: bool = True) -> list | None:
        """Wait for submitted steps (all, or all but the newest); recover from faults.

        With backup workers and ``everyone=False``, a step is waited for until
        enough workers computed it (``_wait_quorum``), else until every worker
        is done with every step. Returns the per-worker results of the newest
        step waited for (with backup workers: of those that returned).
        """
        results = None
        calls = self.cluster.calls
        while len(self._in_flight) > (1 if keep_last else 0):
            step_id, refs = self._in_flight[0]
            if self.cluster.topology.backup_workers and not everyone:
                results = self._guarded(lambda: self._wait_quorum(step_id, refs))
            else:
                results = self._guarded(lambda: self._results(refs, f"step {step_id} on all workers"))
            if not self._in_flight:  # recovery aborted every step in flight and re-ran them
                return results
            self._in_flight.pop(0)
            warn_if_skipped(results)
        if everyone and self._behind:
            behind = list(self._behind)
            warn_if_skipped(self._guarded(lambda: calls.call(behind, "the workers behind to catch up")) or [])
            self._behind = []
        return results

    def _wait_quorum(self, step_id: int, refs: list) -> list:
        """Wait until ``quorum`` workers computed step ``step_id`` (it is then closed on every partition); their
        results and those of the others that returned, worker order. The other calls go on in ``_behind``.

        Up to ``backup_workers`` dead workers are waited without: the servers are told to close steps without
        them, and their failure is recovered from before the next step (``_collect_behind``).
        """
        topology = self.cluster.topology

        def enough(results: list) -> bool:
            return sum(r.backup.computed for r in results) >= topology.quorum

        done, rest = self.cluster.calls.call_until(
            refs, enough, f"step {step_id} on {topology.quorum} of the workers",
            spare_failures=topology.backup_workers,
            on_failure=self.cluster.servers.excuse)
        self._behind += rest
        self.recovery.keep_local_state(done)
        return [done[k] for k in sorted(done)]

    def _results(self, refs: list, what: str) -> list:
        """The step results of ``refs`` (one call a worker, worker order), the workers' local state kept."""
        results = self.cluster.calls.call(refs, what)
        self.recovery.keep_local_state(dict(enumerate(results)))
        return results

    def _collect_behind(self) -> None:
        """The results of the workers behind that have returned; raise if one failed."""
        ready, self._behind = self.cluster.calls.returned(self._behind)
        warn_if_skipped(self.cluster.calls.call(ready, "the workers behind"))

    def _guarded(self, run: Callable[[], list | None]) -> list | None:
        """``run()``; recover from a dead actor (the re-run steps' results), or settle the workers after another error."""
        try:
            return run()
        except ActorFailure as e:
            return self.recover(e, self._take_in_flight())
        except DSGDTimeoutError:
            self._in_flight.clear()
            self._behind = []
            raise
        except DSGDError:
            self.num_steps = self.recovery.settle(self._take_in_flight())
            raise

    def _take_in_flight(self) -> list:
        refs = [r for _, step_refs in self._in_flight for r in step_refs] + self._behind
        self._in_flight.clear()
        self._behind = []
        return refs

    # ---- calls on the workers between steps -----------------------------------

    def on_workers(self, method: str, *args, what: str, worker_0_only: bool = False, rerun: bool = True) -> list:
        """``method(*args)`` on every worker (or worker 0 only), after the steps in flight; the results, worker order.

        A worker found dead is replaced as after a failed step, every replica
        brought to one state, and the call made again if ``rerun`` (it must be
        idempotent). A user's function is not run twice: after the recovery
        a DSGDError says it may have run on some workers only.
        """
        with self.call():
            self.drain()
            while True:
                workers = self.cluster.workers[:1] if worker_0_only else self.cluster.workers
                with sending():
                    refs = [getattr(w, method).remote(*args) for w in workers]
                try:
                    return self.cluster.calls.call(refs, what)
                except ActorFailure as e:
                    self.recover(e, [])
                    if not rerun:
                        raise DSGDError(f"{what} may have run on some workers and not others, so it was not run "
                                        "again after the engine recovered from the failure below (every replica "
                                        f"holds the same state again); call it again if that is safe. {e}") from e

    def queue(self, method: str, *args, what: str) -> Queued:
        """``method(*args)`` sent to every worker behind the steps in flight, not waited for: a worker runs its
        calls in order, so it runs after the steps submitted before and before those submitted after, which the
        caller may submit before reading its answers (``queued_answers``). A step run again after a fault may
        run after it: the call must leave such a step computing as it did before."""
        with self.call():
            workers = list(self.cluster.workers)
            with sending():
                refs = [getattr(w, method).remote(*args) for w in workers]
            return Queued(refs, what, workers, self.recovery.failures)

    def queued_answers(self, queued: Queued) -> list | None:
        """``queued``'s answers, worker order; None if, since it was sent, the engine recovered from a failure
        (a step it followed may have run again after it, or a worker that ran it is gone) or was resized. A
        worker that died is replaced, the steps in flight run again, as after a failed step."""
        def unchanged() -> bool:
            return self.recovery.failures == queued.failures and self.cluster.workers == queued.workers

        with self.call():
            if not unchanged():  # not read: a dead worker's call would count its failure again
                return None
            answers = self._guarded(lambda: self.cluster.calls.call(queued.refs, queued.what))
            return answers if unchanged() else None

    def restore(self, state: dict) -> None:
        """Load a checkpoint's ``state`` onto every worker; steps go on from its step count."""
        self.on_workers("set_state", ray.put(state), what="the workers to load the checkpoint")
        with self.call():
            self.num_steps = state["applied_steps"]
            self.cluster.reset_servers(self.num_steps)

    def latest_state(self) -> dict:
        """The state of the most advanced live worker, after the steps in flight; a worker that dies while it
        is read is replaced as after a failed step, and the state read again."""
        with self.call():
            self.drain()
            while True:
                try:
                    return self.cluster.latest_state()
                except ActorFailure as e:
                    self.recover(e, [])

    # ---- recovery -------------------------------------------------------------

    def recover(self, error: ActorFailure, in_flight: list[ray.ObjectRef]) -> list:
        """Recover from ``error``; the per-worker results (with stats) of the last step re-run, [] if none was.

        ``in_flight``: the calls of the steps not yet waited for. Every step
        below ``num_steps`` is applied on every worker on return.
        """
        newest = self._newest
        while True:
            self.recovery.count(error)
            try:
                applied = self.recovery.settle(in_flight, replace_dead=True)
                if applied == self.num_steps and newest is not None and newest[0] == applied - 1:
                    # The survivors applied the newest step before the fault: its stats are theirs.
                    return [r for r in self.cluster.calls.answers(newest[1], 0) if isinstance(r, StepResult)]
                results = []
                for step_id in range(applied, self.num_steps):
                    in_flight = self.driver_half.submit(self.cluster.workers, step_id, True)
                    newest = step_id, in_flight
                    results = self._results(in_flight, f"re-run of step {step_id}")
                    warn_if_skipped(results)
                return results
            except ActorFailure as e:
                error = e

"""The step ledger: one object owns the steps in flight, the step count, interrupts and recovery.

``DistributedSGD`` hands every call to its ``StepLedger``. The ledger
submits steps through the driver's half of the exchange
(``dsgd.exchange.registry.driver_half``), keeps at most one step in flight beyond the one
waited for, and settles the replicas whenever a call fails:

- a dead actor (``ActorFailure``): ``recover`` aborts the steps in flight,
  replaces dead actors (``Cluster.replace_dead``, which also gives every
  worker new Ray Data splits), gives every worker that is behind (or new)
  the full state (weights, optimizer slots, step count) of the most advanced
  survivor, then runs again the steps no worker applied. A worker applies a
  step only once it holds every averaged partition, so no replica applies a
  partial or duplicated update; parameter servers hold nothing across
  steps, so they only need a reset;
- Ctrl-C (KeyboardInterrupt) inside a call: the next call first settles the
  interrupted step (``settle_interrupted``);
- another dsgd error: the replicas are brought to one state and it is raised.

With backup workers (``backup_workers=b``), ``step`` waits for a step only
until ``num_workers - b`` workers have computed it (``_wait_quorum``); the
calls of the workers behind are kept, and every other call (a drain:
``get_weights``, ``save``, ``foreach_*``...) waits for them too, so the
replicas are identical whenever user code can look. A worker that dies
meanwhile does not stop the step if the others can close it (the servers
are told not to wait for it, ``ServerGroup.excuse``); its failure is
recovered from before the next step, as any other.

Elastic resizing (``resize``) settles the steps in flight, has the cluster
start or stop workers and re-plan the parameter servers, gives the new
workers the survivors' state, and goes on from ``num_steps``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator, Sequence

import ray

from dsgd.exchange import registry
from dsgd.exchange.base import DriverHalf
from dsgd.common import timeline
from dsgd.common.calls import sending
from dsgd.cluster.cluster import Cluster
from dsgd.errors import ActorFailure, DSGDError, DSGDTimeoutError
from dsgd.common.stopwatch import Phases

logger = logging.getLogger(__name__)


def warn_if_skipped(results: Sequence[dict]) -> None:
    """Log the reason when the workers' results say they skipped the step (nan_policy="skip")."""
    skipped = [r["skipped"] for r in results if isinstance(r, dict) and "skipped" in r]
    if skipped:
        logger.warning("skipped a step (nan_policy='skip'): %s", skipped[0])


def _log_resize(old: int, n: int, phases: Phases) -> None:
    """A resize's log line (INFO for a grow, WARNING for a shrink) with its phases' times, which the record
    also holds as ``resize_phases`` (``{phase: seconds}``)."""
    if n > old:
        what = f"grew from {old} to {n} workers: started workers {list(range(old, n))}"
    else:
        what = f"shrank from {old} to {n} workers: stopped workers {list(range(n, old))}"
    logger.log(logging.INFO if n > old else logging.WARNING, "%s in %.2f s (%s)", what, phases.total(),
               phases.describe(), extra={"resize_phases": dict(phases.seconds)})


class StepLedger:
    """The steps of one engine's ``cluster``: submitted, in flight, applied, recovered."""

    def __init__(self, cluster: Cluster, max_failures: int):
        self.cluster = cluster
        self.max_failures = max_failures
        self.failures = 0  # recoveries so far, over the engine's life
        self.num_steps = 0  # steps submitted; step ids count from 0
        self.closed = False
        self._in_flight: list[tuple[int, list]] = []  # (step id, its calls) not yet waited for
        self._behind: list[ray.ObjectRef] = []  # calls of steps already closed, of workers behind (backup workers)
        self._interrupted = False  # Ctrl-C stopped a call that waited on the workers; the next call settles
        self._last_look = time.monotonic()  # an elastic engine last looked for room to grow
        self._joining: set[int] | None = None  # a resize not finished: workers replaced during it, not given the state
        self._resize_phases = Phases()  # the last resize's, for its log line
        self._resize_from = 0  # the last resize's old count
        self._fetch_stats = True  # whether the last step fetched stats: the step a grow's survivors prepare
        self._early_state: tuple | None = None  # (a survivor, its get_state call) made as a grow began
        self._trace: timeline.Recorder | None = None
        self._driver_half: tuple[str, DriverHalf] | None = None  # (its exchange kind, the half), see _strategy

    @property
    def _strategy(self) -> DriverHalf:
        """The driver's half of the exchange of the engine's topology now (made again when its kind changes)."""
        kind = self.cluster.topology.exchange
        if self._driver_half is None or self._driver_half[0] != kind:
            self._driver_half = kind, registry.driver_half(kind, self.cluster.calls.call, self.span)
        return self._driver_half[1]

    # ---- every call ---------------------------------------------------------

    def check_open(self) -> None:
        """Refuse calls after ``close``; settle a step that Ctrl-C interrupted, finish a resize an error cut short."""
        if self.closed:
            raise DSGDError("this DistributedSGD has been shut down; create a new one")
        if self._interrupted or self._joining is not None:
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
        if self._joining is not None:  # Ctrl-C during a resize, after the new workers were built
            self._finish_resize()
        try:
            self.num_steps = self.settle([])
        except ActorFailure as e:
            self.recover(e, [])
        self._interrupted = False
        logger.info("settled the step interrupted by KeyboardInterrupt: %d steps applied on every replica",
                    self.num_steps)

    def close(self) -> None:
        """Refuse every later call; forget the steps in flight (their actors are being killed)."""
        self.closed = True
        self._in_flight = []
        self._behind = []

    # ---- steps --------------------------------------------------------------

    def step(self, fetch_stats: bool) -> tuple[int, list | None]:
        """Submit one step; its id, and with ``fetch_stats`` its per-worker results once done ([] if recovery
        completed it on some workers only), else None while it is still in flight."""
        if self._behind:
            self._guarded(self._collect_behind)  # a worker behind that failed is replaced before the next step
        step_id = self.num_steps
        self.num_steps += 1
        self._fetch_stats = fetch_stats

        def submit() -> None:
            with self.span("submit"):
                self._in_flight.append((step_id, self._strategy.submit(self.cluster.workers, step_id, fetch_stats)))

        per_worker = self._guarded(submit)  # None, unless recovery completed the step
        if per_worker is None:
            with self.span("wait for the workers"):
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
                results = self._guarded(lambda: calls.call(refs, f"step {step_id} on all workers"))
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
            return sum(r["backup"]["computed"] for r in results) >= topology.quorum

        done, rest = self.cluster.calls.call_until(
            refs, enough, f"step {step_id} on {topology.quorum} of the workers",
            spare_failures=topology.backup_workers,
            on_failure=self.cluster.servers.excuse)
        self._behind += rest
        return [done[k] for k in sorted(done)]

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
            self.num_steps = self.settle(self._take_in_flight())
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

    def restore(self, state: dict) -> None:
        """Load a checkpoint's ``state`` onto every worker; steps go on from its step count."""
        self.on_workers("set_state", ray.put(state), what="the workers to load the checkpoint")
        with self.call():
            self.num_steps = state["applied_steps"]
            self.cluster.reset_servers(self.num_steps)

    def latest_state(self) -> dict:
        """The state of the most advanced live worker, after the steps in flight."""
        with self.call():
            self.drain()
            return self.cluster.latest_state()

    # ---- resizing -------------------------------------------------------------

    def resize(self, n: int) -> None:
        """After the steps in flight, start or stop workers so that ``n`` run; steps go on from ``num_steps``.

        New workers build from worker 0's state, read as they start. If they
        cannot start or build (``Cluster.resize``), or worker 0 dies before
        its state is read, the engine is unchanged and the error raised. Once
        they are built, the resize is done: a worker that dies while the
        exchange is re-planned is replaced as after a failed step.
        """
        with self.call():
            phases = self._resize_phases = Phases()
            with phases("settle"):
                self.drain()
            if n == len(self.cluster.workers):
                return
            self._resize_from = len(self.cluster.workers)
            state = None
            if n > self._resize_from:  # worker 0's state, read while the new workers start: they build from it
                source = self.cluster.workers[0]
                state = source.get_state.remote()
                self._early_state = source, state
            self._joining = set()  # until _finish_resize is done, the next call finishes the resize
            try:
                self.cluster.resize(n, state, phases, self._fetch_stats)
            except BaseException as e:
                if self.cluster.topology.num_workers != n:  # a grow that failed: the engine is as it was
                    self._joining = self._early_state = None
                    raise
                if not isinstance(e, ActorFailure):
                    raise
                # a survivor died after the shrink: finishing the resize replaces it
            self._finish_resize()
            self._last_look = time.monotonic()  # an elastic engine grows again only resize_interval_s later

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
        room = self.cluster.room_to_grow()
        if room:
            try:
                self.resize(num_workers + room)
            except (DSGDError, ValueError) as e:  # ValueError: the object store too small for the exchange
                logger.warning("could not grow to %d workers; going on with %d: %s",
                               num_workers + room, num_workers, e)

    def _finish_resize(self) -> None:
        """Every worker on the new count's exchange; those that replaced a worker dead meanwhile (``_joining``)
        given the survivors' state."""
        phases = self._resize_phases
        while True:
            try:
                self.cluster.connect_exchange(phases)
                with phases("resynchronize"):
                    self.num_steps = self._resynchronize(self._joining)
                self._joining = self._early_state = None
                _log_resize(self._resize_from, self.cluster.topology.num_workers, phases)
                return
            except ActorFailure as e:
                self._count_failure(e)
                self._joining |= self.cluster.replace_dead()

    # ---- recovery -------------------------------------------------------------

    def recover(self, error: ActorFailure, in_flight: list[ray.ObjectRef]) -> list:
        """Recover from ``error``; the per-worker results (with stats) of the last step re-run, [] if none was.

        ``in_flight``: the calls of the steps not yet waited for. Every step
        below ``num_steps`` is applied on every worker on return.
        """
        while True:
            self._count_failure(error)
            try:
                applied = self.settle(in_flight, replace_dead=True)
                results = []
                for step_id in range(applied, self.num_steps):
                    in_flight = self._strategy.submit(self.cluster.workers, step_id, True)
                    results = self.cluster.calls.call(in_flight, f"re-run of step {step_id}")
                    warn_if_skipped(results)
                return results
            except ActorFailure as e:
                error = e

    def _count_failure(self, error: ActorFailure) -> None:
        """Count a failure to recover from; a DSGDError past ``max_failures``."""
        self.failures += 1
        if self.failures > self.max_failures:
            raise DSGDError(f"giving up after {self.max_failures} recoveries (max_failures); "
                            f"last failure: {error}") from error
        logger.warning("%s; recovering (failure %d of at most %d)", error, self.failures, self.max_failures)

    def settle(self, in_flight: list[ray.ObjectRef], replace_dead: bool = False) -> int:
        """Abort ``in_flight``, optionally replace dead actors, bring every worker to one state; its step count."""
        cluster = self.cluster
        cluster.abort_servers()  # workers waiting on sums that will never complete fail now
        if replace_dead:
            cluster.stop_datasets()  # and those waiting on a dataset split (replace_dead splits anew)
        cluster.calls.wait_finished(in_flight)
        fresh = cluster.replace_dead() if replace_dead else set()
        return self._resynchronize(fresh)

    def _resynchronize(self, fresh: set[int]) -> int:
        """Copy the most advanced survivor's state to every worker behind it (or new)."""
        workers, calls = self.cluster.workers, self.cluster.calls
        counts = calls.call([w.applied_steps_count.remote() for w in workers], "the workers' step counts")
        survivors = [i for i in range(len(workers)) if i not in fresh]
        source = max(survivors, key=lambda i: counts[i])
        applied = counts[source]
        behind = [w for i, w in enumerate(workers) if i in fresh or counts[i] < applied]
        if behind:
            early = self._early_state  # a grow's: taken before any step could change it
            state = early[1] if early and early[0] is workers[source] else workers[source].get_state.remote()
            calls.call([w.set_state.remote(state) for w in behind], f"worker {source}'s state to be copied")
        self.cluster.reset_servers(applied)
        return applied

    # ---- tracing --------------------------------------------------------------

    @contextlib.contextmanager
    def tracing(self, path: str) -> Iterator[None]:
        """Record the driver, the workers and the servers while the body runs; write the trace to ``path``."""
        step_id, workers, calls = self.num_steps, self.cluster.workers, self.cluster.calls
        calls.call([w.start_trace.remote() for w in workers], "the workers to start tracing")
        self._trace = timeline.Recorder()
        try:
            with self._trace.span(f"step {step_id}"):
                yield
        finally:
            driver, self._trace = self._trace, None
            worker_events = calls.call([w.collect_trace.remote() for w in workers], "the workers' traces")
        servers = self.cluster.servers
        server_events = calls.call(servers.traces(step_id), "the parameter servers' traces") if servers else []
        timeline.write(path, [("driver", driver.events)]
                       + [(f"worker {i}", events) for i, events in enumerate(worker_events)]
                       + [(f"parameter server {j}", events) for j, events in enumerate(server_events)])

    def span(self, name: str):
        """A span of the driver's timeline while one is recorded (``tracing``), else nothing."""
        return timeline.maybe_span(self._trace, name)

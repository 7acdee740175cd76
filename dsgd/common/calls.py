"""The one place the driver waits on Ray: every wait bounded, Ray's errors turned into dsgd's.

``Calls.call`` waits for actor calls up to the step timeout (``timeout_s``),
``call_startup`` up to the startup timeout (``startup_timeout_s``);
``call_until`` waits for only some of the calls (a step closed by backup
workers). A dead actor (or a lost object, or a step the parameter servers
aborted) comes out as ``ActorFailure``, which the step ledger recovers
from, naming the actor by what its ``identity()`` call answered
(``identify``); a dsgd error raised inside an actor comes out as itself;
any other failure as ``DSGDError``; a wait that runs out as
``DSGDTimeoutError`` saying what was awaited. ``peer_errors`` is that
translation for every bounded wait on a peer, the driver's and the actors'
(a worker's on its parameter servers, a relaying server's on a partition's
server). ``sending`` makes a set of calls go out whole, Ctrl-C or not.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator

import ray

from dsgd.common.actor_identity import ActorIdentity
from dsgd.errors import ActorFailure, DSGDError, DSGDTimeoutError, StepAborted

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0
STEP_HINT = "raise timeout_s if steps are legitimately this slow"
# A wait on the actors that passes PROGRESS_AFTER_S is logged (logger "dsgd", INFO): what is
# awaited, how many calls are done and which actors are not; again every PROGRESS_EVERY_S.
PROGRESS_AFTER_S = 5.0
PROGRESS_EVERY_S = 10.0

# Errors that mean an actor (or an object it owned) is gone: recoverable. An actor placed on a node that died
# before it started is unschedulable: gone too, so a replacement is placed again on the nodes alive.
_FAULTS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.ObjectLostError,
           StepAborted)


def _fault_of(error: BaseException) -> BaseException | None:
    """The actor failure behind ``error``, if that is what it is."""
    if isinstance(error, _FAULTS):
        return error
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, _FAULTS):
        return error.cause
    return None


def closed_connection(error: BaseException) -> BaseException | None:
    """``error`` if it is a connection that closed (its peer died or was replaced)."""
    return error if isinstance(error, ConnectionError) else None


@contextlib.contextmanager
def peer_errors(timed_out: str, lost: Callable[[BaseException], BaseException] | None = None,
                fault_of: Callable[[BaseException], BaseException | None] = closed_connection) -> Iterator[None]:
    """A bounded wait on a peer (an actor call, or a socket to another process), its failures as dsgd's errors.

    A wait that ran out (TimeoutError; Ray's GetTimeoutError is one) raises
    ``DSGDTimeoutError(timed_out)``; an error behind which ``fault_of`` finds
    a dead peer (by default a closed connection) raises ``lost(the fault)``,
    unless ``lost`` is None; anything else goes through unchanged, the
    peer's own errors too (a Ray task error is one even when it is also an
    instance of what the peer raised, a TimeoutError say).
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, TimeoutError) and not isinstance(e, ray.exceptions.RayTaskError):
            raise DSGDTimeoutError(timed_out) from e
        fault = None if lost is None else fault_of(e)
        if fault is None:
            raise
        raise lost(fault) from e


@contextlib.contextmanager
def sending() -> Iterator[None]:
    """Send a set of calls whole: a Ctrl-C (SIGINT) while they are submitted takes effect once the last is sent.

    Otherwise a KeyboardInterrupt could leave, say, ``set_weights`` sent to
    some workers and not others; sent to all, the next call settles what
    they did. Python runs signal handlers in the main thread only, so only
    there is anything held: the signal is noted, then raised again under the
    handler it found.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # None: a handler Python did not install, which it could not put back
        return
    noted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            signal.raise_signal(signal.SIGINT)


class Calls:
    """Bounded waits on one engine's actor calls; knows its actors by id to name them in errors."""

    def __init__(self, step_timeout_s: float, startup_timeout_s: float):
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._identities: dict[str, ActorIdentity] = {}  # actor id -> who it is

    def call(self, refs, what: str):
        """ray.get bounded by the step timeout, Ray's errors turned into dsgd's naming the actor.

        Results are taken as they complete, so the first failure is raised at
        once rather than after the slowest of the other calls.
        """
        return self._wait(refs, what, self.step_timeout_s, STEP_HINT)

    def call_startup(self, refs, what: str):
        """``call`` for set-up work (starting actors, building models), bounded by the startup timeout."""
        return self._wait(refs, what, self.startup_timeout_s,
                          "raise startup_timeout_s if building is legitimately this slow, or check with "
                          "`ray status` that nothing else holds the CPUs the actors need")

    def call_until(self, refs: list, enough: Callable[[list], bool], what: str, spare_failures: int = 0,
                   on_failure: Callable[[int], None] | None = None) -> tuple[dict[int, Any], list]:
        """``call``, but only until ``enough(the results so far)``; the results by position, and the calls not
        waited for (still running, or among the ``spare_failures`` failed ones, which ``on_failure(position)``
        is told of; one more actor failure raises as ``call`` does)."""
        values, rest = self._collect(refs, what, self.step_timeout_s, STEP_HINT, enough, spare_failures, on_failure)
        return {k: values[r] for k, r in enumerate(refs) if r in values}, rest

    def _wait(self, refs, what: str, timeout: float, hint: str):
        values, _ = self._collect(refs if isinstance(refs, list) else [refs], what, timeout, hint)
        return [values[r] for r in refs] if isinstance(refs, list) else values[refs]

    def _collect(self, refs: list, what: str, timeout: float, hint: str, enough: Callable[[list], bool] | None = None,
                 spare_failures: int = 0, on_failure: Callable[[int], None] | None = None) -> tuple[dict, list]:
        """Wait for ``refs`` one at a time, until all (or ``enough``) are done; their values, and the refs left."""
        pending, failed = list(refs), []
        start = time.monotonic()
        deadline, next_report = start + timeout, start + PROGRESS_AFTER_S
        values, raising = {}, None
        try:
            with peer_errors(f"timed out after {timeout:.0f}s waiting for {what}; {hint}",
                             lambda fault: ActorFailure(f"{self._describe(fault)} while waiting for {what}: {fault}"),
                             _fault_of):
                while pending and not (enough and enough(list(values.values()))):
                    ready, pending = ray.wait(pending, num_returns=1,
                                              timeout=max(0.0, min(deadline, next_report) - time.monotonic()))
                    if ready:
                        try:
                            values[ready[0]] = ray.get(ready[0], timeout=timeout)  # ready: at once
                        except ray.exceptions.RayError as e:
                            if _fault_of(e) is None or len(failed) >= spare_failures:
                                raising = ready[0]
                                raise
                            failed.append(ready[0])
                            if on_failure is not None:
                                on_failure(refs.index(ready[0]))
                    elif time.monotonic() >= deadline:
                        raise TimeoutError(what)
                    else:
                        self._log_progress(what, len(values), pending, time.monotonic() - start)
                        next_report += PROGRESS_EVERY_S
        except ray.exceptions.RayError as e:  # not a dead actor: an actor's own error
            if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, DSGDError):
                raise e.cause.with_traceback(None) from None
            raise DSGDError(f"failed while waiting for {what}: {self._raised(e, raising)}:\n{e}") from e
        return values, pending + failed

    def _log_progress(self, what: str, done: int, pending: list, waited_s: float) -> None:
        """'waiting 15s for the workers to build their models: 1 of 3 done; not yet: worker 1, worker 2'."""
        actor_ids = [ref.task_id().actor_id().hex() for ref in pending]
        names = list(dict.fromkeys(str(self._identities[a]) for a in actor_ids if a in self._identities))
        logger.info("waiting %.0fs for %s: %d of %d done%s", waited_s, what, done, done + len(pending),
                    f"; not yet: {', '.join(names)}" if names else "")

    def wait_finished(self, refs: list) -> None:
        """Wait (bounded by the step timeout) until calls have returned or failed; their results are not wanted."""
        if refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.step_timeout_s)
            if len(ready) < len(refs):
                logger.warning("%d calls had not finished after %.0fs; going on without them",
                               len(refs) - len(ready), self.step_timeout_s)

    def identify(self, actors: list, what: str = "the actors to start") -> list[ActorIdentity]:
        """Wait for ``actors`` to start; remember who they are, to name them in errors."""
        identities = self.call_startup([a.identity.remote() for a in actors], what)
        self._identities.update((i.actor_id, i) for i in identities)
        return identities

    def _raised(self, error: ray.exceptions.RayError, ref: Any) -> str:
        """'worker 1 (pid 4242 on node 3fa2c1e0) raised InvalidArgumentError': who raised an actor's own error (the
        call ``ref``'s actor), and what, ahead of its traceback (whose end says why)."""
        identity = None if ref is None else self._identities.get(ref.task_id().actor_id().hex())
        who = f"{identity} ({identity.where})" if identity else "an actor"
        cause = getattr(error, "cause", None)
        return f"{who} raised {type(cause).__name__ if cause is not None else type(error).__name__}"

    def _describe(self, error: BaseException) -> str:
        """'worker 1 (pid 4242 on node 3fa2c1e0) failed', for the actor behind an error."""
        identity = self._identities.get(getattr(error, "actor_id", None))
        return f"{identity} failed ({identity.where})" if identity else "an actor failed"

    @staticmethod
    def returned(refs: list) -> tuple[list, list]:
        """The calls of ``refs`` that have returned (or failed) and the others, without waiting."""
        return ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])

    @staticmethod
    def answers(refs: list, timeout: float) -> list:
        """Each call's result, or None for one that failed or had not returned within ``timeout`` (one bound for all)."""
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        answers = []
        for ref in refs:
            try:
                answers.append(ray.get(ref, timeout=timeout) if ref in ready else None)
            except ray.exceptions.RayError:
                answers.append(None)
        return answers

    def unresponsive(self, actors: list) -> list[int]:
        """Indices of ``actors`` that are dead or do not answer a ping within ``PING_TIMEOUT_S``, all pinged at once."""
        identities = self.answers([a.identity.remote() for a in actors], PING_TIMEOUT_S)
        return [i for i, identity in enumerate(identities) if identity is None]

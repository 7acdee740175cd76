"""Job scripts on Ray clusters of their own, run one at a time in a background thread from the session's start.

A multi-node job spends much of its time waiting: nodes starting, a lost node
being noticed, a worker being replaced. Run in the background, those waits
overlap the tests in the pytest process, which are bound by CPU, and the job
is done (or nearly) by the time its tests run.

A test module names its jobs in ``BACKGROUND_JOBS``: fixture name -> ``Job``
(a job script) or ``Call`` (a function that starts processes of its own and
bounds its own time). At the end of collection, conftest queues the jobs
whose fixtures the selected tests use, in the order the tests first use
them; the fixture returns ``QUEUE.result(job)``: the background run's result, or that of a run
started there and then if the job was not queued (a module imported by
another, a test run with a fixture conftest did not see). Every wait is
bounded: each job is killed at its own timeout, so the wait for one is at
most the timeouts of the jobs queued up to it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from job_processes import hidden_environ, kill_running_jobs, run_job, run_job_with_output

# The wait for a queued job beyond the timeouts of the jobs up to it: the thread's hand-over, a killed job's reaping.
SLACK_S = 60.0


@dataclasses.dataclass(frozen=True)
class Job:
    """A job script run by ``run_job``: its path, the seconds it gets, its arguments."""

    script: str
    timeout_s: float
    args: tuple[str, ...] = ()
    with_output: bool = False  # the result is ``run_job_with_output``'s: (result, everything the job wrote)
    scratch: bool = False  # the first argument is a directory of the job's own (``QUEUE.scratch(job.name)``)

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.script))[0] + "".join(f"-{a}" for a in self.args)

    def run(self, queue: JobQueue) -> Any:
        args = (queue.scratch(self.name), *self.args) if self.scratch else self.args
        run = run_job_with_output if self.with_output else run_job
        return run(self.script, self.timeout_s, *args, environ=queue.environ)


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """``function(scratch, environ)``, run in the background: it must end within ``timeout_s`` on its own (every
    process it starts bounded, and stopped by ``kill_running_jobs``), and leave nothing running. ``scratch`` is a
    directory of its own; ``environ`` the environment to start processes with."""

    name: str
    function: Callable[[str, dict[str, str]], Any]
    timeout_s: float

    def run(self, queue: JobQueue) -> Any:
        return self.function(queue.scratch(self.name), queue.environ)


class JobQueue:
    """Runs queued jobs one after another in a thread of its own; hands each result to the fixture that asks."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._runs: dict[Job | Call, tuple[Future, float]] = {}
        self._dir: str | None = None
        self.seconds: dict[str, float] = {}  # job name -> how long its run took (the suite's time budget)
        # The environment jobs start with: this process's when the session starts, before any test changes it
        # (``monkeypatch.setenv``) while a job starts in the background, with ``HIDDEN_DIR`` on its path.
        self.environ = hidden_environ()

    def start(self, jobs: list[Job | Call]) -> None:
        """Queue ``jobs`` in this order; the first starts at once."""
        if not jobs:
            return
        self.environ = hidden_environ()
        bound = SLACK_S
        for job in jobs:
            bound += job.timeout_s
            self._runs[job] = (Future(), bound)
        self._thread = threading.Thread(target=self._run_all, name="background-jobs", daemon=True)
        self._thread.start()

    def scratch(self, name: str) -> str:
        """The directory of the job named ``name``; it lasts until the session ends."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="dsgd-jobs-")
        path = os.path.join(self._dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def result(self, job: Job | Call) -> Any:
        """``job``'s result: the queued run's (waiting for it), else a run started now."""
        if job not in self._runs:
            return job.run(self)
        future, bound = self._runs[job]
        return future.result(timeout=bound)

    def close(self) -> None:
        """Drop the jobs not started, stop a running one, remove the scratch directories."""
        if self._thread is not None:
            for future, _ in self._runs.values():
                future.cancel()
            kill_running_jobs(self._thread)
            self._thread.join(timeout=SLACK_S)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _run_all(self) -> None:
        for job, (future, _) in self._runs.items():
            if future.set_running_or_notify_cancel():  # False: cancelled by close
                start = time.monotonic()
                try:
                    future.set_result(job.run(self))
                except BaseException as e:  # the fixture that takes the result raises it
                    future.set_exception(e)
                self.seconds[job.name] = time.monotonic() - start


QUEUE = JobQueue()

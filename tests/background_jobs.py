"""Job scripts on Ray clusters of their own, run one at a time in a background thread from the session's start.

A multi-node job spends much of its time waiting: nodes starting, a lost node
being noticed, a worker being replaced. Run in the background, those waits
overlap the tests in the pytest process, which are bound by CPU, and the job
is done (or nearly) by the time its tests run.

A test module names its jobs in ``BACKGROUND_JOBS`` (fixture name -> ``Job``).
At the end of collection, conftest queues the jobs whose fixtures the
selected tests use, in the order the tests first use them; the fixture
returns ``QUEUE.result(job)``: the background run's result, or that of a run
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dsgd_test_models import kill_running_jobs, run_job, run_job_with_output

# The wait for a queued job beyond the timeouts of the jobs up to it: the thread's hand-over, a killed job's reaping.
SLACK_S = 60.0


@dataclasses.dataclass(frozen=True)
class Job:
    """A job script run by ``run_job``: its path, the seconds it gets, its arguments."""

    script: str
    timeout_s: float
    args: tuple[str, ...] = ()
    with_output: bool = False  # the result is ``run_job_with_output``'s: (result, everything the job wrote)
    scratch: bool = False  # the first argument is a directory of the job's own (``QUEUE.scratch(job)``)

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.script))[0] + "".join(f"-{a}" for a in self.args)


class JobQueue:
    """Runs queued jobs one after another in one thread; hands each result to the fixture that asks for it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._runs: dict[Job, tuple[Future, float]] = {}
        self._dir: str | None = None

    def start(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` in this order; the first starts at once."""
        if not jobs:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-job")
        bound = SLACK_S
        for job in jobs:
            bound += job.timeout_s
            self._runs[job] = (self._pool.submit(self._run, job), bound)

    def scratch(self, job: Job) -> str:
        """The directory given to ``job`` as its first argument; it lasts until the session ends."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="dsgd-jobs-")
        path = os.path.join(self._dir, job.name)
        os.makedirs(path, exist_ok=True)
        return path

    def result(self, job: Job) -> Any:
        """``job``'s result: the queued run's (waiting for it), else a run started now."""
        if job not in self._runs:
            return self._run(job)
        future, bound = self._runs[job]
        return future.result(timeout=bound)

    def close(self) -> None:
        """Drop the jobs not started, kill a running one, remove the scratch directories."""
        if self._pool is not None:
            for future, _ in self._runs.values():
                future.cancel()
            kill_running_jobs()
            self._pool.shutdown(wait=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self, job: Job) -> Any:
        args = (self.scratch(job), *job.args) if job.scratch else job.args
        if job.with_output:
            return run_job_with_output(job.script, job.timeout_s, *args)
        return run_job(job.script, job.timeout_s, *args)


QUEUE = JobQueue()

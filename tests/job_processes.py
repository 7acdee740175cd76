"""Processes the tests start outside the session's Ray (job scripts, examples, commands), each bounded in time and
stopped, with whatever it started, when the session ends; and the environment the suite's own processes start with.

A job script prints its result as one line, ``RESULT_PREFIX`` then JSON; ``run_job`` returns it. This module
imports only the standard library, so conftest (through ``background_jobs``) does not import TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

RESULT_PREFIX = "RESULT "

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Packages that cannot be imported from here (each raises ImportError), put first on the PYTHONPATH of the
# suite's own processes: the Ray workers its tests and jobs start (``worker_runtime_env``) and the background
# jobs with their clusters (``hidden_environ``); not the test process, nor a script run as a user runs it.
# `import tensorflow` loads Keras 3 (a dsgd worker only once its model imports Keras), and Keras 3 imports
# scikit-learn and matplotlib whenever they are installed, for its scikit-learn wrappers and image plots:
# about 2.5 s more CPU for each such process here (7.4 s against 5.0), every job driver, Keras 3 worker and
# Tune trial. None of them uses either.
HIDDEN_DIR = os.path.join(TESTS_DIR, "hidden")


def _pythonpath(*first: str) -> str:
    """``first``, then this process's PYTHONPATH."""
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH")) if p)


def hidden_environ() -> dict[str, str]:
    """This process's environment with ``HIDDEN_DIR`` first on the PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": _pythonpath(HIDDEN_DIR)}


def worker_runtime_env() -> dict:
    """The ``runtime_env`` of a test's Ray: the test models' folder and ``HIDDEN_DIR`` on the workers' path,
    before this process's PYTHONPATH, and the session's TensorFlow log level."""
    return {"env_vars": {"PYTHONPATH": _pythonpath(TESTS_DIR, HIDDEN_DIR), "TF_CPP_MIN_LOG_LEVEL": "2"}}


# The processes of jobs running now, each with how to stop it and the thread that started it.
_running: dict[subprocess.Popen, tuple[Callable[[subprocess.Popen], None], threading.Thread]] = {}


@contextlib.contextmanager
def stopped_at_session_end(proc: subprocess.Popen, stop: Callable[[subprocess.Popen], None]) -> Iterator[None]:
    """While in the block, ``kill_running_jobs`` (at the session's end, or a Ctrl-C) calls ``stop(proc)``."""
    _running[proc] = (stop, threading.current_thread())
    try:
        yield
    finally:
        _running.pop(proc, None)


def kill_running_jobs(thread: threading.Thread) -> None:
    """Stop every job ``thread`` started that is still running (the thread's wait for it then fails)."""
    for proc, (stop, started_by) in list(_running.items()):
        if started_by is thread:
            stop(proc)


def kill_process_group(proc: subprocess.Popen) -> None:
    """Kill whatever is left of a job's session: the job, and its raylets, GCS and Ray workers."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(script: str, timeout_s: float, *args: str, environ: Mapping[str, str] | None = None) -> dict:
    """Run ``script`` (with ``args``) in its own process, session and Ray temp dir; the JSON of its last ``RESULT``
    line.

    A job starts its own Ray (a process holds one Ray instance, and the test
    session's is taken), or joins the session's as another driver when
    ``args`` give it the address. Its session is killed when it ends or after
    ``timeout_s``, so nothing it started outlives it; a job that times out,
    fails or prints no result fails the test with its stderr's tail. Its
    environment is ``environ`` (default: this process's) with its own Ray
    temp dir.
    """
    return _run_job(script, timeout_s, args, subprocess.PIPE, environ)[0]


def run_job_with_output(script: str, timeout_s: float, *args: str,
                        environ: Mapping[str, str] | None = None) -> tuple[dict, str]:
    """``run_job``, and everything the job wrote: stdout and stderr in one stream, in the order written."""
    return _run_job(script, timeout_s, args, subprocess.STDOUT, environ)


def run_command(argv: Sequence[str], timeout_s: float, **popen: Any) -> tuple[int, str]:
    """Run ``argv`` in a session of its own (``popen``: more ``subprocess.Popen`` arguments); its exit code and
    everything it wrote, stdout and stderr in one stream. Killed, with whatever it started, when it ends or after
    ``timeout_s`` (failing the test with its output's tail)."""
    returncode, out, _ = _bounded_run(argv, timeout_s, stderr=subprocess.STDOUT, **popen)
    return returncode, out


def _bounded_run(argv: Sequence[str], timeout_s: float, **popen: Any) -> tuple[int, str, str | None]:
    """``argv``'s exit code, stdout and stderr (None unless ``popen`` pipes it), run as ``run_command`` says."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, **popen)
    with stopped_at_session_end(proc, kill_process_group):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_group(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(argv)} timed out after {timeout_s}s; output tail:\n"
                                 f"{(err or out)[-4000:]}") from None
        finally:
            kill_process_group(proc)
    return proc.returncode, out, err


def _run_job(script: str, timeout_s: float, args: Sequence[str], stderr: int,
             environ: Mapping[str, str] | None) -> tuple[dict, str]:
    """The job's result and its stdout (with ``stderr=subprocess.STDOUT``, its stderr too)."""
    with tempfile.TemporaryDirectory(prefix="dsgd-job-", ignore_cleanup_errors=True) as ray_tmp:
        env = {**(os.environ if environ is None else environ), "RAY_TMPDIR": ray_tmp, "TF_CPP_MIN_LOG_LEVEL": "2"}
        returncode, out, err = _bounded_run([sys.executable, script, *args], timeout_s, env=env, stderr=stderr)
    # A progress bar drawn on the same stream may put its cursor codes before the line: find the prefix anywhere.
    results = [line.split(RESULT_PREFIX, 1)[1] for line in out.splitlines() if RESULT_PREFIX in line]
    if returncode != 0 or not results:
        raise AssertionError(f"{script} exited with {returncode}; stderr tail:\n{(err or out)[-4000:]}")
    return json.loads(results[-1]), out

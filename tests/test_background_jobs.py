"""The queue that runs job scripts and calls in the background (tests/background_jobs.py)."""

import concurrent.futures
import os
import subprocess
import sys
import threading

import pytest

from background_jobs import Call, JobQueue
from job_processes import stopped_at_session_end


def test_queued_calls_run_one_at_a_time_in_order_each_in_its_own_scratch_and_the_session_start_environment(
        monkeypatch):
    ran, threads = [], []

    def call(name):
        def function(scratch, environ):
            threads.append(threading.current_thread())
            ran.append((name, os.path.basename(scratch), os.path.isdir(scratch), environ.get("DSGD_TEST_VALUE")))
            return name
        return Call(name, function, 10)

    queue = JobQueue()
    monkeypatch.setenv("DSGD_TEST_VALUE", "at start")
    first, second = call("first"), call("second")
    queue.start([first, second])
    monkeypatch.setenv("DSGD_TEST_VALUE", "changed by a test")  # after the start: the jobs do not see it
    try:
        assert queue.result(second) == "second" and queue.result(first) == "first"
    finally:
        queue.close()
    assert ran == [("first", "first", True, "at start"), ("second", "second", True, "at start")]
    # One at a time: both ran on one thread, the queue's (not the test's, not one each).
    assert threads[0] is threads[1] and threads[0] is not threading.current_thread()


def test_a_failed_job_fails_the_fixture_that_takes_it_and_a_job_not_queued_runs_there_and_then():
    def fails(scratch, environ):
        raise AssertionError("the job's own failure")

    queue = JobQueue()
    failing = Call("fails", fails, 10)
    queue.start([failing])
    try:
        with pytest.raises(AssertionError, match="the job's own failure"):
            queue.result(failing)
        not_queued = Call("not queued", lambda scratch, environ: threading.current_thread(), 10)
        assert queue.result(not_queued) is threading.current_thread()
    finally:
        queue.close()


def test_closing_the_queue_stops_the_running_job_and_drops_those_not_started():
    started = threading.Event()

    def sleeper(scratch, environ):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with stopped_at_session_end(proc, subprocess.Popen.kill):
            started.set()
            return proc.wait(timeout=600)

    queue = JobQueue()
    running, waiting = Call("sleeper", sleeper, 600), Call("never", lambda scratch, environ: "ran", 10)
    queue.start([running, waiting])
    assert started.wait(60)
    queue.close()
    assert queue.result(running) == -9  # killed, not run to its end
    with pytest.raises(concurrent.futures.CancelledError):  # never run (it would return "ran" at once)
        queue.result(waiting)

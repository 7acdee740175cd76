"""One Ray instance for the whole test session, sized for a 2-core machine."""

import os

import pytest
import ray

from job_processes import worker_runtime_env

# Logical CPUs: enough for two 2-worker engines at once; actors mostly wait.
NUM_CPUS = 8

# Set when the tests are collected, before any test module (benchmarks' package among them) picks its own.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray's log monitor (one per node; it inherits this environment, as the background jobs' clusters do) polls
# every open log file ten times a second, up to 200 of them, and a dead worker's files stay open until that
# many have piled up: a session that has started 80 actors and is idle keeps it at 63 ms of CPU a second.
# At most 64 files (more than the session's live actors write) and a rescan of the directory every 0.5 s
# instead of every poll: 13 ms. Worker output still reaches the driver, a new file's up to 0.5 s later.
os.environ.setdefault("RAY_LOG_MONITOR_MAX_OPEN_FILES", "64")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "1")

import background_jobs  # noqa: E402 (its jobs start with the environment above)


@pytest.fixture(scope="session")
def ray_session():
    ray.init(
        address="local",  # a Ray of its own, even where a cluster started by `ray start` runs on the machine
        num_cpus=NUM_CPUS,
        object_store_memory=1 << 30,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env=worker_runtime_env(),  # worker processes import the test models by name
    )
    yield ray
    ray.shutdown()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Queue the background jobs of the selected tests' fixtures (``background_jobs``), in the order first used."""
    if session.config.option.collectonly:
        return
    jobs: dict[background_jobs.Job | background_jobs.Call, None] = {}
    for item in session.items:
        for fixture, job in getattr(item.module, "BACKGROUND_JOBS", {}).items():
            if fixture in item.fixturenames:
                jobs.setdefault(job)
    background_jobs.QUEUE.start(list(jobs))


def pytest_sessionfinish(session: pytest.Session) -> None:
    background_jobs.QUEUE.close()


def pytest_terminal_summary(terminalreporter) -> None:
    """How long each background job ran, beside ``--durations`` (the suite's time budget)."""
    if background_jobs.QUEUE.seconds:
        terminalreporter.write_sep("=", "background jobs")
        for name, seconds in background_jobs.QUEUE.seconds.items():
            terminalreporter.write_line(f"{seconds:7.2f}s {name}")

"""One Ray instance for the whole test session, sized for a 2-core machine."""

import os
from pathlib import Path

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
import slow_slices  # noqa: E402


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow-slice", metavar="I/K", default=None,
                     help="keep only the slow tests of slice I of K (1 to K), dealt by their times in "
                          "tests/slow_durations.json (tests/slow_slices.py); with -m slow")
    parser.addoption("--record-slow-durations", metavar="PATH", default=None,
                     help="write (or update) the seconds of the slow tests that ran to PATH, in the format of "
                          "tests/slow_durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--slow-slice I/K``: deselect every test but the slow ones of slice I."""
    spec = config.getoption("slow_slice")
    if spec is None:
        return
    index, count = slow_slices.parse(spec)
    dealt = slow_slices.deal(slow_slices.load(), count)
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        (keep if slow and slow_slices.slice_of(slow_slices.unit(item), dealt, count) == index else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """With ``--slow-slice``: the slice, its measured seconds and its tests' ids, at the head of the run."""
    spec = config.getoption("slow_slice")
    if spec is None:
        return []
    index, count = slow_slices.parse(spec)
    seconds = slow_slices.load()
    units = {slow_slices.unit(item) for item in items}
    unmeasured = sorted(units - set(seconds))
    lines = [f"slow tier, slice {index}/{count}: {len(items)} tests, {sum(seconds.get(u, 0.0) for u in units):.0f} s "
             f"as measured (tests/slow_durations.json)"
             + (f"; {len(unmeasured)} with no measured time, placed by a hash of their ids" if unmeasured else "")]
    lines += [f"  {item.nodeid}" + ("  (no measured time)" if slow_slices.unit(item) in unmeasured else "")
              for item in items]
    return lines


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    TEST_SECONDS[report.nodeid] = TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


TEST_SECONDS: dict[str, float] = {}  # node id -> seconds of its setup, call and teardown (--record-slow-durations)


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
    path = session.config.getoption("record_slow_durations")
    if path is not None:  # after close: a job killed at the session's end has its time too
        measured = slow_slices.unit_seconds(session.items, TEST_SECONDS, background_jobs.QUEUE.seconds)
        slow_slices.write(Path(path), {**slow_slices.load(Path(path)), **measured})


def pytest_terminal_summary(terminalreporter) -> None:
    """How long each background job ran, beside ``--durations`` (the suite's time budget)."""
    if background_jobs.QUEUE.seconds:
        terminalreporter.write_sep("=", "background jobs")
        for name, seconds in background_jobs.QUEUE.seconds.items():
            terminalreporter.write_line(f"{seconds:7.2f}s {name}")

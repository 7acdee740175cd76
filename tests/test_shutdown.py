"""After an engine stops (``shutdown``, its ``with`` block, garbage collection), nothing it started runs or prints.

tests/shutdown_job.py runs the engines in its own process, with its own Ray
and dashboard (Ray's state API, ``ray.util.state``, is served by it) and
Ray Data's progress bars on; see its docstring.
"""

import os

import pytest

from background_jobs import QUEUE, Job

pytest.importorskip("ray.data", reason="Ray Data is the optional extra dsgd[data]")
pytest.importorskip("aiohttp", reason="Ray's state API needs its dashboard: ray[default] (the test extra)")

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shutdown_job.py")
JOB_TIMEOUT_S = 600
BACKGROUND_JOBS = {"job": Job(JOB, JOB_TIMEOUT_S, with_output=True)}


@pytest.fixture(scope="module")
def job():
    return QUEUE.result(BACKGROUND_JOBS["job"])


def test_no_actor_or_task_of_a_stopped_engine_is_alive_in_rays_state(job):
    left, _ = job
    assert left == {"with block, datasets": [], "shutdown, no datasets": [], "garbage collected, datasets": []}


def test_a_stopped_engines_dataset_progress_bars_are_not_drawn_again(job):
    _, output = job
    after = output[output.index("ENGINES STOPPED"):]
    assert "tick 4" in after  # the job printed after the engines stopped
    for progress in ("Running Dataset", "ReadRange", "split("):
        assert progress not in after, after[:3000]

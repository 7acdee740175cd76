"""What an engine leaves running after it is stopped, asked of Ray's state API; prints it as JSON.

Started by tests/test_shutdown.py in its own process and session, with its
own Ray and its dashboard (which serves ``ray.util.state``). Ray Data's
progress bars are on, as a user has them. Three engines, one after the
other, each stopped after 15 steps (with datasets: partway into the first
epoch, the dataset still running):

1. ``datasets=``, stopped by leaving its ``with`` block;
2. no datasets, stopped by ``shutdown()``;
3. ``datasets=``, dropped without shutdown (``del`` and a garbage collection).

After each, the job waits (bounded) until no actor or task that was not
running before the engine is left, by ``ray.util.state``. Then it waits
until what the workers wrote has reached its own output (``forwarded``),
prints ``ENGINES STOPPED`` and goes on printing ``tick`` lines, as a
program that does other things, so that anything still drawing shows after
that line and nothing drawn before it does.
The ``RESULT`` line maps each engine to what was still running after the
wait: ``class name`` of actors, ``name`` of tasks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

# Ray's driver holds back a worker's line that repeats another's for 5 s, to print it once with a count: it could
# then come after "ENGINES STOPPED" although written before. Set before Ray is imported, which reads it.
os.environ["RAY_DEDUP_LOGS"] = "0"

import ray
import ray.data
from ray.util.state import list_actors, list_tasks

import dsgd
import data_test_models as dm
from dsgd_test_models import TanhNet
from job_processes import RESULT_PREFIX

ROWS = 2000  # 2 replicas x 1000 rows, batches of 10: an epoch is 100 steps, still running when stopped
STEPS = 15
SETTLE_S = 60.0  # bound on waiting for Ray's state to show everything stopped


# Ray Data's actors that serve the whole job, not one dataset: a split coordinator that shutdown kills
# may leave a call to them listed as pending (its owner, not it, would have reported its end).
RAY_DATA_JOB_ACTORS = ("_StatsActor", "_AutoscalingCoordinatorActor")


def running() -> dict[str, str]:
    """Id -> name of every live actor, and of every task that has not ended and is not an actor task of a dead actor
    or of Ray Data's job-wide actors.

    (A task's owner reports its end; an owner killed first, as shutdown kills
    the workers, leaves its tasks listed as pending in Ray's state although
    their actor is gone, or although they ran on an actor that outlives them.)
    """
    address = ray.get_runtime_context().gcs_address
    actors = {a.actor_id: f"actor {a.class_name}" for a in list_actors(
        address=address, filters=[("state", "!=", "DEAD")], limit=10_000, raise_on_missing_output=False)}
    tasks = {t.task_id: f"task {t.name}" for t in list_tasks(
        address=address, filters=[("state", "!=", "FINISHED"), ("state", "!=", "FAILED")], limit=10_000,
        raise_on_missing_output=False)
        if (t.actor_id is None or t.actor_id in actors) and not t.name.startswith(RAY_DATA_JOB_ACTORS)}
    return {**actors, **tasks}


def left_running(before: dict[str, str]) -> list[str]:
    """What is running now and was not in ``before``, once that is nothing or after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = sorted(name for key, name in running().items() if key not in before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


class Watched:
    """A stream that sets ``seen`` once ``token`` is written to it (by Ray's thread printing worker output)."""

    def __init__(self, stream, token: str):
        self.stream, self.token, self.seen = stream, token, threading.Event()

    def write(self, text: str) -> int:
        if self.token in text:
            self.seen.set()
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@ray.remote(num_cpus=0)
def say(text: str) -> None:
    print(text, flush=True)


def forwarded() -> None:
    """Wait (bounded) until a line a task prints now has reached this driver's output. Ray's log monitor reads
    every worker's log files on each pass and the driver prints what it sends in order, so what the workers wrote
    before that line has reached the output too."""
    token = f"FORWARDED {os.getpid()}"
    sys.stdout = watched = Watched(sys.stdout, token)
    try:
        ray.get(say.remote(token), timeout=SETTLE_S)
        if not watched.seen.wait(SETTLE_S):
            raise RuntimeError(f"a task's line did not reach the driver's output within {SETTLE_S} s")
    finally:
        sys.stdout = watched.stream


def engine(datasets: bool) -> dsgd.DistributedSGD:
    if datasets:
        return dsgd.DistributedSGD(dm.row_id_creator(ROWS), num_workers=2, strategy="ps",
                                   datasets={"train": ray.data.range(ROWS)}, timeout_s=120, startup_timeout_s=120)
    return dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="ps", timeout_s=120, startup_timeout_s=120)


def left_after(how: str, datasets: bool) -> list[str]:
    """Build an engine, step it, stop it ``how``: what it left running, by ``left_running``."""
    before = running()
    if how == "with block":
        with engine(datasets) as sgd:
            for _ in range(STEPS):
                sgd.step()
        return left_running(before)
    sgd = engine(datasets)
    for _ in range(STEPS):
        sgd.step()
    if how == "shutdown":
        sgd.shutdown()
    else:
        del sgd
        gc.collect()
    return left_running(before)


def main() -> None:
    ray.init(num_cpus=4, include_dashboard=True, logging_level="ERROR")
    ray.data.range(1).materialize()  # Ray Data's own actors for the whole cluster start here, not with an engine
    left = {"with block, datasets": left_after("with block", datasets=True),
            "shutdown, no datasets": left_after("shutdown", datasets=False),
            "garbage collected, datasets": left_after("garbage collection", datasets=True)}
    print("ENGINES STOPPED", flush=True)
    for i in range(5):
        time.sleep(1)
        print("tick", i, flush=True)
    print(RESULT_PREFIX + json.dumps(left), flush=True)


if __name__ == "__main__":
    main()

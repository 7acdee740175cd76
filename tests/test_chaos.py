"""Faults at random moments while the engine steps, saves and resizes: no step lost, replicas identical, the weights
a fault-free run's, right stats.

Each run (``benchmarks.faults.run``) trains ``SlopeNet``, whose weights after
n steps are known whichever workers averaged them, through a plan of steps,
saves, a shrink and a grow, while a thread SIGKILLs workers and parameter
servers (one, two at once, or one more during the recovery) at moments
drawn from a seed. The seed is printed and named in every failure; set
``DSGD_CHAOS_SEED`` to run that plan again. The runs are soaks, all
``slow`` (the suite's time budget): a short run across two nodes (relays,
bf16, a resize, saves), the one-node configurations, and each as a longer
soak. The default run checks the plans and the check itself; every defect
a run found has a deterministic test of its own, in the default run.
"""

import os
import random
import sys

import numpy as np
import pytest

from background_jobs import QUEUE, Job
from benchmarks import faults

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chaos_job.py")
SEED = int(os.environ.get("DSGD_CHAOS_SEED", random.SystemRandom().randrange(1 << 31)))
SHORT = dict(steps=60, count=3)
SOAK = dict(steps=300, count=8)
JOB_TIMEOUT_S = {60: 300, 300: 900}


def replay(test: str) -> str:
    return (f"seed {SEED}; replay: DSGD_CHAOS_SEED={SEED} {sys.executable} -m pytest tests/test_chaos.py -m slow "
            f"-k '{test}'")


def check(record: dict, steps: int, faults_planned: int, test: str) -> None:
    """The run found nothing wrong, every step counted and applied, every kill recovered from."""
    kills = [(k["landed_in"], k["victims"], k["recovered_s"]) for k in record["kills"]]
    print(f"{test}: {replay(test)}\n  kills (landed in, victims, recovered after s): {kills}\n"
          f"  kills skipped {record['kills_skipped']}, failures recovered {record['failures']}, "
          f"resize errors {record['resize_errors']}")
    assert record["problems"] == [], f"{test}, {replay(test)}: {record['problems']}"
    assert record["steps"] == record["steps_shown"] == steps, replay(test)
    # A kill finds no victim only while every worker but one is being replaced (it spares the last live worker).
    assert len({k["fault"] for k in record["kills"]}) + record["kills_skipped"] >= faults_planned, replay(test)
    assert record["failures"] >= 1, replay(test)


def one_node(name: str, steps: int, count: int) -> dict:
    plan = faults.make_plan(SEED, steps, count, faults.NUM_WORKERS)
    try:
        return faults.run(plan, faults.NUM_WORKERS, **faults.CONFIGS[name]).record()
    except Exception as e:
        raise AssertionError(f"chaos run {name} raised, {replay(name)}") from e


def test_the_plan_puts_faults_in_a_save_a_resize_and_steps_none_at_the_ends():
    plan = faults.make_plan(7, 60, 4, 3)
    assert plan == faults.make_plan(7, 60, 4, 3) and plan != faults.make_plan(8, 60, 4, 3)
    assert plan.steps == 60
    kinds = [a.kind for a in plan.actions]
    assert [a.arg for a in plan.actions if a.kind == "resize"] == [2, 3] and kinds.count("save") == 2
    assert plan.actions[0] == faults.Action("step", 1)  # the first stats come from a fault-free step
    at = [f.action for f in plan.faults]
    assert len(at) == 4 and sorted({kinds[i] for i in at}) == ["resize", "save", "step"]
    assert all(faults.FIRST_FAULT <= i < len(plan.actions) - faults.TAIL for i in at)
    assert kinds[-faults.TAIL:] == ["step"] * faults.TAIL


def test_any_workers_mean_of_the_slopes_is_the_slopes_and_a_step_more_or_less_shows():
    for _, slope in faults.START_AND_SLOPES.values():
        k = slope * 64
        assert np.array_equal(k, np.round(k)) and 1 <= np.abs(k).min() and np.abs(k).max() <= 128
        assert not np.any(slope.view(np.uint32) & 0xFFFF)  # exact in bf16: its low 16 bits are 0
        for n in (1, 2, 3, 4):  # a mean over any n workers, as the servers and relays compute it
            total = slope.copy()
            for _ in range(n - 1):
                total = total + slope
            assert np.array_equal(total / np.float32(n), slope)
    trajectory = faults.reference(310)
    for steps in (60, 300):
        rounded = {k: v.astype(np.float32) for k, v in trajectory[steps].items()}
        assert faults.distance(rounded, trajectory[steps], steps) <= 1
        assert faults.distance(trajectory[steps - 1], trajectory[steps], steps) > 10
        assert faults.distance(trajectory[steps + 1], trajectory[steps], steps) > 10
        assert faults.steps_shown(rounded, trajectory) == steps


@pytest.mark.slow
@pytest.mark.parametrize("name", ["simple", "ps-backup"])
def test_random_kills_on_one_node_lose_nothing(ray_session, name):
    check(one_node(name, **SHORT), SHORT["steps"], SHORT["count"], name)


def two_nodes_job(steps: int, count: int, config: str = "two-nodes") -> Job:
    return Job(JOB, JOB_TIMEOUT_S[steps], (str(SEED), str(steps), str(count), config))


BACKGROUND_JOBS = {"short_two_node_run": two_nodes_job(**SHORT),
                   "short_two_node_streams_run": two_nodes_job(**SHORT, config="two-nodes-streams")}


def two_nodes(steps: int, count: int, config: str = "two-nodes") -> dict:
    try:
        return QUEUE.result(two_nodes_job(steps, count, config))
    except AssertionError as e:
        raise AssertionError(f"chaos run across two nodes ({config}) failed, {replay('two_nodes')}: {e}") from e


@pytest.fixture(scope="module")
def short_two_node_run() -> dict:
    return two_nodes(**SHORT)


@pytest.fixture(scope="module")
def short_two_node_streams_run() -> dict:
    return two_nodes(**SHORT, config="two-nodes-streams")


@pytest.mark.slow
def test_random_kills_across_two_nodes_with_relays_and_bf16_lose_nothing(short_two_node_run):
    record = short_two_node_run
    assert len(set(record["worker_nodes"])) == 2 and record["relayed_partitions"] > 0
    check(record, SHORT["steps"], SHORT["count"], "two_nodes")


@pytest.mark.slow
def test_random_kills_across_two_nodes_one_worker_each_summed_as_the_pushes_arrive_lose_nothing(
        short_two_node_streams_run):
    """One worker a node: every partition comes down a stream and through shared memory, its server sums it as
    the pushes arrive and its mean goes back as it is summed; a kill meanwhile cuts the streams."""
    record = short_two_node_streams_run
    assert len(set(record["worker_nodes"])) == 2 and record["relayed_partitions"] == 0
    check(record, SHORT["steps"], SHORT["count"], "two_nodes_one_worker_each")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(faults.CONFIGS))
def test_soak_of_random_kills_on_one_node(ray_session, name):
    check(one_node(name, **SOAK), SOAK["steps"], SOAK["count"], name)


@pytest.mark.slow
def test_soak_of_random_kills_across_two_nodes():
    check(two_nodes(**SOAK), SOAK["steps"], SOAK["count"], "two_nodes")

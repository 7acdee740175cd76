"""Faults at random moments: a model any fault-free run agrees with, a seeded plan of SIGKILLs, the thread that
delivers them, and one chaos run with its checks.

benchmarks/chaos.py runs it at scale against fault-free runs; tests/test_chaos.py runs short ones in the suite
(tests/chaos_job.py across two nodes).

The model (``SlopeNet``): the loss is ``sum(slope * w)`` over its variables,
so every replica's gradient is the constant ``slope``, whatever its weights
or data. Each slope is ``k / 64`` with ``1 <= |k| <= 128``: 8 significant
bits at most, exact in float32 and bf16, and any sum of a few of them is
exact too, so the mean of any set of workers (all of them, the quorum of
backup workers, a node's relayed partial sum) is the slope bit for bit.
With momentum, the weights after ``n`` steps are a function of ``n`` alone
(``reference``): a lost, repeated or half-applied step, or momentum slots
not carried over, moves them well beyond float32 rounding.

A run (``run``) goes through a list of actions (steps, a few of them
fetching stats, ``save``s and a shrink then a grow by one worker); a fault
(``Fault``) is armed as its action begins and, ``delay_s`` later, SIGKILLs
one or two live actors of the engine (workers or parameter servers, never
every worker), sometimes one more ``then_s`` after that, while the engine
recovers. The plan and the choice of victims come from one seed; the moments
the kills land depend on the machine, so a replay repeats the plan, not
necessarily the interleaving.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import tensorflow as tf

import dsgd
from benchmarks import common

LR, MOMENTUM = 0.1, 0.9
SHAPES = {"layer/w": (5, 4), "layer/b": (4,), "out/v": (32,)}  # 56 floats: 4 partitions of PARTITION_BYTES
PARTITION_BYTES = 64
FIRST_FAULT = 5  # actions before the first fault: the first stats are a fault-free step's
TAIL = 10  # steps after the last fault: each victim's loss is found by a step
MAX_STEPS = 1000  # a lost step still moves a weight 8 times the bound on float32 rounding (``distance``)


def _start_and_slopes() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per variable: its start value and its slope (``k / 64``, ``1 <= |k| <= 128``)."""
    rng = np.random.RandomState(46)
    values = {}
    for name, shape in SHAPES.items():
        start = rng.randn(*shape).astype(np.float32)
        slope = rng.randint(1, 129, shape) * rng.choice([-1, 1], shape) / 64
        values[name] = start, slope.astype(np.float32)
    return values


START_AND_SLOPES = _start_and_slopes()


class SlopeNet(dsgd.Model):
    """loss = sum over variables of sum(slope * w): every replica's gradient is its slopes, bit for bit."""

    def __init__(self, worker_index: int, device_index: int):
        terms, sums = [], []
        for name, (start, slope) in START_AND_SLOPES.items():
            w = tf.compat.v1.get_variable(name, start.shape, initializer=tf.compat.v1.constant_initializer(start))
            terms.append(tf.reduce_sum(w * slope))
            sums.append(tf.reduce_sum(w))
        self.loss = tf.add_n(terms)
        self.weight_sum = tf.add_n(sums)

    def get_loss(self):
        return self.loss

    def get_optimizer(self):
        return tf.compat.v1.train.MomentumOptimizer(LR, MOMENTUM)

    def get_metrics(self):
        return {"weight_sum": self.weight_sum}


def reference(steps: int) -> list[dict[str, np.ndarray]]:
    """The weights after 0, 1, ..., ``steps`` momentum steps on the slopes, in float64."""
    weights = {name: start.astype(np.float64) for name, (start, _) in START_AND_SLOPES.items()}
    accum = {name: np.zeros_like(w) for name, w in weights.items()}
    trajectory = [weights]
    for _ in range(steps):
        accum = {name: MOMENTUM * accum[name] + START_AND_SLOPES[name][1] for name in accum}
        weights = {name: weights[name] - LR * accum[name] for name in weights}
        trajectory.append(weights)
    return trajectory


def reference_loss(weights: dict[str, np.ndarray]) -> tuple[float, float]:
    """The loss on ``weights`` and a bound on its float32 rounding (the sum of the terms' magnitudes times 1e-6)."""
    terms = [weights[name] * slope for name, (_, slope) in START_AND_SLOPES.items()]
    return float(sum(t.sum() for t in terms)), 1e-6 * float(sum(np.abs(t).sum() for t in terms)) + 1e-4


def distance(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], steps: int) -> float:
    """The largest difference of ``got`` from ``expected`` in units of a bound on float32 rounding over ``steps``
    steps: at most 1 if they agree.

    Each step rounds a weight (about its magnitude) and its momentum (up to
    ``10 * |slope|``, whose error goes on into the weight), so the bound is
    ``steps`` float32 epsilons of ``|w| + 10 |slope| + 1``. A step more or
    less moves a weight by about ``|slope|``: for a few hundred steps, tens of
    times the bound.
    """
    worst = 0.0
    for name, value in expected.items():
        slope = START_AND_SLOPES[name][1]
        tolerance = (steps + 1) * 2.0 ** -23 * (np.abs(value) + 10 * np.abs(slope) + 1)
        worst = max(worst, float(np.max(np.abs(got[name] - value) / tolerance)))
    return worst


def steps_shown(weights: dict[str, np.ndarray], trajectory: list[dict[str, np.ndarray]]) -> int:
    """The step count whose reference weights ``weights`` are nearest to."""
    return min(range(len(trajectory)), key=lambda n: distance(weights, trajectory[n], len(trajectory)))


# ---- the plan --------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One call of a run: ``step`` (``arg``: 1 to fetch stats), ``save`` (``arg``: the checkpoint's number) or
    ``resize`` (``arg``: the new count)."""

    kind: str
    arg: int

    def label(self, steps_before: int) -> str:
        return {"step": f"step {steps_before}", "save": f"save {self.arg}", "resize": f"resize to {self.arg}"}[
            self.kind]


@dataclass(frozen=True)
class Fault:
    """Kill ``at_once`` live actors ``delay_s`` after action ``action`` begins; then, unless ``then_s`` is None,
    one more that much later (while the engine recovers)."""

    action: int
    delay_s: float
    at_once: int
    then_s: float | None


@dataclass(frozen=True)
class Plan:
    seed: int
    actions: tuple[Action, ...]
    faults: tuple[Fault, ...]

    @property
    def steps(self) -> int:
        return sum(a.kind == "step" for a in self.actions)


DELAYS_S = {"step": 0.3, "save": 0.05, "resize": 3.0}  # a fault lands within this of its action's start


def make_plan(seed: int, steps: int, faults: int, num_workers: int, saves: int = 2, stats_every: int = 7) -> Plan:
    """``steps`` steps (every ``stats_every``-th fetching stats, the first among them), ``saves`` saves and a
    shrink to ``num_workers - 1`` then a grow back, spread over the run; ``faults`` faults: the first during a
    save, the second during a resize, the rest during random steps, none in the first ``FIRST_FAULT`` actions
    or the last ``TAIL`` steps."""
    if not 4 * TAIL <= steps <= MAX_STEPS:
        raise ValueError(f"steps={steps}: a chaos run takes {4 * TAIL} to {MAX_STEPS} steps (beyond, float32 "
                         "rounding hides a lost step from the reference)")
    rng = random.Random(seed)
    actions = [Action("step", int(i % stats_every == 0)) for i in range(steps)]
    inserts = [(steps * (2 * k + 1) // (2 * saves), Action("save", k)) for k in range(saves)]
    inserts += [(steps // 3, Action("resize", num_workers - 1)), (2 * steps // 3, Action("resize", num_workers))]
    for at, action in sorted(inserts, key=lambda x: x[0], reverse=True):
        actions.insert(at, action)
    last = len(actions) - TAIL
    by_kind = {kind: [i for i, a in enumerate(actions) if a.kind == kind and FIRST_FAULT <= i < last]
               for kind in ("step", "save", "resize")}
    chosen: list[int] = []
    for k in range(faults):
        kind = "save" if k == 0 and saves else "resize" if k == 1 else "step"
        free = [i for i in by_kind[kind] if all(abs(i - c) > 3 for c in chosen)] or by_kind[kind]
        chosen.append(rng.choice(free))
    plan_faults = tuple(Fault(i, round(rng.uniform(0, DELAYS_S[actions[i].kind]), 3),
                              2 if rng.random() < 0.3 else 1,
                              round(rng.uniform(0.5, 2.5), 3) if rng.random() < 0.3 else None)
                        for i in sorted(chosen))
    return Plan(seed, tuple(actions), plan_faults)


# ---- the kills ---------------------------------------------------------------


@dataclass
class Kill:
    """One SIGKILL of one or more actors, and when the engine was done with it."""

    fault: int
    landed_in: str  # the action running when it landed ("between calls" if none)
    victims: list[str]
    pids: list[int]
    actor_ids: set[str] = field(repr=False)
    at: float = field(repr=False)  # time.monotonic()
    recovered_s: float | None = None  # from the kill to the end of the first call after which no victim is in use


def engine_actors(sgd: dsgd.DistributedSGD) -> list[tuple[str, str]]:
    """(label, actor id) of every worker and parameter server the engine uses now (not a slot being filled: a
    server being started while another thread reads them is None)."""
    workers = [(f"worker {i}", w._actor_id.hex()) for i, w in enumerate(list(sgd.workers)) if w is not None]
    servers = [(f"parameter server {j}", s._actor_id.hex()) for j, s in enumerate(common.parameter_servers(sgd))
               if s is not None]
    return workers + servers


def live_pid(actor_id: str) -> int | None:
    """The pid of an actor Ray lists alive and whose process exists on this machine, else None."""
    info = ray._private.state.actors(actor_id=actor_id)
    pid = info.get("Pid", 0) if info and info.get("State") == "ALIVE" else 0
    if not pid:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


class FaultInjector:
    """Delivers a plan's faults to one engine, each from a thread of its own, and records the kills."""

    JOIN_S = 30.0  # a delivery's sleeps are at most DELAYS_S and 2.5 s

    def __init__(self, sgd: dsgd.DistributedSGD, seed: int):
        self.sgd = sgd
        self.seed = seed
        self.kills: list[Kill] = []
        self.skipped = 0  # kills with no actor to kill but the last live worker
        self.running = "between calls"  # the action in progress, for the record of where a kill landed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def arm(self, index: int, fault: Fault) -> None:
        """Deliver fault ``index`` from a new thread (after the previous one finished)."""
        self.wait()
        self._thread = threading.Thread(target=self._deliver, args=(index, fault), name=f"fault {index}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the fault in delivery, if any; raise what went wrong in it."""
        if self._thread is not None:
            self._thread.join(self.JOIN_S)
            if self._thread.is_alive():
                raise TimeoutError(f"fault delivery did not finish within {self.JOIN_S:.0f} s")
            self._thread = None
        if self._error is not None:
            raise RuntimeError("a fault could not be delivered") from self._error

    def returned(self) -> None:
        """An action returned: every kill none of whose victims the engine uses any more is recovered now."""
        now = time.monotonic()
        in_use = {actor_id for _, actor_id in engine_actors(self.sgd)}
        for kill in self.kills:
            if kill.recovered_s is None and not kill.actor_ids & in_use:
                kill.recovered_s = now - kill.at

    def _deliver(self, index: int, fault: Fault) -> None:
        try:
            rng = random.Random(f"{self.seed}-{index}")
            time.sleep(fault.delay_s)
            self._kill(index, fault.at_once, rng)
            if fault.then_s is not None:
                time.sleep(fault.then_s)
                self._kill(index, 1, rng)
        except BaseException as e:  # reported by wait(), in the run's thread
            self._error = e

    def _kill(self, index: int, count: int, rng: random.Random) -> None:
        """SIGKILL up to ``count`` live actors of the engine chosen by ``rng``, at least one worker left alive.

        If there is none (only the last live worker, while the others are
        being replaced), nothing is killed: waiting for the replacements here
        could wait for the run's thread, which may be waiting for this one.
        """
        victims = self._choose(count, rng)
        if not victims:
            self.skipped += 1
            return
        landed_in = self.running
        for _, _, pid in victims:
            os.kill(pid, signal.SIGKILL)
        self.kills.append(Kill(index, landed_in, [v[0] for v in victims], [v[2] for v in victims],
                               {v[1] for v in victims}, time.monotonic()))

    def _choose(self, count: int, rng: random.Random) -> list[tuple[str, str, int]]:
        """Up to ``count`` of the engine's live actors, (label, actor id, pid), none the last live worker."""
        # A killed process stays a zombie, which Ray lists alive, until its raylet reaps it: the pids this
        # injector killed are dead, whatever Ray says (two kills moments apart took every worker).
        killed = {pid for kill in self.kills for pid in kill.pids}
        live = [(label, actor_id, pid) for label, actor_id in engine_actors(self.sgd)
                if (pid := live_pid(actor_id)) is not None and pid not in killed]
        workers = [a for a in live if a[0].startswith("worker")]
        victims: list[tuple[str, str, int]] = []
        for _ in range(count):
            spare_workers = sum(a in victims for a in workers) < len(workers) - 1
            candidates = [a for a in live if a not in victims and (spare_workers or a not in workers)]
            if candidates:
                victims.append(rng.choice(candidates))
        return victims


# ---- a run --------------------------------------------------------------------


ENGINE_DEFAULTS = dict(grad_shard_bytes=PARTITION_BYTES, max_failures=1000, timeout_s=60.0, startup_timeout_s=180.0)
RESIZE_ATTEMPTS = 3
# The engines a chaos run tries, by name: DistributedSGD keywords (3 workers on one node unless said).
CONFIGS = {"ps": {"strategy": "ps"}, "simple": {"strategy": "simple"},
           "ps-backup": {"strategy": "ps", "backup_workers": 1}, "ps-bf16": {"strategy": "ps", "compression": "bf16"}}
NUM_WORKERS = 3
# The engines a chaos run tries across two nodes (3 CPUs each), by name: (workers, DistributedSGD keywords).
# "two-nodes": 2 workers on each, so every partition is relayed from the node other than its server's;
# "two-nodes-streams": one on each, so every partition comes from a worker on the server's node (shared memory)
# and one on the other (a stream), and its server sums it as the pushes arrive.
ACROSS_TWO_NODES = {"two-nodes": (4, {"strategy": "ps", "compression": "bf16"}),
                    "two-nodes-streams": (2, {"strategy": "ps"})}


@dataclass
class Run:
    """What one run did and found."""

    seed: int
    config: dict[str, Any]
    faults_planned: int
    kills: list[Kill] = field(default_factory=list)
    kills_skipped: int = 0  # no actor to kill but the last live worker (while the others were being replaced)
    failures: int = 0  # the engine's recoveries
    resize_errors: list[str] = field(default_factory=list)  # a grow a kill made fail (the engine as it was); retried
    problems: list[str] = field(default_factory=list)  # every check that failed
    steps: int = 0
    steps_shown: int = 0  # the step count the final weights show (``steps_shown``)
    build_s: float = 0.0
    worker_nodes: list[str] = field(default_factory=list)  # at the start, each worker's node
    relayed_partitions: int = 0  # at the start, the partitions a node's relay sums for their server
    wall_s: float = 0.0  # the actions, from the first to the end of the last
    weights: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def steps_lost(self) -> int:
        return self.steps - self.steps_shown

    def record(self) -> dict[str, Any]:
        """As JSON: everything but the weights."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("kills", "weights")}
        kills = [{k: v for k, v in dataclasses.asdict(kill).items() if k not in ("actor_ids", "at")}
                 for kill in self.kills]
        return {**fields, "kills": kills, "steps_lost": self.steps_lost}


def run(plan: Plan, num_workers: int, inject: bool = True, **engine_kwargs: Any) -> Run:
    """Build a ``SlopeNet`` engine of ``num_workers`` workers, go through ``plan`` (with its faults if
    ``inject``), check the result; the engine is shut down on return."""
    config = {"num_workers": num_workers, **engine_kwargs}
    result = Run(plan.seed, config, len(plan.faults) if inject else 0)
    started = time.monotonic()
    with dsgd.DistributedSGD(SlopeNet, num_workers=num_workers, **{**ENGINE_DEFAULTS, **engine_kwargs}) as sgd, \
            tempfile.TemporaryDirectory(prefix="dsgd-chaos-") as scratch:
        result.build_s = time.monotonic() - started
        result.worker_nodes = list(sgd._cluster.worker_nodes)
        result.relayed_partitions = len(sgd._cluster.servers.relays) if sgd._cluster.servers else 0
        trajectory = reference(plan.steps + TAIL)
        injector = FaultInjector(sgd, plan.seed)
        faults = {f.action: (k, f) for k, f in enumerate(plan.faults)} if inject else {}
        saved: list[tuple[str, int]] = []
        first_stats: dict[int, set[str]] = {}  # worker count -> the keys of its first step's stats
        started = time.monotonic()
        for i, action in enumerate(plan.actions):
            if i == len(plan.actions) - TAIL:
                injector.wait()  # every kill is over before the tail's steps, which find each victim dead
            if i in faults:
                injector.arm(*faults[i])
            injector.running = action.label(sgd.num_steps)
            if action.kind == "step":
                step_id = sgd.num_steps
                stats = sgd.step(fetch_stats=bool(action.arg))
                if stats is not None:
                    keys = first_stats.setdefault(sgd.num_workers, set(stats))  # one worker: no exchange's stats
                    result.problems += _check_stats(stats, step_id, keys, sgd, trajectory)
            elif action.kind == "save":
                path = os.path.join(scratch, f"save-{action.arg}.npz")
                sgd.save(path)
                saved.append((path, sgd.num_steps))
            else:
                _resize(sgd, action.arg, result)
            injector.running = "between calls"
            injector.returned()
        injector.wait()
        result.wall_s = time.monotonic() - started
        result.kills, result.kills_skipped = injector.kills, injector.skipped
        result.failures, result.steps = sgd.failures, plan.steps
        _check_end(sgd, result, trajectory)
        for path, steps in saved:
            sgd.restore(path)
            if sgd.num_steps != steps:
                result.problems.append(f"{os.path.basename(path)}: restored {sgd.num_steps} steps, saved at {steps}")
            if (d := distance(sgd.get_weights(), trajectory[steps], steps)) > 1:
                result.problems.append(f"{os.path.basename(path)}: its weights are not the reference's after "
                                       f"{steps} steps ({d:.0f} times float32 rounding away)")
    return result


def _resize(sgd: dsgd.DistributedSGD, n: int, result: Run) -> None:
    """``resize(n)``; a grow that a kill made fail leaves the engine as it was: tried again, up to RESIZE_ATTEMPTS."""
    for attempt in range(RESIZE_ATTEMPTS):
        try:
            sgd.resize(n)
            return
        except dsgd.DSGDError as e:
            if isinstance(e, dsgd.DSGDTimeoutError) or sgd.num_workers >= n or attempt == RESIZE_ATTEMPTS - 1:
                raise
            result.resize_errors.append(f"resize to {n}: {type(e).__name__}: {str(e)[:300]}")


def _check_stats(stats: dict[str, float], step_id: int, keys: set[str], sgd: dsgd.DistributedSGD,
                 trajectory: list[dict[str, np.ndarray]]) -> list[str]:
    """What is wrong with step ``step_id``'s stats: keys a fault-free step had missing, the step id, the loss and
    the metric against the reference, num_replicas (and dropped_gradients) against the topology now."""
    problems = []
    topology = sgd._cluster.topology
    missing = sorted(keys - set(stats))
    if missing:
        problems.append(f"step {step_id}: stats without {missing}")
    loss, tolerance = reference_loss(trajectory[step_id])
    weight_sum = sum(float(w.sum()) for w in trajectory[step_id].values())
    if stats.get("step") != step_id:
        problems.append(f"step {step_id}: stats say step {stats.get('step')}")
    if not abs(stats.get("loss", np.nan) - loss) <= tolerance:
        problems.append(f"step {step_id}: loss {stats.get('loss')}, expected {loss:.6g}")
    if not abs(stats.get("weight_sum", np.nan) - weight_sum) <= 1e-5 * abs(weight_sum) + 1e-3:
        problems.append(f"step {step_id}: weight_sum {stats.get('weight_sum')}, expected {weight_sum:.6g}")
    if stats.get("num_replicas") != topology.quorum * sgd.devices_per_worker:
        problems.append(f"step {step_id}: num_replicas {stats.get('num_replicas')}, expected {topology.quorum}")
    # Workers left out of at least one partition: each partition leaves out backup_workers, maybe not the same.
    if topology.backup_workers and not 1 <= stats.get("dropped_gradients", 0) <= topology.num_workers:
        problems.append(f"step {step_id}: dropped_gradients {stats.get('dropped_gradients')}, expected 1 to "
                        f"{topology.num_workers}")
    return problems


def _check_end(sgd: dsgd.DistributedSGD, result: Run, trajectory: list[dict[str, np.ndarray]]) -> None:
    """The step counts, every replica bit for bit the same, the weights the reference's, every kill recovered."""
    steps = result.steps
    result.weights = sgd.get_weights()  # after the steps in flight
    workers = list(sgd.workers)
    counts = ray.get([w.applied_steps_count.remote() for w in workers], timeout=60)
    replicas = ray.get([w.get_weights.remote() for w in workers], timeout=60)
    if sgd.num_steps != steps:
        result.problems.append(f"num_steps is {sgd.num_steps}, expected {steps}")
    if counts != [steps] * len(workers):
        result.problems.append(f"the workers applied {counts} steps, expected {steps} each")
    for i, replica in enumerate(replicas[1:], start=1):
        differ = [name for name in replica if not np.array_equal(replica[name], replicas[0][name])]
        if differ:
            result.problems.append(f"worker {i}'s replica differs from worker 0's in {differ}")
    result.steps_shown = steps_shown(result.weights, trajectory)
    if (d := distance(result.weights, trajectory[steps], steps)) > 1:
        result.problems.append(f"the weights are not the reference's after {steps} steps ({d:.0f} times float32 "
                               f"rounding away; nearest: after {result.steps_shown} steps)")
    lost = [f"fault {k.fault}: {', '.join(k.victims)}" for k in result.kills if k.recovered_s is None]
    if lost:
        result.problems.append(f"kills never recovered from: {lost}")

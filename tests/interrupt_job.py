"""Ctrl-C during DistributedSGD.step in a script; prints what happened as JSON.

Started by tests/test_interrupt.py in its own process and session, a
driver of the test session's Ray (its address the one argument). While
step() waits for worker 1, which a gate holds before its batch (``Gate``:
the worker says when it arrives, and waits until the job opens the gate
after the interrupt), a thread sends SIGINT to the whole process group, as
Ctrl-C in a terminal does. Twice:

1. a "ps" engine in a ``with`` block: the KeyboardInterrupt leaves the
   block, which shuts the engine down;
2. then, in the same process, a "simple" engine outside any ``with``
   block, interrupted while the driver gathers the gradients: the script
   goes on stepping, then drops the engine (``del`` and a garbage
   collection).

Prints one stdout line, ``RESULT`` and a JSON object: per engine, whether
the KeyboardInterrupt came out of step() (and where it was raised), the dsgd
actors still alive once the engine was shut down (or dropped), and for the
second its start weights, every replica's final weights and its step count.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import sys
import tempfile
import threading
import traceback
from typing import Iterator

import ray

import dsgd
from dsgd_test_models import Gate, GatedWorker1Net, known_actors, replica_weights, set_start_weights
from job_processes import RESULT_PREFIX, worker_runtime_env

# Worker 1 is held before its batch while this gate is closed (the creator, with the gate's
# path, is pickled by value: the job runs as __main__).
GATE = Gate(os.path.join(tempfile.gettempdir(), f"dsgd-interrupt-job-{os.getpid()}"))
HELD_ON_WORKER_1 = functools.partial(GatedWorker1Net, gate=GATE)
DSGD_ACTORS = {"SGDWorker", "ParameterServer"}


@contextlib.contextmanager
def ctrl_c_while_worker_1_is_held() -> Iterator[None]:
    """SIGINT to the whole process group, as Ctrl-C in a terminal, once worker 1 is held before its batch
    in the body; the gate opens once the body is left (by the KeyboardInterrupt), so the step can end."""
    GATE.close()
    done = threading.Event()

    def interrupt():
        try:
            GATE.wait_arrived()
        except AssertionError:  # never arrived: the body's step raises its own error
            return
        if not done.is_set():
            os.killpg(os.getpgrp(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        GATE.open()
        thread.join()


def where_raised(error: KeyboardInterrupt) -> list[str]:
    """The functions ``error`` passed through, outermost first, as 'file:function'."""
    return [f"{os.path.basename(frame.filename)}:{frame.name}" for frame in traceback.extract_tb(error.__traceback__)]


def alive_dsgd_actors(before: dict) -> list[str]:
    """Class names of the dsgd actors started since ``before`` that Ray lists alive now."""
    return sorted(name for actor_id, (name, state) in known_actors().items()
                  if actor_id not in before and name in DSGD_ACTORS and state != "DEAD")


def shut_down_by_with_block() -> dict:
    before = known_actors()
    raised_through = ["no KeyboardInterrupt"]
    try:
        with dsgd.DistributedSGD(HELD_ON_WORKER_1, num_workers=2, strategy="ps", num_parameter_servers=1) as sgd:
            started = sorted(name for actor_id, (name, _) in known_actors().items() if actor_id not in before)
            with ctrl_c_while_worker_1_is_held():
                sgd.step(fetch_stats=True)
    except KeyboardInterrupt as e:
        raised_through = where_raised(e)
    return {"raised_through": raised_through, "started": started, "alive_after": alive_dsgd_actors(before)}


def steps_on_then_dropped() -> dict:
    before = known_actors()
    sgd = dsgd.DistributedSGD(HELD_ON_WORKER_1, num_workers=2, strategy="simple")
    start = set_start_weights(sgd)
    sgd.step(fetch_stats=True)
    raised_through = ["no KeyboardInterrupt"]
    try:
        with ctrl_c_while_worker_1_is_held():
            sgd.step(fetch_stats=True)
    except KeyboardInterrupt as e:
        raised_through = where_raised(e)
    sgd.step(fetch_stats=True)
    result = {"raised_through": raised_through, "num_steps": sgd.num_steps,
              "start": {k: v.tolist() for k, v in start.items()},
              "replicas": [{k: v.tolist() for k, v in r.items()} for r in replica_weights(sgd)]}
    del sgd
    gc.collect()
    result["alive_after"] = alive_dsgd_actors(before)
    return result


def main() -> None:
    # Ctrl-C as a script started from a terminal gets it. A process started in the background by a
    # non-interactive shell (`cmd &`, as a CI runner may start the test session) has SIGINT ignored;
    # the job inherits that through exec, and Python then installs no KeyboardInterrupt handler:
    # install it. (Nothing in the test session blocks SIGINT: its main thread's signal mask stays
    # empty through test_tune, test_data, test_multinode, test_benchmarks and test_interrupt.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ray.init(address=sys.argv[1], logging_level="ERROR",
             runtime_env=worker_runtime_env())
    try:
        result = {"with_block": shut_down_by_with_block(), "next_engine": steps_on_then_dropped()}
    finally:
        ray.shutdown()
    print(RESULT_PREFIX + json.dumps(result))


if __name__ == "__main__":
    main()

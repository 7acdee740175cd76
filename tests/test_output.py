"""What a user sees: the examples' own lines, TensorFlow's start-up lines only when asked for (dsgd.worker.tf_logs), and
progress while the engine is being built."""

import concurrent.futures
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import pytest

import dsgd
from background_jobs import QUEUE, Call
from dsgd.common import calls
from dsgd.worker import tf_logs
from dsgd_test_models import Gate, held_to_build_on_worker_1, wait_until
from job_processes import HIDDEN_DIR, run_command

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mnist.py"
# What TensorFlow 2.21 writes to stderr as it is imported on a machine without GPUs.
START_UP_MARKERS = ("absl::InitializeLog", "oneDNN custom operations", "cudart_stub", "cpu_feature_guard")


def user_env(environ: Mapping[str, str] = os.environ, **variables: str) -> dict[str, str]:
    """``environ`` (this process's) without the test session's TF_CPP_MIN_LOG_LEVEL and ``HIDDEN_DIR``, plus
    ``variables``."""
    env = {k: v for k, v in environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    path = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and p != HIDDEN_DIR]
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return {**env, **variables}


def import_outputs(*envs: dict[str, str]) -> list[str]:
    """What ``import dsgd, tensorflow`` writes in a new process of each environment (the imports, one
    core each, run at once)."""
    runs = [subprocess.Popen([sys.executable, "-c", "import dsgd, tensorflow; print('imported')"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    try:
        done = [run.communicate(timeout=120) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for run, (stdout, stderr) in zip(runs, done):
        assert run.returncode == 0 and stdout.split() == ["imported"], stderr[-2000:]
    return [stderr for _, stderr in done]


def test_start_up_lines_are_dropped_and_other_lines_kept():
    text = (f"{tf_logs.ABSL_NOTICE}\n"
            "I0000 00:00:1795483744.197626    3631 port.cc:153] oneDNN custom operations are on.\n"
            "I1124 01:29:03.234973    3631 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.\n"
            "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.\n"
            "E0000 00:00:1795484359.612400   20023 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA "
            "error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
            "E0000 00:00:1795484359.612401   20023 op_kernel.cc:1830] OP_REQUIRES failed\n"
            "/x.py:3: DeprecationWarning: old\n")
    assert tf_logs.without_start_up_lines(text) == (
        "E0000 00:00:1795484359.612401   20023 op_kernel.cc:1830] OP_REQUIRES failed\n"
        "/x.py:3: DeprecationWarning: old\n")


def test_importing_tensorflow_after_dsgd_is_quiet_unless_the_user_sets_level_0():
    quiet, level_1, level_0 = import_outputs(user_env(), user_env(TF_CPP_MIN_LOG_LEVEL="1"),
                                             user_env(TF_CPP_MIN_LOG_LEVEL="0"))
    assert not [m for m in START_UP_MARKERS if m in quiet], quiet
    assert not [m for m in START_UP_MARKERS if m in level_1], level_1
    assert "absl::InitializeLog" in level_0  # the user asked: TF's lines


def test_a_keras_trainer_built_on_the_driver_is_as_quiet_as_its_workers():
    """``KerasTrainer(build)`` builds the driver's model, where TensorFlow's context starts: its CUDA probe's
    "failed call to cuInit" (on a machine without GPUs) is hidden as in a worker, other output kept."""
    tests = str(Path(__file__).resolve().parent)
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    code = ("import dsgd, keras_trainer_models as km; t = dsgd.KerasTrainer(km.build_binary); "
            "import sys; print('built', len(t.model.weights)); print('kept', file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split()[0] == "built", run.stderr[-2000:]
    assert "cuInit" not in run.stderr and "kept" in run.stderr, run.stderr[-2000:]


def test_a_keras_trainers_worker_at_level_2_shows_no_failed_cuinit_as_it_builds_and_steps():
    """A KerasTrainer's worker, built as a worker actor builds it (``local_worker``, in a new process) and stepped
    once, at TF_CPP_MIN_LOG_LEVEL=2, where TensorFlow shows ERROR lines: its replicas are built the TF2 way at once
    (not first tried in a TF1 graph, where Keras's ``compile`` listed the devices before the worker could hide
    CUDA's probe, which fails with "failed call to cuInit" on a machine without GPUs)."""
    tests = str(Path(__file__).resolve().parent)
    env = user_env(TF_CPP_MIN_LOG_LEVEL="2", DSGD_SKIP_KERAS_PRELOAD="1")
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    code = ("import sys, dsgd, dsgd_test_models, keras_trainer_models as km; "
            "from dsgd.integrations.keras_feed import DatasetStart; "
            "from dsgd.integrations.keras_trainer import ReplicaCreator; "
            "creator = ReplicaCreator(km.build_binary, 1, DatasetStart(km.binary_replica_dataset, token=1)); "
            "worker = dsgd_test_models.local_worker(creator); worker.step(0, fetch_stats=True); "
            "print('kept', type(worker.runtime).__name__, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cuInit" not in run.stderr and "kept Tf2Runtime" in run.stderr, run.stderr[-3000:]


def test_tensorflows_python_warnings_follow_the_cpp_level_in_workers():
    code = ("import logging; from dsgd import tf_logs; tf_logs.python_warnings_follow_cpp_level(); "
            "print(logging.getLevelName(logging.getLogger('tensorflow').level))")
    levels = {}
    for level in (None, "0", "1", "2", "3"):
        env = user_env() if level is None else user_env(TF_CPP_MIN_LOG_LEVEL=level)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        levels[level] = out.stdout.strip()
    assert levels == {None: "ERROR", "0": "NOTSET", "1": "NOTSET", "2": "ERROR", "3": "ERROR"}


def mnist_example(scratch: str, environ: dict[str, str]) -> tuple[int, str]:
    """The MNIST example as a user runs it, starting its own Ray: its exit code and everything it wrote."""
    return run_command([sys.executable, str(EXAMPLE), "--steps", "20", "--log-every", "10", "--num-cpus", "4"],
                       600, env=user_env(environ))


BACKGROUND_JOBS = {"mnist_example_run": Call("mnist-example", mnist_example, 600)}


@pytest.fixture(scope="module")
def mnist_example_run() -> tuple[int, str]:
    return QUEUE.result(BACKGROUND_JOBS["mnist_example_run"])


def test_mnist_example_prints_its_own_lines_and_no_tensorflow_start_up_line(mnist_example_run):
    returncode, out = mnist_example_run
    assert returncode == 0, out[-3000:]
    assert "built 2 x 1 replicas (ps)" in out
    assert re.search(r"^\s*100%.*20/20 .*loss .*accuracy", out, re.MULTILINE), out
    assert re.search(r"^test accuracy [0-9.]+ after 20 steps", out, re.MULTILINE), out
    assert not [m for m in START_UP_MARKERS if m in out], out  # driver and workers alike


def test_a_long_build_is_logged_naming_the_workers_still_building(ray_session, caplog, monkeypatch, tmp_path):
    """Worker 1's build is held at a gate until a report names it alone (a report that always listed every
    worker would never do so); every report names it."""
    monkeypatch.setattr(calls, "PROGRESS_AFTER_S", 1.0)
    gate = Gate(str(tmp_path / "build"))
    gate.close()

    def not_yet() -> list[list[str]]:
        waits = [r.getMessage() for r in caplog.records
                 if r.name == "dsgd.common.calls" and r.getMessage().startswith("waiting")]
        return [m.split("; not yet: ")[1].split(", ") for m in waits
                if "for the workers to build their models: " in m]

    with caplog.at_level(logging.INFO, logger="dsgd"), concurrent.futures.ThreadPoolExecutor(1) as pool:
        building = pool.submit(dsgd.DistributedSGD, held_to_build_on_worker_1(gate), num_workers=2,
                               strategy="simple")
        try:
            gate.wait_arrived()
            wait_until(lambda: ["worker 1"] in not_yet() or building.done(), timeout_s=120)
        finally:
            gate.open()
        building.result(timeout=120).shutdown()
    reports = not_yet()
    assert ["worker 1"] in reports and all("worker 1" in names for names in reports), reports

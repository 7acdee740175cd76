"""Smoke tests of the benchmark entry points at a tiny size; nothing here asserts on timings."""

import argparse
import ast
import json
import os
import shlex
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
import tensorflow as tf
from matplotlib.container import BarContainer

from benchmarks import (common, exchange, keras3, peers, resnet, resnet101, scaling, setup_cost, soak, step_breakdown,
                        stream_tls)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "resnet50", "--image-size", "32", "--batch-size", "2",
        "--num-iters", "1", "--warmup", "1"]
# Random labels at this size can drive the loss to infinity within steps; the
# default nan_policy="raise" would then stop a smoke run that times nothing.
NAN_IGNORE = ["--nan-policy", "ignore"]
RECORD_FIELDS = {
    "system", "model", "image_size", "batch_size_per_replica", "global_batch", "num_workers",
    "devices_per_worker", "cpus_per_worker", "num_iters", "warmup", "interrupted", "measured_steps",
    "images_per_sec_mean", "images_per_sec_std", "step_times_s", "host", "versions",
}


def check_record(record: dict, system: str, num_workers: int) -> None:
    assert RECORD_FIELDS <= record.keys()
    assert record["system"] == system
    assert (record["model"], record["image_size"], record["batch_size_per_replica"]) == ("resnet50", 32, 2)
    assert record["num_workers"] == num_workers
    assert record["global_batch"] == 2 * num_workers
    assert len(record["step_times_s"]) == 2 and record["measured_steps"] == 1
    assert record["images_per_sec_mean"] > 0 and not record["interrupted"]
    assert record["host"]["cores"] >= 1 and record["host"]["cpu_model"]
    assert record["versions"]["tensorflow"] == tf.__version__


def test_resnet_sizes_match_the_reference_models():
    for model, params in (("resnet50", 25_557_032), ("resnet101", 44_549_160)):
        with tf.Graph().as_default():
            resnet.build_v1_replica(model, batch_size=1, image_size=32)
            count = sum(int(np.prod(v.shape)) for v in tf.compat.v1.trainable_variables())
            num_bn = len([v for v in tf.compat.v1.global_variables() if v.name.endswith("moving_mean:0")])
            updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        assert count == params
        assert len(updates) == 2 * num_bn


def test_tf2_variable_store_runs_batch_norm_updates():
    store = peers.VariableStore("resnet50")
    store.create()
    moving_mean = store.variables["bn1/moving_mean"]

    @tf.function
    def forward():
        images, _ = resnet.synthetic_imagenet(2, 32)
        return resnet.resnet_v1(images, "resnet50", store, training=True)

    assert forward().shape == (2, resnet.NUM_CLASSES)
    assert np.any(moving_mean.numpy() != 0.0)


def test_rounds_rotate_the_order_of_the_systems():
    ran = []
    systems = {name: (lambda name=name: ran.append(name) or 0.001) for name in "abc"}
    times, order, interrupted = common.run_rounds(systems, rounds=4, warmup=1)
    assert order == ran == list("abc" "bca" "cab" "abc")
    assert {name: len(t) for name, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert not interrupted


def test_engine_flags_pass_only_what_was_given():
    parser = argparse.ArgumentParser()
    common.add_engine_flags(parser)
    assert common.engine_kwargs(parser.parse_args([])) == {}
    given = parser.parse_args(["--grad-shard-bytes", "1000", "--num-parameter-servers", "2",
                               "--nan-policy", "ignore", "--no-ops"])
    assert common.engine_kwargs(given) == {"grad_shard_bytes": 1000, "num_parameter_servers": 2,
                                           "nan_policy": "ignore", "use_ops": False}


def test_exchange_shapes():
    sizes = {shape: [int(np.prod(dims)) for _, dims in exchange.variable_shapes(shape)]
             for shape in exchange.VARIABLE_SHAPES}
    assert (len(sizes["resnet101"]), sum(sizes["resnet101"])) == (314, 44_549_160)
    assert len(sizes["huge"]) == 2 and abs(sum(sizes["huge"]) - 44_549_160) < 1000
    assert len(sizes["tiny"]) == 3000 and sum(sizes["tiny"]) == 3000 * 256
    assert (len(sizes["small"]), sum(sizes["small"])) == (314, 4_042_741)  # ResNet-101 at 0.3 of its channels
    assert exchange.variable_shapes("small")[0] == ("conv1/weights", [7, 7, 1, 19])
    scaled = exchange.variable_shapes("huge", scale=0.001)
    assert [dims for _, dims in scaled] == [[22_275], [22_275]]


def test_exchange_gradients_are_computed_by_tensorflow():
    shapes = [("a", [3, 4]), ("b", [5])]
    with tf.Graph().as_default():
        model = exchange.ExchangeModel(0, 0, shapes)
        variables = tf.compat.v1.trainable_variables()
        grads = tf.gradients(model.get_loss(), variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values = sess.run(grads)
    assert [g.shape for g in values] == [(3, 4), (5,)]
    for g in values:  # x_k broadcast over v_k, x_k drawn from [0.5, 1.5)
        assert np.all(g == g.flat[0]) and 0.5 <= g.flat[0] < 1.5


@pytest.fixture
def digits_loaded_here(monkeypatch):
    """examples/mnist.py's model loads its data (scikit-learn's digits, offline) where it is built, on the session's
    Ray workers, which find no scikit-learn (tests/job_processes.py). The same digits loaded here instead: the example
    goes to the workers by value (``common.example``), with this ``load_digits``."""
    mnist = common.example("mnist")
    loaded = mnist.load_digits(None)
    monkeypatch.setattr(mnist, "load_digits", lambda data_dir: loaded)


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget); the huge shape's runs by default
def test_exchange_benchmark_compares_the_mnist_example_with_one_process_on_the_union_batch(ray_session, tmp_path,
                                                                                          digits_loaded_here):
    result = exchange.main(["--shapes", "mnist", "--batch-size", "8", "--warmup", "1", "--steps", "2",
                            "--burst", "3", "--settle-s", "0", "--out", str(tmp_path / "exchange.json")])
    assert result["burst"] == 3
    (shape,) = result["shapes"]
    assert shape["shape"] == "mnist" and shape["tensors"] == 6 and not shape["interrupted"]
    assert shape["systems"] == ["floor", "ideal", "simple", "ps", "bound", "union"]
    ms, ratios = shape["first"]["median_ms"], shape["first"]["ratios"]
    assert ratios["ps/union"] == pytest.approx(ms["ps"] / ms["union"])
    assert "| mnist |" in result["table"] and "| union ms |" in result["table"] and "ps/union" in result["table"]


@pytest.mark.parametrize("shape", ["huge", pytest.param("mnist", marks=pytest.mark.slow)])  # huge by default (time)
def test_step_breakdown_reads_every_process_cpu_and_the_traced_kinds_of_its_step(ray_session, shape, request):
    if shape == "mnist":
        request.getfixturevalue("digits_loaded_here")
    args = argparse.Namespace(scale=0.001, num_workers=2, warmup=1, steps=2, traced=1, batch_size=8)
    record = step_breakdown.measure(shape, args, nodes=1)
    cpu, traced = record["cpu_ms_per_step"], record["traced_ms_per_step"]
    assert {"worker 0", "worker 1", "parameter server 0", "driver", "raylets", "gcs"} <= set(cpu)
    assert all(ms >= 0 for ms in cpu.values()) and record["step_ms_median"] > 0
    for worker in ("worker 0", "worker 1"):  # the send scheduler's spans and the worker's TensorFlow ops, by kind
        assert {"push partitions (pack, signal / actor call)", "wait for and read the means",
                "the step waits for the means", "TF: apply", "TF: graph callbacks (sends, receives)",
                "TF: non-finite checks"} <= set(traced[worker])
    assert "sum partitions" in traced["parameter server 0"]
    assert "| CPU (untraced steps) |" in step_breakdown.table(record)


def test_finite_check_benchmark_times_the_three_checks_on_a_shape(capsys):
    from benchmarks import finite_check

    result = finite_check.measure("small", reps=2)
    assert set(result) == {"checknumerics", "tensors", "partitions"} and all(ms > 0 for ms in result.values())
    assert "small: 4.0 M float32 in 314 tensors" in capsys.readouterr().out


def test_step_breakdown_kinds_of_events():
    assert step_breakdown.event_kind({"name": "a/b", "args": {"op": "ResourceApplyAdam(a, b)"}}) == "TF: apply"
    assert step_breakdown.event_kind({"name": "nonfinite_check_gradients/IsFinite_3",
                                      "args": {"op": "IsFinite(g)"}}) == "TF: non-finite checks"
    assert step_breakdown.event_kind({"name": "d", "args": {"op": "MatMul(x, w)"}}) == "TF: other ops (compute)"
    assert step_breakdown.event_kind({"name": "answer of partition 3"}) == "wait for and read the means"
    assert step_breakdown.event_kind({"name": "compute, exchange and apply"}) is None
    assert step_breakdown.cpu_seconds(os.getpid()) > 0


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget)
def test_soak_reports_object_store_and_every_actors_rss_at_start_and_end(ray_session, tmp_path):
    out = tmp_path / "soak.json"
    result = soak.main(["--shape", "huge", "--scale", "0.001", "--warmup", "1", "--steps", "3",
                        "--sample-every", "2", "--settle-s", "0", "--out", str(out),
                        "--peer-env", "TF_CPU_ALLOCATOR_USE_BFC=false"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["engine_kwargs"] == {}  # the engine's defaults
    assert result["command"].startswith("python -m benchmarks.soak --shape huge")
    assert [s["step"] for s in result["samples"]] == [0, 2, 3]
    actors = ["worker 0", "worker 1"] + [f"parameter server {j}" for j in range(result["num_parameter_servers"])]
    assert sorted(result["pids"]) == sorted(actors) and len(set(result["pids"].values())) == len(actors)
    assert list(result["summary"]) == [soak.OBJECT_STORE, *result["pids"]]
    for name in actors:  # a TensorFlow worker holds 50 MiB to a few GiB; a server (no TensorFlow) under 1 GiB
        summary = result["summary"][name]
        low_mib, high_mib = (50, 8 << 10) if name.startswith("worker") else (1, 1 << 10)
        assert low_mib < summary["start_mib"] < high_mib
        assert summary["ratio"] == pytest.approx(summary["end_mib"] / summary["start_mib"])
        assert f"| {name} RSS |" in result["table"]
    capacity_mib = ray.cluster_resources()["object_store_memory"] / 2**20
    assert all(0 <= result["summary"][soak.OBJECT_STORE][k] <= capacity_mib for k in ("start_mib", "end_mib"))
    # The peer ran interleaved with the defaults, its own actors sampled as often.
    (label, peer), = result["peers"].items()
    assert label == "workers' TF_CPU_ALLOCATOR_USE_BFC=false"
    assert [s["step"] for s in peer["samples"]] == [0, 2, 3]
    assert not set(peer["pids"].values()) & set(result["pids"].values())
    assert peer["step_time_ratio"] == pytest.approx(peer["median_step_ms"] / result["median_step_ms"])
    assert f"| {label} | worker 1 RSS |" in result["table"] and f"{label} " in result["table"].splitlines()[-1]


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget)
def test_setup_cost_times_plain_tensorflow_process_start_and_dsgd_interleaved(ray_session, tmp_path):
    out = tmp_path / "setup_cost.json"
    result = setup_cost.main(["--variables", "12", "--floats", "3000", "--rounds", "1", "--later-steps", "3",
                              "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (size,) = result["sizes"]
    assert size["variables"] == 12 and abs(size["floats"] - 3000) <= 12 and not size["interrupted"]
    assert size["order"] == list(setup_cost.SYSTEMS)  # later rounds rotate (common.run_rounds)
    for run in size["runs"]["dsgd"]:  # the phases add up to the set-up, each one measured
        parts = ["workers up", "models built", "parameter servers", "initial weights"]
        assert all(run[p] > 0 for p in parts) and sum(run[p] for p in parts) == pytest.approx(run["set-up"])
        assert run["total"] == pytest.approx(run["set-up"] + run["first step"])
    assert all(run["later step"] > 0 for name in ("plain", "dsgd") for run in size["runs"][name])
    m = size["median_s"]
    assert size["ratio"] == pytest.approx((m["dsgd"]["total"] - m["start"]["total"]) / m["plain"]["total"])
    assert "| 12 |" in result["table"] and "(target <= 1.2)" in result["table"]


def test_soak_refuses_a_peer_variable_dsgd_does_not_pass_to_its_workers(capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(["--peer-env", "MALLOC_ARENA_MAX=2"])
    assert "--peer-env sets ['MALLOC_ARENA_MAX'], which dsgd does not pass to its workers" in capsys.readouterr().err
    assert soak.parse_args(["--peer-env", "TF_CPU_ALLOCATOR_USE_BFC=false"]).peer_env == [
        ("TF_CPU_ALLOCATOR_USE_BFC", "false")]


def test_soak_compares_the_first_and_last_sample():
    samples = [{"step": 0, "mib": {"object store": 0.0, "worker 0": 100.0, "worker 1": 100.0}},
               {"step": 9, "mib": {"object store": 0.0, "worker 0": 104.0, "worker 1": 106.0}}]
    summary = soak.summarize(samples, tolerance=0.05)
    assert summary["object store"] == {"start_mib": 0.0, "end_mib": 0.0, "ratio": None, "flat": True}
    assert summary["worker 0"]["flat"] and summary["worker 0"]["ratio"] == pytest.approx(1.04)
    assert not summary["worker 1"]["flat"]


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget); Ray Train's peer runs by default
def test_peers_run_interleaved(ray_session, tmp_path):
    records = peers.main(TINY + NAN_IGNORE + ["--num-workers", "1", "--systems", "single", "simple", "ideal", "ps",
                                              "ps-tf2", "--results-dir", str(tmp_path), "--no-plot"])
    systems = ["single-process", "dsgd-simple", "dsgd-ideal", "dsgd-ps", "dsgd-ps-tf2"]
    assert [r["system"] for r in records] == systems
    for record in records:
        check_record(record, record["system"], num_workers=1)
        assert record["run_order"] == systems + systems[1:] + systems[:1]
        assert json.loads((tmp_path / f"{record['system']}.json").read_text()) == record
    assert all(r["engine_kwargs"] == {"nan_policy": "ignore"} for r in records[1:])  # the flags given
    assert records[2]["engines"] == 1 and len(records[2]["worker_nodes"]) == 1  # one 1-worker engine per worker
    assert records[4].keys() == records[3].keys() and records[4]["strategy"] == "ps"  # "ps" the TF2 way
    report = (tmp_path / "report.md").read_text()
    assert all(f"| {system} |" in report for system in systems)
    assert "ps-tf2/ps, median step: **" in report
    assert "`python -m benchmarks.peers --model resnet50" in report


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget: 43 s)
def test_keras3_benchmark_steps_single_and_ps_interleaved(ray_session, tmp_path):
    out = tmp_path / "keras3.json"
    result = keras3.main(["--image-size", "32", "--batch-size", "2", "--num-workers", "1", "--warmup", "1",
                          "--steps", "1", "--systems", "single", "ps", "--nan-policy", "ignore", "--out", str(out)])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    assert result["command"].startswith("python -m benchmarks.keras3 --image-size 32")
    assert [r["system"] for r in result["systems"]] == ["keras3-single", "dsgd-ps"]
    for record in result["systems"]:
        assert record["run_order"] == ["keras3-single", "dsgd-ps", "dsgd-ps", "keras3-single"]
        assert record["global_batch"] == 2 and len(record["step_times_s"]) == 2 and record["measured_steps"] == 1
        assert record["images_per_sec_mean"] > 0 and not record["interrupted"]
    single, ps = result["systems"]
    assert ps["engine_kwargs"] == {**keras3.ENGINE_TIMEOUTS, "nan_policy": "ignore"}
    assert result["ratios"] == {"ps/raytrain": None, "ps/ideal": None,
                                "ps/single": pytest.approx(ps["images_per_sec_mean"] / single["images_per_sec_mean"])}
    assert "| dsgd-ps |" in result["table"] and "| ps/raytrain | – | >= 1.5 |" in result["table"]


def test_turnstile_gives_every_worker_each_turn_in_step(ray_session):
    turnstile = peers.Turnstile.remote(2)
    try:
        take_three_turns(turnstile)
    finally:
        ray.kill(turnstile)


def take_three_turns(turnstile) -> None:
    events, steps_taken = [], {}

    def worker(rank):
        def step():
            events.append(rank)
            return 0.5 + rank, float(rank)

        steps_taken[rank] = peers.take_turns(turnstile, rank, step)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    ray.get(turnstile.all_arrived.remote(), timeout=60)
    assert events == []  # nobody steps before the driver opens a turn
    for turn in range(3):
        assert ray.get(turnstile.run_turn.remote(turn), timeout=60) == (0.5, 0.0)  # rank 0's
        assert len(events) == 2 * (turn + 1) and sorted(events[-2:]) == [0, 1]
    ray.get(turnstile.stop.remote())
    for t in threads:
        t.join(timeout=60)
    assert steps_taken == {0: 3, 1: 3}


@pytest.mark.parametrize("strategy,num_workers", [pytest.param("simple", 1, marks=pytest.mark.slow), ("ps", 2)])
def test_dsgd_benchmark_cli(ray_session, tmp_path, strategy, num_workers):
    out = tmp_path / "run.json"
    record = resnet101.main(TINY + NAN_IGNORE + ["--num-workers", str(num_workers), "--strategy", strategy,
                                                 "--out", str(out)])
    check_record(record, f"dsgd-{strategy}", num_workers)
    assert record["strategy"] == strategy and record["engine_kwargs"] == {"nan_policy": "ignore"}
    assert len(record["engine_step_times_s"]) == 2
    assert json.loads(out.read_text()) == record


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget)
def test_data_input_benchmark_interleaves_numpy_and_ray_data(ray_session, tmp_path):
    from benchmarks import data_input  # imports Ray Data, the dsgd[data] extra

    out = tmp_path / "data_input.json"
    result = data_input.main(["--batch-sizes", "8", "--tiles", "1", "--warmup", "1", "--rounds", "2", "--chunk", "3",
                              "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (record,) = result["records"]
    assert record["order"] == ["numpy", "ray-data", "ray-data", "numpy", "numpy", "ray-data"]
    assert all(len(rates) == 2 and min(rates) > 0 for rates in record["samples_per_s"].values())
    assert record["steps_per_epoch"] == record["rows"] // 16  # 2 replicas x 8
    assert record["ray_data_over_numpy"] > 0 and f"| 8 | {record['rows']} |" in result["table"]


def test_stream_tls_benchmark_moves_the_same_bytes_plain_and_over_tls_interleaved(tmp_path, monkeypatch):
    pairs = []

    class RecordedPair(stream_tls.Pair):
        def __init__(self, *args):
            super().__init__(*args)
            pairs.append(self)

    monkeypatch.setattr(stream_tls, "Pair", RecordedPair)
    result = stream_tls.main(["--mb", "0.2", "--warmup", "0", "--steps", "2", "--out", str(tmp_path / "s.json")])
    assert result["encryption"].startswith("TLSv1.3 ") and set(result["modes"]) == {"plain", "tls"}
    sent = np.random.default_rng(0).standard_normal(200_000 // 4).astype(np.float32)  # the benchmark's 0.2 MB
    assert [pair.stream.encryption is None for pair in pairs] == [True, False]  # plain, then TLS
    for pair in pairs:  # each pair's server answered with what it received: the data, back
        np.testing.assert_array_equal(pair.inputs, sent)
        np.testing.assert_array_equal(pair.means, sent)
    assert all(len(times) == 2 for times in result["times_s"].values())
    assert result["tls_over_plain"]["cpu"] > 0 and (tmp_path / "s.json").exists()


SCRIPTS = sorted(p.name for p in Path(REPO_ROOT, "benchmarks").glob("*.py")
                 if 'if __name__ == "__main__"' in p.read_text())
# One starts in the default run (each process imports TensorFlow: about 10 s here), as a script from another
# directory; every script's header is checked without starting it, below.
STARTED_BY_DEFAULT = {("benchmarks/exchange.py",)}


def test_every_benchmark_script_puts_the_repository_first_before_importing_the_benchmarks_package():
    """What lets `python benchmarks/x.py` run from any directory: ``_repo_path`` imported, when there is no
    package, before the script's first import from ``benchmarks``."""
    for name in SCRIPTS:
        tree = ast.parse(Path(REPO_ROOT, "benchmarks", name).read_text())
        header = next((i for i, node in enumerate(tree.body)
                       if isinstance(node, ast.If) and ast.unparse(node.test) == "not __package__"
                       and "import _repo_path" in ast.unparse(node)), None)
        first_import = next((i for i, node in enumerate(tree.body) if _imports_benchmarks(node)), None)
        assert first_import is None or (header is not None and header < first_import), name


def _imports_benchmarks(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "benchmarks"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "benchmarks" for a in node.names)


@pytest.mark.parametrize("command", [
    pytest.param(command, marks=() if tuple(command) in STARTED_BY_DEFAULT else pytest.mark.slow)
    for name in SCRIPTS for command in (["benchmarks/" + name], ["-m", "benchmarks." + name[:-3]])
], ids=" ".join)
def test_benchmarks_start_as_scripts_and_modules(command, tmp_path):
    # A script runs from any directory; `-m` from the repository root.
    script = command[0] != "-m"
    args = [os.path.join(REPO_ROOT, command[0])] if script else command
    out = subprocess.run([sys.executable, *args, "--help"], cwd=tmp_path if script else REPO_ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:")


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget: 80 s); its pieces are tested by default
def test_exchange_benchmark_run_as_a_script_from_elsewhere_interleaves_floor_ideal_simple_ps_ps_bf16_and_bound(
        ray_session, tmp_path):
    """exchange.py end to end as a user runs it (the other tests call each benchmark's main in this process): from
    another directory, joining this session's Ray, the huge shape scaled down, every system interleaved."""
    out = tmp_path / "exchange.json"
    args = [os.path.join(REPO_ROOT, "benchmarks", "exchange.py"), "--shapes", "huge", "--scale", "0.001",
            "--warmup", "1", "--steps", "2", "--steady-warmup", "1", "--settle-s", "0", "--compression", "bf16",
            "--out", str(out), "--address", ray.get_runtime_context().gcs_address]
    run = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["engine_kwargs"] == {}  # the engine's defaults
    assert result["command"] == shlex.join([sys.executable, *args])  # the command that made it, as run
    (shape,) = result["shapes"]
    assert shape["shape"] == "huge" and shape["tensors"] == 2 and not shape["interrupted"]
    assert shape["num_parameter_servers"] >= 1 and shape["num_partitions"] >= 1
    systems = ["floor", "ideal", "simple", "ps", "ps-bf16", "bound"]
    assert shape["systems"] == systems
    first_rounds = shape["order"][:18]  # 3 rounds of the 6 systems, each round starting one later
    assert first_rounds == [*systems, *systems[1:], *systems[:1], *systems[2:], *systems[:2]]
    for phase in ("first", "steady"):
        summary = shape[phase]
        assert summary["measured_steps"] == 2
        assert set(summary["median_ms"]) == set(systems) and all(ms > 0 for ms in summary["median_ms"].values())
        # The ratios of systems this run has; none for those it has not (a union system is the mnist shape's alone;
        # ps-tf2 and ps-sched run when asked for).
        not_run = ("ps/union", "ps-tf2/ps", "ps-sched/ps")
        assert all(summary["ratios"][name] is not None for name in exchange.TARGETS if name not in not_run)
        assert all(summary["ratios"][name] is None for name in not_run)
    for table in (result["table"], run.stdout):
        assert "| huge |" in table and "| ps-bf16 ms |" in table
        assert "| ideal ms |" in table and "(ps − ideal)/bound" in table


@pytest.mark.slow  # a full smoke run of a benchmark (the suite's time budget): a minute of Ray Train's start-up
def test_ray_train_peer(ray_session, tmp_path):
    (record,) = peers.main(TINY + ["--num-workers", "2", "--systems", "raytrain",
                                   "--results-dir", str(tmp_path), "--no-plot"])
    check_record(record, "raytrain-mwms", num_workers=2)


def test_report_and_plot(tmp_path):
    cfg = common.BenchConfig(model="resnet50", image_size=32, batch_size=2, num_iters=2, warmup=1)
    records = [common.make_record(system, cfg, [1.0, 0.5, seconds], False)
               for system, seconds in (("single-process", 0.5), ("raytrain-mwms", 1.0), ("dsgd-simple", 0.8),
                                       ("dsgd-ps", 0.4), ("dsgd-ideal", 0.5))]
    report = peers.write_report(records, cfg, tmp_path, "python -m benchmarks.peers").read_text()
    assert "`python -m benchmarks.peers`" in report
    assert "| dsgd-ps | 9.00 ± 1.41 | 2 | 1.12 | 1.50 | 1.38 | 1.12 |" in report
    assert "ps-tf2/ps" not in report  # not run
    tf2 = common.make_record("dsgd-ps-tf2", cfg, [1.0, 0.45, 0.4], False)  # median 0.425 s against "ps"'s 0.45 s
    with_tf2 = peers.write_report(records + [tf2], cfg, tmp_path, "python -m benchmarks.peers").read_text()
    assert "ps-tf2/ps, median step: **0.94** (meets the target <= 1.1)." in with_tf2

    (ax,) = peers.throughput_figure(records, cfg).axes
    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [label.get_text() for label in ax.get_xticklabels()] == [r["system"] for r in records]
    assert [bar.get_height() for bar in bars] == [r["images_per_sec_mean"] for r in records]

    png = peers.plot_throughput(records, cfg, tmp_path).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert png[12:16] == b"IHDR" and struct.unpack(">II", png[16:24]) == (720, 420)  # 6 x 3.5 in at 120 dpi


def _scaling_record(nodes: int, per_node: int, exchange_s: dict[str, float]) -> dict:
    """A scaling record as ``scaling.run_config`` makes one: M/B 1 s, the floor 0.1 s."""
    median_ms = {"floor": 100.0, **{name: 100.0 + s * 1000 for name, s in exchange_s.items()}}
    return {"config": f"{nodes}x{per_node}", "nodes": nodes, "workers": nodes * per_node, "per_node": per_node,
            "m_over_b_ms": 1000.0, "ring_ms": 2 * (nodes - 1) / nodes * 1000.0, "median_ms": median_ms,
            "exchange_ms": {name: s * 1000 for name, s in exchange_s.items()}, "probe_gbit": {"min": 0.24},
            "cpu_s_per_step": dict.fromkeys(median_ms, {"node 1: ps worker 0": 0.5}),
            "scale": 0.25, "m_bytes": 44_500_000, "link_gbit": 0.25}


def test_scaling_verdicts_table_and_plot(tmp_path):
    records = [_scaling_record(2, 1, {"ps": 1.1, "ps-bf16": 0.6, "simple": 1.2, "raytrain": 1.5}),
               _scaling_record(4, 1, {"ps": 1.6, "ps-bf16": 0.8, "ps-servers": 1.1, "simple": 1.3, "raytrain": 2.5}),
               _scaling_record(8, 1, {"ps": 1.9, "ps-bf16": 1.0, "simple": 1.6, "raytrain": 3.0}),
               _scaling_record(4, 2, {"ps": 1.7, "ps-bf16": 0.9, "simple": 2.5, "raytrain": 4.0})]
    found = scaling.verdicts(records)
    assert found["ps/(M/B)"] == {"2x1": 1.1, "4x1": 1.6, "8x1": 1.9, "4x2": 1.7}
    assert found["ps 8 nodes / 2 nodes"] == pytest.approx(1.9 / 1.1)
    assert found["raytrain/ps at 8 nodes"] == pytest.approx(3100 / 2000)  # whole steps
    lines = scaling.verdict_lines(found)
    assert lines[0] == "ps/(M/B): 2x1 1.10, 4x1 1.60, 8x1 1.90, 4x2 1.70 (misses <= 1.3)"
    assert lines[3] == "raytrain/ps at 8 nodes: 1.55 (meets >= 1.3)"
    assert lines[4] == "ps-servers/(M/B): 4x1 1.10 (meets <= 1.3)"  # servers on nodes of their own
    assert "| 8x1 | ps | 2000 | 1900 | 1000 | 1750 | 1.90 | 0.240 | 0.50 | node 1: ps worker 0 0.50 |" in \
        scaling.config_rows(records[2])
    (ax,) = scaling.scaling_figure(records).axes
    lines_drawn = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines_drawn["ps"].get_xdata()) == [2, 4, 8]
    assert list(lines_drawn["ps"].get_ydata()) == [1.1, 1.6, 1.9]
    assert list(lines_drawn["ps-servers"].get_xdata()) == [4]
    assert list(lines_drawn["ps, 2 workers a node"].get_ydata()) == [1.7]
    assert list(lines_drawn["2(n-1)/n x M/B"].get_ydata()) == [1.0, 1.5, 1.75]
    assert list(lines_drawn["M/B"].get_ydata()) == [1.0, 1.0, 1.0]


def test_scaling_measures_the_overlap_of_compute_and_exchange_against_the_compute_models_own_floor():
    median_ms = {"floor": 100.0, "ps": 1100.0, "floor+compute": 900.0, "ps+compute": 1320.0}
    assert scaling.exchange_times(median_ms) == {"ps": 1000.0, "ps+compute": 420.0}  # the compute model's floor
    found = scaling.overlap(median_ms)
    assert found["ratio"] == pytest.approx(1320 / 1100) and found["serial"] == pytest.approx(2000 / 1100)
    record = {**_scaling_record(2, 1, {"ps": 1.0}), "overlap": found}
    line = scaling.verdict_lines(scaling.verdicts([record]))[-1]
    assert line == "ps+compute/max(compute, exchange): 2x1 1.20 (misses <= 1.1)"
    assert scaling.overlap({"floor": 100.0, "ps": 1100.0}) is None


def test_scaling_plots_several_runs_each_system_from_the_last_record_that_measured_it(tmp_path, monkeypatch):
    old, new, bf16, other = (tmp_path / f"{name}.json" for name in ("old", "new", "bf16", "other"))
    old.write_text(json.dumps({"configs": [_scaling_record(2, 1, {"ps": 1.1, "raytrain": 1.2}),
                                           _scaling_record(4, 1, {"ps": 2.1, "raytrain": 2.0})]}))
    new.write_text(json.dumps({"configs": [_scaling_record(4, 1, {"ps": 1.9, "ps-servers": 1.7})]}))
    bf16.write_text(json.dumps({"configs": [_scaling_record(4, 1, {"ps-bf16": 1.0})]}))
    drawn, figure = [], scaling.scaling_figure
    monkeypatch.setattr(scaling, "scaling_figure", lambda records: drawn.append(records) or figure(records))
    sources = scaling.main(["--plot-from", str(old), str(new), str(bf16), "--out", str(tmp_path / "plot.json")])
    assert sources == {"2x1": {"ps": str(old), "raytrain": str(old)},
                       "4x1": {"ps": str(new), "raytrain": str(old), "ps-servers": str(new), "ps-bf16": str(bf16)}}
    [(two, four)] = drawn
    assert two["exchange_ms"] == pytest.approx({"ps": 1100, "raytrain": 1200})
    assert four["exchange_ms"] == pytest.approx({"ps": 1900, "raytrain": 2000, "ps-servers": 1700, "ps-bf16": 1000})
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other.write_text(json.dumps({"configs": [{**_scaling_record(8, 1, {"ps": 2.5}), "link_gbit": 1.0}]}))
    with pytest.raises(SystemExit, match="differ in link rate or scale"):
        scaling.main(["--plot-from", str(old), str(other), "--out", str(tmp_path / "plot.json")])


@pytest.mark.slow  # a benchmark's smoke run: three fresh processes each tracing a model (about 60 s here)
def test_first_step_benchmark_times_keras_and_dsgd_first_steps(ray_session, tmp_path):
    from benchmarks import first_step

    out = tmp_path / "first_step.json"
    first_step.main(["--models", "cnn", "--devices", "1", "--rounds", "1", "--later-steps", "1", "--out", str(out)])
    result = json.loads(out.read_text())["models"]["cnn"]
    assert set(result) == {"keras", "dsgd-1"}
    assert all(r["to_first_step_s"] > r["later_step_s"] > 0 for r in result.values())  # a process start, a trace
    assert result["keras"]["later_step_in_process_s"] == result["keras"]["later_step_s"]  # timed in its actor
    assert [len(run["in_process"]) for run in result["dsgd-1"]["runs_s"]] == [1]  # timed inside the worker too
    assert result["dsgd-1"]["later_step_in_process_s"] > 0
    assert result["dsgd-1"]["to_first_step_over_keras"] == result["dsgd-1"]["to_first_step_s"] / result["keras"][
        "to_first_step_s"]


@pytest.mark.slow  # a benchmark's smoke run: one KerasTrainer, fit (arrays, a dataset, one long epoch), its step() loop
def test_keras_fit_benchmark_interleaves_fit_and_the_step_loop_on_one_engine(ray_session, tmp_path):
    from benchmarks import keras_fit

    out = tmp_path / "keras_fit.json"
    keras_fit.main(["--models", "mlp", "--rounds", "2", "--warmup", "1", "--steps", "4", "--out", str(out)])
    result = json.loads(out.read_text())["models"]["mlp"]
    names = ["fit", "steps", "fit-dataset", "fit-one-epoch", "fit-checkpoint"]
    assert result["order"] == names + names[1:] + names[:1]  # each system first in turn
    assert {k: len(v) for k, v in result["per_step_s"].items()} == {name: 1 for name in names}
    medians = result["median_s"]
    assert result["fit_over_steps"] == medians["fit"] / medians["steps"]
    assert result["dataset_over_fit"] == medians["fit-dataset"] / medians["fit"]
    assert result["epoch_end_s"] == pytest.approx((medians["fit"] - medians["fit-one-epoch"]) * 3 * 4 / 2)
    assert result["checkpoint_over_fit"] == medians["fit-checkpoint"] / medians["fit"]


@pytest.mark.slow  # a benchmark's smoke run: dsgd, Ray Train and one Keras process each fitting (about 50 s here)
def test_keras_peers_benchmark_interleaves_the_same_keras_program_epoch_by_epoch(ray_session, tmp_path):
    from benchmarks import keras_peers

    out = tmp_path / "keras_peers.json"
    keras_peers.main(["--models", "convnet", "--steps", "4", "--rounds", "2", "--warmup", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.keras_peers --models convnet")
    model = result["models"]["convnet"]
    names = ["dsgd-fit", "raytrain-mwms", "keras3-single"]
    assert (model["steps"], model["batch_size"], model["epochs"], model["rows"]) == (4, 64, 3, 256)
    assert model["order"] == names + names[1:] + names[:1] + names[2:] + names[:2]  # each system first in turn
    for name in names:
        record = model["systems"][name]
        assert len(record["epoch_s"]) == 3 and record["startup_s"] > 0
        losses = record["losses"]  # every system trained: one finite loss an epoch, falling
        assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)
        assert record["samples_per_s"] == pytest.approx(256 / record["median_epoch_s"])
    loop = model["systems"]["dsgd-fit"]["step_loop"]  # dsgd's own step() loop on the same engine, after the rounds
    assert len(loop["per_step_s"]) == keras_peers.LOOP_REPEATS and loop["last_step_stats"]["step_time_s"] > 0
    rates = {name: model["systems"][name]["samples_per_s"] for name in names}
    assert model["ratios"] == {"dsgd/raytrain": pytest.approx(rates["dsgd-fit"] / rates["raytrain-mwms"]),
                               "dsgd/single": pytest.approx(rates["dsgd-fit"] / rates["keras3-single"])}
    assert "| convnet | dsgd/raytrain |" in result["table"]

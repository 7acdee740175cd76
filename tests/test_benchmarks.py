"""Smoke tests of the benchmark entry points at a tiny size (resnet50, 32x32, batch 2)."""

import json

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import common, peers, resnet, resnet101

TINY = ["--model", "resnet50", "--image-size", "32", "--batch-size", "2",
        "--num-iters", "1", "--warmup", "1"]
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
    store = peers.VariableStore()
    resnet.resnet_v1(tf.zeros([1, 32, 32, 3]), "resnet50", store, training=False)
    store.create()
    moving_mean = store.variables["bn1/moving_mean"]

    @tf.function
    def forward():
        images, _ = resnet.synthetic_imagenet(2, 32)
        return resnet.resnet_v1(images, "resnet50", store, training=True)

    assert forward().shape == (2, resnet.NUM_CLASSES)
    assert np.any(moving_mean.numpy() != 0.0)


def test_single_process_baseline(ray_session, tmp_path):
    (record,) = peers.main(TINY + ["--num-workers", "2", "--systems", "single",
                                   "--results-dir", str(tmp_path), "--no-plot"])
    check_record(record, "single-process", num_workers=2)
    assert json.loads((tmp_path / "single-process.json").read_text()) == record
    assert "| single-process |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("strategy,num_workers", [("simple", 1), ("ps", 2)])
def test_dsgd_benchmark_cli(ray_session, tmp_path, strategy, num_workers):
    out = tmp_path / "run.json"
    record = resnet101.main(TINY + ["--num-workers", str(num_workers), "--strategy", strategy,
                                    "--out", str(out)])
    check_record(record, f"dsgd-{strategy}", num_workers)
    assert record["strategy"] == strategy
    assert len(record["engine_step_times_s"]) == 2
    assert json.loads(out.read_text()) == record


@pytest.mark.slow  # Ray Train's start-up alone takes minutes on a busy 2-core machine
def test_ray_train_peer(ray_session, tmp_path):
    pytest.importorskip("ray.train.tensorflow", exc_type=ImportError)
    (record,) = peers.main(TINY + ["--num-workers", "2", "--systems", "raytrain",
                                   "--results-dir", str(tmp_path), "--no-plot"])
    check_record(record, "raytrain-mwms", num_workers=2)


def test_report_and_plot(tmp_path):
    cfg = common.BenchConfig(model="resnet50", image_size=32, batch_size=2, num_iters=2, warmup=1)
    records = [common.make_record(system, cfg, [1.0, 0.5, seconds], False)
               for system, seconds in (("single-process", 0.5), ("raytrain-mwms", 1.0), ("dsgd-ps", 0.4))]
    report = peers.write_report(records, cfg, tmp_path).read_text()
    assert "| dsgd-ps | 9.00 ± 1.41 | 2 | 1.12 | 1.50 |" in report
    pytest.importorskip("matplotlib")
    assert peers.plot_throughput(records, cfg, tmp_path).stat().st_size > 0

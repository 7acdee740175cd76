"""ScalarLogger writes event files TensorBoard reads as scalars."""

import numpy as np
import pytest

from dsgd.integrations.tensorboard import ScalarLogger
from readers import read_scalars


def test_logged_steps_read_back_as_scalars(tmp_path):
    with ScalarLogger(tmp_path) as tb:
        tb.log(1, {"loss": 2.5, "accuracy": 0.25, "samples_per_s": 1200.0})
        tb.log(2, {"loss": 1.5, "accuracy": 0.5, "samples_per_s": 1300.0})
        tb.log(4, {"loss": np.float32(0.75)})
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["accuracy", "loss", "samples_per_s"]
    assert [(step, value) for step, value, _ in scalars["loss"]] == [(1, 2.5), (2, 1.5), (4, 0.75)]
    assert [(step, value) for step, value, _ in scalars["samples_per_s"]] == [(1, 1200.0), (2, 1300.0)]
    # TensorBoard's Scalars tab keys on the plugin name of a tag's first value.
    assert all(values[0][2] == "scalars" for values in scalars.values())


def test_close_is_idempotent_and_logdir_is_created(tmp_path):
    logdir = tmp_path / "runs" / "a"
    tb = ScalarLogger(logdir)
    tb.log(0, {"loss": 1.0})
    tb.close()
    tb.close()
    assert read_scalars(logdir)["loss"][0][:2] == (0, 1.0)


def test_rejects_non_numbers(tmp_path):
    with ScalarLogger(tmp_path) as tb, pytest.raises((TypeError, ValueError)):
        tb.log(0, {"name": "not a number"})


def test_engine_logdir_writes_each_fetched_steps_stats(ray_session, tmp_path):
    import dsgd
    from dsgd_test_models import TanhNet

    from dsgd_test_models import BATCH

    with dsgd.DistributedSGD(TanhNet, num_workers=1, devices_per_worker=2, logdir=str(tmp_path),
                             batch_size=BATCH) as sgd:
        sgd.step(fetch_stats=True)
        sgd.step()  # no stats fetched: nothing logged
        last = sgd.step(fetch_stats=True)
    assert last["samples_per_s"] == pytest.approx(2 * BATCH / last["step_time_s"])
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["abs_error", "compute_and_apply_s", "get_feed_dict_s", "loss", "num_replicas",
                               "samples_per_s", "sent_bytes", "step_time_s"]
    assert [step for step, _, _ in scalars["loss"]] == [0, 2]
    assert scalars["loss"][-1][1] == pytest.approx(last["loss"])

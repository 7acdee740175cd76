"""step(write_timeline=...) writes a Chrome trace of the driver, workers and parameter servers."""

import pytest

import dsgd
from dsgd_test_models import TanhNet, ps_actors, server_group
from readers import load_trace, names


@pytest.mark.parametrize("use_ops", [True, pytest.param(False, marks=pytest.mark.slow)])  # Python path: slow tier
def test_ps_step_trace_shows_every_actor_on_one_clock(ray_session, tmp_path, use_ops):
    path = tmp_path / "step.json"
    with dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="ps", grad_shard_bytes=40, use_ops=use_ops) as sgd:
        sgd.step()
        stats = sgd.step(fetch_stats=True, write_timeline=str(path))
        assert stats["loss"] > 0 and stats["step"] == 1
        num_ps = len(ps_actors(sgd))
        placement = server_group(sgd).placement
    processes, spans = load_trace(path)
    assert (num_ps, len(placement)) == (2, 3)  # 112 bytes in 40-byte partitions, on 2 servers
    assert sorted(processes.values()) == sorted(
        ["driver", "worker 0", "worker 1"] + [f"parameter server {j}" for j in range(num_ps)])
    assert {"step 1", "submit", "wait for the workers"} <= names(spans["driver"])
    for w in range(2):
        worker = names(spans[f"worker {w}"])
        assert "get_feed_dict" in worker
        if use_ops:
            assert {f"hand partition {p} over" for p in range(3)} <= worker
            assert {f"receive partition {p}" for p in range(3)} <= worker
            assert any(n.startswith("dsgd_send_") for n in worker)  # TensorFlow's own op events
        else:
            assert {"compute", "pack and send", "receive", "apply"} <= worker
        assert any("ApplyGradientDescent" in e["args"].get("op", "") for e in spans[f"worker {w}"])
    for j in range(num_ps):
        mine = [p for p, server in enumerate(placement) if server == j]
        assert names(spans[f"parameter server {j}"]) == (
            {f"average partition {p} of workers [0, 1]" for p in mine}
            | {f"worker {w}'s push of partition {p} (waits for the sum)" for p in mine for w in range(2)})
    [step] = [e for e in spans["driver"] if e["name"] == "step 1"]
    for process, events in spans.items():
        for e in events:  # one clock: everything happens inside the driver's step (1 ms slack)
            assert step["ts"] - 1000 <= e["ts"] <= e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1000, (process, e)


def test_simple_step_trace_shows_the_driver_average(ray_session, tmp_path):
    path = tmp_path / "simple.json"
    with dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="simple") as sgd:
        assert sgd.step(write_timeline=str(path)) is None
    processes, spans = load_trace(path)
    assert sorted(processes.values()) == ["driver", "worker 0", "worker 1"]
    assert {"submit", "gather gradients", "average", "wait for the workers"} <= names(spans["driver"])
    assert {"compute", "apply"} <= names(spans["worker 1"])

"""Compressed runs beside a float32 run on the same data, and what they must satisfy.

Used by tests/test_compression.py (one node) and tests/multinode_job.py
with tests/test_multinode.py (a two-node cluster, where partitions cross
object stores).

``lockstep`` steps every engine from the float32 run's weights on the same
batches, one step at a time, so each step's difference to float32 comes from
that step's 16-bit roundings alone, with no drift of earlier steps to bound.
``check_lockstep`` then derives each element's tolerance from the step's
gradients, the learning rate and the 16-bit format's rounding.
"""

from __future__ import annotations

import numpy as np

from dsgd_test_models import LR, batch, numpy_gradients, replica_weights, reset_data, set_start_weights

STEPS = 3
FLOAT32 = "float32"

# Relative rounding error of round-to-nearest (half an ulp at 1) and the largest absolute error below
# the normal range (half the smallest subnormal) of each 16-bit format.
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
SUBNORMAL_ERROR = {"bf16": 2.0 ** -134, "fp16": 2.0 ** -25}
F32_EPS = 2.0 ** -23


def lockstep(engines: dict, steps: int = STEPS) -> list[dict]:
    """Per step: the float32 run's weights before it, every engine's replicas after it, its ``sent_bytes``.

    ``engines``: name -> engine, ``FLOAT32`` among them; every engine gets the
    float32 run's weights before each step, and all read the same batches.
    """
    start = set_start_weights(engines[FLOAT32])
    for name, sgd in engines.items():
        if name != FLOAT32:
            sgd.set_weights(start)
            sgd.foreach_model(reset_data)
    record = []
    for _ in range(steps):
        before = engines[FLOAT32].get_weights()
        for name, sgd in engines.items():
            if name != FLOAT32:
                sgd.set_weights(before)
        sent = {name: sgd.step(fetch_stats=True)["sent_bytes"] for name, sgd in engines.items()}
        record.append({"before": before, "replicas": {name: replica_weights(sgd) for name, sgd in engines.items()},
                       "sent_bytes": sent})
    return record


def tolerance(before: dict, replicas: list[tuple[int, int]], step: int, compression: str) -> dict:
    """Per element, how far one compressed step may land from float32's, derived from the step's gradients.

    Each replica's gradient g_i is rounded to 16 bits (error <= u|g_i| + s,
    s the subnormal error), the server's float32 mean of those is rounded
    once more (<= u|mean| + s, |mean| <= mean|g_i| (1 + u)), the float32
    sums differ by a few float32 ulps, and the update ``w - LR * mean`` is
    computed in float32 in both runs (the product and the difference each
    rounded: a float32 ulp of each apart at most).
    The numpy gradients (float64) stand in for TensorFlow's float32 ones: a
    1% margin on the gradient terms covers that.
    """
    u, s = UNIT_ROUNDOFF[compression], SUBNORMAL_ERROR[compression]
    grads = [numpy_gradients({k: v.astype(np.float64) for k, v in before.items()}, *batch(w, d, step))
             for w, d in replicas]
    out = {}
    for name, w in before.items():
        mean_abs = np.mean([np.abs(g[name]) for g in grads], axis=0)
        abs_mean = np.abs(np.mean([g[name] for g in grads], axis=0))
        mean_error = 1.01 * ((u + 4 * F32_EPS) * mean_abs + u * (1 + u) * (abs_mean + u * mean_abs)) + 2 * s
        after = np.abs(w.astype(np.float64)) + 2 * LR * mean_abs
        out[name] = LR * mean_error + F32_EPS * after
    return out


def check_lockstep(record: list[dict], compressed: dict[str, str], replicas: list[tuple[int, int]]) -> None:
    """The claims of wire compression on a ``lockstep`` record.

    ``compressed``: engine name -> its compression. Every engine's replicas
    are bit-identical after every step; each compressed engine is within the
    derived tolerance of float32 but not equal to it (it did round); engines
    of one compression agree bit for bit (the op path and the Python path);
    each pushed half of float32's bytes.
    """
    for step, entry in enumerate(record):
        after = entry["replicas"]
        for name, weights in after.items():
            for i, other in enumerate(weights[1:], start=1):
                for var in weights[0]:
                    assert np.array_equal(other[var], weights[0][var]), f"{name}: replica {i} differs in {var}"
        reference = after[FLOAT32][0]
        for name, compression in compressed.items():
            got = after[name][0]
            bound = tolerance(entry["before"], replicas, step, compression)
            for var in reference:
                error = np.abs(got[var].astype(np.float64) - reference[var])
                assert np.all(error <= bound[var]), (
                    f"{name}, step {step}, {var}: off float32 by {error.max():.3g}, beyond "
                    f"{bound[var].flat[np.argmax(error)]:.3g} where it is furthest")
            assert any(not np.array_equal(got[var], reference[var]) for var in reference), \
                f"{name}, step {step}: bit-identical to float32, so nothing was rounded to 16 bits"
            assert entry["sent_bytes"][name] * 2 == entry["sent_bytes"][FLOAT32] > 0
        for compression in set(compressed.values()):
            same = [after[name][0] for name, c in compressed.items() if c == compression]
            for other in same[1:]:
                for var in same[0]:
                    assert np.array_equal(other[var], same[0][var]), f"{compression}: paths differ in {var}"

"""Wire compression (compression="bf16" / "fp16"): 16-bit partitions both ways, checked against float32.

The two-node run (16-bit partitions through the object store between
nodes) is in tests/test_multinode.py, beside its float32 run.
"""

import logging

import ml_dtypes
import numpy as np
import pytest

import dsgd
from compression_runs import FLOAT32, check_lockstep, lockstep
from dsgd.wire import arrays, codec, kernels
from dsgd.wire.partitions import VarSpec, pack, plan_partitions, segments, unpack
from dsgd_test_models import (REPLICAS_2x1, FixedDataMomentumNet, TanhNet, assert_replicas_identical, batch, kill,
                              numpy_gradients, set_start_weights)

PARTITION_BYTES = 40  # TanhNet's 112 bytes of float32 gradients -> 3 partitions, variables split


# ---- the conversions (no Ray) ------------------------------------------------

def _awkward_float32(n: int = 200_000) -> np.ndarray:
    """Values over float32's whole range, with ties, subnormals, the 16-bit limits, infinities and NaN."""
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):  # beyond float32: inf, wanted too
        x = (rng.standard_normal(n) * np.exp2(rng.uniform(-140, 128, n))).astype(np.float32)
    ties = np.float32(1) + np.float32(2.0 ** -8) * np.arange(1, 9, dtype=np.float32)  # bf16 halfway cases
    special = [0.0, -0.0, 65504, 65520, -65520, 1e-8, 6e-8, 3e38, 3.4e38, np.inf, -np.inf, np.nan, 2.0 ** -149]
    return np.concatenate([x, ties, -ties, np.array(special, np.float32)])


@pytest.fixture(params=["kernels", "numpy"])
def bf16_backend(request, monkeypatch):
    """bf16's conversions and averages in the wire kernels (C++), or in numpy, where the kernels cannot be built."""
    if request.param == "kernels":
        assert kernels.library() is not None, "the test install builds the wire kernels"
    else:
        monkeypatch.setattr(kernels, "_library", [None])
    return request.param


def test_bf16_rounds_to_nearest_even_as_ml_dtypes_does(bf16_backend):
    x = _awkward_float32()
    bits = codec.convert_into(np.empty(x.size, np.uint16), x)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    back = codec.convert_into(np.empty(x.size, np.float32), bits)
    np.testing.assert_array_equal(back, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert codec.convert_into(np.empty(1, np.uint16), np.float32([1 + 2 ** -8]))[0] == 0x3F80  # tie: down to even
    assert codec.convert_into(np.empty(1, np.uint16), np.float32([1 + 3 * 2 ** -8]))[0] == 0x3F82  # tie: up to even


def _in_order_average(inputs: list[np.ndarray], divisor: int | None) -> np.ndarray:
    """The reference: float32 ``inputs`` added in worker order, in float32, then divided."""
    total = inputs[0]
    with np.errstate(invalid="ignore", over="ignore"):
        for a in inputs[1:]:
            total = total + a
        return total / np.float32(divisor or len(inputs))


def _bf16_averages(inputs: list[np.ndarray], divisor: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The float32 average of bf16 ``inputs`` and that average rounded to bf16."""
    size = inputs[0].size
    return (arrays.average_into(np.empty(size, np.float32), inputs, divisor),
            arrays.average_rounded_into(np.empty(size, np.uint16), inputs, divisor))


@pytest.mark.parametrize("count,divisor", [(1, None), (2, None), (3, None), (3, 1), (2, 5)])
def test_bf16_averages_in_the_kernels_and_in_numpy_agree_bit_for_bit(monkeypatch, count, divisor):
    x = _awkward_float32(30_011)  # not a whole number of the kernels' or numpy's blocks
    rng = np.random.default_rng(count)
    inputs = [codec.convert_into(np.empty(x.size, np.uint16), rng.permutation(x)) for _ in range(count)]
    assert kernels.library() is not None, "the test install builds the wire kernels"
    kernel_mean, kernel_rounded = _bf16_averages(inputs, divisor)
    monkeypatch.setattr(kernels, "_library", [None])
    numpy_mean, numpy_rounded = _bf16_averages(inputs, divisor)
    # NaN + NaN keeps one operand's payload, which the two may pick differently: NaNs are compared as NaNs
    nan = np.isnan(numpy_mean)
    np.testing.assert_array_equal(np.isnan(kernel_mean), nan)
    np.testing.assert_array_equal(kernel_mean.view(np.uint32)[~nan], numpy_mean.view(np.uint32)[~nan])
    np.testing.assert_array_equal(kernel_rounded[~nan], numpy_rounded[~nan])
    expected = _in_order_average([codec.to_float32(a) for a in inputs], divisor)
    np.testing.assert_array_equal(numpy_mean, expected)
    np.testing.assert_array_equal(codec.to_float32(kernel_rounded[~nan]),
                                  expected[~nan].astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("count,divisor", [(1, None), (2, None), (3, None), (3, 1), (2, 5)])
def test_float32_averages_in_the_kernels_and_in_numpy_agree_bit_for_bit(monkeypatch, count, divisor):
    x = _awkward_float32(30_011)
    rng = np.random.default_rng(count)
    inputs = [rng.permutation(x) for _ in range(count)]
    assert kernels.library() is not None, "the test install builds the wire kernels"
    kernel_mean = arrays.average_into(np.empty(x.size, np.float32), inputs, divisor)
    monkeypatch.setattr(kernels, "_library", [None])
    numpy_mean = arrays.average_into(np.empty(x.size, np.float32), inputs, divisor)
    expected = _in_order_average(inputs, divisor)
    nan = np.isnan(expected)
    for mean in (kernel_mean, numpy_mean):
        np.testing.assert_array_equal(np.isnan(mean), nan)
        np.testing.assert_array_equal(mean.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def test_a_rounded_average_needs_a_16_bit_output():
    with pytest.raises(ValueError, match="16-bit wire form"):
        arrays.average_rounded_into(np.empty(4, np.float32), [np.zeros(4, np.uint16)])


def test_fp16_beyond_its_range_is_inf_without_a_warning(recwarn):
    out = codec.convert_into(np.empty(4, np.float16), np.float32([65504, 65520, -1e6, 1e-9]))
    assert out.tolist() == [65504, np.inf, -np.inf, 0]
    assert not recwarn.list


def test_a_server_averages_non_finite_fp16_pushes_without_a_warning(recwarn):
    """A non-finite mean is nan_policy's to judge on the workers: the servers' logs stay quiet."""
    mean = arrays.average_rounded_into(np.empty(3, np.float16), [np.float16([np.inf, 60000, 1]),
                                                                  np.float16([-np.inf, 60000, 1])])
    assert np.isnan(mean[0]) and mean[1:].tolist() == [60000, 1]
    assert not recwarn.list


def test_compressed_layout_is_float32_layout_at_half_the_bytes_and_other_dtypes_travel_as_they_are():
    specs = [VarSpec("a", (40_000,), np.dtype(np.float32)), VarSpec("b", (7, 3), np.dtype(np.float32)),
             VarSpec("c", (9,), np.dtype(np.float64))]
    plain = plan_partitions(specs, 50_000)
    for compression, wire_dtype in [("bf16", np.uint16), ("fp16", np.float16)]:
        layout = plan_partitions(specs, 50_000, compression)
        assert [(p.size, p.pieces) for p in layout] == [(p.size, p.pieces) for p in plain]
        for partition in layout:
            if partition.dtype == np.float32:
                assert partition.wire_dtype == wire_dtype and partition.wire_nbytes * 2 == partition.nbytes
                # the large piece travels packed (converted), never as a view of the gradient
                assert not any(seg.view for seg in segments(partition))
            else:
                assert partition.compression is None and partition.wire_nbytes == partition.nbytes
                assert segments(partition) == segments(plain[partition.index])


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_server_sums_16_bit_pushes_in_float32_and_rounds_the_mean_once(compression):
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    [partition] = plan_partitions([VarSpec("g", (1000,), np.dtype(np.float32))], 0, compression)
    pushed = [pack([g], partition, np.empty(partition.size, partition.wire_dtype)) for g in grads]
    total = arrays.average_into(np.empty(partition.size, np.float32), pushed)
    widened = [codec.to_float32(p).astype(np.float64) for p in pushed]
    np.testing.assert_allclose(total, np.mean(widened, axis=0), rtol=2 ** -22)  # float32 sum, not 16-bit
    # The server's own rounding (what dsgd.server.sums calls for a compressed partition): bit for bit the
    # float32 mean rounded once.
    mean = arrays.average_rounded_into(np.empty(partition.size, partition.wire_dtype), pushed)
    once = codec.convert_into(np.empty(partition.size, partition.wire_dtype), total)
    np.testing.assert_array_equal(mean.view(np.uint16), once.view(np.uint16))
    # Rounding to 16 bits after every addition gives other bits on these values, so the check above can tell.
    running = pushed[0]
    for p in pushed[1:]:
        running = codec.convert_into(np.empty_like(running), codec.to_float32(running) + codec.to_float32(p))
    rounded_each_time = codec.convert_into(np.empty_like(running), codec.to_float32(running) / np.float32(3))
    assert not np.array_equal(rounded_each_time.view(np.uint16), mean.view(np.uint16))
    [decoded] = unpack([mean], [partition], [VarSpec("g", (1000,), np.dtype(np.float32))])
    np.testing.assert_array_equal(decoded, codec.to_float32(once))


# ---- bad values ------------------------------------------------------------------

@pytest.mark.parametrize("value", ["bfloat16", "fp8", 16, True, "BF16"])
def test_unknown_compression_is_refused_listing_the_choices(value):
    with pytest.raises(ValueError, match=r"compression must be one of \(None, 'bf16', 'fp16'\), got "):
        dsgd.DistributedSGD(TanhNet, num_workers=2, compression=value)


def test_compression_with_simple_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"compression='fp16' needs strategy='ps'"):
        dsgd.DistributedSGD(TanhNet, num_workers=2, strategy="simple", compression="fp16")


# ---- the engine on one node ---------------------------------------------------

COMPRESSED = {"bf16": dict(compression="bf16", use_ops=True), "bf16-python": dict(compression="bf16", use_ops=False),
              "fp16": dict(compression="fp16", use_ops=True), "fp16-python": dict(compression="fp16", use_ops=False)}
ENGINE = dict(num_workers=2, strategy="ps", grad_shard_bytes=PARTITION_BYTES, nan_policy="skip")
FP16_MAX = 65504


@pytest.fixture(scope="module")
def float32_engine(ray_session):
    with dsgd.DistributedSGD(TanhNet, **ENGINE) as sgd:
        yield sgd


@pytest.fixture(scope="module", params=["bf16", "fp16"])
def compressed_engines(request, ray_session):
    """(compression, {name: engine}): the op path's and the Python path's engine of one compression.

    The tests using them run after the module's other engine tests (file
    order): pytest keeps one compression's engines until the next is asked
    for, or the module ends.
    """
    names = [name for name, kwargs in COMPRESSED.items() if kwargs["compression"] == request.param]
    engines = {}
    try:
        for name in names:
            engines[name] = dsgd.DistributedSGD(TanhNet, **ENGINE, **COMPRESSED[name])
        yield request.param, engines
    finally:
        for sgd in engines.values():
            sgd.shutdown()


def test_sent_bytes_of_float32_and_of_a_compressed_engine_with_nothing_to_send(ray_session, float32_engine, caplog):
    """(test_engine checks "simple"'s and "ps"'s at their step.)"""
    caplog.set_level(logging.WARNING, logger="dsgd")
    # TanhNet's float32 gradients, w (5 x 4), b (4) and v (4), in partitions of PARTITION_BYTES=40, every piece
    # starting on a 64-byte boundary: b, 12 floats of gap, v, 12 of gap and w's first 2; then w's 18 in two of 9.
    assert float32_engine.step(fetch_stats=True)["sent_bytes"] == 4 * (4 + 12 + 4 + 12 + 2 + 9 + 9)
    with dsgd.DistributedSGD(TanhNet, num_workers=1, strategy="ps", compression="bf16") as sgd:
        assert "compression='bf16' has nothing to send" in caplog.text
        assert sgd.step(fetch_stats=True)["sent_bytes"] == 0


@pytest.mark.slow  # the suite's time budget (29 s); bf16 with a checkpoint and a killed worker by default: test 43 of
# docs/features.md (test_features_together[tf1]); exact recovery by default: test_recovery_matrix (float32)
def test_recovery_and_checkpoints_with_compression(ray_session, tmp_path, caplog):
    """From a checkpoint, a run whose worker is killed equals the uninterrupted one bit for bit."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    with dsgd.DistributedSGD(FixedDataMomentumNet, num_workers=2, strategy="ps", grad_shard_bytes=PARTITION_BYTES,
                             compression="bf16") as sgd:
        set_start_weights(sgd)
        sgd.step()
        sgd.step()
        sgd.save(str(tmp_path / "ckpt.npz"))  # weights and momentum after step 2
        sgd.step()
        sgd.step()
        expected = sgd.get_weights()
        sgd.restore(str(tmp_path / "ckpt.npz"))
        sgd.step()
        kill(sgd.workers[1])
        sgd.step()
        assert_replicas_identical(sgd, 2)
        assert "worker 1 is dead" in caplog.text and sgd.failures == 1
        got = sgd.get_weights()
        assert all(np.array_equal(got[k], expected[k]) for k in expected)


def test_compressed_steps_against_float32_through_shared_memory_op_and_python_paths(float32_engine,
                                                                                     compressed_engines):
    compression, compressed = compressed_engines
    for name, sgd in compressed.items():  # one node: every partition through shared memory, in 16-bit form
        ends = sgd.foreach_worker(lambda w: [(type(e).__name__, str(next(iter(e.means[0].values())).dtype))
                                             for e in w.client.ends])
        assert {end for worker in ends for end in worker} == {
            ("SharedMemoryWorkerEnd", "uint16" if compression == "bf16" else "float16")}
    check_lockstep(lockstep({FLOAT32: float32_engine, **compressed}), {name: compression for name in compressed},
                   REPLICAS_2x1)


def huge_gradient_weights(sgd) -> dict[str, np.ndarray]:
    """Set ``sgd``'s start weights with the output weights 1000 times larger; those weights.

    Every replica's first gradients then reach about 1e6 (numpy's reference
    says so below): finite in float32 and bf16, beyond fp16's largest value.
    """
    start = set_start_weights(sgd)
    huge = {**start, "out/v": start["out/v"] * 1000}
    sgd.set_weights(huge)
    grads = [numpy_gradients({k: v.astype(np.float64) for k, v in huge.items()}, *batch(w, d, 0))
             for w, d in REPLICAS_2x1]
    largest = max(np.abs(g[name]).max() for g in grads for name in g)
    assert FP16_MAX < largest < 1e30, largest
    return huge


def test_fp16_overflow_is_a_non_finite_mean_for_nan_policy(float32_engine, compressed_engines, caplog):
    """Gradients of about 1e6: finite in float32 and bf16 (the control: that step applies), inf in fp16 (skipped
    on every replica under nan_policy='skip'), through the op path and the Python path."""
    caplog.set_level(logging.WARNING, logger="dsgd")
    compression, compressed = compressed_engines
    for name, sgd in {FLOAT32: float32_engine, **compressed}.items():
        caplog.clear()
        before = huge_gradient_weights(sgd)
        stats = sgd.step(fetch_stats=True)
        after = sgd.get_weights()
        skipped = "skipped a step (nan_policy='skip'): non-finite gradient of variable" in caplog.text
        if name != FLOAT32 and compression == "fp16":
            assert skipped, name
            assert all(np.array_equal(before[k], after[k]) for k in before), name
        else:
            assert not skipped and np.isfinite(stats["loss"]), name
            assert not all(np.array_equal(before[k], after[k]) for k in before), name
        assert_replicas_identical(sgd, 2)
        set_start_weights(sgd)
        assert np.isfinite(sgd.step(fetch_stats=True)["loss"]), name  # training goes on

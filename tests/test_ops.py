"""Tests for the dsgd C++ op library (dsgd.ops)."""

import gc
import weakref

import numpy as np
import pytest
import ray
import tensorflow as tf

import dsgd.ops as ops
from dsgd.wire.partitions import VarSpec, pack as np_pack, plan_partitions, segments, unpack as np_unpack

if not ops.is_available():
    pytest.skip("dsgd op library cannot be built here", allow_module_level=True)

DTYPES = [np.float32, np.float16, tf.bfloat16.as_numpy_dtype, np.float64, np.int32]
SHAPES = [(3, 5), (0,), (7,), (1,), (17, 3, 3), (2, 0, 4), (1000,), (33, 65), (4096,), ()]


def _grads(specs, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s.shape) * 100).astype(s.dtype) for s in specs]


def _run(fetches, feed=None):
    with tf.compat.v1.Session(graph=tf.compat.v1.get_default_graph()) as sess:
        return sess.run(fetches, feed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("partition_bytes", [0, 200, 4096])
def test_pack_unpack_round_trip(dtype, partition_bytes):
    specs = [VarSpec(f"v{i}", shape, np.dtype(dtype)) for i, shape in enumerate(SHAPES)]
    grads = _grads(specs)
    layout = plan_partitions(specs, partition_bytes)
    with tf.Graph().as_default():
        grad_tensors = [tf.constant(g) for g in grads]
        packed = [ops.pack(grad_tensors, s) for s in layout]
        unpacked = ops.unpack(packed, layout, specs)
        packed_out, unpacked_out = _run((packed, unpacked))
    for partition, out in zip(layout, packed_out):
        expected = np_pack(grads, partition, np.zeros(partition.size, partition.dtype))
        assert out.dtype == np.dtype(dtype) and out.shape == (partition.size,)
        np.testing.assert_array_equal(out, expected)  # includes zeroed gaps
    for spec, g, out in zip(specs, grads, unpacked_out):
        assert out.shape == spec.shape and out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, g)
    assert ops.drain_released() == 0


def test_mixed_dtypes_and_type_check():
    specs = [VarSpec("a", (5, 3), np.dtype(np.float32)), VarSpec("b", (9,), np.dtype(np.float64)),
             VarSpec("c", (4,), np.dtype(np.float32))]
    grads = _grads(specs)
    layout = plan_partitions(specs, 0)
    with tf.Graph().as_default():
        gt = [tf.constant(g) for g in grads]
        out = _run(ops.unpack([ops.pack(gt, s) for s in layout], layout, specs))
        for g, o in zip(grads, out):
            np.testing.assert_array_equal(o, g)
        with pytest.raises(TypeError, match="grads\\[1\\] has dtype float32"):
            ops.pack([gt[0], tf.cast(gt[1], tf.float32), gt[2]], layout[1])


def _address_inside(address, array):
    start = array.__array_interface__["data"][0]
    return start <= address < start + array.nbytes


def test_receive_aliases_object_store_memory(ray_session):
    specs = [VarSpec("w", (64, 33), np.dtype(np.float32)), VarSpec("b", (33,), np.dtype(np.float32)),
             VarSpec("odd", (7,), np.dtype(np.float32))]
    layout = plan_partitions(specs, 0)
    [partition] = layout
    grads = _grads(specs)
    ref = ray.put(np_pack(grads, partition, np.zeros(partition.size, np.float32)))
    fetched = []

    def fetch(s):
        fetched.append(ray.get(ref))
        return fetched[-1]

    with tf.Graph().as_default():
        grad_tensors = ops.unpack([ops.receive_partition(lambda s=s: fetch(s), s) for s in layout], layout, specs)
        addresses = [ops.data_address(t) for t in grad_tensors]
        values, addresses = _run((grad_tensors, addresses))
    [array] = fetched
    assert not array.flags.writeable  # a plasma view, not a private copy
    for spec, g, v, address in zip(specs, grads, values, addresses):
        np.testing.assert_array_equal(v, g)
        assert _address_inside(address, array), spec.name
    del values
    gc.collect()
    assert ops.drain_released() == 1 and ops.live_buffers() == 0


def test_misaligned_fetch_is_copied_and_released(ray_session):
    specs = [VarSpec("x", (10,), np.dtype(np.float32))]
    [partition] = plan_partitions(specs, 0)
    raw = np.zeros(partition.size * 4 + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + 4  # deliberately 4 bytes past a 64-byte boundary
    array = raw[start:start + partition.size * 4].view(np.float32)
    array[:] = np.arange(partition.size)
    with tf.Graph().as_default():
        t = ops.receive_partition(lambda: array, partition)
        value, address = _run((t, ops.data_address(t)))
    np.testing.assert_array_equal(value, array)
    assert not _address_inside(address, array)
    assert ops.drain_released() == 1 and ops.live_buffers() == 0


def test_object_alive_while_tensor_alive(ray_session):
    [partition] = plan_partitions([VarSpec("x", (1000,), np.dtype(np.float32))], 0)
    ref = ray.put(np.arange(partition.size, dtype=np.float32))
    object_id = ref.hex()
    holder = []

    def fetch():
        array = ray.get(ref)
        holder.append(weakref.ref(array))
        return array

    tensor = ops.receive_partition(fetch, partition)  # eager: the tensor outlives the call
    [array_alive] = holder
    del ref
    gc.collect()
    assert ops.drain_released() == 0 and ops.live_buffers() == 1
    assert array_alive() is not None
    np.testing.assert_array_equal(tensor.numpy(), np.arange(partition.size))
    sliced = ops.unpack([tensor], [partition], [VarSpec("x", (10, 100), np.dtype(np.float32))])[0]
    del tensor
    gc.collect()
    assert ops.drain_released() == 0  # the unpacked gradient still aliases the buffer
    assert sliced.numpy()[3, 7] == 307
    del sliced
    gc.collect()
    assert ops.drain_released() == 1 and ops.live_buffers() == 0
    assert array_alive() is None
    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    assert object_id not in counts


def test_send_hands_the_partition_over_as_segments():
    specs = [VarSpec(f"v{i}", shape, np.dtype(np.float32)) for i, shape in enumerate(SHAPES)]
    grads = _grads(specs)
    layout = plan_partitions(specs, 1024)
    sent = {}
    with tf.Graph().as_default():
        gt = [tf.constant(g) for g in grads]
        step = tf.constant(7, tf.int64)
        tokens = [ops.build_send(gt, s, lambda s, arrays, st: sent.setdefault(s.index, ([a.copy() for a in arrays], int(st))),
                                 [step], view_bytes=64)
                  for s in layout]
        assert sorted(_run(tokens)) == [s.index for s in layout]
    assert any(seg.view for s in layout for seg in segments(s, 64))
    assert any(not seg.view for s in layout for seg in segments(s, 64))
    for s in layout:
        arrays, st = sent[s.index]
        assert st == 7
        parts = segments(s, 64)
        partition = np.zeros(s.size, np.float32)
        assert [a.size for a in arrays] == [seg.size for seg in parts]
        for seg, got in zip(parts, arrays):
            partition[seg.start:seg.start + seg.size] = got
        np.testing.assert_array_equal(partition, np_pack(grads, s, np.zeros(s.size, np.float32)))


def test_bad_fetch_and_unknown_handle(ray_session):
    [partition] = plan_partitions([VarSpec("x", (8,), np.dtype(np.float32))], 0)
    with tf.Graph().as_default():
        t = ops.receive_partition(lambda: np.zeros(9, np.float32), partition)
        with pytest.raises(Exception, match="must return a numpy array of 8 float32"):
            _run(t)
        bogus = ops.load().dsgd_alias_tensor(tf.constant(10**12, tf.int64), T=tf.float32, size=8)
        with pytest.raises(tf.errors.NotFoundError, match="no object-store buffer"):
            _run(bogus)
    assert ops.discard_unclaimed() == 0 and ops.live_buffers() == 0


def _wide_range_grads(specs, seed=0):
    """float32 gradients over most of float32's range, with bf16 ties, fp16's limit, infinities and NaN."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        grads = [(rng.standard_normal(s.shape) * np.exp2(rng.uniform(-140, 128, s.shape))).astype(np.float32)
                 for s in specs]
    grads[2][:7] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, 65504, 65520, np.inf, -np.inf, np.nan]
    return grads


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_pack_send_receive_unpack_convert_as_numpy_does_bit_for_bit(compression):
    """The op path's 16-bit bytes equal the Python path's (dsgd.wire.partitions.pack / unpack), both ways."""
    specs = [VarSpec(f"v{i}", shape, np.dtype(np.float32)) for i, shape in enumerate(SHAPES)]
    specs.append(VarSpec("other", (5,), np.dtype(np.float64)))  # travels as it is
    grads = _wide_range_grads(specs[:-1]) + [np.arange(5, dtype=np.float64) / 3]
    layout = plan_partitions(specs, 1024, compression)
    expected = [np_pack(grads, s, np.zeros(s.size, s.wire_dtype)) for s in layout]
    sent = {}
    with tf.Graph().as_default():
        gt = [tf.constant(g) for g in grads]
        tokens = [ops.build_send(gt, s, lambda s, arrays: sent.setdefault(s.index, [a.copy() for a in arrays]))
                  for s in layout]
        received = [ops.receive_partition(lambda e=e: e, s) for s, e in zip(layout, expected)]
        unpacked = ops.unpack(received, layout, specs)
        _, got = _run((tokens, unpacked))
    for s, want in zip(layout, expected):
        parts = segments(s)
        assert not any(seg.view for seg in parts) or s.compression is None
        partition = np.zeros(s.size, s.wire_dtype)
        for seg, a in zip(parts, sent[s.index]):
            assert a.dtype == s.wire_dtype
            partition[seg.start:seg.start + seg.size] = a
        np.testing.assert_array_equal(partition.view(np.uint8), want.view(np.uint8))
    for want, g in zip(np_unpack(expected, layout, specs), got):
        assert g.dtype == want.dtype
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))
    ops.drain_released()
    assert ops.live_buffers() == 0  # compressed means are converted, so no gradient holds on to them


def test_pack_refuses_a_conversion_other_than_float32_to_16_bits():
    with tf.Graph().as_default():
        packed = ops.load().dsgd_pack([tf.zeros([4], tf.float64)], W=tf.float16, partition_size=4, piece_input=[0],
                                      piece_var_offset=[0], piece_partition_offset=[0], piece_size=[4])
        with pytest.raises(tf.errors.InvalidArgumentError, match="cannot convert double to half"):
            _run(packed)

"""The shard layout: balanced, aligned, and covering every element once."""

import numpy as np
import pytest

from dsgd.shards import ALIGN_BYTES, VarSpec, pack, plan_shards, segment_arrays, segments, unpack

F32 = np.dtype(np.float32)


def specs(*shapes, dtype=F32):
    return [VarSpec(f"v{i}", shape, np.dtype(dtype)) for i, shape in enumerate(shapes)]


def coverage(layout, var_specs):
    seen = [np.zeros(s.size, int) for s in var_specs]
    for shard in layout:
        for p in shard.pieces:
            seen[p.var_index][p.var_offset:p.var_offset + p.size] += 1
    return seen


@pytest.mark.parametrize("shard_bytes", [0, 4, 40, 100, 1000, 10**9])
def test_every_element_lands_in_exactly_one_shard(shard_bytes):
    var_specs = specs((7, 3), (1,), (100,), (2, 2, 2), (0,), (33,))
    layout = plan_shards(var_specs, shard_bytes)
    for counts in coverage(layout, var_specs):
        assert np.all(counts == 1)


def test_pieces_are_aligned_and_do_not_overlap():
    layout = plan_shards(specs((7, 3), (1,), (100,), (33,)), 64)
    for shard in layout:
        end = 0
        for p in shard.pieces:
            assert (p.shard_offset * 4) % ALIGN_BYTES == 0
            assert p.shard_offset >= end
            end = p.shard_offset + p.size
        assert shard.size == end


def test_large_variable_is_split_and_shards_are_balanced():
    layout = plan_shards(specs((1000,), (10,)), 1000)  # 4040 bytes -> 5 shards
    assert len(layout) == 5
    payloads = [sum(p.size for p in s.pieces) for s in layout]
    assert max(payloads) - min(payloads) <= 2
    assert sum(1 for s in layout for p in s.pieces if p.var_index == 0) == 5


def test_whole_variables_moved_to_the_next_shard_do_not_add_a_shard():
    layout = plan_shards(specs((6,), (6,), (6,)), 36)  # 72 bytes -> exactly 2 shards
    assert [[p.var_index for p in s.pieces] for s in layout] == [[0, 1], [2]]
    layout = plan_shards(specs((6,), (6,), (6,), (25,)), 40)  # 172 bytes -> exactly 5 shards
    assert len(layout) == 5
    assert sum(p.size for s in layout for p in s.pieces) == 43


def test_zero_means_one_shard_per_dtype():
    layout = plan_shards(specs((10,)) + specs((4,), dtype=np.float16), 0)
    assert [s.dtype for s in layout] == [F32, np.dtype(np.float16)]


def test_negative_shard_size_is_rejected():
    with pytest.raises(ValueError, match="grad_shard_bytes must be >= 0, got -1"):
        plan_shards(specs((3,)), -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_pack_unpack_round_trip(dtype):
    var_specs = specs((7, 3), (5,), (64,), (1, 1), dtype=dtype)
    layout = plan_shards(var_specs, 48)
    rng = np.random.RandomState(0)
    grads = [rng.randn(*s.shape).astype(dtype) for s in var_specs]
    buffers = [pack(grads, shard, np.zeros(shard.size, shard.dtype)) for shard in layout]
    for got, want in zip(unpack(buffers, layout, var_specs), grads):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_variable_that_fits_in_a_shard_is_never_split():
    layout = plan_shards(specs((6,), (6,), (6,), (25,)), 40)  # target 10 elements per shard
    owners = {}
    for shard in layout:
        for p in shard.pieces:
            owners.setdefault(p.var_index, []).append(shard.index)
    assert all(len(owners[v]) == 1 for v in (0, 1, 2))
    assert len(owners[3]) > 1  # larger than a shard: split


def test_segments_send_large_pieces_as_views_and_pack_runs_of_small_ones():
    var_specs = specs((100,), (3,), (5,), (200,), (2,))
    [shard] = plan_shards(var_specs, 0)
    parts = segments(shard, view_bytes=400)  # 100 float32 = 400 bytes: a view
    assert [(seg.view, [p.var_index for p in seg.pieces]) for seg in parts] == [
        (True, [0]), (False, [1, 2]), (True, [3]), (False, [4])]
    for seg in parts:
        assert seg.pieces[0].shard_offset == 0 and seg.dtype == shard.dtype
        last = seg.pieces[-1]
        assert seg.size == last.shard_offset + last.size
    by_var = {p.var_index: p.shard_offset for p in shard.pieces}
    assert [seg.start for seg in parts] == [by_var[0], by_var[1], by_var[3], by_var[4]]


def test_segment_arrays_rebuild_the_packed_shard():
    var_specs = specs((100,), (3,), (5,), (7, 30), (2,))
    rng = np.random.RandomState(1)
    grads = [rng.randn(*s.shape).astype(np.float32) for s in var_specs]
    for shard in plan_shards(var_specs, 500):
        parts = segments(shard, view_bytes=200)
        buffers = [None if seg.view else np.zeros(seg.size, np.float32) for seg in parts]
        arrays = segment_arrays(grads, parts, buffers)
        rebuilt = np.zeros(shard.size, np.float32)
        for seg, a in zip(parts, arrays):
            assert a.size == seg.size
            if seg.view:
                assert np.shares_memory(a, grads[seg.pieces[0].var_index])  # no copy
            rebuilt[seg.start:seg.start + seg.size] = a
        np.testing.assert_array_equal(rebuilt, pack(grads, shard, np.zeros(shard.size, np.float32)))

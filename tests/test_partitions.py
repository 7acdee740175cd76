"""The partition layout: balanced, aligned, and covering every element once."""

import numpy as np
import pytest

from dsgd.wire.partitions import ALIGN_BYTES, VarSpec, pack, plan_partitions, segment_arrays, segments, unpack

F32 = np.dtype(np.float32)


def specs(*shapes, dtype=F32):
    return [VarSpec(f"v{i}", shape, np.dtype(dtype)) for i, shape in enumerate(shapes)]


def coverage(layout, var_specs):
    seen = [np.zeros(s.size, int) for s in var_specs]
    for partition in layout:
        for p in partition.pieces:
            seen[p.var_index][p.var_offset:p.var_offset + p.size] += 1
    return seen


@pytest.mark.parametrize("partition_bytes", [0, 4, 40, 100, 1000, 10**9])
def test_every_element_lands_in_exactly_one_partition(partition_bytes):
    var_specs = specs((7, 3), (1,), (100,), (2, 2, 2), (0,), (33,))
    layout = plan_partitions(var_specs, partition_bytes)
    for counts in coverage(layout, var_specs):
        assert np.all(counts == 1)


def test_pieces_are_aligned_and_do_not_overlap():
    layout = plan_partitions(specs((7, 3), (1,), (100,), (33,)), 64)
    for partition in layout:
        end = 0
        for p in partition.pieces:
            assert (p.partition_offset * 4) % ALIGN_BYTES == 0
            assert p.partition_offset >= end
            end = p.partition_offset + p.size
        assert partition.size == end


def test_large_variable_is_split_and_partitions_are_balanced():
    layout = plan_partitions(specs((1000,), (10,)), 1000)  # 4040 bytes -> 5 partitions
    assert len(layout) == 5
    payloads = [sum(p.size for p in partition.pieces) for partition in layout]
    assert max(payloads) - min(payloads) <= 2
    assert sum(1 for partition in layout for p in partition.pieces if p.var_index == 0) == 5


def test_whole_variables_moved_to_the_next_partition_do_not_add_a_partition():
    layout = plan_partitions(specs((6,), (6,), (6,)), 36)  # 72 bytes -> exactly 2 partitions
    assert [[p.var_index for p in partition.pieces] for partition in layout] == [[0, 1], [2]]
    layout = plan_partitions(specs((6,), (6,), (6,), (25,)), 40)  # 172 bytes -> exactly 5 partitions
    assert len(layout) == 5
    assert sum(p.size for partition in layout for p in partition.pieces) == 43


def test_zero_means_one_partition_per_dtype():
    layout = plan_partitions(specs((10,)) + specs((4,), dtype=np.float16), 0)
    assert [partition.dtype for partition in layout] == [F32, np.dtype(np.float16)]


def test_negative_partition_size_is_rejected():
    with pytest.raises(ValueError, match="grad_shard_bytes must be >= 0, got -1"):
        plan_partitions(specs((3,)), -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_pack_unpack_round_trip(dtype):
    var_specs = specs((7, 3), (5,), (64,), (1, 1), dtype=dtype)
    layout = plan_partitions(var_specs, 48)
    rng = np.random.RandomState(0)
    grads = [rng.randn(*s.shape).astype(dtype) for s in var_specs]
    buffers = [pack(grads, partition, np.zeros(partition.size, partition.dtype)) for partition in layout]
    for got, want in zip(unpack(buffers, layout, var_specs), grads):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_variable_that_fits_in_a_partition_is_never_split():
    layout = plan_partitions(specs((6,), (6,), (6,), (25,)), 40)  # target 10 elements per partition
    owners = {}
    for partition in layout:
        for p in partition.pieces:
            owners.setdefault(p.var_index, []).append(partition.index)
    assert all(len(owners[v]) == 1 for v in (0, 1, 2))
    assert len(owners[3]) > 1  # larger than a partition: split


def test_segments_send_large_pieces_as_views_and_pack_runs_of_small_ones():
    var_specs = specs((100,), (3,), (5,), (200,), (2,))
    [partition] = plan_partitions(var_specs, 0)
    parts = segments(partition, view_bytes=400)  # 100 float32 = 400 bytes: a view
    assert [(seg.view, [p.var_index for p in seg.pieces]) for seg in parts] == [
        (True, [0]), (False, [1, 2]), (True, [3]), (False, [4])]
    for seg in parts:
        assert seg.pieces[0].partition_offset == 0 and seg.dtype == partition.dtype
        last = seg.pieces[-1]
        assert seg.size == last.partition_offset + last.size
    by_var = {p.var_index: p.partition_offset for p in partition.pieces}
    assert [seg.start for seg in parts] == [by_var[0], by_var[1], by_var[3], by_var[4]]


def test_segment_arrays_rebuild_the_packed_partition():
    var_specs = specs((100,), (3,), (5,), (7, 30), (2,))
    rng = np.random.RandomState(1)
    grads = [rng.randn(*s.shape).astype(np.float32) for s in var_specs]
    for partition in plan_partitions(var_specs, 500):
        parts = segments(partition, view_bytes=200)
        buffers = [None if seg.view else np.zeros(seg.size, np.float32) for seg in parts]
        arrays = segment_arrays(grads, parts, buffers)
        rebuilt = np.zeros(partition.size, np.float32)
        for seg, a in zip(parts, arrays):
            assert a.size == seg.size
            if seg.view:
                assert np.shares_memory(a, grads[seg.pieces[0].var_index])  # no copy
            rebuilt[seg.start:seg.start + seg.size] = a
        np.testing.assert_array_equal(rebuilt, pack(grads, partition, np.zeros(partition.size, np.float32)))

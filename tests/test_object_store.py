"""dsgd.transport.object_store: arrays go into one object in chunks and come back whole, without a copy."""

import numpy as np
import pytest

from dsgd.transport import object_store


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(object_store, "CHUNK_BYTES", 4096)


def test_round_trip_of_many_sizes_and_dtypes(ray_session, small_chunks):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(dtype) for n, dtype in
              [(0, np.float32), (1, np.float32), (1023, np.float32), (1024, np.float32), (5000, np.float32),
               (3333, np.float16), (700, np.float64), (12, np.int32), (0, np.float16)]]
    ref = object_store.put(arrays)
    got = object_store.join(ray_session.get(ref, timeout=30), [a.size for a in arrays])
    for a, g in zip(arrays, got):
        assert g.dtype == a.dtype
        np.testing.assert_array_equal(g, a)


def test_chunked_arrays_come_back_as_one_view_of_the_object(ray_session, small_chunks):
    array = np.arange(10_000, dtype=np.float32)  # 10 chunks of 1024 elements
    stored = ray_session.get(object_store.put([array]), timeout=30)
    assert len(stored) == 10
    [joined] = object_store.join(stored, [array.size])
    assert joined.ctypes.data == stored[0].ctypes.data  # the object's memory, not a copy
    assert not joined.flags.writeable and joined.flags.c_contiguous
    np.testing.assert_array_equal(joined, array)


def test_chunks_that_are_not_adjacent_are_copied_together():
    parts = [np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)]  # two allocations
    [joined] = object_store.join(parts, [8])
    np.testing.assert_array_equal(joined, np.arange(8, dtype=np.float32))


def test_sizes_that_do_not_match_the_chunks_are_refused():
    parts = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    with pytest.raises(ValueError, match=r"expected arrays of sizes \[3, 5\], got chunks of sizes \[4, 4\]"):
        object_store.join(parts, [3, 5])
    with pytest.raises(ValueError, match="expected arrays of sizes"):
        object_store.join(parts, [4])

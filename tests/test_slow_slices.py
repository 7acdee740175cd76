"""The slow tier's slices (``--slow-slice I/K``, tests/slow_slices.py): every slow test in exactly one, the same one
whatever else a run selects, and the slices about equal in measured time. No Ray."""

import pytest

import slow_slices


def test_each_unit_goes_to_exactly_one_slice_longest_first_to_the_least_loaded():
    seconds = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 3.0}
    dealt = slow_slices.deal(seconds, 2)
    assert dealt == {"a": 1, "b": 2, "c": 2, "d": 1, "e": 2}  # a, b; c to 2 (4 < 5), d to 1 (5 < 7), e to 2 (7 < 8)
    totals = [sum(s for name, s in seconds.items() if dealt[name] == i) for i in (1, 2)]
    assert totals == [8.0, 10.0]
    assert slow_slices.deal(dict(reversed(seconds.items())), 2) == dealt  # the file's order does not matter


def test_more_slices_than_units_leaves_the_last_slices_empty():
    assert slow_slices.deal({"a": 1.0, "b": 2.0}, 4) == {"b": 1, "a": 2}


def test_a_unit_with_no_measured_time_goes_to_the_same_slice_every_run():
    dealt = slow_slices.deal({"a": 1.0}, 4)
    assert slow_slices.slice_of("a", dealt, 4) == 1
    placed = [slow_slices.slice_of(f"tests/test_x.py::test_{n}", dealt, 4) for n in range(200)]
    assert placed == [slow_slices.slice_of(f"tests/test_x.py::test_{n}", {}, 4) for n in range(200)]
    assert set(placed) == {1, 2, 3, 4}


@pytest.mark.parametrize("spec", ["0/4", "5/4", "2", "a/b", "2/4/1"])
def test_a_slice_outside_one_to_k_is_refused(spec):
    with pytest.raises(pytest.UsageError, match="--slow-slice"):
        slow_slices.parse(spec)


def test_the_committed_times_name_tests_and_shared_jobs():
    seconds = slow_slices.load()
    assert seconds, "tests/slow_durations.json lists no slow test"
    for name, duration in seconds.items():
        assert name.startswith("tests/test_") and ".py::" in name and duration >= 0, name


def test_a_written_file_reads_back(tmp_path):
    path = tmp_path / "durations.json"
    slow_slices.write(path, {"tests/test_a.py::test_b[x y]": 12.345})
    assert slow_slices.load(path) == {"tests/test_a.py::test_b[x y]": 12.3}

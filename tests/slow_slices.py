"""The ``slow`` tier cut into K slices of about equal time, so that CI can run one slice per commit.

``pytest -m slow --slow-slice I/K`` (conftest) keeps the slow tests of slice I
(1 to K). A slice is a set of units: a test, or the tests of one module that
share a background job (``BACKGROUND_JOBS``), which go together so that no two
slices run the same job. The units' measured seconds are in
``slow_durations.json`` (written by ``pytest -m slow --record-slow-durations
PATH``); they are dealt longest first, each to the slice with the fewest
seconds so far (ties to the lowest slice). The deal depends on the file alone,
not on which tests a run collects, so a test is in the same slice whatever else
is selected. A unit the file does not list goes to the slice a CRC-32 of its
id names: the same slice on every run, though not balanced, until the file is
measured again.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterable, Mapping

import pytest

DURATIONS = Path(__file__).with_name("slow_durations.json")

ABOUT = ("Seconds per unit of the slow tier (a test, or a module's tests that share a background job, named "
         "<file>::<fixture>), for tests/slow_slices.py. Written by `pytest -m slow --record-slow-durations PATH`.")


def parse(spec: str) -> tuple[int, int]:
    """``"I/K"`` -> (I, K), with 1 <= I <= K."""
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--slow-slice takes I/K (slice I of K, from 1), not {spec!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--slow-slice {spec}: I must be 1 to K")
    return index, count


def unit(item: pytest.Item) -> str:
    """The unit ``item`` is dealt in: ``<file>::<fixture>`` for a test that takes a background job's result from its
    module's fixture (the job's other tests go with it), else its own node id."""
    jobs = sorted(fixture for fixture in getattr(item.module, "BACKGROUND_JOBS", {}) if fixture in item.fixturenames)
    return f"{item.nodeid.split('::')[0]}::{jobs[0]}" if jobs else item.nodeid


def load(path: Path = DURATIONS) -> dict[str, float]:
    """Unit -> measured seconds; empty if there is no file."""
    if not path.exists():
        return {}
    return {name: float(seconds) for name, seconds in json.loads(path.read_text())["seconds"].items()}


def deal(seconds: Mapping[str, float], count: int) -> dict[str, int]:
    """Unit -> slice (1 to ``count``) for every unit of ``seconds``: longest first, each to the slice with the fewest
    seconds so far."""
    totals = [0.0] * count
    slices: dict[str, int] = {}
    for name, duration in sorted(seconds.items(), key=lambda pair: (-pair[1], pair[0])):
        index = min(range(count), key=lambda i: (totals[i], i))
        totals[index] += duration
        slices[name] = index + 1
    return slices


def slice_of(name: str, dealt: Mapping[str, int], count: int) -> int:
    """The slice of unit ``name``: as dealt, or from a CRC-32 of the name for a unit with no recorded time."""
    return dealt[name] if name in dealt else zlib.crc32(name.encode()) % count + 1


def write(path: Path, seconds: Mapping[str, float]) -> None:
    path.write_text(json.dumps({"_about": ABOUT, "seconds": {name: round(s, 1) for name, s in sorted(seconds.items())}},
                               indent=1) + "\n")


def unit_seconds(items: Iterable[pytest.Item], test_seconds: Mapping[str, float],
                 job_seconds: Mapping[str, float]) -> dict[str, float]:
    """Seconds per unit of the slow ``items`` that ran: their tests' (setup, call and teardown) and, for a unit of a
    background job, the job's own run (it overlapped other tests, but its CPU is the unit's)."""
    units: dict[str, float] = {}
    for item in items:
        if item.get_closest_marker("slow") is None or item.nodeid not in test_seconds:
            continue
        name = unit(item)
        if name != item.nodeid and name not in units:
            fixture = name.split("::")[-1]
            units[name] = job_seconds.get(item.module.BACKGROUND_JOBS[fixture].name, 0.0)
        units[name] = units.get(name, 0.0) + test_seconds[item.nodeid]
    return units


def main(count: int = 6) -> None:
    """Print each of ``count`` slices: its units with their measured seconds, longest first, and its total."""
    seconds = load()
    dealt = deal(seconds, count)
    for index in range(1, count + 1):
        units = sorted((name for name in dealt if dealt[name] == index), key=lambda name: (-seconds[name], name))
        print(f"slice {index}/{count}: {len(units)} units, {sum(seconds[name] for name in units):.0f} s measured")
        for name in units:
            print(f"  {seconds[name]:7.1f} s  {name}")


if __name__ == "__main__":  # python tests/slow_slices.py [K]
    import sys

    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)  # .ci/run's SLOW_SLICES

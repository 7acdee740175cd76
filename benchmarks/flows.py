"""Every TCP flow's bytes over time on a linked cluster: which of a step's streams lag, and how far.

A ``FlowMonitor`` runs, in every linked node's network namespace, a shell
loop that prints the time and `ss -tinH state established` every
``interval_s`` (one process a node, not one a sample), and parses each
connection's ``bytes_acked`` (what its sender has delivered) as it comes.
``per_step`` then takes a system's measured steps (``scaling.LinkMonitor``
times them) and, for every flow that carried at least ``MIN_BYTES`` in a
step, says how many bytes it moved, when (ms from the step's start) it
started and finished, and its mean rate between: flows of one step that
share a link but finish far apart are the ones lagging.

``benchmarks.scaling --flows`` runs one beside its link monitor and prints
the table per system.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from typing import Any, Sequence

from benchmarks.linked_cluster import LinkedCluster

ACKED = re.compile(r"bytes_acked:(\d+)")
MIN_BYTES = 64 << 10  # a flow that carried less in a step is Ray's chatter, not the exchange's


class FlowMonitor:
    """Samples every established TCP connection's delivered bytes in every linked node's namespace."""

    def __init__(self, cluster: LinkedCluster, names: dict[str, str], interval_s: float = 0.05):
        """``names``: an address -> the node's name, for the flows' ends."""
        self.cluster, self.names, self.interval_s = cluster, names, interval_s
        # (local, peer) -> [(time, bytes delivered)], time.perf_counter's
        self.samples: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._loops: list[subprocess.Popen] = []

    def __enter__(self) -> FlowMonitor:
        loop = f"while :; do echo; ss -tinH state established; sleep {self.interval_s}; done"
        for node in self.cluster.linked:
            process = subprocess.Popen(["ip", "netns", "exec", self.cluster.namespace(node), "sh", "-c", loop],
                                       stdout=subprocess.PIPE, text=True)
            self._loops.append(process)
            threading.Thread(target=self._read, args=(process,), daemon=True, name=f"flows node {node}").start()
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._loops:
            process.kill()
            process.wait(timeout=10)

    def _read(self, process: subprocess.Popen) -> None:
        """Parse one node's samples: a connection's line ("recv-q send-q local peer") and its info line after."""
        ends = None
        for line in process.stdout:
            fields = line.split()
            if not line.startswith((" ", "\t")) and len(fields) >= 4:
                ends = fields[2], fields[3]
            elif ends is not None and (m := ACKED.search(line)):
                with self._lock:
                    self.samples[ends].append((time.perf_counter(), int(m[1])))
                ends = None

    def name(self, address: str) -> str:
        """"node 3:45678" for an address of a known node."""
        host, _, port = address.rpartition(":")
        return f"{self.names.get(host, host)}:{port}"

    def per_step(self, steps: Sequence[tuple[float, float]]) -> list[dict[str, Any]]:
        """For each flow that moved at least ``MIN_BYTES`` in some step: its ends, and per step the bytes it
        moved, when it started and finished (ms from the step's start) and its mean rate in between (Gbit/s)."""
        with self._lock:
            samples = {ends: list(points) for ends, points in self.samples.items()}
        rows = []
        for (local, peer), points in samples.items():
            per_step = []
            for start, end in steps:
                inside = [(t, b) for t, b in points if start <= t <= end]
                before = [b for t, b in points if t < start]
                if not inside:
                    continue
                base = before[-1] if before else inside[0][1]
                moved = inside[-1][1] - base
                if moved < MIN_BYTES:
                    continue
                first = next(t for t, b in inside if b > base)
                last = next(t for t, b in inside if b == inside[-1][1])
                per_step.append({"bytes": moved, "start_ms": (first - start) * 1000, "end_ms": (last - start) * 1000,
                                 "gbit": moved * 8 / max(last - first, self.interval_s) / 1e9})
            if per_step:
                rows.append({"from": self.name(local), "to": self.name(peer), "steps": per_step})
        return sorted(rows, key=lambda r: (r["from"], r["to"]))


def print_flows(system: str, rows: list[dict[str, Any]]) -> None:
    """The medians over the measured steps of each flow's bytes, start, end and rate."""
    print(f"\n  flows of {system} (medians over its steps; ms from the step's start):", flush=True)
    for row in rows:
        steps = row["steps"]
        print(f"  {row['from']:>22} -> {row['to']:<22} {statistics.median(s['bytes'] for s in steps) / 1e6:6.2f} MB"
              f"  {statistics.median(s['start_ms'] for s in steps):6.0f} - "
              f"{statistics.median(s['end_ms'] for s in steps):6.0f} ms  "
              f"{statistics.median(s['gbit'] for s in steps):6.3f} Gbit/s", flush=True)

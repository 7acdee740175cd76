"""One traced "ps" step, partition by partition: when each push left each worker and reached its server, when
the sum completed, when each worker read the mean; and which link each took.

Reads a Chrome trace that ``DistributedSGD.step(write_timeline=...)`` wrote (``benchmarks.scaling
--timeline DIR`` writes one per system) and prints, in ms from the step's first push:

  per partition   its server; the pushes' span (first start - last end over the workers); when the server took
                  the last push (registered it); when its sum completed; the mean read by the first and last
                  worker;
  per link        worker -> server: its pushes' first start, last end, and how long it was busy sending;
  the tail        the last sum and the last read, against the last push.

With ``--png``, a picture: a row per link (worker -> server), a bar per push, a tick per sum completed.

    .venv/bin/python -m benchmarks.partition_timeline benchmarks/results/scaling/timelines/4x1-ps-servers.json
"""

from __future__ import annotations

if not __package__:  # run as `python benchmarks/partition_timeline.py`
    import _repo_path  # noqa: F401

import argparse
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PUSH = re.compile(r"push partition (\d+)$")  # a worker's push (its send scheduler's lane; a chained step's own in older traces)
READ = re.compile(r"(?:answer of|read the mean of) partition (\d+)$")  # a worker's mean read
TAKEN = re.compile(r"worker (\d+)'s (?:late )?push of partition (\d+) \(waits for the sum\)$")  # a server took it
SUM = re.compile(r"(?:average|sum) partition (\d+) of workers")


@dataclass
class Partition:
    server: int | None = None
    pushes: dict[int, tuple[float, float]] = field(default_factory=dict)  # worker -> (start, end), us
    taken: dict[int, float] = field(default_factory=dict)  # worker -> when its server took the push
    summed: float | None = None
    read: dict[int, float] = field(default_factory=dict)  # worker -> when it had the mean


def partitions_of(trace: dict[str, Any]) -> dict[int, Partition]:
    """Every partition's pushes, sum and reads in ``trace`` (its events in microseconds)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    found: dict[int, Partition] = defaultdict(Partition)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        process, name, start, end = names[e["pid"]], e["name"], e["ts"], e["ts"] + e["dur"]
        if process.startswith("worker "):
            worker = int(process.split()[1])
            if m := PUSH.match(name):
                found[int(m[1])].pushes[worker] = start, end
            elif m := READ.match(name):
                found[int(m[1])].read[worker] = max(end, found[int(m[1])].read.get(worker, 0.0))
        elif process.startswith("parameter server "):
            server = int(process.split()[2])
            if m := TAKEN.match(name):
                found[int(m[2])].taken[int(m[1])] = start
            elif m := SUM.match(name):
                found[int(m[1])].server, found[int(m[1])].summed = server, end
    return dict(sorted(found.items()))


def report(parts: dict[int, Partition]) -> list[str]:
    """The tables, in ms from the step's first push."""
    t0 = min(s for p in parts.values() for s, _ in p.pushes.values())

    def ms(us: float | None) -> str:
        return "–" if us is None else f"{(us - t0) / 1000:7.0f}"

    lines = ["partition server   pushes: first start  last end   last taken   summed   read: first    last"]
    for j, p in parts.items():
        starts = [s for s, _ in p.pushes.values()]
        ends = [e for _, e in p.pushes.values()]
        lines.append(f"{j:9d} {p.server if p.server is not None else '?':>6}   {ms(min(starts, default=None)):>18} "
                     f"{ms(max(ends, default=None)):>9} {ms(max(p.taken.values(), default=None)):>12} "
                     f"{ms(p.summed):>8} {ms(min(p.read.values(), default=None)):>13} "
                     f"{ms(max(p.read.values(), default=None)):>7}")
    links: dict[tuple[int, Any], list[tuple[float, float]]] = defaultdict(list)
    for p in parts.values():
        for worker, span in p.pushes.items():
            links[worker, p.server].append(span)
    lines += ["", "link (worker -> server)   first start   last end   sending"]
    for (worker, server), spans in sorted(links.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        busy = sum(e - s for s, e in spans)
        lines.append(f"{worker:6d} -> {server!s:<16} {ms(min(s for s, _ in spans)):>11} "
                     f"{ms(max(e for _, e in spans)):>10} {busy / 1000:8.0f}")
    last_push = max(e for p in parts.values() for _, e in p.pushes.values())
    last_sum = max((p.summed for p in parts.values() if p.summed is not None), default=None)
    last_read = max((r for p in parts.values() for r in p.read.values()), default=None)
    lines += ["", f"last push ends {ms(last_push).strip()} ms, last sum {ms(last_sum).strip()} ms, "
                  f"last mean read {ms(last_read).strip()} ms"]
    return lines


def picture(parts: dict[int, Partition], png: Path) -> None:
    """A row per link, a bar per push (labelled with its partition), a tick where its sum completed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s for p in parts.values() for s, _ in p.pushes.values())
    links = sorted({(w, p.server) for p in parts.values() for w in p.pushes}, key=lambda l: (l[0], str(l[1])))
    row = {link: k for k, link in enumerate(links)}
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(links) + 1.5))
    for j, p in parts.items():
        for w, (s, e) in p.pushes.items():
            ax.broken_barh([((s - t0) / 1000, (e - s) / 1000)], (row[w, p.server] - 0.4, 0.8), color=f"C{j % 10}")
            if p.summed is not None:
                ax.plot([(p.summed - t0) / 1000] * 2, [row[w, p.server] - 0.45, row[w, p.server] + 0.45], "k-", lw=0.8)
            if w in p.read:
                ax.plot((p.read[w] - t0) / 1000, row[w, p.server], "k.", ms=3)
    ax.set_yticks(range(len(links)), [f"worker {w} -> server {s}" for w, s in links])
    ax.set_xlabel("ms from the step's first push (bars: pushes; lines: sums complete; dots: means read)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args(argv)
    parts = partitions_of(json.loads(args.trace.read_text()))
    print("\n".join(report(parts)))
    if args.png:
        picture(parts, args.png)
        print(f"picture written to {args.png}")


if __name__ == "__main__":
    main()

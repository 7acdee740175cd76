"""Chrome-trace timelines of one step, viewable in Perfetto or chrome://tracing.

Every process records complete events (``"ph": "X"``) against the wall clock
(``time.time()``, microseconds), which is shared by all processes on a machine
(across machines it is as good as their clock sync). TensorFlow's own step
stats use the same clock, so a worker's op-level trace lines up with the
driver's and the parameter servers' events.

This module must not import TensorFlow: parameter servers use ``Recorder``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterator

Event = dict[str, Any]


def now_us() -> float:
    return time.time() * 1e6


class Recorder:
    """Collects complete events of one process, on named threads (tracks)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, name: str, start_us: float, end_us: float, track: str = "main", **args: Any) -> None:
        self.events.append({"name": name, "ph": "X", "ts": start_us, "dur": max(0.0, end_us - start_us),
                            "tid": track, "args": args})

    @contextlib.contextmanager
    def span(self, name: str, track: str = "main", **args: Any) -> Iterator[None]:
        start = now_us()
        try:
            yield
        finally:
            self.add(name, start, now_us(), track, **args)


def maybe_span(recorder: Recorder | None, name: str, track: str = "main", **args: Any):
    """``recorder.span(...)``, or a no-op when not tracing."""
    return contextlib.nullcontext() if recorder is None else recorder.span(name, track, **args)


def from_step_stats(step_stats: Any) -> list[Event]:
    """Events for every op TensorFlow ran, from a RunMetadata's step_stats."""
    events = []
    for device in step_stats.dev_stats:
        for node in device.node_stats:
            events.append({"name": node.node_name, "ph": "X", "ts": float(node.all_start_micros),
                           "dur": float(max(node.all_end_rel_micros, 0)),
                           "tid": f"{device.device.rsplit('/', 1)[-1]} thread {node.thread_id}",
                           "args": {"op": node.timeline_label.split(" = ")[-1][:200]}})
    return events


def write(path: str, processes: list[tuple[str, list[Event]]]) -> None:
    """Write ``[(process name, events)]`` as one trace: one track group per process."""
    trace: list[Event] = []
    for pid, (name, events) in enumerate(processes):
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        tids: dict[str, int] = {}
        for event in events:
            tid = tids.setdefault(str(event["tid"]), len(tids))
            trace.append({**event, "pid": pid, "tid": tid})
        trace += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
                  for track, tid in tids.items()]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)

"""The driver's timeline of one step (``DistributedSGD.step(write_timeline=path)``), with the workers' and servers'."""

from __future__ import annotations

import contextlib
from typing import Iterator

from dsgd.cluster.cluster import Cluster
from dsgd.common import timeline


class StepTrace:
    """Records the driver's spans while a trace is open (``record``); ``span`` is a no-op otherwise."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._recorder: timeline.Recorder | None = None

    def span(self, name: str):
        """A span of the driver's timeline while one is recorded, else nothing."""
        return timeline.maybe_span(self._recorder, name)

    @contextlib.contextmanager
    def record(self, path: str, step_id: int) -> Iterator[None]:
        """Record the driver, the workers and the servers while the body runs step ``step_id``; write the trace to
        ``path``."""
        workers, calls = self.cluster.workers, self.cluster.calls
        calls.call([w.start_trace.remote() for w in workers], "the workers to start tracing")
        self._recorder = timeline.Recorder()
        try:
            with self._recorder.span(f"step {step_id}"):
                yield
        finally:
            driver, self._recorder = self._recorder, None
            worker_events = calls.call([w.collect_trace.remote() for w in workers], "the workers' traces")
        servers = self.cluster.servers
        server_events = calls.call(servers.traces(step_id), "the parameter servers' traces") if servers else []
        timeline.write(path, [("driver", driver.events)]
                       + [(f"worker {i}", events) for i, events in enumerate(worker_events)]
                       + [(f"parameter server {j}", events) for j, events in enumerate(server_events)])

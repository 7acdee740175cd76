"""Streams under Ray's TLS: with ``RAY_USE_TLS`` on, a stream is TLS with Ray's files (mutual, Ray's CA); if they
cannot be used, the pair falls back to the object store and the log says why, once.

The first tests run a server's transports and a worker's client in this
process (no Ray: the pair meets over 127.0.0.1), Ray's environment variables
set for the test only; the last runs tests/tls_job.py: a two-node Ray cluster
with TLS on, "ps" across its nodes.
"""

import json
import logging
import os

import numpy as np
import pytest
import ray

from background_jobs import QUEUE, Call
from benchmarks import tls_files
from dsgd.exchange.ps_client import ParameterServerClient
from dsgd.server.layout import BufferLayout
from dsgd.server.transports import Transports
from dsgd.transport import ends, tls
from dsgd.transport.ends import ObjectStoreServerEnd, ObjectStoreWorkerEnd, StreamWorkerEnd
from dsgd.wire.partitions import VarSpec, plan_partitions, segments
from dsgd_test_models import REPLICAS_2x1, assert_job_replicas_identical_and_numpy_like
from job_processes import run_job

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS_DIR, "tls_job.py")
TIMEOUT_S = 300
LAYOUT = plan_partitions([VarSpec("w", (1000,), np.dtype(np.float32))], 1 << 20)
FALLBACK = "those pushes go through Ray's object store instead"


@pytest.fixture
def ca(tmp_path) -> dict[str, str]:
    return tls_files.make(tmp_path / "ca")


@pytest.fixture
def log(caplog, monkeypatch):
    """The warnings of the transports, "once per process" starting afresh."""
    monkeypatch.setattr(ends, "_fell_back", False)
    caplog.set_level(logging.WARNING, logger=ends.__name__)
    return caplog


class Server:
    """A parameter server's transports for 1 worker, on a node of its own; its push doubles the worker's input."""

    def __init__(self):
        self.layout = BufferLayout(0, LAYOUT, 1, shared=False)
        self.transports = Transports(0, 1, "the server's node", "127.0.0.1", self.layout, 30.0)
        self.attached_to_object_store = []

    def attach(self, node_id):
        return self.transports.attach(0, node_id, self._push, lambda step, j: self.layout.places[j].mean(step), [])

    def _push(self, step, j, epoch=None):
        [inputs] = self.transports.ends[0].read(LAYOUT[j], self.layout.places[j].offset,
                                                self.layout.places[j].segments, None)
        np.multiply(inputs, 2, out=self.layout.places[j].mean(step))
        return [], (0,)

    def close(self):
        self.transports.ends[0].close()


class _Actor:
    """What a worker's client calls on a server actor when it falls back: ``attach.remote(worker, None)``."""

    def __init__(self, server: Server):
        self.attach = self
        self.server = server

    def remote(self, worker_index, node_id):
        self.server.attached_to_object_store.append(self.server.attach(node_id))
        return "attached"


def _worker_end(server: Server, info):
    """A worker's end to ``server``, as its client picks it for what the server offered (``info``)."""
    client = ParameterServerClient(0, LAYOUT, [0], step_timeout_s=30, startup_timeout_s=30)
    client._wait = lambda refs, what, timeout_s=None: refs  # the fallback's attach is no Ray call here
    return client._end(0, _Actor(server), info)


def test_with_rays_tls_on_a_worker_and_a_server_on_other_nodes_push_down_a_tls_stream(ca, monkeypatch):
    for name, value in ca.items():
        monkeypatch.setenv(name, value)
    server = Server()
    info = server.attach("the worker's node")
    end = _worker_end(server, info)
    assert isinstance(end, StreamWorkerEnd) and end.stream.encryption.startswith("TLSv1.3")
    partition = LAYOUT[0]
    data = np.arange(partition.size, dtype=np.float32)
    end.push(None, 0, partition, 0, end.write(partition, segments(partition), [data]))
    reply, averaged = end.answer(partition, 0, timeout_s=30)
    assert averaged == (0,)
    np.testing.assert_array_equal(end.read_mean(partition, 0, reply, None), 2 * data)
    end.close()
    server.close()


def test_a_server_that_cannot_read_rays_certificate_offers_no_stream_and_says_why_once(ca, log, monkeypatch):
    for name, value in {**ca, tls.CERT: "/nonexistent/node.crt"}.items():
        monkeypatch.setenv(name, value)
    server = Server()
    for _ in range(2):
        assert server.attach("the worker's node") is None  # the object store
        assert isinstance(server.transports.ends[0], ObjectStoreServerEnd)
    [warning] = [r.getMessage() for r in log.records if FALLBACK in r.getMessage()]
    assert "parameter server 0 offers no stream (Ray's TLS is on but the certificate" in warning
    assert "'/nonexistent/node.crt' (RAY_TLS_SERVER_CERT)" in warning and "No such file" in warning


def test_a_worker_that_cannot_use_rays_certificate_falls_back_to_the_object_store_and_says_why(ca, log, monkeypatch,
                                                                                                tmp_path):
    for name, value in ca.items():
        monkeypatch.setenv(name, value)
    server = Server()
    info = server.attach("the worker's node")  # a TLS stream, offered
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    monkeypatch.setenv(tls.CERT, str(garbage))  # the worker's process reads another file
    end = _worker_end(server, info)
    assert isinstance(end, ObjectStoreWorkerEnd)
    assert server.attached_to_object_store == [None]  # it told the server, which took the object store
    assert isinstance(server.transports.ends[0], ObjectStoreServerEnd)
    [warning] = [r.getMessage() for r in log.records if FALLBACK in r.getMessage()]
    assert f"Ray's TLS is on but the certificate '{garbage}' (RAY_TLS_SERVER_CERT)" in warning
    monkeypatch.setenv(tls.USE_TLS, "0")
    assert tls.ray_contexts() is None  # Ray's TLS off: plain streams, whatever the files say


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("TRUE", True), ("0", False), ("", False),
                                      ("yes", False)])
def test_tls_is_on_as_ray_reads_it(value, on):
    assert tls.ray_uses_tls({tls.USE_TLS: value}) is on
    assert tls.ray_uses_tls({}) is False


def two_node_tls_run(scratch: str, environ: dict[str, str]) -> dict:
    """The job on a two-node cluster whose Ray has TLS on, with a CA and a certificate made in ``scratch``."""
    env = tls_files.make(scratch, ["127.0.0.1", ray.util.get_node_ip_address()])
    return run_job(JOB, TIMEOUT_S, json.dumps(env), environ=environ)


BACKGROUND_JOBS = {"two_node_job": Call("tls-job", two_node_tls_run, TIMEOUT_S)}


@pytest.fixture(scope="module")
def two_node_job() -> dict:
    return QUEUE.result(BACKGROUND_JOBS["two_node_job"])


def test_on_a_two_node_cluster_with_rays_tls_the_streams_across_nodes_are_tls(two_node_job):
    job = two_node_job
    assert len(job["nodes"]) == 2 and sorted(job["worker_nodes"]) == job["nodes"]
    # Each worker pushes the partitions summed on the other node down a stream, not through the object store.
    for transports in job["transports"]:
        assert "StreamWorkerEnd" in transports and "ObjectStoreWorkerEnd" not in transports
    for encryptions in job["encryption"]:
        assert encryptions and all(e is not None and e.startswith("TLSv1.3 ") for e in encryptions), encryptions
    assert sum(n for t in job["traffic"] for n in t.values()) == 3 * job["steps"]  # every partition crossed once a step
    assert_job_replicas_identical_and_numpy_like(job, REPLICAS_2x1)

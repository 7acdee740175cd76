"""A worker's stream to a parameter server on another node (dsgd.transport.streams), both ends in this process."""

import itertools
import socket
import sys
import threading
import time

import numpy as np
import pytest

from dsgd.transport import streams
from dsgd.transport.answers import Answers, Forgotten

SIZE = 10  # float32 elements of the one partition (0) in these tests
# "At once" against "at the timeout": waits that should end at once get LONG_S to run out and must end
# within AT_ONCE_S, so a wait that ended only at its timeout fails under any load.
LONG_S, AT_ONCE_S = 600, 60
_names = itertools.count()


class Server:
    """A listener whose partition 0 arrives into ``inputs`` and is answered with ``mean`` (its input doubled),
    or with the exception ``fail`` holds."""

    def __init__(self, accept_timeout_s=30.0):
        self.inputs = np.zeros(SIZE, np.float32)
        self.mean = np.zeros(SIZE, np.float32)
        self.fail: Exception | None = None
        self.release = threading.Event()
        self.release.set()
        self.name = f"test{next(_names)}"
        self.listener = streams.StreamListener(self.name, "127.0.0.1", self._target, self._answer, accept_timeout_s)

    def _target(self, partition, nbytes):
        if partition != 0 or nbytes != self.inputs.nbytes:
            raise ValueError(f"unexpected push of partition {partition}, {nbytes} bytes")
        view = memoryview(self.inputs).cast("B")
        return [view[:8], view[8:]]  # two segments, filled in turn

    def _answer(self, step, partition, epoch):
        self.release.wait(LONG_S)
        if self.fail is not None:
            raise self.fail
        np.multiply(self.inputs, 2, out=self.mean)
        return ("averaged", step), self.mean


def _threads(server):
    return [t for t in threading.enumerate() if t.name.startswith(f"dsgd stream {server.name}")]


def _connect(server, means=None):
    means = np.zeros(SIZE, np.float32) if means is None else means
    return streams.Stream(server.listener.address, lambda step, partition: means, 10, 10), means


def _blocked_in_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Answers.wait`` now: waiting for its answer."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is Answers.wait.__code__:
            return True
        frame = frame.f_back
    return False


def _waiting(call) -> tuple[threading.Thread, list]:
    """``call()`` on a thread of its own, returned once it is provably blocked waiting for its answer; the list
    receives what it raised or returned."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + AT_ONCE_S
    while not _blocked_in_wait(thread):
        assert thread.is_alive() and time.monotonic() < deadline, f"the wait never blocked: {outcome}"
        time.sleep(0.01)
    return thread, outcome


def _ended_at_once(thread: threading.Thread, outcome: list) -> BaseException:
    thread.join(AT_ONCE_S)
    assert not thread.is_alive(), f"the wait was still blocked {AT_ONCE_S} s later (its timeout is {LONG_S} s)"
    return outcome[0]


def test_a_push_lands_in_its_segments_and_the_mean_comes_back_into_the_workers_buffer():
    server = Server()
    stream, means = _connect(server)
    for step in range(3):
        data = np.arange(SIZE, dtype=np.float32) + step
        stream.send(step, 0, [data[:2], data[2:]])  # the worker's segments, sent as they are
        assert stream.wait(step, 0, 10) == ("averaged", step)
        np.testing.assert_array_equal(server.inputs, data)
        np.testing.assert_array_equal(means, 2 * data)
    stream.close()


def test_the_servers_exception_is_raised_in_the_worker_and_the_stream_goes_on():
    server = Server()
    stream, _ = _connect(server)
    server.fail = RuntimeError("step 0 was aborted")
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    with pytest.raises(RuntimeError, match="step 0 was aborted"):
        stream.wait(0, 0, 10)
    stream.send(0, 1, [np.ones(3, np.float32)])  # a partition the server does not expect: its error, in order
    with pytest.raises(ValueError, match="unexpected push of partition 1, 12 bytes"):
        stream.wait(0, 1, 10)
    server.fail = None
    stream.send(1, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(1, 0, 10) == ("averaged", 1)


def test_answers_to_a_forgotten_step_are_dropped_and_waits_are_bounded():
    server = Server()
    stream, _ = _connect(server)
    server.release.clear()
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    with pytest.raises(TimeoutError, match="no answer to the push of partition 0, step 0 within 0s"):
        stream.wait(0, 0, 0.2)
    stream.forget()  # the step failed: its late answer must not pass for the re-run's
    server.release.set()
    stream.send(0, 0, [np.full(SIZE, 3, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)
    with pytest.raises(TimeoutError):  # exactly one answer counted: the re-run's
        stream.wait(0, 0, 0.2)


def test_a_wait_on_a_closed_stream_fails_as_a_closed_connection():
    """A pushing end closed (its server replaced, the engine shut down): a late wait fails as the stream's end,
    the error the client turns into an aborted step, not a ValueError from polling a closed socket."""
    server = Server()
    stream, _ = _connect(server)
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    stream.close()
    with pytest.raises(ConnectionError):
        stream.wait(0, 0, 10)


def test_a_wait_for_a_push_forgotten_meanwhile_fails_at_once():
    """A relaying server's push of a step that failed: its wait ends when the step is forgotten, and cannot take
    the answer to the re-run's push of the same step and partition."""
    server = Server()
    stream, _ = _connect(server)
    server.release.clear()
    epoch = stream.send(0, 0, [np.ones(SIZE, np.float32)])
    thread, outcome = _waiting(lambda: stream.wait(0, 0, LONG_S, epoch))
    stream.forget()
    assert isinstance(_ended_at_once(thread, outcome), Forgotten), outcome
    server.release.set()
    epoch = stream.send(0, 0, [np.full(SIZE, 3, np.float32)])
    assert stream.wait(0, 0, 10, epoch) == ("averaged", 0)


def test_the_worker_sees_the_server_close_at_once():
    server = Server()
    stream, _ = _connect(server)
    server.release.clear()
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    thread, outcome = _waiting(lambda: stream.wait(0, 0, LONG_S))
    server.listener.close()
    assert isinstance(_ended_at_once(thread, outcome), ConnectionError), outcome
    server.release.set()


def test_the_server_sees_the_worker_close_at_once():
    """Either side's death ends the stream: a worker that goes away ends the server's threads serving it."""
    server = Server(accept_timeout_s=LONG_S)
    stream, _ = _connect(server)
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)
    assert _threads(server)
    stream.close()
    deadline = time.monotonic() + AT_ONCE_S
    while _threads(server) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads(server), "the server still serves a worker that closed its stream"


def test_only_the_holder_of_the_token_gets_in():
    server = Server()
    host, port, token = server.listener.address
    with socket.create_connection((host, port), timeout=10) as intruder:
        intruder.sendall(bytes(len(token)))
        intruder.settimeout(10)
        assert intruder.recv(1) == b""  # closed on it
    stream, means = _connect(server)  # the listener still takes the worker
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)


def test_closing_a_listener_nobody_joined_ends_its_threads_at_once():
    server = Server(accept_timeout_s=LONG_S)
    assert len(_threads(server)) == 2  # the reader (accepting) and the answerer
    server.listener.close()
    deadline = time.monotonic() + AT_ONCE_S
    while _threads(server) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads(server)
    with pytest.raises(OSError):
        _connect(server)

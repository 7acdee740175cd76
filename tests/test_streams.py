"""A worker's stream to a parameter server on another node (dsgd.transport.streams), both ends in this process,
plain and over TLS (mutual, with a CA made for the test: dsgd.transport.tls)."""

import errno
import itertools
import pickle
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from benchmarks import tls_files
from dsgd.transport import streams, tls
from dsgd.transport.answers import Forgotten

SIZE = 10  # float32 elements of the one partition (0) in these tests
# "At once" against "at the timeout": waits that should end at once get LONG_S to run out and must end
# within AT_ONCE_S, so a wait that ended only at its timeout fails under any load.
LONG_S, AT_ONCE_S = 600, 60
_names = itertools.count()


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> dict[str, str]:
    """A CA and a node certificate it signs (the environment of a cluster whose Ray uses TLS)."""
    return tls_files.make(tmp_path_factory.mktemp("tls"))


@pytest.fixture(params=["plain TCP", "TLS"])
def contexts(request, ca):
    """Each test once over plain TCP (Ray's TLS off) and once over TLS."""
    return tls_files.contexts(ca) if request.param == "TLS" else None


class Server:
    """A listener whose partition 0 arrives into ``inputs`` and is answered with ``mean`` (its input doubled),
    or with the exception ``fail`` holds; over TLS with ``contexts``, which ``_connect`` uses too."""

    def __init__(self, contexts=None, accept_timeout_s=30.0, size=SIZE):
        self.inputs = np.zeros(size, np.float32)
        self.mean = np.zeros(size, np.float32)
        self.fail: Exception | None = None
        self.release = threading.Event()
        self.release.set()
        self.name = f"test{next(_names)}"
        self.contexts = contexts
        self.listener = streams.StreamListener(self.name, "127.0.0.1", self._target, self._answer, accept_timeout_s,
                                               tls_context=contexts and contexts.server)

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


def _connect(server, means=None, contexts=None):
    """A pushing end (over TLS, with ``contexts`` or else the server's) and the buffer its means come into."""
    means = np.zeros(server.inputs.size, np.float32) if means is None else means
    contexts = contexts or server.contexts
    return streams.Stream(server.listener.address, lambda step, partition: means, 10, 10,
                          tls_context=contexts and contexts.client), means


def _reading(stream: streams.Stream) -> bool:
    """Whether a thread waiting on ``stream`` is reading its connection now: it passed every check of
    ``Answers.wait`` and released the lock to block in the read.

    Not ``sys._current_frames()``: on Python 3.11 it can deadlock the process against a thread that exits
    meanwhile (CPython gh-106883), which hung a whole test session here once."""
    answers = stream._answers
    with answers._changed:
        return answers._reading


def _waiting(stream: streams.Stream, call) -> tuple[threading.Thread, list]:
    """``call()`` (a wait on ``stream``) on a thread of its own, returned once it is provably blocked reading
    for its answer; the list receives what it raised or returned."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + AT_ONCE_S
    while not _reading(stream):
        assert thread.is_alive() and time.monotonic() < deadline, f"the wait never blocked: {outcome}"
        time.sleep(0.01)
    return thread, outcome


def _ended_at_once(thread: threading.Thread, outcome: list) -> BaseException:
    thread.join(AT_ONCE_S)
    assert not thread.is_alive(), f"the wait was still blocked {AT_ONCE_S} s later (its timeout is {LONG_S} s)"
    return outcome[0]


EOF_ERROR = "the stream's other end closed"  # what a stream's read raises at end-of-file (streams._receive_into)


@pytest.fixture
def read_errors(monkeypatch) -> list[tuple[object, OSError]]:
    """What the streams' reads (both ends') raised, in order, with the connection read: why a wait or a server's
    reading thread ended."""
    raised = []
    receive_into = streams._receive_into

    def recorded(sock, target):
        try:
            receive_into(sock, target)
        except OSError as e:
            raised.append((sock, e))
            raise

    monkeypatch.setattr(streams, "_receive_into", recorded)
    return raised


@pytest.fixture
def accept_errors(monkeypatch) -> list[OSError]:
    """What the listeners' accepts raised: why a listener's accepting thread ended (closed, or timed out)."""
    raised = []

    class RecordedServerSocket(socket.socket):
        def accept(self):
            try:
                return super().accept()
            except OSError as e:
                raised.append(e)
                raise

    def create_server(address):
        server = RecordedServerSocket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(address)
        server.listen()
        return server

    monkeypatch.setattr(streams.socket, "create_server", create_server)
    return raised


def test_a_push_lands_in_its_segments_and_the_mean_comes_back_into_the_workers_buffer(contexts):
    server = Server(contexts)
    stream, means = _connect(server)
    for step in range(3):
        data = np.arange(SIZE, dtype=np.float32) + step
        stream.send(step, 0, [data[:2], data[2:]])  # the worker's segments, sent as they are
        assert stream.wait(step, 0, 10) == ("averaged", step)
        np.testing.assert_array_equal(server.inputs, data)
        np.testing.assert_array_equal(means, 2 * data)
    stream.close()


def test_the_servers_exception_is_raised_in_the_worker_and_the_stream_goes_on(contexts):
    server = Server(contexts)
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


def test_answers_to_a_forgotten_step_are_dropped_and_waits_are_bounded(contexts):
    server = Server(contexts)
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


def test_a_wait_on_a_closed_stream_fails_as_a_closed_connection(contexts):
    """A pushing end closed (its server replaced, the engine shut down): a late wait fails as the stream's end,
    the error the client turns into an aborted step, not a ValueError from polling a closed socket."""
    server = Server(contexts)
    stream, _ = _connect(server)
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    stream.close()
    with pytest.raises(ConnectionError):
        stream.wait(0, 0, 10)


def test_a_wait_for_a_push_forgotten_meanwhile_fails_at_once(contexts):
    """A relaying server's push of a step that failed: its wait ends when the step is forgotten, and cannot take
    the answer to the re-run's push of the same step and partition."""
    server = Server(contexts)
    stream, _ = _connect(server)
    server.release.clear()
    epoch = stream.send(0, 0, [np.ones(SIZE, np.float32)])
    thread, outcome = _waiting(stream, lambda: stream.wait(0, 0, LONG_S, epoch))
    stream.forget()
    assert isinstance(_ended_at_once(thread, outcome), Forgotten), outcome
    server.release.set()
    epoch = stream.send(0, 0, [np.full(SIZE, 3, np.float32)])
    assert stream.wait(0, 0, 10, epoch) == ("averaged", 0)


def test_the_worker_sees_the_server_close_at_once(contexts, read_errors):
    """The wait ends because its read met the end of the stream, not at a timeout."""
    server = Server(contexts)
    stream, _ = _connect(server)
    server.release.clear()
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    thread, outcome = _waiting(stream, lambda: stream.wait(0, 0, LONG_S))
    server.listener.close()
    ended = _ended_at_once(thread, outcome)
    assert isinstance(ended, ConnectionResetError) and "the parameter server closed" in str(ended), outcome
    # The worker's read met the end of the stream (or, plain, the reset of a server closed with bytes unread).
    [(_, error)] = [(sock, e) for sock, e in read_errors if sock is stream._socket]
    assert str(error) == EOF_ERROR or error.errno == errno.ECONNRESET, error
    server.release.set()


def _join_threads(server) -> None:
    for thread in _threads(server):
        thread.join(AT_ONCE_S)
    assert not _threads(server), f"the server's threads were still running {AT_ONCE_S} s later"


def test_the_server_sees_the_worker_close_at_once(contexts, read_errors):
    """Either side's death ends the stream: a worker that goes away ends the server's threads serving it, their
    read having met the end of the stream."""
    server = Server(contexts, accept_timeout_s=LONG_S)
    stream, _ = _connect(server)
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)
    assert _threads(server)
    stream.close()
    _join_threads(server)
    assert [str(e) for _, e in read_errors] == [EOF_ERROR]  # the server's read, at the end of the stream


def test_only_the_holder_of_the_token_gets_in(contexts):
    server = Server(contexts)
    host, port, token = server.listener.address
    with pytest.raises(ConnectionRefusedError, match="refused this end"):  # told at once, not at its first push
        streams.Stream((host, port, bytes(len(token))), lambda step, partition: None, 10, 10,
                       tls_context=contexts and contexts.client)
    stream, means = _connect(server)  # the listener still takes the worker
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)


def test_closing_a_listener_nobody_joined_ends_its_threads_at_once(contexts, accept_errors):
    """Its accept ends because the socket was closed, not at its timeout."""
    server = Server(contexts, accept_timeout_s=LONG_S)
    assert len(_threads(server)) == 2  # the reader (accepting) and the answerer
    server.listener.close()
    _join_threads(server)
    [closed] = accept_errors
    assert isinstance(closed, OSError) and not isinstance(closed, TimeoutError), closed
    with pytest.raises(OSError):
        _connect(server)


def test_large_pushes_and_means_cross_whole_both_ways_at_once(contexts):
    """8 MB pushes, two sent back to back: the server reads the second while it sends the first's mean (over TLS
    one end's reads and writes on two threads, each write many records, waiting for the socket)."""
    server = Server(contexts, size=2_000_000)
    stream, means = _connect(server)
    data = np.random.default_rng(0).standard_normal(server.inputs.size).astype(np.float32)
    for step in range(2):
        stream.send(step, 0, [data[:2], data[2:]])
    for step in range(2):
        assert stream.wait(step, 0, 30) == ("averaged", step)
    np.testing.assert_array_equal(server.inputs, data)
    np.testing.assert_array_equal(means, 2 * data)
    assert stream.encryption == (None if contexts is None else "TLSv1.3 TLS_AES_256_GCM_SHA384")
    stream.close()


def test_a_pushing_end_whose_certificate_the_ca_did_not_sign_is_refused(ca, tmp_path):
    """Mutual TLS: the server refuses a pusher with a certificate of another CA (though it trusts the server)."""
    server = Server(tls_files.contexts(ca))
    other = tls_files.make(tmp_path)
    impostor = tls_files.contexts({**other, tls.CA: ca[tls.CA]})
    with pytest.raises((ssl.SSLError, ConnectionRefusedError)):  # its alert, or the connection closed on it
        _connect(server, contexts=impostor)
    stream, _ = _connect(server)  # the listener still takes the worker
    stream.send(0, 0, [np.ones(SIZE, np.float32)])
    assert stream.wait(0, 0, 10) == ("averaged", 0)


def test_a_server_whose_certificate_the_ca_did_not_sign_is_refused(ca, tmp_path):
    other = tls_files.make(tmp_path)
    server = Server(tls_files.contexts({**other, tls.CA: ca[tls.CA]}))
    with pytest.raises(ssl.SSLCertVerificationError):
        _connect(server, contexts=tls_files.contexts(ca))


def test_plain_tcp_and_tls_do_not_mix(ca):
    """A plain connection to a TLS server is closed, even with the token, and so is a TLS one to a plain server."""
    server = Server(tls_files.contexts(ca))
    host, port, token = server.listener.address
    with socket.create_connection((host, port), timeout=10) as plain:
        plain.sendall(token)
        plain.settimeout(10)
        try:
            # Closed on it, without the byte that takes the stream: at once, or after a TLS alert record (0x15)
            # for what TLS read as a malformed hello.
            assert plain.recv(1) in (b"", b"\x15")
        except ConnectionResetError:
            pass
    with pytest.raises(OSError):
        streams.Stream(server.listener.address, lambda step, partition: None, 10, 10)
    stream, _ = _connect(server)  # the listener still takes the worker
    stream.close()
    with pytest.raises(OSError):
        _connect(Server(), contexts=tls_files.contexts(ca))


def test_an_answer_decrypted_ahead_of_its_wait_is_read_without_waiting_for_the_socket(ca):
    """Two answers in one TLS record: reading the first decrypts the second too, and the socket holds nothing
    more; the wait for the second must find it (``pending``), not poll the socket until its timeout."""
    contexts = tls_files.contexts(ca)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        token = bytes(streams.TOKEN_BYTES)
        stream_box: list = []
        connecting = threading.Thread(target=lambda: stream_box.append(streams.Stream(
            ("127.0.0.1", listening.getsockname()[1], token), lambda step, j: np.zeros(0, np.float32), 10, 10,
            tls_context=contexts.client)))
        connecting.start()
        raw, _ = listening.accept()
        raw.settimeout(10)
        server = tls.handshake(raw, contexts.server, server_side=True)
        assert streams._receive(server, len(token)) == token
        server.sendall(streams.TAKEN)
        connecting.join(10)
        [stream] = stream_box
        answers = [pickle.dumps(("averaged", step)) for step in range(2)]
        server.sendall(b"".join(streams.ANSWER.pack(0, step, 0, len(a), 0) + a for step, a in enumerate(answers)))
        assert stream.wait(0, 0, 10) == ("averaged", 0)
        assert stream.wait(1, 0, 20) == ("averaged", 1)  # else TimeoutError: no more bytes come
        stream.close()
        server.close()

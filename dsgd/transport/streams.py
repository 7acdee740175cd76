"""Partitions and their means between a worker and a parameter server on another node: a TCP stream per pair.

The same stream carries a relaying server's partial sums to the partition's
server on another node (node-local aggregation, ``dsgd.server.relays``): the
relaying server is then the stream's pushing end, as a worker is.

Across nodes, the object store moves each push and each mean through Ray's
object manager: a ``ray.put`` into the sender's store, a pull into the
receiver's, and an actor call per push. On this project's 2-core machine the
raylets alone spent about 0.8 s of CPU per ResNet-101 step moving 2 x 89 MB
each way (``benchmarks/step_breakdown.py``). A stream carries the same bytes
with the kernel's copies only: the worker sends a partition's segments
straight from its gradient arrays, the server receives them into that
worker's input buffer, sums as for a worker on its node, and sends the mean
back from its mean buffer into the worker's.

- **Frames.** A push is a header (epoch, step, partition, byte count) and
  the partition's bytes in the wire dtype. An answer is a header (epoch,
  step, partition, answer length, mean length), the pickled answer (the
  workers the mean averages, or the exception the server's push raised),
  and the mean's bytes if there is one. The server never unpickles
  anything.
- **Who talks.** The server listens on its node's address (the one Ray knows
  it by) on a port the kernel picks, for ``accept_timeout_s``, and accepts
  the connection that first sends the 16-byte token it gave the worker in
  its ``attach`` reply (a relaying server: ``attach_relay``; an
  authenticated Ray call), and says so (one byte) before the first push;
  anything else is closed. A pushing end that cannot connect within
  ``CONNECT_TIMEOUT_S``, or is refused, goes through the object store.
- **Encryption.** When Ray encrypts its traffic (``RAY_USE_TLS``), a
  stream does too, with Ray's certificates, both ends verified against
  Ray's CA (``dsgd.transport.tls``): the TLS handshake comes before the
  token, and the segments are encrypted straight from their arrays and
  decrypted straight into their buffers. The rest is the same.
- **Order.** One thread per stream on the server reads pushes as they come
  (so a worker's next partition is never held up behind a sum that waits for
  other workers), tells the server of each push's bytes as they come in,
  ``CHUNK_BYTES`` at a time (``Arrivals.arriving``: it may sum what every
  worker has sent of a partition so far), has the server take each push as
  it arrives (``take``: counted, and summed if it completes its step) and
  queues them; another answers them in order, except those its ``apart``
  test picks, each answered on a thread of its own (a relayed partition,
  which waits on another node): a sum never waits for a mean still going
  out ahead of it.
- **Means as they are summed.** Where the server sums a partition chunk by
  chunk as the pushes come in, its answer can go before the sum is done
  (``Arrivals.early``): the header and the workers averaged once every
  worker's push has begun, then the mean's bytes as they are summed
  (``MeanStream``). The pushing end reads the same frame either way. If the
  step fails after such an answer began, the stream is cut (its frame could
  not be finished): the pushing end reads end-of-file.
- **Failures.** Either side's death closes the stream: the other reads
  end-of-file at once. A wait for an answer is bounded by its caller, a send
  by ``send_timeout_s``. Answers to a failed step's pushes (an earlier
  epoch) are read and dropped, and a wait for one fails (``Forgotten``).

No TensorFlow here: the parameter servers import it.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from dsgd.transport import tls
from dsgd.transport.answers import Answers
from dsgd.transport.listener import Listener, Request, shut_down

PUSH = struct.Struct("<qqqQ")  # epoch, step, partition index, bytes that follow
ANSWER = struct.Struct("<qqqQQ")  # epoch, step, partition index, answer bytes, mean bytes
TOKEN_BYTES = 16
TAKEN = b"\x01"  # the server's reply to the right token: the stream is the pushing end's
# A server listens before its attach returns, so the kernel completes a stream's connection at once; one that
# takes longer is blocked (e.g. a firewall dropping the port), and the pair falls back to the object store.
CONNECT_TIMEOUT_S = 10.0
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's option; Python names it on few builds
CHUNK_BYTES = 1 << 18  # a push is read, and the server told of its progress, this many bytes at a time


class MeanStream(Protocol):
    """A mean that goes out while the server sums it."""

    def ready(self, sent: int) -> int:
        """Wait until more than ``sent`` of the mean's bytes are summed: the bytes summed so far (all of them
        once the step is done). OSError if the step failed instead."""

    def finish(self) -> None:
        """The whole mean went out: the push's bookkeeping, as for an answer sent when the step was done."""


class Arrivals(Protocol):
    """What the server does with a stream's pushes as their bytes come in, before their answers' turn."""

    def arriving(self, step: int, j: int, epoch: int, nbytes: int) -> None:
        """``nbytes`` of the push of partition j for ``step`` are in (called as each chunk comes, the last with
        all of them, before ``take``)."""

    def take(self, step: int, j: int, epoch: int) -> None:
        """The push is in whole: counted (and summed if it completes the step). What it raises is the push's
        answer."""

    def answers_early(self, j: int) -> bool:
        """Whether a push of partition j may be answered while its bytes still come in (``early``)."""

    def early(self, step: int, j: int, epoch: int) -> tuple[Any, np.ndarray, MeanStream] | None:
        """The push's answer, its mean and the mean's progress, if the mean can go out while it is summed; else
        None (the answer waits for the step as usual)."""


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


Connection = socket.socket | tls.TlsSocket  # a stream's connection, plain or TLS


def _receive_into(sock: Connection, target: memoryview) -> None:
    """Fill ``target`` from ``sock``; ConnectionError at end-of-file."""
    while target:
        n = sock.recv_into(target)
        if n == 0:
            raise ConnectionResetError("the stream's other end closed")
        target = target[n:]


def _receive(sock: Connection, size: int) -> bytes:
    buffer = bytearray(size)
    _receive_into(sock, memoryview(buffer))
    return bytes(buffer)


class StreamListener(Listener):
    """The server's end: accepts one pushing end's stream (a worker's or a relaying server's), takes its pushes
    and answers them."""

    def __init__(self, name: str, host: str, target: Callable[[int, int], Sequence[memoryview]],
                 answer: Callable[[int, int, int], tuple[Any, np.ndarray | None]], accept_timeout_s: float,
                 apart: Callable[[int, int], bool] = lambda step, j: False, tls_context: ssl.SSLContext | None = None,
                 arrivals: Arrivals | None = None):
        """``target(j, nbytes)``: where a push of partition j goes, its bytes filling each view in turn
        (ValueError if ``nbytes`` is not their size); ``answer(step, j, epoch)``: the server's push (``epoch``:
        the one it was sent in), returning what goes back and the mean to send (or raising, which goes back
        too). The worker must connect within ``accept_timeout_s``; over TLS if ``tls_context`` is given (a
        server's, ``tls.Contexts.server``). ``arrivals``, if given, hears of each push as its bytes come in, on
        the reading thread, and may answer it before its step is done."""
        super().__init__(f"dsgd stream {name}", answer, apart, read_ahead=True)
        self._target = target
        self._arrivals = arrivals
        self._unread: tuple | None = None  # a push queued for its answer before its bytes were read
        self._tls = tls_context
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._server = socket.create_server((host, 0))
        self._server.settimeout(accept_timeout_s)
        self.address: tuple[str, int, bytes] = (host, self._server.getsockname()[1], self.token)
        self._start()

    def _accept(self) -> Connection | None:
        """The first connection that presents the token (after the TLS handshake, with TLS; others are closed),
        or None (closed, or timed out)."""
        deadline = time.monotonic() + self._server.gettimeout()
        try:
            while time.monotonic() < deadline:
                connection, _ = self._server.accept()
                try:
                    connection = self._taken(connection, max(0.1, deadline - time.monotonic()))
                except OSError:  # no TLS, a certificate the CA did not sign, the wrong token, or gone
                    connection.close()
                    continue
                connection.settimeout(None)  # between steps it waits as long as it takes
                return connection
        except OSError:  # closed, or nobody came within the timeout
            pass
        finally:
            self._server.close()
        return None

    def _taken(self, connection: socket.socket, timeout_s: float) -> Connection:
        """``connection`` (with TLS, handshaken) once it presented the token within ``timeout_s``, told so;
        OSError if it did not."""
        connection.settimeout(timeout_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            connection = tls.handshake(connection, self._tls, server_side=True)
        try:
            if not hmac.compare_digest(_receive(connection, TOKEN_BYTES), self.token):
                raise ConnectionRefusedError("the wrong token")
            connection.sendall(TAKEN)
        except BaseException:
            connection.close()
            raise
        return connection

    def _receive(self, connection: Connection) -> Request:
        """The next push, its bytes read into its target (a bad one's read past, to fail it); or, if it may be
        answered while it arrives, the push as soon as its header is in, its bytes read at the next call (the
        answer may begin meanwhile; what ``take`` raises then fails the step at the server, which answers so)."""
        if self._unread is not None:
            unread, self._unread = self._unread, None
            self._read_push(connection, *unread)
        epoch, step, j, nbytes = PUSH.unpack(_receive(connection, PUSH.size))
        try:
            targets = self._target(j, nbytes)
        except ValueError as e:
            _receive(connection, nbytes)
            return epoch, step, j, e
        if self._arrivals is not None and self._arrivals.answers_early(j):
            self._unread = (epoch, step, j, targets)
            return epoch, step, j, None
        return epoch, step, j, self._read_push(connection, epoch, step, j, targets)

    def _read_push(self, connection: Connection, epoch: int, step: int, j: int,
                   targets: Sequence[memoryview]) -> Exception | None:
        """A push's bytes into its targets, the server told as they come in; what ``take`` raised, if it did."""
        if self._arrivals is None:
            for target in targets:
                _receive_into(connection, target)
            return None
        received = 0
        for target in targets:
            for start in range(0, target.nbytes, CHUNK_BYTES):
                chunk = target[start:start + CHUNK_BYTES]
                _receive_into(connection, chunk)
                received += chunk.nbytes
                self._arrivals.arriving(step, j, epoch, received)
        try:
            self._arrivals.take(step, j, epoch)
        except Exception as e:  # the pusher raises it
            return e
        return None

    def _answer_of(self, epoch: int, step: int, j: int) -> Any:
        early = None if self._arrivals is None else self._arrivals.early(step, j, epoch)
        return self._answer(step, j, epoch) if early is None else early

    def _send(self, connection: Connection, epoch: int, step: int, j: int, answer: Any) -> None:
        """The answer's header, the pickled answer (the workers averaged, or the exception), and the mean's bytes
        (as they are summed, for an early answer: if the step fails meanwhile, the stream is cut)."""
        if isinstance(answer, BaseException):
            value, mean, progress = answer, None, None
        elif len(answer) == 3:  # an early answer (``Arrivals.early``)
            value, mean, progress = answer
        else:
            (value, mean), progress = answer, None
        meta = pickle.dumps(value)
        payload = _bytes(mean) if mean is not None else memoryview(b"")
        connection.sendall(ANSWER.pack(epoch, step, j, len(meta), payload.nbytes) + meta)
        if progress is None:
            connection.sendall(payload)
            return
        sent = 0
        try:
            while sent < payload.nbytes:
                summed = progress.ready(sent)
                connection.sendall(payload[sent:summed])
                sent = summed
        except OSError:
            shut_down(connection)  # a frame cut short: the pushing end must not read on
            raise
        progress.finish()

    def _stop_accepting(self) -> None:
        """Shutting the listening socket down wakes the thread blocked in accept."""
        shut_down(self._server)
        self._server.close()


class Stream:
    """The pushing end (a worker, or a relaying server): sends pushes, and waits, from any thread, for each
    answer, its mean read into ``means(step, j)`` (j: the partition's index)."""

    def __init__(self, address: tuple[str, int, bytes], means: Callable[[int, int], np.ndarray],
                 connect_timeout_s: float, send_timeout_s: float, epoch: int = 0,
                 tls_context: ssl.SSLContext | None = None):
        """Connect to the ``StreamListener`` at ``address`` (over TLS if ``tls_context`` is given: a pushing
        end's, ``tls.Contexts.client``); OSError if this process cannot reach it, or it refuses the connection,
        within ``connect_timeout_s``. ``send_timeout_s`` bounds each send (the server stopped reading) and the
        rest of an answer that started to arrive. Pushes are of ``epoch`` until ``forget``."""
        host, port, token = address
        self._means = means
        connection: Connection = socket.create_connection((host, port), timeout=connect_timeout_s)
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls_context is not None:
                connection = tls.handshake(connection, tls_context, server_side=False)
            connection.sendall(token)
            if _receive(connection, len(TAKEN)) != TAKEN:
                raise ConnectionRefusedError(f"the stream at {host}:{port} answered its token with garbage")
            connection.settimeout(send_timeout_s)
        except ConnectionResetError:  # closed on it: the wrong token, or (TLS 1.3) its certificate refused
            connection.close()
            raise ConnectionRefusedError(f"the stream at {host}:{port} refused this end (its token, or its TLS "
                                         "certificate)") from None
        except BaseException:
            connection.close()
            raise
        self._socket = connection
        # The protocol and cipher ("TLSv1.3 TLS_AES_256_GCM_SHA384"), None if the stream is plain TCP.
        self.encryption = connection.encryption if isinstance(connection, tls.TlsSocket) else None
        self._sending = threading.Lock()  # a push goes out whole
        self._answers = Answers(self._read_answer, "the stream")
        self._answers.epoch = epoch
        self._wakeup = socket.socketpair()  # ``forget`` wakes the reading thread out of its poll
        for end in self._wakeup:
            end.setblocking(False)

    def send(self, step: int, j: int, arrays: Sequence[np.ndarray], epoch: int | None = None) -> int:
        """Push ``arrays`` (partition j's segments, in the wire dtype) as ``(step, j)``, of ``epoch`` (default:
        the stream's now; a relaying server's pushes say the generation they were summed in); the push's epoch
        (for ``wait``, which fails at once if it is not the stream's). OSError: a ConnectionError if the server
        is gone, TimeoutError if it stopped reading."""
        views = [_bytes(a) for a in arrays]
        with self._sending:
            epoch = self._answers.epoch if epoch is None else epoch
            try:
                self._socket.sendall(PUSH.pack(epoch, step, j, sum(v.nbytes for v in views)))
                for view in views:
                    self._socket.sendall(view)
            except OSError:  # a frame cut short: the server would misread what follows
                self._answers.end()
                raise
        return epoch

    def pace(self, bytes_per_s: int) -> None:
        """Have the kernel send at most ``bytes_per_s`` down this stream (TCP's own pacing, ``SO_MAX_PACING_RATE``)."""
        self._socket.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, bytes_per_s)

    @property
    def broken(self) -> bool:
        """The stream ended (the server closed it, a send or an answer was cut short, or ``close``): every later
        push and wait on it fails; a new one must be opened."""
        return self._answers.gone

    def wait(self, step: int, j: int, timeout_s: float, epoch: int | None = None) -> Any:
        """The answer to push ``(step, j)``, raised if it is an exception (its mean is in
        ``means(step, j)``); TimeoutError after ``timeout_s``, ConnectionError if the stream ended,
        ``Forgotten`` if the push (sent in ``epoch``, as ``send`` returned) was forgotten meanwhile."""
        return self._answers.wait((step, j), timeout_s, f"the push of partition {j}, step {step}",
                                  epoch)

    def _read_answer(self, timeout_s: float) -> tuple[int, tuple[int, int], Any] | None:
        """The next answer, its mean read into its buffer, if one starts within ``timeout_s`` (and ``forget`` does
        not wake the poll); one that started must arrive whole within the socket's timeout, else the stream
        counts as broken (its next bytes would be misread): OSError."""
        if isinstance(self._socket, tls.TlsSocket) and self._socket.pending():
            ready = {self._socket.fileno()}  # decrypted already: the socket itself may have nothing left to read
        else:
            poller = select.poll()
            poller.register(self._socket, select.POLLIN)
            poller.register(self._wakeup[0], select.POLLIN)
            ready = {fd for fd, _ in poller.poll(timeout_s * 1000)}
        if self._wakeup[0].fileno() in ready:  # forgotten pushes: their waits fail, the others read on
            _drain(self._wakeup[0])
            return None
        if not ready:
            return None
        epoch, step, j, meta_bytes, mean_bytes = ANSWER.unpack(_receive(self._socket, ANSWER.size))
        value = pickle.loads(_receive(self._socket, meta_bytes))
        if mean_bytes:
            _receive_into(self._socket, _bytes_of(self._means(step, j), mean_bytes))
        return epoch, (step, j), value

    def forget(self, epoch: int | None = None) -> None:
        """Drop the answers to every push sent so far (a failed step's), arrived or still to come; pushes from
        now on are of ``epoch`` (default: the next)."""
        self._answers.forget(epoch)  # waits for those pushes fail
        try:
            self._wakeup[1].send(b"\0")
        except BlockingIOError:  # it is awake already
            pass

    def close(self) -> None:
        """End the stream: a wait from now on fails as if the server had closed it."""
        self._answers.end()
        shut_down(self._socket)
        self._socket.close()
        for end in self._wakeup:
            end.close()


def _drain(sock: socket.socket) -> None:
    """Read whatever is waiting on non-blocking ``sock``."""
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def _bytes_of(array: np.ndarray, nbytes: int) -> memoryview:
    """``array``'s memory as bytes, checked to hold exactly ``nbytes``."""
    view = memoryview(array).cast("B")
    if view.nbytes != nbytes:
        raise ConnectionAbortedError(f"the server sent a mean of {nbytes} bytes for a buffer of {view.nbytes}")
    return view

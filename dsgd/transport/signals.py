"""Requests and answers between two processes of one host, without Ray: a Unix socket per pair.

A parameter server and a worker on its node share buffers (``dsgd.transport.shared_memory``);
what they still need is to tell each other "partition j of step s is in my
buffer" and "its mean is ready". This module carries those signals over a
connected ``AF_UNIX`` ``SOCK_SEQPACKET`` socket (one message per send, in
order), created by the server (``ChannelListener``) and joined by the worker
(``Channel``) through an abstract address the worker learns when it attaches:

- a request is two integers (the step and the partition), packed; an answer
  is whatever the server's handler returned or raised, pickled, so a
  ``StepAborted`` or a bad push's ``ValueError`` reaches the worker as itself;
- each side sees the other's death at once: its end of the socket reads
  end-of-file (an ``eventfd`` or a futex in shared memory would only show it
  as a timeout, and an ``eventfd`` cannot be opened through ``/proc/<pid>/fd``);
- only the intended peers talk: the server accepts one connection, from its
  own user (``SO_PEERCRED``), and the worker checks that it reached the
  server's pid; the server never unpickles what it receives.

Every wait for an answer is bounded by its caller. The server answers a
channel's requests one at a time, in order, on one thread per channel (a
worker sends a server's partitions in layout order, in each round the ones
that server relays first, so it never waits for an answer queued behind
another: ``dsgd.cluster.server_plan.send_rounds``), except those its
``apart`` test picks, each answered on a thread of its own (a relay's push,
which waits on another node). No
TensorFlow here: the parameter servers import it.
"""

from __future__ import annotations

import os
import pickle
import secrets
import select
import socket
import struct
from typing import Any, Callable

from dsgd.transport.answers import Answers
from dsgd.transport.listener import Listener, Request

REQUEST = struct.Struct("<qqq")  # (epoch, a, b): a request of the channel's current epoch
MAX_ANSWER_BYTES = 1 << 16
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peer(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of ``sock``."""
    pid, uid, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid, uid


def available() -> bool:
    """Whether this host has what a channel needs (Linux: abstract Unix sockets, peer credentials)."""
    return hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "SOCK_SEQPACKET")


class ChannelListener(Listener):
    """The server's end: accepts one worker's channel and answers its requests in order, on its own thread."""

    def __init__(self, name: str, answer: Callable[[int, int], Any], accept_timeout_s: float,
                 apart: Callable[[int, int], bool] = lambda a, b: False):
        """``answer(a, b)`` is called for each request ``(a, b)``; what it returns or raises goes back. Requests
        for which ``apart(a, b)`` is true are answered on a thread of their own, so the next ones need not wait.

        The worker must connect within ``accept_timeout_s`` of this call.
        """
        super().__init__(f"dsgd signals {name}", answer, apart, read_ahead=False)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._server.bind(f"\0dsgd-{name}-{os.getpid()}-{secrets.token_hex(8)}")
        self._server.listen(1)
        self._server.settimeout(accept_timeout_s)
        self.address: tuple[int, bytes] = (os.getpid(), self._server.getsockname())
        self._start()

    def _accept(self) -> socket.socket | None:
        """The worker's connection, if it came in time from this user (``SO_PEERCRED``)."""
        try:
            connection, _ = self._server.accept()
        except OSError:  # closed, or nobody came within the timeout
            return None
        finally:
            self._server.close()
        connection.setblocking(True)  # between steps it waits for the next request as long as it takes
        if _peer(connection)[1] != os.getuid():
            connection.close()
            return None
        return connection

    def _receive(self, connection: socket.socket) -> Request | None:
        request = connection.recv(REQUEST.size)
        if len(request) != REQUEST.size:  # end of file: the worker closed its end or died
            return None
        epoch, a, b = REQUEST.unpack(request)
        return epoch, a, b, None

    def _send(self, connection: socket.socket, epoch: int, a: int, b: int, answer: Any) -> None:
        connection.send(pickle.dumps((epoch, a, b, answer)))

    def _stop_accepting(self) -> None:
        """Connect: nothing else wakes a thread in accept; it sees closed (or is past accept already)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as wake:
                wake.setblocking(False)
                wake.connect(self.address[1])
        except OSError:
            pass


class Channel:
    """The worker's end: sends requests and waits, from any thread, for the answer to each."""

    def __init__(self, address: tuple[int, bytes], send_timeout_s: float):
        """Connect to the ``Listener`` at ``address``; OSError if this process cannot reach it.

        A send blocks only while the server's socket buffer is full (it stopped reading), at most
        ``send_timeout_s`` (then TimeoutError)."""
        pid, name = address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._socket.settimeout(send_timeout_s)
            self._socket.connect(name)
            if _peer(self._socket)[0] != pid:
                raise ConnectionRefusedError(f"the socket {name!r} is not held by process {pid}")
        except BaseException:
            self._socket.close()
            raise
        self._answers = Answers(self._read_answer, "the channel")

    def send(self, a: int, b: int) -> int:
        """Request ``(a, b)``; the epoch it was sent in (for ``wait``). ConnectionError if the server is gone."""
        epoch = self._answers.epoch
        self._socket.send(REQUEST.pack(epoch, a, b))
        return epoch

    def wait(self, a: int, b: int, timeout_s: float, epoch: int | None = None) -> Any:
        """The answer to request ``(a, b)``, raised if it is an exception; TimeoutError after ``timeout_s``,
        ConnectionError if the server closed the channel (it died, or the worker re-attached), ``Forgotten`` if
        the request (sent in ``epoch``) was forgotten meanwhile."""
        return self._answers.wait((a, b), timeout_s, f"request {(a, b)}", epoch)

    def _read_answer(self, timeout_s: float) -> tuple[int, tuple[int, int], Any] | None:
        """The next answer, if one arrives within ``timeout_s``; OSError at end of file."""
        poller = select.poll()
        poller.register(self._socket, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            return None
        message = self._socket.recv(MAX_ANSWER_BYTES)
        if not message:
            raise ConnectionResetError("the channel's other end closed")
        epoch, a, b, answer = pickle.loads(message)
        return epoch, (a, b), answer

    def forget(self) -> None:
        """Drop the answers to every request sent so far (a failed step's), arrived or still to come."""
        self._answers.forget()

    def close(self) -> None:
        self._socket.close()

"""The server's end of one pair's connection, a signal channel's or a stream's: one pusher, its requests answered.

A ``Listener`` accepts one connection (its subclass says from whom), reads
the requests that come down it and answers each with what the server's
handler returns or raises, in order, except those its ``apart`` test picks,
each answered on a thread of its own (a relay's push, which waits on another
node). A request that carries data (a stream's push) is read ahead of the
answers, on a thread of its own, so a pusher's next partition is never held
up behind a sum that waits for other workers; one that carries none (a
signal) is answered on the thread that read it. ``close`` stops it: the
pusher reads end-of-file.
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Any, Callable

Request = tuple[int, int, int, Exception | None]  # (epoch, a, b, why it cannot be answered, if it cannot)


def shut_down(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways, which wakes a thread blocked on it (in recv, or in accept on Linux);
    nothing if it is closed already."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Listener:
    """Accepts one pusher's connection and answers its requests; subclasses frame them (``_accept``,
    ``_receive``, ``_send``, ``_stop_accepting``)."""

    def __init__(self, thread_name: str, answer: Callable[[int, int], Any], apart: Callable[[int, int], bool],
                 read_ahead: bool):
        """``answer(a, b)``: the server's handler of request ``(a, b)``; ``apart(a, b)``: whether it is answered
        on a thread of its own; ``read_ahead``: whether requests are read on a thread of their own, ahead of the
        answers. Subclasses call ``_start`` once they can accept."""
        self._answer, self._apart = answer, apart
        self._thread_name = thread_name
        self._sending = threading.Lock()  # answers from several threads go out whole
        self._lock = threading.Lock()  # guards the two below
        self._closed = False
        self._connection: socket.socket | None = None
        self._queue: queue.SimpleQueue | None = queue.SimpleQueue() if read_ahead else None  # None: the end

    def _start(self) -> None:
        threading.Thread(target=self._read, name=self._thread_name, daemon=True).start()
        if self._queue is not None:
            threading.Thread(target=self._serve, name=f"{self._thread_name} answers", daemon=True).start()

    # ---- what a subclass says ----------------------------------------------

    def _accept(self) -> socket.socket | None:
        """The pusher's connection, or None (closed, timed out, or an impostor); closes the listening socket."""
        raise NotImplementedError

    def _receive(self, connection: socket.socket) -> Request | None:
        """The next request; None (or OSError) once the connection ended."""
        raise NotImplementedError

    def _send(self, connection: socket.socket, epoch: int, a: int, b: int, answer: Any) -> None:
        """Send ``answer`` (what ``answer(a, b)`` returned, or the exception it raised); OSError if it cannot."""
        raise NotImplementedError

    def _stop_accepting(self) -> None:
        """Wake the thread still waiting in ``_accept``: it sees ``_closed``."""
        raise NotImplementedError

    # ---- the threads -------------------------------------------------------

    def _read(self) -> None:
        """Accept, then read requests and answer or queue them, until the connection ends."""
        connection = self._accept()
        with self._lock:
            if connection is not None and self._closed:
                connection.close()
                connection = None
            self._connection = connection
        try:
            while connection is not None and (request := self._receive(connection)) is not None:
                if self._queue is not None:
                    self._queue.put(request)
                elif not self._dispatch(request):
                    return
        except OSError:  # end of file, or closed: the pusher died or re-attached, or the server closed it
            pass
        finally:
            if self._queue is not None:
                self._queue.put(None)

    def _serve(self) -> None:
        """Answer the requests read ahead, in order."""
        while (request := self._queue.get()) is not None:
            if not self._dispatch(request):
                return

    def _dispatch(self, request: Request) -> bool:
        """Answer ``request`` now, or on a thread of its own if ``apart`` says so; False if the pusher is gone."""
        if self._apart(request[1], request[2]):
            threading.Thread(target=self._respond, args=request, daemon=True,
                             name=f"{self._thread_name} request {request[1]}, {request[2]}").start()
            return True
        return self._respond(*request)

    def _respond(self, epoch: int, a: int, b: int, error: Exception | None) -> bool:
        """Answer request ``(a, b)``; False if the pusher is gone."""
        try:
            if error is not None:
                raise error
            answer = self._answer_of(epoch, a, b)
        except Exception as e:  # the pusher raises it
            answer = e
        try:
            with self._sending:
                connection = self._connection
                if connection is None:
                    return False
                self._send(connection, epoch, a, b, answer)
        except OSError:
            return False
        return True

    def _answer_of(self, epoch: int, a: int, b: int) -> Any:
        """The server's answer to request ``(a, b)`` of the pusher's ``epoch`` (a subclass may hand it on)."""
        return self._answer(a, b)

    def close(self) -> None:
        """Stop answering: the connection (or the wait for it) ends, and the pusher reads end-of-file."""
        with self._lock:
            self._closed = True
            connection = self._connection
        if connection is not None:
            shut_down(connection)  # wakes the reader blocked in recv
            connection.close()
        else:
            self._stop_accepting()

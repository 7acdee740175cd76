"""Waiting, from many threads, for the answers a server sends back down one connection.

A worker's threads (or a relaying server's) each wait for the answer to their
own request. Nobody runs a reader thread: a waiting thread that finds nobody
reading reads the next answer for everyone, files it by its key and wakes the
others; the one it is for takes it. Requests carry an epoch: ``forget`` (a
failed step) starts a new one, and answers to an earlier epoch are read and
dropped. Once the connection ends, every wait fails as a ConnectionError.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable

# (epoch, key, answer) of one answer read; None if none arrived within the time given (or the read was woken)
Read = Callable[[float], "tuple[int, Hashable, Any] | None"]


class Forgotten(Exception):
    """The request a wait was for was dropped by ``Answers.forget`` (a failed step's) while it waited."""


class Answers:
    """The answers of one connection, as they arrive, for whichever thread waits for each."""

    def __init__(self, read: Read, connection: str):
        """``read(timeout_s)``: the next answer from the connection (see ``Read``), raising OSError once the
        connection ended; called under no lock, by one thread at a time. ``connection``: what it is, for errors
        ("the channel")."""
        self._read_answer = read
        self._connection = connection
        self._changed = threading.Condition()  # guards everything below
        self.epoch = 0  # answers to requests of earlier epochs are dropped
        self._answers: dict[Hashable, Any] = {}  # key -> its answer, arrived and not yet taken
        self._reading = False  # a waiting thread is reading the connection for all of them
        self.gone = False  # the connection ended: every wait, now or later, fails

    def wait(self, key: Hashable, timeout_s: float, request: str, epoch: int | None = None) -> Any:
        """The answer to the request ``key`` (``request`` names it), raised if it is an exception; TimeoutError
        after ``timeout_s``, ConnectionError if the connection ended, ``Forgotten`` if the request (sent in
        ``epoch``) was forgotten meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if epoch is not None and epoch != self.epoch:
                    raise Forgotten(f"{request} was dropped (its step failed)")
                if key in self._answers:
                    break
                remaining = deadline - time.monotonic()
                if self.gone:
                    raise ConnectionResetError(f"the parameter server closed {self._connection} (it died or was "
                                               "replaced)")
                if remaining <= 0:
                    raise TimeoutError(f"no answer to {request} within {timeout_s:.0f}s")
                if self._reading:  # another thread reads for everyone; it wakes us
                    self._changed.wait(remaining)
                else:
                    self._read(remaining)
            answer = self._answers.pop(key)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _read(self, timeout_s: float) -> None:
        """Read one answer (under the lock, which it releases meanwhile) into ``_answers``."""
        self._reading = True
        self._changed.release()
        answer, gone = None, False
        try:
            answer = self._read_answer(timeout_s)
        except OSError:  # end of file, closed, or an answer cut off
            gone = True
        finally:
            self._changed.acquire()
            self._reading = False
            self._changed.notify_all()
        if gone:
            self.gone = True
        elif answer is not None and answer[0] == self.epoch:
            self._answers[answer[1]] = answer[2]

    def forget(self, epoch: int | None = None) -> None:
        """Drop the answers to every request sent so far, arrived or still to come; their waits fail. Requests
        from now on are of ``epoch`` (a relaying server's generation, ``ParameterServer.reset``), by default the
        next."""
        with self._changed:
            self.epoch = self.epoch + 1 if epoch is None else epoch
            self._answers.clear()
            self._changed.notify_all()

    def end(self) -> None:
        """The connection ended: every wait, now or later, fails."""
        with self._changed:
            self.gone = True
            self._changed.notify_all()

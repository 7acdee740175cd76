"""Ray's TLS for dsgd's own connections across nodes: whether Ray encrypts its traffic, and a stream that does too.

Ray encrypts its traffic (gRPC, mutual TLS) when ``RAY_USE_TLS`` is "1" or
"true" (any case) in a process's environment, with the certificate chain in
the file ``RAY_TLS_SERVER_CERT``, its private key in ``RAY_TLS_SERVER_KEY``
and the certificate authority's in ``RAY_TLS_CA_CERT``; every Ray process of
the cluster reads them from its environment, and an actor's process inherits
its node's. A stream (``dsgd.transport.streams``) then does the same with the
same files, in its own process:

- **mutual**: each end presents the node's certificate and requires the
  other's to be signed by the CA. No host name is checked (Ray's own
  self-signed certificates name addresses as DNS names, and one certificate
  may serve every node): a verified peer is a member of the cluster, and the
  stream's token (sent over it, from an authenticated Ray call) says which
  pusher it is. TLS 1.3 only: both ends are dsgd.
- **shared by threads**: one thread reads a stream while others write to it,
  but an SSL object takes one call at a time. ``TlsSocket`` makes each call
  non-blocking under a lock and waits for the socket (want-read, want-write)
  outside it, as long as its timeout allows, as a socket would.

With Ray's TLS off, nothing here is used: streams are plain TCP.
"""

from __future__ import annotations

import functools
import os
import select
import socket
import ssl
import threading
import time
from typing import Callable, Mapping, NamedTuple, TypeVar

USE_TLS = "RAY_USE_TLS"
CERT, KEY, CA = "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"

T = TypeVar("T")


class TlsUnavailable(OSError):
    """Ray's TLS is on but its files cannot make a stream's TLS (a stream then falls back to the object store)."""


class Contexts(NamedTuple):
    """The two ends' TLS settings: the listening server's and the connecting pusher's."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def ray_uses_tls(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Ray encrypts its traffic in a process of ``environ`` (read as Ray reads it)."""
    return environ.get(USE_TLS, "0").lower() in ("1", "true")


def contexts(cert: str, key: str, ca: str) -> Contexts:
    """Both ends' contexts from a certificate chain, its key and the CA certificate (PEM files); TlsUnavailable
    naming the file that cannot be used and why."""
    made = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED  # a server too: it requires the pusher's certificate
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise TlsUnavailable(f"Ray's TLS is on but the certificate {cert!r} ({CERT}) with the key {key!r} "
                                 f"({KEY}) cannot be used: {e}") from e
        try:
            context.load_verify_locations(ca)
        except (OSError, ValueError) as e:
            raise TlsUnavailable(f"Ray's TLS is on but the CA certificate {ca!r} ({CA}) cannot be used: {e}") from e
        if purpose == ssl.PROTOCOL_TLS_SERVER:
            context.num_tickets = 0  # no session tickets: nothing but the stream's bytes comes after the handshake
        made.append(context)
    return Contexts(*made)


@functools.cache
def _contexts_of(cert: str, key: str, ca: str) -> Contexts:
    return contexts(cert, key, ca)


def ray_contexts() -> Contexts | None:
    """The contexts of Ray's files (made once per process) if Ray's TLS is on in this process, else None;
    TlsUnavailable naming what is wrong if it is on but they cannot be made."""
    if not ray_uses_tls():
        return None
    missing = [name for name in (CERT, KEY, CA) if not os.environ.get(name)]
    if missing:
        raise TlsUnavailable(f"Ray's TLS is on ({USE_TLS}) but {' and '.join(missing)} not set")
    return _contexts_of(os.environ[CERT], os.environ[KEY], os.environ[CA])


def ray_server_context() -> ssl.SSLContext | None:
    """A listening server's end of ``ray_contexts``: None with Ray's TLS off; TlsUnavailable as it says."""
    made = ray_contexts()
    return made and made.server


def ray_client_context() -> ssl.SSLContext | None:
    """A pushing end's of ``ray_contexts``: None with Ray's TLS off; TlsUnavailable as it says."""
    made = ray_contexts()
    return made and made.client


def handshake(sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> TlsSocket:
    """``sock`` (connected) as a TLS connection, once the handshake is done within its timeout (which the
    connection keeps); OSError (ssl.SSLError) if the peer speaks no TLS or its certificate is refused."""
    tls = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    try:
        tls.do_handshake()
    except BaseException:
        tls.close()
        raise
    return TlsSocket(tls)


class TlsSocket:
    """A TLS connection that one thread may read while another writes; the calls of a socket a stream makes."""

    def __init__(self, tls: ssl.SSLSocket):
        """``tls``: handshaken; its timeout becomes this connection's."""
        self._timeout = tls.gettimeout()
        tls.setblocking(False)
        self._tls = tls
        self._lock = threading.Lock()  # one SSL call at a time
        self._writing = threading.Lock()  # one write at a time: a write that waited is retried with the same bytes

    @property
    def encryption(self) -> str:
        """The protocol and cipher, e.g. "TLSv1.3 TLS_AES_256_GCM_SHA384"."""
        name, version, _ = self._tls.cipher()
        return f"{version} {name}"

    def settimeout(self, timeout_s: float | None) -> None:
        """Bound each later call's waits for the socket (None: as long as it takes)."""
        self._timeout = timeout_s

    def fileno(self) -> int:
        return self._tls.fileno()

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._tls.setsockopt(level, option, value)

    def pending(self) -> int:
        """Bytes decrypted already and not read: the socket may have none left while these wait."""
        with self._lock:
            return self._tls.pending()

    def recv_into(self, buffer: memoryview) -> int:
        """Read into ``buffer`` (at most one TLS record); 0 at end of file; TimeoutError after the timeout."""
        return self._call(functools.partial(self._tls.recv_into, buffer))

    def sendall(self, data: bytes | memoryview) -> None:
        """Send ``data`` whole, encrypted straight from its memory; TimeoutError if the socket stays full longer
        than the timeout."""
        view = memoryview(data).cast("B")
        with self._writing:
            while view:
                view = view[self._call(functools.partial(self._tls.send, view)):]

    def _call(self, call: Callable[[], T]) -> T:
        """``call`` (non-blocking) under the lock, again each time the socket is ready for what it wanted."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            with self._lock:
                try:
                    return call()
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
            self._wait(events, deadline)

    def _wait(self, events: int, deadline: float | None) -> None:
        fd = self._tls.fileno()
        if fd < 0:
            raise ConnectionAbortedError("the TLS connection was closed")
        poller = select.poll()
        poller.register(fd, events)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not poller.poll(None if remaining is None else remaining * 1000):
            raise TimeoutError(f"the TLS connection was not ready within {self._timeout:.0f}s")

    def shutdown(self, how: int) -> None:
        """Shut the socket down (waking a thread that waits on it), keeping the TLS state for the calls that
        follow (which then fail or read end-of-file)."""
        socket.socket.shutdown(self._tls, how)  # SSLSocket.shutdown would drop the SSL object under a reader

    def close(self) -> None:
        with self._lock:
            self._tls.close()

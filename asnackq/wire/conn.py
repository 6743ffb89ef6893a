"""The stdlib sender's connections and TLS: one kept-alive connection per thread, every
read bounded by the request's deadline.

Rules of this module:

* ``http.client`` parses the answer (status line, ``100 Continue``, headers, chunked or
  sized or close-delimited bodies); every byte it reads comes through ``UntilDeadline``,
  which waits only for the time left and reads through a ``makefile`` reference, so the
  socket stays readable after ``http.client`` hands a closing connection to its answer.
* A connection is used again only when its answer was read to its end and the server did
  not announce a close (HTTP/1.0 without keep-alive, ``Connection: close``, a body ending at
  close); it is dropped when idle for ``POOL_IDLE_S`` or when it has become readable while
  idle (the server closed it, or sent bytes no request asked for).
* Stale connection: a request on a reused connection that fails with a closed connection
  before a single byte of answer came back is sent once more, on a new connection, within
  the same deadline. The server may have received the first copy; the sink is idempotent
  by id, so a second copy of the same event changes nothing, and the answer to the second
  is the evidence.  Any other failure is raised as it is.
* A ``gzip`` or ``deflate`` answer is decoded to at most ``limit`` bytes (no bomb).
"""

from __future__ import annotations

import functools
import http.client
import io
import select
import socket
import ssl
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["POOL_IDLE_S", "STALE", "Pool", "dial", "time_left"]

# An idle pooled connection is closed after this, below the sink's idle timeout (10 s):
# the sender closes first, so a send rarely races the sink closing the same connection.
POOL_IDLE_S = 5.0
# Closed before an answer began: the marks of a stale kept-alive connection.
STALE = (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic``); ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's timeout_s has passed")
    return left


def dial(addresses: Sequence[str], port: int, deadline: float) -> socket.socket:
    """A TCP socket connected to the first of ``addresses`` (IP addresses, never looked
    up) that takes the connection before the deadline; the last failure if none does."""
    failure = OSError("no address to connect to")
    for address in addresses:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        try:
            sock.settimeout(time_left(deadline))
            sock.connect((address, port))
        except OSError as error:  # (a TimeoutError too)
            sock.close()
            failure = error
            continue
        return sock
    raise failure


class Exchange:
    """One request's deadline and how many bytes of its answer have come back."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.received = 0


class UntilDeadline(io.RawIOBase):
    """A socket's receiving side on which every read waits only for the time left."""

    def __init__(self, sock: socket.socket, exchange: Exchange) -> None:
        self.sock = sock
        self.raw = sock.makefile("rb", buffering=0)  # keeps the descriptor while open
        self.exchange = exchange

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(time_left(self.exchange.deadline))
        n = self.raw.readinto(buffer)
        self.exchange.received += n or 0
        return n or 0

    def close(self) -> None:
        self.raw.close()
        super().close()


class BoundedResponse(http.client.HTTPResponse):
    """``http.client``'s response, reading its status line, headers and body by a deadline.

    Interim answers (``102 Processing``, ``103 Early Hints``, any other 1xx but ``101``) are
    read past, as ``http.client`` reads past ``100 Continue``: the final answer is the one
    judged.  ``101 Switching Protocols`` is a final answer here (and no ACK).
    """

    def __init__(self, sock: socket.socket, *args: Any, exchange: Exchange, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the unbounded reader the base class made
        self.fp = io.BufferedReader(UntilDeadline(sock, exchange))

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 102 <= status <= 199:  # (100: skipped by http.client itself)
                return version, status, reason
            http.client.parse_headers(self.fp)  # the interim answer's headers, unused


class Connection(http.client.HTTPConnection):
    """One thread's connection: opened by the pool's ``opener`` within a deadline,
    reopened by ``http.client`` after the server closed it."""

    def __init__(self, host: str, port: int, opener: Any) -> None:
        super().__init__(host, port)
        self.opener = opener
        self.exchange = Exchange(0.0)
        self.idle_since = 0.0

    def connect(self) -> None:
        self.sock = self.opener(self.exchange.deadline)

    def usable(self) -> bool:
        """Whether the kept socket may carry a request (closes it if not)."""
        if self.sock is None:
            return False
        idle = time.monotonic() - self.idle_since > POOL_IDLE_S
        if idle or readable(self.sock):
            self.close()
            return False
        return True

    def post(self, path: str, body: bytes, headers: dict[str, str], limit: int) -> Answer:
        """Send; read at most ``limit`` bytes of the answer's body (decoded)."""
        self.response_class = functools.partial(BoundedResponse, exchange=self.exchange)  # type: ignore[assignment]
        if self.sock is not None:
            self.sock.settimeout(time_left(self.exchange.deadline))
        self.request("POST", path, body=body, headers=headers)
        response = self.getresponse()
        raw = response.read(limit)
        short = (response.length or 0) if len(raw) < limit else 0  # fewer bytes than announced
        encoding = (response.getheader("Content-Encoding") or "").strip().lower()
        answer = Answer(response.status, decoded(encoding, raw, limit), short)
        answer.retry_after = response.getheader("Retry-After")
        if not response.isclosed():  # not read to its end: never used again
            self.close()
        self.idle_since = time.monotonic()
        return answer


class Answer:
    """A status, the body read (at most the limit), and how many bytes it ended short."""

    def __init__(self, status: int, body: bytes, short: int) -> None:
        self.status, self.body, self.short = status, body, short
        self.retry_after: str | None = None  # the Retry-After header, as sent


def readable(sock: socket.socket) -> bool:
    """Whether an idle socket has something to read (a close, or bytes nobody asked for)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def decoded(encoding: str, raw: bytes, limit: int) -> bytes:
    """``raw`` decoded by its ``Content-Encoding`` to at most ``limit`` bytes; an
    encoding not understood, or a body already at the limit, is returned as it is."""
    if encoding not in WBITS or len(raw) >= limit:
        return raw
    decoder = zlib.decompressobj(WBITS[encoding])
    text = decoder.decompress(raw, limit)
    if not decoder.eof and len(text) < limit:
        raise zlib.error(f"the {encoding} answer ends before its end")
    return text


class Pool:
    """One ``Connection`` per thread to one server; ``close()`` ends them all (a pool that
    is collected without it closes them quietly)."""

    def __init__(self, host: str, port: int, opener: Any) -> None:
        self.host, self.port, self.opener = host, port, opener
        self.lock = threading.Lock()
        self.connections: dict[int, Connection] = {}
        weakref.finalize(self, close_all, self.connections, self.lock)

    def post(
        self, path: str, body: bytes, headers: dict[str, str], deadline: float, limit: int
    ) -> Answer:
        """One request within ``deadline``, sent once more if its kept connection was stale."""
        conn = self.mine()
        conn.exchange = Exchange(deadline)
        reused = conn.usable()
        try:
            return conn.post(path, body, headers, limit)
        except STALE:
            conn.close()
            if not reused or conn.exchange.received:
                raise
        except BaseException:
            conn.close()
            raise
        conn.exchange = Exchange(deadline)
        try:
            return conn.post(path, body, headers, limit)
        except BaseException:
            conn.close()
            raise

    def mine(self) -> Connection:
        """This thread's connection (made on first use)."""
        ident = threading.get_ident()
        conn = self.connections.get(ident)
        if conn is None:
            conn = Connection(self.host, self.port, self.opener)
            with self.lock:
                self.connections[ident] = conn
        return conn

    def close(self) -> None:
        close_all(self.connections, self.lock)


def close_all(connections: dict[int, Connection], lock: threading.Lock) -> None:
    with lock:
        for conn in connections.values():
            conn.close()
        connections.clear()

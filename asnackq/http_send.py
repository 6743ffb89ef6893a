"""Senders: POST one event to a sink and turn the answer into evidence, or an exception.

Rules (shared by the sync and the async sender; the decision lives in ``judge`` once):

* Only ``200`` with a JSON ACK whose ``id`` is the sent id and whose status is
  ``applied`` or ``duplicate`` is evidence of completion: the sender returns ``True``.
* ``400 409 413 415 422`` raise ``Permanent``; ``408 425 429 5xx`` raise ``Retryable``;
  ``502 503 504``, connection errors, resets and timeouts raise its subclass
  ``Unavailable`` (the sink is not there: nothing about the job); a redirect, a wrong id,
  a malformed or oversized ACK, or any other status raise ``BadAck`` - none of them proves anything.
* Loopback only unless ``allow_remote``; never follow a redirect; ignore proxy
  variables; read at most ``MAX_ACK_BYTES`` of an answer.
* ``timeout_s`` bounds the whole request - connect, send, headers and body - not each
  read; a body shorter than its ``Content-Length`` proves nothing (``Retryable``).
"""

from __future__ import annotations

import functools
import http.client
import io
import ipaddress
import socket
import ssl
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from asnackq import strict_json
from asnackq.core.worker import (
    BadAck,
    Permanent,
    Retryable,
    Unavailable,
    check_event,
    check_int,
)

# aiohttp is imported by AsyncHttpSender alone: a command that only checks a URL or uses
# HttpSender starts 0.15 s sooner.
if TYPE_CHECKING:
    import aiohttp

__all__ = ["MAX_ACK_BYTES", "TOKEN_HEADER", "AsyncHttpSender", "HttpSender", "judge"]

TOKEN_HEADER = "X-Asnackq-Token"
MAX_ACK_BYTES = 4096
PERMANENT_STATUSES = frozenset({400, 409, 413, 415, 422})
RETRYABLE_STATUSES = frozenset({408, 425, 429})
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
ACK_STATUSES = ("applied", "duplicate")
# An idle pooled connection is closed after this, below the sink's idle timeout (10 s):
# the sender closes first, so a send never races the sink closing the same connection.
POOL_IDLE_S = 5.0


def judge(status: int, body: bytes, event_id: str) -> bool:
    """Return True for a verified ACK of ``event_id``; raise the exception the answer means."""
    if status in PERMANENT_STATUSES:
        raise Permanent(f"sink rejected {event_id!r} with {status}")
    if status in UNAVAILABLE_STATUSES:
        raise Unavailable(f"sink answered {status} for {event_id!r}")
    if status in RETRYABLE_STATUSES or 500 <= status <= 599:
        raise Retryable(f"sink answered {status} for {event_id!r}")
    if status != 200:
        raise BadAck(f"sink answered {status} for {event_id!r}: not an ACK")
    if len(body) > MAX_ACK_BYTES:
        raise BadAck(f"ACK for {event_id!r} is over {MAX_ACK_BYTES} bytes")
    try:
        ack = strict_json.loads(body)
    except ValueError as error:
        raise BadAck(f"ACK for {event_id!r} is not JSON: {error}") from None
    if type(ack) is not dict or ack.get("id") != event_id or ack.get("status") not in ACK_STATUSES:
        raise BadAck(f"ACK {ack!r} does not confirm {event_id!r}")
    return True


def check_url(url: object, allow_remote: bool) -> urllib.parse.SplitResult:
    """Parse a sink URL; refuse anything but http(s), and non-loopback hosts unless allowed."""
    if type(url) is not str:
        raise ValueError(f"url must be a str: {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http(s)://HOST[:PORT]/PATH: {url!r}")
    try:
        port = parts.port
    except ValueError:  # not a number, or over 65535
        port = 0
    if port == 0:
        raise ValueError(f"url port must be a number in 1..65535: {url!r}")
    if not allow_remote and not is_loopback(parts.hostname):
        raise ValueError(f"refusing non-loopback sink {parts.hostname!r} (pass allow_remote=True)")
    return parts


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_number(
    value: object, name: str, low: float, high: float, *, open_low: bool = False
) -> float:
    """Return ``value`` as a float if it is an exact int or float in ``[low, high]``
    (``(low, high]`` with ``open_low``); never a bool, NaN or infinity."""
    refusal = f"{name} must be a number in {'(' if open_low else '['}{low}, {high}]: {value!r}"
    if type(value) not in (int, float) or not isinstance(value, (int, float)):
        raise ValueError(refusal)  # (a bool is an int, but not exactly one)
    if not (low < value <= high if open_low else low <= value <= high):
        raise ValueError(refusal)
    return float(value)


def check_timeout(timeout_s: object) -> float:
    return check_number(timeout_s, "timeout_s", 0, 600, open_low=True)


def request_parts(event: object, token: object) -> tuple[str, bytes, dict[str, str]]:
    """Validate an event (and optional token) and return ``(id, body, headers)``."""
    event_id, qty = check_event(event)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[TOKEN_HEADER] = str(check_int(token, "token", 1, 10**15))
    # json.dumps's very bytes: a checked id is [A-Za-z0-9_-], nothing in it to escape.
    return event_id, b'{"id": "%s", "qty": %d}' % (event_id.encode(), qty), headers


async def read_bounded(stream: aiohttp.StreamReader) -> bytes:
    """Read at most ``MAX_ACK_BYTES + 1`` bytes: enough to tell an oversized ACK."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_ACK_BYTES:
        chunk = await stream.read(MAX_ACK_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if stream.at_eof():  # (usually the whole ACK came in one read)
            break
    return b"".join(chunks)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic``); ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's timeout_s has passed")
    return left


class UntilDeadline(io.RawIOBase):
    """A socket's receiving side on which every read waits only for the time left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(time_left(self.deadline))
        return self.sock.recv_into(buffer)


class BoundedResponse(http.client.HTTPResponse):
    """``http.client``'s response, reading its status line, headers and body by a deadline."""

    def __init__(self, sock: socket.socket, *args: Any, deadline: float, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the unbounded reader the base class made
        self.fp = io.BufferedReader(UntilDeadline(sock, deadline))


class HttpSender:
    """Synchronous sender (standard library): ``sender(event, token=None)`` -> True or raises."""

    def __init__(self, url: str, *, timeout_s: float = 2.0, allow_remote: bool = False) -> None:
        self.parts = check_url(url, allow_remote)
        self.timeout_s = check_timeout(timeout_s)
        self.path = self.parts.path or "/"
        if self.parts.query:
            self.path += "?" + self.parts.query

    def __call__(self, event: dict[str, Any], token: int | None = None) -> bool:
        event_id, body, headers = request_parts(event, token)
        deadline = time.monotonic() + self.timeout_s
        # http.client never consults proxy variables and never follows redirects.
        conn = http.client.HTTPConnection(self.parts.hostname or "", self.port)
        conn.response_class = functools.partial(BoundedResponse, deadline=deadline)  # type: ignore[assignment]
        try:
            conn.sock = self.connect(deadline)
            conn.request("POST", self.path, body=body, headers=headers)
            response = conn.getresponse()
            answer = response.read(MAX_ACK_BYTES + 1)
        except (OSError, http.client.HTTPException) as error:  # resets, timeouts, refusals
            raise Unavailable(f"sending {event_id!r}: {error!r}") from error
        finally:
            conn.close()
        if response.length and len(answer) <= MAX_ACK_BYTES:  # fewer bytes than announced
            raise Unavailable(f"the answer for {event_id!r} ended {response.length} bytes short")
        return judge(response.status, answer, event_id)

    @property
    def port(self) -> int:
        return self.parts.port or (443 if self.parts.scheme == "https" else 80)

    def connect(self, deadline: float) -> socket.socket:
        """A connected (for https, handshaken) socket within the deadline (a host name's
        resolution aside), its timeout set to the time left for the send."""
        sock = socket.create_connection((self.parts.hostname or "", self.port), time_left(deadline))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.parts.scheme == "https":
                sock.settimeout(time_left(deadline))
                sock = ssl.create_default_context().wrap_socket(
                    sock, server_hostname=self.parts.hostname
                )
            sock.settimeout(time_left(deadline))
        except BaseException:
            sock.close()
            raise
        return sock


class AsyncHttpSender:
    """Asynchronous sender (aiohttp, one pooled session): ``await sender(event, token=None)``.

    Use as ``async with AsyncHttpSender(url) as send: ...``.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, allow_remote: bool = False, limit: int = 256
    ) -> None:
        check_url(url, allow_remote)
        self.url = url
        self.timeout_s = check_timeout(timeout_s)
        self.limit = limit
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncHttpSender:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.limit, keepalive_timeout=POOL_IDLE_S)
        self._session = aiohttp.ClientSession(
            connector=connector,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, event: dict[str, Any], token: int | None = None) -> bool:
        import aiohttp

        if self._session is None:
            raise RuntimeError("AsyncHttpSender is used outside 'async with'")
        event_id, body, headers = request_parts(event, token)
        try:
            async with self._session.post(
                self.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                answer = await read_bounded(response.content)
                status = response.status
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise Unavailable(f"sending {event_id!r}: {error!r}") from error
        return judge(status, answer, event_id)

"""Senders: POST one event to a receiver and turn the answer into evidence, or an exception.

Rules (shared by the sync and the async sender; the decision lives in ``judge`` once):

* What proves a delivery is the sender's ``success`` rule: ``"ack"`` (the default, the
  sink's): only ``200`` with a JSON ACK whose ``id`` is the sent id and whose status is
  ``applied`` or ``duplicate``; ``"2xx"`` (an ordinary webhook receiver): any ``2xx``
  answer within ``timeout_s``, whatever its body. Either way the sender returns ``True``.
* ``400 409 413 415 422`` raise ``Permanent``; ``408 425 5xx`` raise ``Retryable``;
  ``502 503 504``, connection errors and resets raise its subclass ``Unavailable`` (the
  sink is not there: nothing about the job), and no whole answer within ``timeout_s`` on a
  connection made raises ``Unavailable``'s subclass ``TimedOut`` (the sink is there, but
  slower than the sender waits: nothing about the job either); ``410`` raises its subclass
  ``Gone`` (the receiver asks for nothing more: the run pauses, and spends no attempt);
  ``429``, and ``502 503 504`` with a ``Retry-After`` that can be read, raise its subclass
  ``Overloaded`` (the sink is there but over its capacity: nothing about the job either),
  carrying the wait asked for (``retry_after``: delta-seconds or an HTTP-date, at most
  ``RETRY_AFTER_MAX_S``; garbage is no wait asked); a redirect (``3xx``, never followed),
  a wrong id, a malformed or oversized ACK, or any other status raise ``BadAck`` - none of
  them proves anything.
* Signed when the sender holds secrets (``secrets``: ``whsec_`` strings or a
  ``webhooks.Keyring``): every request carries Standard Webhooks headers, the event's id
  as ``webhook-id`` (the same on every attempt) and one ``v1`` signature per active secret,
  signed when the request is made (``asnackq.wire.webhooks``). The fencing token travels
  in its own header (``TOKEN_HEADER``) either way.
* Loopback only unless ``allow_remote``; never follow a redirect; ignore proxy
  variables; read at most ``MAX_ACK_BYTES`` of an answer.
* With ``allow_remote``, every new connection goes to an address ``asnackq.wire.guard``
  permits: the sender resolves the host itself, before each connection, and connects to
  the addresses it checked (none permitted: ``Refused``, a ``Permanent``: nothing is sent).
  A kept-alive connection is used again unchecked: its peer was checked when it was made
  and cannot change. ``allow_networks`` permits networks that are not globally routable.
* ``timeout_s`` (default ``DEFAULT_TIMEOUT_S``, 15 s: what webhook receivers are given)
  bounds the whole request - connect, send, headers and body - not each read; a connection
  not made within it is ``Unavailable``; a body shorter than its ``Content-Length`` proves
  nothing (``Unavailable``).
* https: an untrusted certificate (unknown CA, another host's name, expired) or a failed
  handshake raises ``Untrusted``, a ``BadAck``: never evidence. Its ``why`` names what to fix
  (``asnackq.wire.tls.tls_cause``: the CA, the certificate's dates or names, the protocol,
  this worker's client certificate). A connection the sink ends during the TLS handshake (as
  a server that refuses a client certificate without an alert does) is ``Untrusted`` too.
"""

from __future__ import annotations

import contextvars
import datetime
import email.utils
import http.client
import socket
import ssl
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from asnackq.core import tracing
from asnackq.core.endpoints import FIELDS, Headers
from asnackq.core.receivers import SUCCESS_RULES, check_url
from asnackq.core.worker import (
    BadAck,
    Overloaded,
    Permanent,
    Retryable,
    Unavailable,
    check_event,
    check_identifier,
    check_int,
)
from asnackq.wire import http_spans, strict_json, webhooks
from asnackq.wire.conn import POOL_IDLE_S, STALE, Pool, dial, time_left
from asnackq.wire.guard import Lookup, aiohttp_host, aiohttp_resolver, sender_guard
from asnackq.wire.tls import tls_cause, tls_context
from asnackq.wire.webhooks import Keyring

# aiohttp is imported by AsyncHttpSender alone: a command that only checks a URL or uses
# HttpSender starts 0.15 s sooner.
if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LAST_ANSWER",
    "MAX_ACK_BYTES",
    "RETRY_AFTER_MAX_S",
    "TOKEN_HEADER",
    "Answer",
    "AsyncHttpSender",
    "AsyncSend",
    "HttpSender",
    "TimedOut",
    "Untrusted",
    "check_number",
    "judge",
    "retry_after",
]

# What a Dispatcher sends with: ``await send(event, token)``, an ACK (True) or an exception
# (``AsyncHttpSender`` is one; an application may give its own).
AsyncSend = Callable[..., Awaitable[object]]

TOKEN_HEADER = "X-Asnackq-Token"
DEFAULT_TIMEOUT_S = 15.0  # an answer's wait: Standard Webhooks advises 15-30 s
MAX_ACK_BYTES = 4096
PERMANENT_STATUSES = frozenset({400, 409, 413, 415, 422})
RETRYABLE_STATUSES = frozenset({408, 425})
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
OVERLOAD_STATUSES = frozenset({429, 502, 503, 504})  # with a Retry-After: an overload
ACK_STATUSES = ("applied", "duplicate")
RETRY_AFTER_MAX_S = 60.0  # the longest wait a Retry-After header is taken at its word for


def retry_after(value: str | None, now_s: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait (delta-seconds, or an HTTP-date
    measured from ``now_s``, the wall clock's time), in ``[0, RETRY_AFTER_MAX_S]``; None for
    no header, or one that cannot be read."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return min(float(text), RETRY_AFTER_MAX_S)
    try:
        date = email.utils.parsedate_to_datetime(text)
        when = (date if date.tzinfo else date.replace(tzinfo=datetime.UTC)).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    now = time.time() if now_s is None else now_s
    return min(max(when - now, 0.0), RETRY_AFTER_MAX_S)


Answered = tuple[int, bytes, str | None]  # a status, the body, the Retry-After header


class Answer(NamedTuple):
    """What the last request of a send got: its status (None: no answer), how long it took,
    and the start of its body (at most ``MAX_ACK_BYTES + 1`` bytes)."""

    status: int | None
    latency_ms: int
    body: bytes


# The last request's answer, set by either sender in the caller's context (a delivery
# coroutine reads it after each send to keep it: ``asnackq.store.attempts``).
LAST_ANSWER: contextvars.ContextVar[Answer | None] = contextvars.ContextVar(
    "asnackq_last_answer", default=None
)


def judge(
    status: int, body: bytes, event_id: str, wait: str | None = None, success: str = "ack"
) -> bool:
    """Return True for evidence of ``event_id``'s delivery under the ``success`` rule (the
    sink's verified ACK, or any 2xx); raise the exception the answer means (``wait``: the
    answer's ``Retry-After`` header, if any)."""
    if success == "2xx" and 200 <= status <= 299:
        return True
    if status == 410:
        raise Gone(f"sink answered 410 for {event_id!r}: the receiver is gone")
    if status in PERMANENT_STATUSES:
        raise Permanent(f"sink rejected {event_id!r} with {status}")
    wait_s = retry_after(wait) if status in OVERLOAD_STATUSES else None
    if status == 429 or wait_s is not None:
        raise Overloaded(f"sink answered {status} for {event_id!r}: over its capacity", wait_s)
    if status in UNAVAILABLE_STATUSES:
        raise Unavailable(f"sink answered {status} for {event_id!r}")
    if status in RETRYABLE_STATUSES or 500 <= status <= 599:
        raise Retryable(f"sink answered {status} for {event_id!r}")
    if 300 <= status <= 399:
        raise BadAck(f"sink answered {status} for {event_id!r}: a redirect, never followed")
    if status != 200 or success != "ack":
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


class Gone(Unavailable):
    """Raised for ``410 Gone``: the receiver asks to be sent nothing more. Like
    ``Unavailable`` it spends no attempt: the run pauses its sends (the breaker) and its
    probes find the receiver when it is back."""


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


def request_parts(
    event: object, token: object, keys: Sequence[bytes] = (), extra: Headers = ()
) -> tuple[str, bytes, dict[str, str]]:
    """Validate an event (and optional token) and return ``(id, body, headers)``: an
    endpoint's ``extra`` headers first (checked when the sender was made), then the
    sender's own, signed with ``keys`` (Standard Webhooks: the event's id is the
    ``webhook-id``) if any."""
    event_id, qty = check_event(event)
    # json.dumps's very bytes: a checked id is [A-Za-z0-9_-], nothing in it to escape.
    body = b'{"id": "%s", "qty": %d}' % (event_id.encode(), qty)
    return event_id, body, body_headers(event_id, body, token, keys, extra)


def body_headers(
    event_id: str, body: bytes, token: object, keys: Sequence[bytes] = (), extra: Headers = ()
) -> dict[str, str]:
    """The headers of a request sending ``body`` as the event ``event_id`` (its
    ``webhook-id``, signed with ``keys`` if any), ``token`` in its own header."""
    headers = dict(extra)
    headers["Content-Type"] = "application/json"
    if token is not None:
        headers[TOKEN_HEADER] = str(check_int(token, "token", 1, 10**15))
    if keys:
        headers.update(webhooks.signed_headers(keys, event_id, body))
    return headers


def check_headers(headers: object) -> Headers:
    """An endpoint's extra request headers (``asnackq.core.endpoints``' rule: RFC 9110
    tokens, visible ASCII values, no CR or LF, none the sender sets itself)."""
    checked: Headers = FIELDS["headers"](headers)
    return checked


def check_rules(success: object, secrets: object) -> Keyring | None:
    """Check a sender's success rule and secrets (a ``Keyring``, or ``whsec_`` strings)."""
    if success not in SUCCESS_RULES:
        raise ValueError(f"success must be 'ack' or '2xx': {success!r}")
    if secrets is None or isinstance(secrets, Keyring):
        return secrets
    if isinstance(secrets, (str, bytes)) or not isinstance(secrets, Sequence):
        raise ValueError("secrets must be a Keyring or a list of whsec_ secrets")
    return Keyring.of(*secrets) if secrets else None


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


class Untrusted(BadAck):
    """Raised when an https sink cannot be trusted: its certificate is not from a trusted
    CA, names another host or has expired, or the TLS handshake failed (a client
    certificate it wanted and did not get). Nothing was sent, or nothing proves anything.
    ``why``: the cause, in one line."""

    def __init__(self, text: str, why: str = "") -> None:
        super().__init__(text)
        self.why = why or text


class HandshakeCut(OSError):
    """The sink ended the connection during the TLS handshake."""


HANDSHAKE_CUT = (
    "the sink ended the TLS handshake: it may refuse this worker's client certificate (or want one)"
)


class TimedOut(Unavailable):
    """Raised when a connection was made but no whole answer came within the sender's
    ``timeout_s``: the sink is there and slower than the sender waits (*timing out*), as
    opposed to not there (*away*: refused, reset, no connection). Like ``Unavailable``, it
    proves nothing about the job; the request may still have been applied."""


class ConnectTimeout(OSError):
    """No connection (for https: no handshake) within the send's time: the sink is away."""


def failure(event_id: str, error: BaseException, timeout_s: float) -> Unavailable | Untrusted:
    """What a send that got no answer raises: ``Untrusted`` if TLS refused (a certificate,
    a handshake alert: ``ssl.SSLError`` in the error or its causes, but a plain EOF);
    ``TimedOut`` if the time ran out on a connection made; else ``Unavailable``."""
    text = f"sending {event_id!r}: {shown(error)}"
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, HandshakeCut):
            return Untrusted(f"sending {event_id!r}: {HANDSHAKE_CUT}", HANDSHAKE_CUT)
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, STALE):
            why = tls_cause(cause)
            return Untrusted(f"sending {event_id!r}: {why}", why)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, TimeoutError) and not connecting(error):
        return TimedOut(f"sending {event_id!r}: no answer within {timeout_s:g} s")
    return Unavailable(text)


def shown(error: BaseException) -> str:
    """An error as a failure's text: its repr, but for aiohttp's errors about an answer,
    whose repr holds the whole request (every header: an ``Authorization`` made of the URL's
    userinfo, the signature): their type and ``str`` (status, message and URL) only."""
    if hasattr(error, "request_info"):
        return f"{type(error).__name__}({str(error)!r})"
    return repr(error)


def answered(began: float, status: int | None, body: bytes) -> None:
    """Tell the caller's context what the request got (``LAST_ANSWER``)."""
    LAST_ANSWER.set(Answer(status, round((time.monotonic() - began) * 1000), body))


def connecting(error: BaseException) -> bool:
    """Whether a timeout struck before a connection was made."""
    return type(error).__name__ == "ConnectionTimeoutError" or isinstance(error, ConnectTimeout)


class HttpSender:
    """Synchronous sender (standard library): ``sender(event, token=None)`` -> True or raises.

    One connection per thread, kept alive while the server keeps it (``asnackq.wire.conn``);
    ``close()`` (or ``with``) ends them. For https: the system's trust store, or ``ca_file``,
    and a client certificate from ``cert_file`` and ``key_file``. With ``allow_remote``: the
    guard's rule, ``allow_networks`` permitted, hosts resolved by ``lookup`` (the system's
    resolver unless given).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        allow_remote: bool = False,
        allow_networks: Iterable[object] = (),
        lookup: Lookup | None = None,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        success: str = "ack",
        secrets: Keyring | Sequence[str] | None = None,
        headers: Headers | Mapping[str, str] = (),
    ) -> None:
        self.parts = check_url(url, allow_remote)
        self.guard = sender_guard(self.parts.hostname or "", allow_remote, allow_networks, lookup)
        self.url = url
        self.timeout_s = check_timeout(timeout_s)
        self.tls = tls_context(self.parts.scheme, ca_file, cert_file, key_file)
        self.keyring = check_rules(success, secrets)
        self.extra = check_headers(headers)  # an endpoint's own headers
        self.success = success
        self.tracer = tracing.tracer()  # None: no spans, no traceparent header
        self.path = self.parts.path or "/"
        if self.parts.query:
            self.path += "?" + self.parts.query
        # http.client never consults proxy variables and never follows redirects.
        self.pool = Pool(self.parts.hostname or "", self.port, self.connect)

    def __call__(self, event: dict[str, Any], token: int | None = None) -> bool:
        keys = () if self.keyring is None else self.keyring.keys()
        event_id, body, headers = request_parts(event, token, keys, self.extra)
        if self.tracer is None:
            status, answer, wait = self._post(event_id, body, headers)
            return judge(status, answer, event_id, wait, self.success)
        with http_spans.client(self.tracer, self.url, headers) as span:
            status, answer, wait = self._post(event_id, body, headers)
            http_spans.answered(span, status)
            return judge(status, answer, event_id, wait, self.success)

    def _post(self, event_id: str, body: bytes, headers: dict[str, str]) -> Answered:
        began = time.monotonic()
        deadline = began + self.timeout_s
        try:
            answer = self.pool.post(self.path, body, headers, deadline, MAX_ACK_BYTES + 1)
        except (OSError, http.client.HTTPException, zlib.error) as error:  # resets, timeouts
            answered(began, None, b"")
            raise failure(event_id, error, self.timeout_s) from error
        answered(began, answer.status, answer.body)
        if answer.short:
            raise Unavailable(f"the answer for {event_id!r} ended {answer.short} bytes short")
        return answer.status, answer.body, answer.retry_after

    def close(self) -> None:
        """Close every kept connection."""
        self.pool.close()

    def __enter__(self) -> HttpSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self.parts.port or (443 if self.parts.scheme == "https" else 80)

    def connect(self, deadline: float) -> socket.socket:
        """A connected (for https, handshaken) socket within the deadline (a host name's
        resolution aside), its timeout set to the time left for the send; with the guard, to
        an address it permits, looked up now."""
        address = (self.parts.hostname or "", self.port)
        try:
            if self.guard is None:
                sock = socket.create_connection(address, time_left(deadline))
            else:  # (the addresses checked, never the name resolved again)
                sock = dial(self.guard.addresses(*address), self.port, deadline)
        except TimeoutError as error:
            raise ConnectTimeout(f"no connection to {address} in time") from error
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock.settimeout(time_left(deadline))
                try:
                    sock = self.tls.wrap_socket(sock, server_hostname=self.parts.hostname)
                except (ConnectionResetError, ssl.SSLEOFError) as error:
                    raise HandshakeCut("the sink ended the TLS handshake") from error
            sock.settimeout(time_left(deadline))
        except TimeoutError as error:
            sock.close()
            raise ConnectTimeout(f"no TLS handshake with {address} in time") from error
        except BaseException:
            sock.close()
            raise
        return sock


class AsyncHttpSender:
    """Asynchronous sender (aiohttp, one pooled session): ``await sender(event, token=None)``.

    Use as ``async with AsyncHttpSender(url) as send: ...``. With ``allow_remote``: the
    guard's rule, as for ``HttpSender``; aiohttp's own DNS cache is off, so each new
    connection is preceded by a lookup of its own.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        allow_remote: bool = False,
        allow_networks: Iterable[object] = (),
        lookup: Lookup | None = None,
        limit: int = 256,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        success: str = "ack",
        secrets: Keyring | Sequence[str] | None = None,
        headers: Headers | Mapping[str, str] = (),
    ) -> None:
        parts = check_url(url, allow_remote)
        try:  # (a URL the standard library reads and aiohttp refuses: never sendable)
            host = aiohttp_host(url)
        except ValueError:
            raise ValueError(f"url must be http(s)://HOST[:PORT]/PATH: {url!r}") from None
        self.guard = sender_guard(parts.hostname or "", allow_remote, allow_networks, lookup)
        self.host = "" if self.guard is None else host  # (checked each send)
        self.url = url
        self.timeout_s = check_timeout(timeout_s)
        self.limit = limit
        self.tls = tls_context(parts.scheme, ca_file, cert_file, key_file)
        self.keyring = check_rules(success, secrets)
        self.extra = check_headers(headers)  # an endpoint's own headers
        self.success = success
        self.tracer = tracing.tracer()  # None: no spans, no traceparent header
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncHttpSender:
        import aiohttp

        connector = aiohttp.TCPConnector(
            limit=self.limit,
            keepalive_timeout=POOL_IDLE_S,
            ssl=self.tls or True,
            **self.resolving(),
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )
        return self

    def resolving(self) -> dict[str, Any]:
        """The connector's resolver: the guard's, uncached, when there is a guard."""
        if self.guard is None:
            return {}
        return {"resolver": aiohttp_resolver(self.guard), "use_dns_cache": False}

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, event: dict[str, Any], token: int | None = None) -> bool:
        if self._session is None:
            raise RuntimeError("AsyncHttpSender is used outside 'async with'")
        keys = () if self.keyring is None else self.keyring.keys()
        event_id, body, headers = request_parts(event, token, keys, self.extra)
        return await self._send(event_id, body, headers)

    async def post(self, event_id: str, body: bytes, token: int | None = None) -> bool:
        """Send ``body`` (an event's stored body, ``asnackq.core.events``) as the event
        ``event_id``: its ``webhook-id``, judged as ``__call__`` judges an answer."""
        if self._session is None:
            raise RuntimeError("AsyncHttpSender is used outside 'async with'")
        keys = () if self.keyring is None else self.keyring.keys()
        event_id = check_identifier(event_id, "event id")
        return await self._send(
            event_id, body, body_headers(event_id, body, token, keys, self.extra)
        )

    async def _send(self, event_id: str, body: bytes, headers: dict[str, str]) -> bool:
        assert self._session is not None
        if self.tracer is None:
            status, answer, wait = await self._post(self._session, event_id, body, headers)
            return judge(status, answer, event_id, wait, self.success)
        with http_spans.client(self.tracer, self.url, headers) as span:
            status, answer, wait = await self._post(self._session, event_id, body, headers)
            http_spans.answered(span, status)
            return judge(status, answer, event_id, wait, self.success)

    async def _post(
        self, session: aiohttp.ClientSession, event_id: str, body: bytes, headers: dict[str, str]
    ) -> Answered:
        import aiohttp

        if self.guard is not None:  # (aiohttp resolves no host written as an IP address)
            self.guard.check(self.host)
        began = time.monotonic()
        try:
            async with session.post(
                self.url, data=body, headers=headers, allow_redirects=False
            ) as response:
                answer = await read_bounded(response.content)
                answered(began, response.status, answer)
                return response.status, answer, response.headers.get("Retry-After")
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            answered(began, None, b"")
            if (
                isinstance(error, aiohttp.ClientConnectorError)
                and error.ssl is not False
                and self.tls is not None
                and isinstance(error.os_error, (ConnectionResetError, ssl.SSLEOFError))
            ):  # (an https connection cut before it was made: during the handshake)
                raise failure(event_id, HandshakeCut(str(error)), self.timeout_s) from error
            raise failure(event_id, error, self.timeout_s) from error

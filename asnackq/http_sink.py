"""The HTTP sink: an aiohttp application that applies each event's effect once, however often
it arrives, and its serving (``serve``; ``python -m asnackq.http_sink`` is ``asnackq sink``).

Rules of this module:

* ``POST /events`` carries ``{"id", "qty"}`` (the core's value rules).  The sink is one
  receiver of the library's inbox (``asnackq.sink.stock``): the inbox row and its effect
  (stock += qty) are written in one transaction; the ACK leaves only after COMMIT.  The
  same id and qty again is a ``duplicate`` (no effect); another qty is a ``conflict``
  (nothing changes).
* With ``secrets``, an event's Standard Webhooks signature is verified before its body is
  parsed (401 without one that holds), and its ``webhook-id`` must be its event's id (400):
  the id the signature vouches for is the id the inbox keeps, as a ``WebhookReceiver``'s.
* Group commit (``asnackq.sink.inbox``, every receiver's): the ACK leaves only after the
  COMMIT of the batch that decided it; a failed batch answers 503 to each of its requests
  and changes nothing.
* Bad input is a 4xx with a JSON reason, never a 500, and one log line, never a
  traceback; fault injection (fail, drop, delay) is off by default and seeded.
* A capacity (``max_inflight``, ``max_rate``: ``asnackq.sink.capacity``) is off by default;
  an event past it is answered ``429`` with ``Retry-After`` before its body is read, and
  changes nothing.
* A body must arrive within ``body_timeout_s``.
* The port is bound before the DB is opened: an address that cannot be had creates no file.
* At most ``max_connections`` live connections (lowered to fit the descriptor limit, so
  ``accept()`` never runs out): past it a newcomer first closes the oldest idle ones -
  no request in a handler, or one still waiting for its body (``BUSY`` says which);
  only when every one is busy does it get a 503.
* A connection with no request in a handler is closed after ``idle_timeout_s``
  (aiohttp's keep-alive timer, which also runs while headers arrive); an unread body is
  drained for ``LINGER_S`` at most.  Headers are small (``MAX_LINE``, ``MAX_HEADERS``):
  a connection's buffered headers cost little memory even at the connection limit.
* Every log record is one line on stderr, never a traceback.
* An ``Expect`` other than ``100-continue`` is refused before the application runs.
* Embedding: ``make_app(SinkConfig(db=...))`` is an ``aiohttp.web.Application`` to run or
  to add as a sub-application; ``serve`` listens the way ``asnackq sink`` does.
* A receiving application needs this module alone: ``WebhookReceiver``, its effect's
  ``Rejected``, ``read_secrets`` (a secrets file) and ``turn`` (the connection's lock, for
  the application's own transactions on a connection it shares with the receiver).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import random
import re
import resource
import ssl
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from asnackq.core import tracing
from asnackq.core.inbox import RECORD_FIELDS, SQL_RECORD, SQL_STOCK
from asnackq.core.worker import (
    check_event,
    check_identifier,
    check_int,
)
from asnackq.sink import faults, spans
from asnackq.sink.capacity import Capacity
from asnackq.sink.checks import Signatures, Unverified, check_token_header, read_secrets
from asnackq.sink.inbox import LOG, SinkUnavailable
from asnackq.sink.receiver import (
    Rejected,
    WebhookReceiver,
    as_json,
    expect_continue,
    read_within,
)
from asnackq.sink.stock import StockInbox, open_sink_db
from asnackq.store.outage import StoreUnavailable, database_error
from asnackq.store.targets import one_line
from asnackq.store.turns import turn
from asnackq.wire import strict_json
from asnackq.wire.metrics import screen_expect
from asnackq.wire.send import MAX_ACK_BYTES, TOKEN_HEADER, check_number

__all__ = [
    "BUSY",
    "SERVER_OPTIONS",
    "STATS",
    "Rejected",
    "SinkConfig",
    "WebhookReceiver",
    "as_json",
    "expect_continue",
    "make_app",
    "read_secrets",
    "serve",
    "turn",
]

COUNTERS = (
    "requests",
    "applied",
    "duplicates",
    "conflicts",
    "rejected",
    "failed",
    "dropped",
    "evicted",
    "refused",
    "overloaded",
)
TOKEN_RULE = re.compile(r"[!-~]{1,256}")  # visible ASCII: what fits a Bearer header
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class SinkConfig:
    """How a sink runs: its DB, its batching, and the faults it injects (all off by default)."""

    db: Path | str  # a file, or a postgresql:// URL
    auth_token: str | None = None
    fail_rate: float = 0.0
    drop_rate: float = 0.0
    delay_ms: int = 0
    seed: int | None = None
    batch_max: int = 512
    idle_timeout_s: float = 10.0
    body_timeout_s: float = 5.0
    max_connections: int = 1024
    max_inflight: int | None = None
    max_rate: float | None = None
    secrets: tuple[str, ...] = field(default=(), repr=False)  # whsec_: verify signatures
    rng: random.Random = field(init=False)
    signatures: Signatures | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        faults.check(self.fail_rate, self.drop_rate, self.delay_ms)
        check_int(self.batch_max, "batch_max", 1, 10_000)
        check_number(self.idle_timeout_s, "idle_timeout_s", 0, 3600, open_low=True)
        check_number(self.body_timeout_s, "body_timeout_s", 0, 600, open_low=True)
        check_int(self.max_connections, "max_connections", 1, 65_536)
        Capacity(self.max_inflight, self.max_rate)  # (checks both)
        if self.auth_token is not None and (
            type(self.auth_token) is not str or not TOKEN_RULE.fullmatch(self.auth_token)
        ):
            raise ValueError("auth_token must be 1-256 visible ASCII characters")
        self.rng = random.Random(self.seed)
        self.signatures = Signatures.of(self.secrets) if self.secrets else None


CONFIG = web.AppKey("config", SinkConfig)
INBOX = web.AppKey("inbox", StockInbox)
STATS = web.AppKey("stats", dict[str, int])
CAPACITY = web.AppKey("capacity", Capacity)
# The connections with a request in a handler (and not waiting for its body).
BUSY = web.AppKey("busy", set[web.RequestHandler])


def answer(status: int, event_id: str, outcome: str) -> web.Response:
    """``{"id": ..., "status": ...}``: json.dumps's very bytes (a checked id and the outcomes
    are [A-Za-z0-9_-]: nothing to escape)."""
    body = b'{"id": "%s", "status": "%s"}' % (event_id.encode(), outcome.encode())
    return web.Response(body=body, status=status, content_type="application/json")


def require_token(request: web.Request) -> None:
    """Refuse (401) a request without the configured bearer token, on every route."""
    expected = request.app[CONFIG].auth_token
    given = request.headers.get("Authorization", "")
    # A valid token is visible ASCII (TOKEN_RULE): a header with any other byte never matches.
    if expected is not None and not (
        given.isascii() and hmac.compare_digest(given, f"Bearer {expected}")
    ):
        raise web.HTTPUnauthorized(
            text="'Authorization: Bearer TOKEN' is required", headers={"WWW-Authenticate": "Bearer"}
        )


# The sink decodes a body's Content-Encoding itself, strictly (a gzip stream must end with
# its checksum and length; aiohttp's decoder accepts one cut short): serve ``make_app``
# with these runner options, so that aiohttp hands over the bytes as they came.
SERVER_OPTIONS: dict[str, Any] = {"auto_decompress": False}
CODINGS = {"": None, "identity": None, "gzip": 31, "x-gzip": 31, "deflate": 15}  # zlib wbits


def content_coding(request: web.Request) -> int | None:
    """The zlib ``wbits`` of the body's coding (None: as is); 415 for any other coding."""
    given = request.headers.getall("Content-Encoding", [])
    coding = given[0].strip().lower() if len(given) == 1 else ",".join(given)
    if coding not in CODINGS:
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {coding[:40]!r} is not understood: use gzip, deflate "
            "or identity"
        )
    return CODINGS[coding]


def decoded(body: bytes, wbits: int | None) -> bytes:
    """``body`` decoded, whole and nothing after it; 400 or 413 (measured decoded)."""
    if wbits is None:
        return body
    decoder = zlib.decompressobj(wbits)
    try:
        data = decoder.decompress(body, MAX_ACK_BYTES + 1)
    except zlib.error as error:
        raise web.HTTPBadRequest(text=f"the body cannot be read: {error}") from None
    if len(data) > MAX_ACK_BYTES:
        raise web.HTTPRequestEntityTooLarge(MAX_ACK_BYTES, len(data))
    if not decoder.eof or decoder.unused_data:
        raise web.HTTPBadRequest(
            text="the body cannot be read: its compressed stream is cut off or followed by "
            "other bytes"
        )
    return data


async def read_body(request: web.Request) -> bytes:
    """The whole body, decoded, within ``body_timeout_s``; a body that cannot be had is a 4xx.

    While a body is still arriving its connection does not count as busy: nothing has been
    done for it yet, so past the connection limit it may be closed for a newcomer.  A body
    that cannot be had spoils the rest: it is marked ended, so that aiohttp does not drain
    it after the answer (nor log its error a second time), and the connection closes.
    """
    wbits = content_coding(request)
    timeout_s, busy = request.app[CONFIG].body_timeout_s, request.app[BUSY]
    arrived = request.content.is_eof()  # usually the body came with the headers
    if not arrived:
        busy.discard(request.protocol)
    try:  # over client_max_size: aiohttp raises 413
        body = await read_within(request, request.read, None if arrived else timeout_s)
    finally:
        busy.add(request.protocol)
    return decoded(body, wbits)


async def parse_event(request: web.Request) -> tuple[str, int, int | None]:
    """Read and validate one event; raise the aiohttp HTTP error its flaw deserves."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="the body must be application/json")
    body = await read_body(request)
    signatures = request.app[CONFIG].signatures
    signed_id = None
    if signatures is not None:  # Standard Webhooks: before the body is parsed
        try:
            signed_id = signatures.check(request.headers, body)
        except Unverified as error:
            raise web.HTTPUnauthorized(text=error.reason) from None
    try:
        event_id, qty = check_event(strict_json.loads(body))
        token = check_token_header(request.headers.get(TOKEN_HEADER))
    except ValueError as error:
        raise web.HTTPBadRequest(text=str(error)) from None
    if signed_id not in (None, event_id):  # the signed id is the one the inbox keeps
        raise web.HTTPBadRequest(text=f"the webhook-id is not the event's id {event_id!r}")
    return event_id, qty, token


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Mark the connection busy while its request runs; every refusal a JSON 4xx, logged;
    a DB that cannot be read (away, or its file unreadable) a JSON 503, never a 500."""
    busy = request.app[BUSY]
    busy.add(request.protocol)
    try:
        return await handler(request)
    except web.HTTPException as error:
        as_json(request, error)
        raise
    except Exception as error:
        if not db_away(error):
            raise
        LOG.warning("503 %s %s: the DB is away: %s", request.method, request.path[:80], error)
        return web.json_response(
            {"status": "unavailable", "error": one_line(error)[:200]}, status=503
        )
    finally:
        busy.discard(request.protocol)


def db_away(error: BaseException) -> bool:
    """Whether a request failed only because the sink's DB could not be read or written."""
    return isinstance(error, StoreUnavailable) or database_error(error)


async def post_event(request: web.Request) -> web.StreamResponse:
    stats, capacity = request.app[STATS], request.app[CAPACITY]
    stats["requests"] += 1
    try:
        require_token(request)
    except web.HTTPException:
        stats["rejected"] += 1
        raise
    wait_s = capacity.admit()
    if wait_s is not None:
        stats["overloaded"] += 1
        return web.json_response(
            {"status": "overloaded"}, status=429, headers={"Retry-After": str(wait_s)}
        )
    try:
        return await handle_event(request, asyncio.get_running_loop().time())
    finally:
        capacity.done()


async def handle_event(request: web.Request, admitted: float) -> web.StreamResponse:
    """An admitted event: read, checked, applied once, answered no earlier than
    ``delay_ms`` after its admission (the stand-in for the receiver's own work, which its
    commit is part of)."""
    config, stats = request.app[CONFIG], request.app[STATS]
    try:
        event_id, qty, token = await parse_event(request)
    except web.HTTPException:
        stats["rejected"] += 1
        raise
    if config.fail_rate and config.rng.random() < config.fail_rate:
        stats["failed"] += 1
        return answer(503, event_id, "unavailable")  # before any change
    try:
        outcome = await request.app[INBOX].submit(event_id, qty, token)
    except SinkUnavailable:
        stats["failed"] += 1
        return answer(503, event_id, "unavailable")
    stats[{"applied": "applied", "duplicate": "duplicates", "conflict": "conflicts"}[outcome]] += 1
    spans.decided(event_id, token, outcome)
    if config.delay_ms:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, admitted + config.delay_ms / 1000 - loop.time()))
    if config.drop_rate and config.rng.random() < config.drop_rate:
        stats["dropped"] += 1
        if request.transport is not None:
            request.transport.abort()  # committed, but the ACK is lost
        raise asyncio.CancelledError
    return answer(409 if outcome == "conflict" else 200, event_id, outcome)


async def get_event(request: web.Request) -> web.Response:
    require_token(request)
    try:
        event_id = check_identifier(request.match_info["id"], "event id")
    except ValueError as error:
        raise web.HTTPBadRequest(text=str(error)) from None
    rows = await request.app[INBOX].read(SQL_RECORD, (event_id,))
    if not rows:
        return answer(404, event_id, "unknown")
    return web.json_response(dict(zip(RECORD_FIELDS, rows[0], strict=True)))


async def stock(app: web.Application) -> int:
    rows = await app[INBOX].read(SQL_STOCK)
    return int(rows[0][0])


async def get_stats(request: web.Request) -> web.Response:
    require_token(request)
    counters: dict[str, int] = request.app[STATS]
    inbox = request.app[INBOX]
    stats = {**counters, **inbox.health()}
    capacity = request.app[CAPACITY]
    stats.update(inflight=capacity.inflight, inflight_peak=capacity.peak)
    stats.update(stock=await stock(request.app), commits=inbox.commits)
    return web.json_response(stats)


async def get_metrics(request: web.Request) -> web.Response:
    require_token(request)
    inbox = request.app[INBOX]
    health = inbox.health()
    down_s = health.pop("db_down_ms") / 1000
    lines = []
    counters: dict[str, int] = request.app[STATS]
    for name, value in {**counters, **health, "commits": inbox.commits}.items():
        lines += [f"# TYPE asnackq_sink_{name}_total counter", f"asnackq_sink_{name}_total {value}"]
    lines += [
        "# TYPE asnackq_sink_db_down_seconds_total counter",
        f"asnackq_sink_db_down_seconds_total {down_s:g}",
        "# TYPE asnackq_sink_db_up gauge",
        f"asnackq_sink_db_up {int(not inbox.db_down)}",
        "# TYPE asnackq_sink_inflight gauge",
        f"asnackq_sink_inflight {request.app[CAPACITY].inflight}",
    ]
    with contextlib.suppress(StoreUnavailable):  # the counters are served while the DB is away
        total = await stock(request.app)
        lines += ["# TYPE asnackq_sink_stock gauge", f"asnackq_sink_stock {total}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def inbox_context(app: web.Application) -> AsyncIterator[None]:
    """Open the DB; at cleanup, answer every delivery in hand, then close it."""
    inbox = StockInbox(await open_sink_db(app[CONFIG].db), app[CONFIG].batch_max)
    app[INBOX] = inbox
    try:
        yield
    finally:
        await inbox.close()


def make_app(config: SinkConfig) -> web.Application:
    """The sink as an aiohttp application (bodies over 4 KiB are refused with 413)."""
    tracer = tracing.tracer()  # None: no spans (``asnackq.sink.spans``)
    traced = [] if tracer is None else [spans.middleware(tracer)]
    app = web.Application(client_max_size=MAX_ACK_BYTES, middlewares=[*traced, guard])
    app[CONFIG] = config
    app[STATS] = dict.fromkeys(COUNTERS, 0)
    app[CAPACITY] = Capacity(config.max_inflight, config.max_rate, service_s=config.delay_ms / 1000)
    app[BUSY] = set()
    app.cleanup_ctx.append(inbox_context)
    app.router.add_post("/events", post_event)
    app.router.add_get("/events/{id}", get_event)
    app.router.add_get("/stats", get_stats)
    app.router.add_get("/metrics", get_metrics)
    return app


BACKLOG = 128  # asyncio accepts up to this many sockets before admitting any
FD_RESERVE = 64  # descriptors kept for the DB, its journal and the listening socket
LINGER_S = 2.0  # how long an unread request body is drained before the close
MAX_LINE = 4096  # bytes in the request line, and in each header line
MAX_HEADERS = 32

TOO_MANY_BODY = b'{"status": "too many connections"}'
TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(TOO_MANY_BODY), TOO_MANY_BODY)
)


class Refused(asyncio.Protocol):
    """A connection past the limit while every other one is busy: a 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(TOO_MANY)
        transport.close()


class ConnectionLimit:
    """The listening socket's protocol factory: at most ``limit`` live connections.

    Past the limit a newcomer first closes the oldest idle connections (idle keep-alive,
    headers or a body still arriving): a flood of half-sent requests only churns itself,
    and a real request finds a place unless every connection has a whole request in a
    handler (then it gets a 503).
    """

    def __init__(self, app: web.Application, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.server: web.Server | None = None  # set once the runner is set up

    def __call__(self) -> asyncio.BaseProtocol:
        assert self.server is not None
        if len(self.server.connections) >= self.limit and not self._make_room():
            self.app[STATS]["refused"] += 1
            return Refused()
        return self.server()

    def _make_room(self) -> bool:
        assert self.server is not None
        live = [handler for handler in self.server.connections if handler.transport is not None]
        excess = len(live) + 1 - self.limit
        idle = [handler for handler in live if handler not in self.app[BUSY]][: max(excess, 0)]
        for handler in idle:
            handler.force_close()
        self.app[STATS]["evicted"] += len(idle)
        return len(idle) >= excess


def connection_limit(wanted: int) -> int:
    """``wanted``, lowered so that the live connections, one accept batch and the DB's
    files stay within the process's descriptor limit (no ``accept()`` failures)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - BACKLOG - FD_RESERVE))


def log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's OS errors (``accept()`` out of descriptors, ...) as one line each."""
    error = context.get("exception")
    if isinstance(error, OSError):
        LOG.error("%s", context.get("message", "event loop error"), exc_info=error)
    else:
        loop.default_exception_handler(context)


async def serve(
    config: SinkConfig,
    host: str,
    port: int,
    stop: asyncio.Event,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Serve until ``stop`` is set (https with ``tls``); print the listening line first.

    The port is bound before the DB is opened: an address that cannot be had creates no file.
    Its log (``asnackq.sink``, aiohttp's server errors included) goes where the
    application's logging sends it; ``asnackq sink`` writes it to stderr, one line each.
    """
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(log_loop_error)
    app = make_app(config)
    gate = ConnectionLimit(app, connection_limit(config.max_connections))
    listener = await loop.create_server(
        gate, host, port, backlog=BACKLOG, start_serving=False, ssl=tls
    )
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        logger=LOG,
        keepalive_timeout=config.idle_timeout_s,
        lingering_time=LINGER_S,
        max_line_size=MAX_LINE,
        max_field_size=MAX_LINE,
        max_headers=MAX_HEADERS,
        **SERVER_OPTIONS,
    )
    try:
        await runner.setup()  # opens (or creates) the DB
    except BaseException:
        listener.close()
        raise
    assert runner.server is not None
    runner.server.request_handler = screen_expect(runner.server.request_handler, as_json)
    gate.server = runner.server
    try:
        await listener.start_serving()
        bound = listener.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        scheme = "http" if tls is None else "https"
        url = f"{scheme}://{shown}:{bound[1]}/events"
        print(f"asnackq sink listening on {url}", flush=True)
        LOG.info("started", extra={"event": "started", "fields": {"url": url}})
        await stop.wait()
        LOG.info("stopping: answering requests in flight", extra={"event": "stopping"})
    finally:
        listener.close()
        await runner.cleanup()  # in-flight requests are answered, then the DB closes
    LOG.info("stopped", extra={"event": "stopped"})


if __name__ == "__main__":  # python -m asnackq.http_sink: the command line's ``asnackq sink``
    from asnackq.cli import main

    sys.exit(main(["sink", *sys.argv[1:]]))

"""Serving the sink: its listening socket, a connection limit, timeouts and one-line logs.

Rules of this module:

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
"""

from __future__ import annotations

import asyncio
import resource
import ssl
from typing import Any

from aiohttp import web

from asnackq.sink.app import BUSY, SERVER_OPTIONS, STATS, SinkConfig, as_json, make_app
from asnackq.sink.inbox import LOG
from asnackq.wire import logs
from asnackq.wire.metrics import screen_expect

__all__ = ["serve"]

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


class Gate:
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


def log_to_stderr() -> None:
    """The sink's own log and aiohttp's server errors go to stderr, one line each."""
    logs.to_stderr(LOG, "asnackq sink")


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
    """
    log_to_stderr()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(log_loop_error)
    app = make_app(config)
    gate = Gate(app, connection_limit(config.max_connections))
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
        print(f"asnackq sink listening on {scheme}://{shown}:{bound[1]}/events", flush=True)
        await stop.wait()
    finally:
        listener.close()
        await runner.cleanup()  # in-flight requests are answered, then the DB closes

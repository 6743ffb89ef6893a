"""Ordinary HTTP servers of many kinds, each a real server in its own thread on 127.0.0.1
port 0: Python's ``http.server`` answering in each way a hand-written sink may answer,
aiohttp's server, and the project's own sink.  Each records the ids it was sent and the
connections they came on; each answers with ``answer(id) -> (status, body)``."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.server
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from asnackq.http_sink import SinkConfig, make_app
from asnackq.wire.send import AsyncHttpSender, HttpSender

Answer = Callable[[str], tuple[int, bytes]]

KINDS = (
    "http10",  # http.server's default: HTTP/1.0, a close after every answer
    "keep-alive",  # HTTP/1.1 with Content-Length
    "close",  # HTTP/1.1 answering 'Connection: close'
    "chunked",  # Transfer-Encoding: chunked, the ACK in three chunks
    "until-close",  # no Content-Length: the body ends at the close
    "gzip",  # Content-Encoding: gzip
    "continue",  # '100 Continue' before the answer
    "dribble",  # the answer in many small writes, pauses well below the timeout
    "aiohttp",  # aiohttp's server
    "sink",  # the project's own sink
)
# The kinds whose server keeps a connection open after an ordinary answer.
KEPT_ALIVE = frozenset({"keep-alive", "chunked", "gzip", "continue", "dribble", "aiohttp", "sink"})


def ack(event_id: str) -> tuple[int, bytes]:
    return 200, json.dumps({"id": event_id, "status": "applied"}).encode()


class Peer:
    """A running server: its URL, the ids it was sent, the connections they came on."""

    def __init__(self, scheme: str, port: int) -> None:
        self.url = f"{scheme}://127.0.0.1:{port}/events"
        self.ids: list[str] = []
        self.peers: list[tuple[str, int]] = []  # each request's client address

    def record(self, event_id: str, client: tuple[str, int]) -> None:
        self.ids.append(event_id)
        self.peers.append(client)

    @property
    def connections(self) -> int:
        return len(set(self.peers))


class Handler(http.server.BaseHTTPRequestHandler):
    """One connection to an ``http.server`` peer; ``server.kind`` says how it answers."""

    server: Server

    def do_POST(self) -> None:
        event_id = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["id"]
        self.server.peer.record(event_id, self.client_address)
        status, body = self.server.answer(event_id)
        kind = self.server.kind
        if kind == "continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        if kind == "gzip":
            body = gzip.compress(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if kind == "gzip":
            self.send_header("Content-Encoding", "gzip")
        if kind == "close":
            self.send_header("Connection", "close")
        if kind == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
        elif kind != "until-close":
            self.send_header("Content-Length", str(len(body)))
        if kind != "dribble":
            self.end_headers()  # (flushed: the body comes a moment later, as from an app)
            time.sleep(0.002)
            self.wfile.write(chunked(body) if kind == "chunked" else body)
            self.close_connection |= kind == "until-close"
            return
        self._headers_buffer.append(b"\r\n")
        head = b"".join(self._headers_buffer)
        self._headers_buffer = []
        whole = head + body
        for at in range(0, len(whole), 7):  # about 20 writes, 5 ms apart
            self.wfile.write(whole[at : at + 7])
            self.wfile.flush()
            time.sleep(0.005)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def chunked(body: bytes) -> bytes:
    third = max(1, len(body) // 3)
    parts = [body[at : at + third] for at in range(0, len(body), third)]
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, kind: str, answer: Answer, tls: ssl.SSLContext | None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.kind, self.answer = kind, answer
        self.peer = Peer("https" if tls else "http", self.server_address[1])
        version = "HTTP/1.0" if kind == "http10" else "HTTP/1.1"
        self.RequestHandlerClass = type("Handler", (Handler,), {"protocol_version": version})


@contextlib.contextmanager
def threaded_http_server(kind: str, answer: Answer, tls: ssl.SSLContext | None) -> Iterator[Peer]:
    server = Server(kind, answer, tls)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.peer
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@contextlib.contextmanager
def threaded_aiohttp(app: web.Application, tls: ssl.SSLContext | None) -> Iterator[Peer]:
    """``app`` on aiohttp's server, in a thread running its own event loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)

    listening = socket.create_server(("127.0.0.1", 0))

    async def start() -> int:
        await runner.setup()
        await web.SockSite(runner, listening, ssl_context=tls).start()
        return int(listening.getsockname()[1])

    async def stop() -> None:
        # Accept no more, then let the connections accepted last make their transports
        # (each a task of the loop's, one step away): closed first, the server would fail
        # them - Python 3.11's Server._attach asserts it is open - and leave their sockets
        # to the collector, unclosed, unseen by the sweep below (not yet in the loop's table)
        loop.remove_reader(listening.fileno())
        await asyncio.sleep(0)
        await runner.cleanup()
        # aiohttp closes the connections it serves; one still in its TLS handshake (a
        # client that gave up, whose close this loop has not read yet) is asyncio's alone,
        # which on Python 3.11 does not close it with its server (3.13: abort_clients):
        # left open, it would be collected unclosed during a later test
        # A connection accepted just before the close is still a task of the loop's (its
        # TLS transport is made when that task runs): sweep until no task but this one is
        # left and every transport is closing (bounded: each pass aborts what the last let in)
        this = asyncio.current_task()
        for _ in range(100):
            for transport in list(loop._transports.values()):  # type: ignore[attr-defined]
                transport.abort()  # (one closed already: nothing to do)
            await asyncio.sleep(0)  # (an abort closes its socket on the loop's next pass)
            if all(task is this for task in asyncio.all_tasks()) and all(
                transport.is_closing()
                for transport in list(loop._transports.values())  # type: ignore[attr-defined]
            ):
                break

    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        try:
            yield app[PEER].set(Peer("https" if tls else "http", port))
        finally:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        listening.close()  # (closed with the server; here if it never started)


class Slot:
    """Where an aiohttp app finds the ``Peer`` it records into (known once it listens)."""

    def __init__(self) -> None:
        self.peer: Peer | None = None

    def set(self, peer: Peer) -> Peer:
        self.peer = peer
        return peer


PEER = web.AppKey("peer", Slot)


def aiohttp_app(answer: Answer) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        event_id = (await request.json())["id"]
        request.app[PEER].peer.record(event_id, request.transport.get_extra_info("peername"))
        status, body = answer(event_id)
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app[PEER] = Slot()
    app.router.add_post("/events", handle)
    return app


def sink_app(db: Path) -> web.Application:
    """The project's sink, recording each request's id and connection as well."""

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        event_id = json.loads(await request.read())["id"]
        request.app[PEER].peer.record(event_id, request.transport.get_extra_info("peername"))
        return await handler(request)

    app = make_app(SinkConfig(db))
    app.middlewares.append(record)
    app[PEER] = Slot()
    return app


@contextlib.contextmanager
def serving(
    kind: str, tmp_path: Path, answer: Answer = ack, tls: ssl.SSLContext | None = None
) -> Iterator[Peer]:
    """A running peer of ``kind`` (the sink's DB in ``tmp_path``)."""
    if kind == "sink":
        with threaded_aiohttp(sink_app(tmp_path / "sink.db"), tls) as peer:
            yield peer
    elif kind == "aiohttp":
        with threaded_aiohttp(aiohttp_app(answer), tls) as peer:
            yield peer
    else:
        with threaded_http_server(kind, answer, tls) as peer:
            yield peer


async def send_each(url, ids=("a", "b", "c"), **options):
    """Send ``ids`` with one HttpSender, then with one AsyncHttpSender; what each gave."""

    def sync():
        with HttpSender(url, **options) as send:
            return [outcome(send, event_id) for event_id in ids]

    def outcome(send, event_id):
        try:
            return send({"id": event_id, "qty": 1})
        except Exception as error:
            return type(error)

    first = await asyncio.to_thread(sync)
    async with AsyncHttpSender(url, **options) as send:
        second = []
        for event_id in ids:
            try:
                second.append(await send({"id": event_id, "qty": 1}))
            except Exception as error:
                second.append(type(error))
    return first, second

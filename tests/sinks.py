"""Real servers on 127.0.0.1 port 0 for tests: the asnackq sink and small misbehaving peers."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from asnackq.core.inbox import event_digest
from asnackq.http_sink import SERVER_OPTIONS, SinkConfig, make_app
from asnackq.store.targets import is_url

from .pgdb import query


class Running:
    """A running app: its URL and, for a sink, its config and DB path."""

    def __init__(self, runner: web.AppRunner, app: web.Application) -> None:
        host, port = runner.addresses[0][:2]
        self.base = f"http://{host}:{port}"
        self.url = f"{self.base}/events"
        self.app = app
        self.runner = runner


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[Running]:
    runner = web.AppRunner(app, access_log=None, **SERVER_OPTIONS)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield Running(runner, app)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def sink(db: Path | str, **options: Any) -> AsyncIterator[Running]:
    async with serving(make_app(SinkConfig(db, **options))) as running:
        yield running


def peer(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    """A one-route app answering POST /events (and GET /elsewhere) with ``handler``."""
    app = web.Application()
    app.router.add_post("/events", handler)
    app.router.add_post("/elsewhere", handler)
    return app


# The sink's records: each inbox row (the library's) with its stock move (the sink's effect).
SINK_ROWS = """SELECT i.id, m.qty, i.deliveries FROM asnackq_webhook_inbox AS i
LEFT JOIN stock_moves AS m ON m.id = i.id ORDER BY i.id"""


def sink_state(db: Path | str) -> tuple[int, list[tuple[Any, ...]]]:
    """(stock, [(id, qty, deliveries)]) read through a separate connection."""
    if is_url(db):
        return (
            query(db, "SELECT total FROM stock")[0][0],
            query(db, SINK_ROWS + ' COLLATE "C"'),
        )
    con = sqlite3.connect(db)
    try:
        total = con.execute("SELECT total FROM stock").fetchone()[0]
        return total, con.execute(SINK_ROWS).fetchall()
    finally:
        con.close()


def add_records(con: Any, rows: list[tuple[Any, ...]]) -> None:
    """Write sink records ``(id, qty, first_token, last_token, deliveries, applied_at_ms,
    last_seen_ms)`` as a sink would (the inbox row, its move), without the stock."""
    con.executemany(
        "INSERT INTO asnackq_webhook_inbox VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(r[0], event_digest(r[0], r[1]), *r[2:]) for r in rows],
    )
    con.executemany("INSERT INTO stock_moves VALUES (?, ?)", [r[:2] for r in rows])


def dead_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""An order service whose orders and delivery jobs commit together (aiohttp + aiosqlite).

    asnackq sink --db stock.db                 # prints: asnackq sink listening on URL
    python examples/orders_app.py shop.db URL  # prints: listening on http://127.0.0.1:PORT/orders

``POST /orders {"id": "o1", "qty": 3}`` records the order in the shop's own table and
enqueues its delivery in the queue's tables of the same file, in one transaction: both are
committed (201), or neither (409 for a known order id, 400 for a bad order).  A crash before
the COMMIT leaves neither; the queue never delivers an order the shop does not have.

With a sink URL, a Dispatcher delivers the jobs in the background, on its own connection to
the same file, started and stopped with the app (``cleanup_ctx``).  SIGTERM or Ctrl-C stops
the app gracefully: no new orders, sends in flight finish and their results commit, then
the connections close.  Without one, ``asnackq work shop.db --sink URL`` delivers them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from functools import partial

import aiosqlite
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import check_event, epoch_ms
from asnackq.wire.send import AsyncHttpSender

DB = web.AppKey("db", aiosqlite.Connection)
QUEUE = web.AppKey("queue", AsyncQueue)
LOCK = web.AppKey("lock", asyncio.Lock)
ORDERS = """CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY,
  qty INTEGER NOT NULL, placed_ms INTEGER NOT NULL)"""


async def place(request: web.Request) -> web.Response:
    try:
        order_id, qty = check_event(json.loads(await request.read()))
    except ValueError as error:  # json.JSONDecodeError is one, too
        return web.json_response({"error": str(error)}, status=400)
    db, now = request.app[DB], epoch_ms()
    async with request.app[LOCK]:  # one transaction at a time on the shop's connection
        await db.execute("BEGIN IMMEDIATE")
        try:
            await db.execute("INSERT INTO orders VALUES (?, ?, ?)", (order_id, qty, now))
            await request.app[QUEUE].enqueue({"id": order_id, "qty": qty})  # a day, 5 tries
            await db.commit()  # the order and its delivery job, together
        except sqlite3.IntegrityError:
            await db.rollback()
            return web.json_response({"error": f"order {order_id!r} exists"}, status=409)
        except BaseException:
            await db.rollback()
            raise
    return web.json_response({"id": order_id, "qty": qty}, status=201)


async def delivery(app: web.Application, path: str, sink: str) -> AsyncIterator[None]:
    """A Dispatcher delivering the shop's jobs to ``sink`` for as long as the app runs."""
    async with (
        AsyncQueue.open(path) as queue,  # the Dispatcher's own connection
        AsyncHttpSender(sink) as send,
    ):
        dispatcher = Dispatcher(queue, send, owner="shop", concurrency=8)
        running = asyncio.create_task(dispatcher.run(follow=True))
        yield
        running.cancel()  # claim no more; sends in flight finish and their results commit
        with contextlib.suppress(asyncio.CancelledError):
            await running


def shop(path: str, sink: str | None = None) -> web.Application:
    async def connection(app: web.Application) -> AsyncIterator[None]:
        async with aiosqlite.connect(path, isolation_level=None) as db:
            await db.execute(ORDERS)
            app[DB], app[LOCK] = db, asyncio.Lock()
            app[QUEUE] = await AsyncQueue.within(db)  # the queue's tables, if absent
            yield

    app = web.Application()
    app.cleanup_ctx.append(connection)
    if sink is not None:
        app.cleanup_ctx.append(partial(delivery, path=path, sink=sink))  # after the connection
    app.router.add_post("/orders", place)
    return app


async def main(path: str, sink: str | None) -> None:
    runner = web.AppRunner(shop(path, sink), access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}/orders", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # aiohttp's graceful shutdown: the cleanup_ctx in reverse


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python examples/orders_app.py SHOP_DB [SINK_URL]")
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else None))

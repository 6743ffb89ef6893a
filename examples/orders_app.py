"""An order service whose orders and delivery jobs commit together (aiohttp + aiosqlite).

    python examples/orders_app.py shop.db     # prints: listening on http://127.0.0.1:PORT/orders
    asnackq work shop.db --sink http://...    # delivers the jobs (a separate process)

``POST /orders {"id": "o1", "qty": 3}`` records the order in the shop's own table and
enqueues its delivery in the queue's tables of the same file, in one transaction: both are
committed (201), or neither (409 for a known order id, 400 for a bad order).  A crash before
the COMMIT leaves neither; the queue never delivers an order the shop does not have.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from collections.abc import AsyncIterator

import aiosqlite
from aiohttp import web

from asnackq.core.worker import check_event, epoch_ms
from asnackq.store.aio import AsyncQueue

DB = web.AppKey("db", aiosqlite.Connection)
QUEUE = web.AppKey("queue", AsyncQueue)
LOCK = web.AppKey("lock", asyncio.Lock)
ORDERS = """CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY,
  qty INTEGER NOT NULL, placed_ms INTEGER NOT NULL)"""
DELIVER_WITHIN_MS = 24 * 3_600_000


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
            await request.app[QUEUE].enqueue({"id": order_id, "qty": qty}, now, DELIVER_WITHIN_MS)
            await db.commit()  # the order and its delivery job, together
        except sqlite3.IntegrityError:
            await db.rollback()
            return web.json_response({"error": f"order {order_id!r} exists"}, status=409)
        except BaseException:
            await db.rollback()
            raise
    return web.json_response({"id": order_id, "qty": qty}, status=201)


def shop(path: str) -> web.Application:
    async def connection(app: web.Application) -> AsyncIterator[None]:
        async with aiosqlite.connect(path, isolation_level=None) as db:
            await db.execute(ORDERS)
            app[DB], app[LOCK] = db, asyncio.Lock()
            app[QUEUE] = await AsyncQueue.within(db)  # the queue's tables, made if absent
            yield

    app = web.Application()
    app.cleanup_ctx.append(connection)
    app.router.add_post("/orders", place)
    return app


async def main(path: str) -> None:
    runner = web.AppRunner(shop(path), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}/orders", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/orders_app.py SHOP_DB")
    asyncio.run(main(sys.argv[1]))

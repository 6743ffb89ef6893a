"""A payments service receiving signed webhooks: each payment credited to its account once,
however often it is delivered (aiohttp + aiosqlite + asnackq's WebhookReceiver).

    python examples/webhook_receiver.py --db pay.db --port 8080 --secret-file secrets.txt
    # prints: listening on http://127.0.0.1:8080/webhooks

``POST /webhooks`` takes a Standard Webhooks delivery (``webhook-id``, ``webhook-timestamp``,
``webhook-signature`` with a ``whsec_`` secret of ``--secret-file``, one a line) whose body
is ``{"account": "a-1", "amount": 5}``.  The payment's row and its account's new balance are
written inside the transaction that records the ``webhook-id`` in the receiver's inbox, on
the service's own connection: a delivery sent again - after a lost answer, a crash, a
restart - finds its id and changes nothing (``200 duplicate``).  A payload the service will
never apply is ``422`` (``Rejected``); a bad signature ``401``, and nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiosqlite
from aiohttp import web

from asnackq.core.worker import epoch_ms
from asnackq.http_sink import Rejected, WebhookReceiver, expect_continue, read_secrets
from asnackq.wire.logs import OneLine

TABLES = (
    "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL)",
    # One row per payment applied (no unique key: a payment applied twice would show twice).
    """CREATE TABLE IF NOT EXISTS payments (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL,
  account TEXT NOT NULL, amount INTEGER NOT NULL, applied_ms INTEGER NOT NULL)""",
)
ACCOUNT = re.compile(r"[a-z0-9-]{1,32}")


async def credit(db: aiosqlite.Connection, event_id: str, payload: Any) -> None:
    """The effect: one payment, inside the inbox's transaction (no commit of its own)."""
    if type(payload) is not dict or payload.keys() != {"account", "amount"}:
        raise Rejected("the body must be {'account': ..., 'amount': ...}")
    account, amount = payload["account"], payload["amount"]
    if type(account) is not str or not ACCOUNT.fullmatch(account):
        raise Rejected("account must be 1-32 of a-z, 0-9 and '-'")
    if type(amount) is not int or not 1 <= amount <= 1_000_000:
        raise Rejected("amount must be an int in 1..1000000")
    await db.execute(
        "INSERT INTO payments (event_id, account, amount, applied_ms) VALUES (?, ?, ?, ?)",
        (event_id, account, amount, epoch_ms()),
    )
    await db.execute(
        "INSERT INTO accounts VALUES (?, ?) ON CONFLICT (id) DO UPDATE"
        " SET balance = balance + excluded.balance",
        (account, amount),
    )


RECEIVER = web.AppKey("receiver", WebhookReceiver[aiosqlite.Connection])


async def receive(request: web.Request) -> web.StreamResponse:
    return await request.app[RECEIVER].handle(request)


def payments(path: str, secrets: tuple[str, ...]) -> web.Application:
    async def connection(app: web.Application) -> AsyncIterator[None]:
        async with aiosqlite.connect(path, isolation_level=None) as db:
            for table in TABLES:
                await db.execute(table)
            app[RECEIVER] = await WebhookReceiver.within(db, secrets, credit)  # + its inbox
            yield

    app = web.Application()
    app.cleanup_ctx.append(connection)
    app.router.add_post("/webhooks", receive, expect_handler=expect_continue)
    return app


async def main(path: str, port: int, secrets: tuple[str, ...]) -> None:
    runner = web.AppRunner(payments(path, secrets), access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}/webhooks", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()  # requests in flight are answered, then the connection closes


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="the service's SQLite file")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--secret-file", required=True, help="whsec_ secrets, one a line")
    args = parser.parse_args()
    try:
        args.secrets = read_secrets(args.secret_file)
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    args = arguments()
    handler = logging.StreamHandler()
    handler.setFormatter(OneLine("webhook_receiver"))  # every record one line, no traceback
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    asyncio.run(main(args.db, args.port, args.secrets))

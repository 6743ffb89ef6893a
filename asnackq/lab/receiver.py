"""One endpoint of ``asnackq lab --endpoints``: a receiver process of its own, the library's
``WebhookReceiver`` on 127.0.0.1 with its own SQLite file and secret (``--secret-file``: a
secret is never an argument, which any process may read), and the fault it is given
(``python -m asnackq.lab.receiver``).

Rules of this module:

* The effect records each applied delivery (its ``webhook-id``, key, number and time) in
  ``applied``, inside the inbox's transaction: a row there is a delivery applied.  The
  ``applied`` table has no unique key, so an effect applied twice shows twice.
* Faults (``asnackq.lab.fanout.FAULTS``) act before the receiver, so a refused request
  applies nothing: ``slow:MS`` delays each answer; ``429:RATE`` and ``503:RATE`` answer
  that share of requests (seeded) with the status (429 with ``Retry-After: 1``);
  ``410:AFTER`` answers ``410 Gone`` once, to the first request after AFTER applied
  deliveries.  ``down`` is the lab's (a SIGKILL, then a restart on the same port).
* ``twice`` is the lab's self-check, a receiver with a bug: its effect records each
  delivery twice, which the verdict "each applied once" must catch.
* Once listening it prints ``{"port": P}`` on stdout, one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import aiosqlite
from aiohttp import web

from asnackq.core.worker import epoch_ms
from asnackq.http_sink import WebhookReceiver, read_secrets
from asnackq.store.sqlite_aio import connected

__all__ = ["APPLIED", "main"]

APPLIED = """CREATE TABLE IF NOT EXISTS applied (seq INTEGER PRIMARY KEY,
  event_id TEXT NOT NULL, key TEXT NOT NULL, n INTEGER NOT NULL, applied_ms INTEGER NOT NULL)"""
SQL_APPLY = "INSERT INTO applied (event_id, key, n, applied_ms) VALUES (?, ?, ?, ?)"
SQL_COUNT = "SELECT count(*) FROM applied"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def effect(times: int) -> Callable[[aiosqlite.Connection, str, Any], Awaitable[None]]:
    """The effect: ``times`` rows in ``applied`` (1; 2 for the ``twice`` bug)."""

    async def record(con: aiosqlite.Connection, event_id: str, payload: Any) -> None:
        data = payload["data"]
        for _ in range(times):
            await con.execute(SQL_APPLY, (event_id, data["key"], data["n"], epoch_ms()))

    return record


def faulty(handle: Handler, con: aiosqlite.Connection, fault: str, seed: int) -> Handler:
    """``handle`` behind the fault (``fault`` is ``KIND`` or ``KIND:ARG``)."""
    kind, _, arg = fault.partition(":")
    rng = random.Random(seed)
    gone = [kind == "410"]

    async def answer(request: web.Request) -> web.StreamResponse:
        if kind == "slow":
            await asyncio.sleep(int(arg) / 1000)
        elif kind in ("429", "503") and rng.random() < float(arg):
            headers = {"Retry-After": "1"} if kind == "429" else {}
            return web.json_response({"status": "busy"}, status=int(kind), headers=headers)
        elif gone[0] and next(iter(await con.execute_fetchall(SQL_COUNT)))[0] >= int(arg):
            gone[0] = False
            return web.json_response({"status": "gone"}, status=410)
        return await handle(request)

    return answer


async def main(db: str, port: int, secrets: tuple[str, ...], fault: str, seed: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    async with connected(db, isolation_level=None) as con:
        await con.execute_fetchall(APPLIED)
        receiver = await WebhookReceiver.within(con, secrets, effect(2 if fault == "twice" else 1))
        app = web.Application()
        app.router.add_post("/hook", faulty(receiver.handle, con, fault, seed))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print(json.dumps({"port": runner.addresses[0][1]}), flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await receiver.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one endpoint of asnackq lab --endpoints")
    parser.add_argument("--db", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--secret-file", required=True, help="whsec_ secrets, one a line")
    parser.add_argument("--fault", default="none")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    secrets = read_secrets(args.secret_file)
    asyncio.run(main(args.db, args.port, secrets, args.fault, args.seed))

"""Every driver behind one face, so one suite of scenarios runs against each.

``con`` is a ``sqlite3.Connection`` (the sync core), a ``PgCon`` (the core's plans through
``asnackq.store.pg.drive``) or an ``AioBridge`` (an ``AsyncQueue`` on an event loop in a
background thread, on a file or on PostgreSQL); ``q.NAME(con, ...)`` calls the same
operation on any of them, with the core's signature.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.store import opening, pg, pg_session
from asnackq.store.sqlite_aio import SqliteStore

from .pgdb import tracing

DRIVERS = ("sync", "aio", "pg", "pgaio")
BEGIN = {"sync": "BEGIN IMMEDIATE", "aio": "BEGIN IMMEDIATE", "pg": "BEGIN", "pgaio": "BEGIN"}


def on_pg(driver: str) -> bool:
    return driver.startswith("pg")


class AioBridge:
    """An AsyncQueue driven from synchronous test code."""

    def __init__(self, path: Path | str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # The store it runs on, opened here (as AsyncQueue.connect does) so that the tests
        # can trace its statements through the store's own public connection.
        self.store = self.wait(opening.open_store(path, w.SCHEMA))
        self.queue = AsyncQueue(self.store, limits=w.CONTRACT)

    def wait(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    @property
    def in_transaction(self) -> bool:
        return self.queue.in_transaction

    def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        store = self.store
        if isinstance(store, pg_session.AsyncStore):
            store.con.cursor_factory = tracing(callback)[1] if callback else psycopg.AsyncCursor
        else:
            assert isinstance(store, SqliteStore)
            self.wait(store.db.set_trace_callback(callback))

    def close(self) -> None:
        self.wait(self.queue.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class PgCon:
    """A PostgreSQL session on which the core's plans run through ``pg.drive``."""

    def __init__(self, url: str) -> None:
        self.con = pg.connect(url)

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        self.con.cursor_factory = tracing(callback)[0] if callback else psycopg.Cursor

    def run(self, name: str, *args: Any, fault: w.Fault = None) -> Any:
        """The core's ``NAME(con, *args)``: its plan, with the contract's limits."""
        make = partial(getattr(w, f"plan_{name}"), *args, limits=w.CONTRACT)
        return pg.drive(self.con, make(), fault, make=make)

    def close(self) -> None:
        self.con.close()


class Operations:
    """``q.claim(con, ...)`` and friends, dispatched on the kind of ``con``."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(con: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(con, AioBridge):
                return con.wait(getattr(con.queue, name)(*args, **kwargs))
            if isinstance(con, PgCon):
                return con.run(name, *args, **kwargs)
            return getattr(w, name)(con, *args, **kwargs)

        return call


q = Operations()


def open_con(driver: str, db: Path | str) -> sqlite3.Connection | AioBridge | PgCon:
    """A connection of the given driver to a queue file (or database URL)."""
    if driver == "sync":
        return w.open_queue(db)
    if driver == "pg":
        assert isinstance(db, str)
        return PgCon(db)
    return AioBridge(db)


def connect(driver: str, db: Path | str) -> Iterator[sqlite3.Connection | AioBridge | PgCon]:
    """Yield a connection of the given driver; afterwards insist no transaction is open."""
    con: Any = open_con(driver, db)
    try:
        yield con
        assert not con.in_transaction, "a function left a transaction open"
    finally:
        con.close()

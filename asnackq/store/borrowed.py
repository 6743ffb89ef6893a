"""A connection the application owns: intakes inside the application's own transaction.

Rules of this module:

* The application begins, commits, rolls back and closes its connection; a borrowed
  store never does.  An intake (``enqueue``, ``enqueue_many``, the outbox's ``accept``)
  runs inside the transaction the application has open, under a savepoint: a failing plan
  leaves that transaction as it was, and nothing is durable before the application's
  COMMIT - its own rows and the jobs commit together, or neither does.
* Refused, in one line (``ValueError``), before anything is written: an intake with no
  transaction open (autocommit, or nothing begun); a SQLite connection whose journal
  settings differ from the queue's (``worker.PRAGMAS``: the rollback journal, every
  commit synced); claims, finishes and the Dispatcher (``aio.AsyncQueue`` refuses them:
  they are the queue's own transactions, each committed at once).
* The tables are created when the store is built, in a transaction of their own: the
  connection must have none open then.
* One intake at a time on a connection, whichever queue or outbox runs it (``turn``: one
  lock per connection), each under a savepoint of its own name: a failing intake rolls
  back its own rows only, never another queue's on the same connection nor a savepoint
  of the application's.  The application's own coroutines must not write on the
  connection while an intake runs (as on any connection shared by coroutines: hold the
  application's lock around its transaction).
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
from functools import partial
from typing import Any

import aiosqlite

from asnackq.core import events as ev
from asnackq.core import outbox
from asnackq.core import worker as w
from asnackq.store.outage import BUSY, NO_TRANSACTION
from asnackq.store.sqlite_aio import adrive, steps
from asnackq.store.turns import turn

__all__ = [
    "BUSY",
    "NO_TRANSACTION",
    "PG_ORDERS",
    "BorrowedSqlite",
    "Source",
    "adopt",
    "check_journal",
]

PG_ORDERS = (
    "the outbox on PostgreSQL takes events with data ({id, data, type?, key?}); "
    "{id, qty} orders and their ordered dispatch need a SQLite source DB"
)

# What the queue's file must be (``worker.PRAGMAS``), as the PRAGMAs read it back.
JOURNAL = {"journal_mode": "delete", "synchronous": 2}


async def check_journal(db: aiosqlite.Connection) -> None:
    """Refuse a connection whose journal settings differ from the queue file's."""
    found = {}
    for name in JOURNAL:
        (row,) = await db.execute_fetchall(f"PRAGMA {name}")
        found[name] = str(row[0]).lower() if name == "journal_mode" else row[0]
    if found != JOURNAL:
        raise ValueError(
            "the queue needs journal_mode=delete and synchronous=FULL (2) on its file; "
            f"this connection has journal_mode={found['journal_mode']}, "
            f"synchronous={found['synchronous']}"
        )


_savepoints = itertools.count(1)


class BorrowedSqlite:
    """An application's aiosqlite connection as a ``Store``: plans inside its transaction."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db

    @classmethod
    async def adopt(cls, db: aiosqlite.Connection, schema: tuple[str, ...]) -> BorrowedSqlite:
        """Check ``db`` and create ``schema`` in a transaction of its own."""
        await check_journal(db)
        if db.in_transaction:
            raise ValueError(BUSY)
        await adrive(db, w.plan_schema(schema))
        return cls(db)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    async def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        """Run ``make()``'s plan under a savepoint of the application's open transaction."""
        plan = make()
        async with turn(self.db):
            if not self.db.in_transaction:
                raise ValueError(NO_TRANSACTION)
            savepoint = f"asnackq_{next(_savepoints)}"
            await self.db.execute_fetchall(f"SAVEPOINT {savepoint}")
            try:
                result, _ = await steps(self.db, plan, fault)
            except BaseException:
                with contextlib.suppress(sqlite3.Error, ValueError):  # the original error wins
                    await self.db.execute_fetchall(f"ROLLBACK TO {savepoint}")
                    await self.db.execute_fetchall(f"RELEASE {savepoint}")
                raise
            await self.db.execute_fetchall(f"RELEASE {savepoint}")
            return result

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self.db.execute_fetchall(sql, params)]

    async def close(self) -> None:
        """Nothing: the connection is the application's."""


async def adopt(con: object, schema: tuple[str, ...], attempts: int) -> Any:
    """A borrowed store on ``con``: an ``aiosqlite.Connection`` or a psycopg
    ``AsyncConnection``; anything else is refused."""
    if isinstance(con, aiosqlite.Connection):
        return await BorrowedSqlite.adopt(con, schema)
    with contextlib.suppress(ImportError):
        import psycopg

        if isinstance(con, psycopg.AsyncConnection):
            from asnackq.store import pg_session

            return await pg_session.BorrowedStore.adopt(con, schema, attempts)
    raise ValueError(
        f"a queue on the application's connection takes an aiosqlite.Connection or a "
        f"psycopg.AsyncConnection, not {type(con).__name__}"
    )


class Source:
    """The outbox (``core.outbox``) on an application's connection: ``accept`` writes an
    order and its outbox row, or an event and its deliveries, inside the application's
    transaction.

    On an aiosqlite connection the source's tables and the queue's are made
    (``outbox.TABLES``); on a psycopg ``AsyncConnection`` the queue's alone: there the
    outbox takes events with ``data``, and the ``{id, qty}`` orders (the seq-ordered
    outbox) are refused in one line, since their ordered dispatch reads a SQLite source
    DB."""

    def __init__(self, store: Any, sqlite: bool, max_event_bytes: int) -> None:
        self.store, self.sqlite, self.max_event_bytes = store, sqlite, max_event_bytes

    @classmethod
    async def within(
        cls, db: object, *, attempts: int = 8, max_event_bytes: int = ev.DEFAULT_MAX_BYTES
    ) -> Source:
        """Check ``db`` and create the tables, in a transaction of their own; ``attempts``
        and ``max_event_bytes`` as ``AsyncQueue.within``'s."""
        w.check_int(attempts, "attempts", 1, 100)
        ev.check_max_bytes(max_event_bytes)
        if isinstance(db, aiosqlite.Connection):
            store = await BorrowedSqlite.adopt(db, outbox.TABLES)
            return cls(store, True, max_event_bytes)
        return cls(await adopt(db, w.SCHEMA, attempts), False, max_event_bytes)

    async def accept(self, event: dict[str, Any], now_ms: int | None = None) -> bool:
        """``outbox.accept`` inside the open transaction: True accepted, False already
        there; ``now_ms`` (None: the wall clock) is an event's intake time."""
        if not (self.sqlite or ev.is_event(event)):
            raise ValueError(PG_ORDERS)
        now = w.epoch_ms() if now_ms is None else now_ms
        make = partial(outbox.plan_accept, event, now, max_event_bytes=self.max_event_bytes)
        make()  # validated before anything is sent
        return bool(await self.store.run(make))  # (the connection's turn; re-made on a retry)

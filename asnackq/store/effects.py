"""Transactions asnackq begins and commits on an application's connection, with the
application's own effect awaited inside them: a receiver's inbox (``core.inbox``), one
delivery or a batch of them (a group commit: ``asnackq.sink.inbox``).

Rules of this module:

* The connection is the application's: an ``aiosqlite.Connection`` or a psycopg
  ``AsyncConnection``; anything else is a ``ValueError``.  asnackq never closes it.
* One transaction at a time on it: each takes ``turn(con)``, the lock every intake on the
  connection takes (``asnackq.store.turns``; the effect's own intakes, in the same task,
  re-enter it and commit with the transaction).  Under the turn the connection must be idle:
  one with a transaction open is refused (``ValueError``), nothing written.
* A transaction is BEGIN (IMMEDIATE on SQLite, retried while another process holds the
  file: ``QueueBusy``), the inbox plan's steps (its decisions and rows), the effect of each
  applied delivery awaited in arrival order, COMMIT.  Anything raised before COMMIT rolls
  back every write, the inbox's and the effects', and propagates (a failing ROLLBACK never
  hides it); an exception of an effect arrives as ``EffectFailed``, its ``index`` the
  delivery's place in the batch, its cause the effect's own.  An effect that ends the transaction
  (COMMIT, ROLLBACK) or, on PostgreSQL, leaves it aborted (a failed statement it caught: the
  server would answer COMMIT with a silent ROLLBACK) is refused at COMMIT: a ``RuntimeError``,
  everything rolled back.  On PostgreSQL a transaction
  that met a concurrent one (deadlock, serialization failure) runs again from BEGIN,
  effect included (bounded, jittered): it rolled back, so nothing of it stayed.
* The transaction runs in a task of its own under ``asyncio.shield``: a cancelled caller
  never splits it (the task finishes, then the cancellation is raised).
* The plan runs on the connection's own driver (``sqlite_aio.steps``, ``pg.asteps``).
* ``on_file``: the sink's batches on its own file, whose effect is statements in the plan:
  no awaited effect, and the plan's first statement begins the transaction itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import aiosqlite

from asnackq.core import worker as w
from asnackq.store.sqlite_aio import (
    QueueBusy,
    SqliteStore,
    adrive,
    begin,
    busy,
    rollback,
    steps,
)
from asnackq.store.turns import turn

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "ATTEMPTS",
    "IDLE",
    "Decisions",
    "EffectAt",
    "EffectFailed",
    "check_connection",
    "on_file",
    "prepare",
    "receive",
]

Decisions = w.Plan[list[str]]  # an inbox plan (``core.inbox.plan_receive``)
EffectAt = Callable[[int], Awaitable[None]]  # awaits the effect of the batch's delivery i
ATTEMPTS = 8  # BEGIN IMMEDIATE on a busy file; runs of a PostgreSQL transaction
IDLE = (
    "the application's connection has a transaction open: a webhook receiver's transaction "
    "begins and commits on an idle connection (take turn(con) around the application's own)"
)
ENDED = "the effect ended the inbox's transaction: an effect must not commit or roll back"
ABORTED = (
    "a statement of the effect failed and the effect went on: the transaction cannot commit "
    "(let the error propagate, or wrap the statement in a savepoint: con.transaction())"
)


class EffectFailed(Exception):
    """Raised when the application's effect for one delivery raised: the transaction rolled
    back, nothing of it stays; ``index`` is that delivery's place in its batch and
    ``__cause__`` the effect's exception."""

    def __init__(self, index: int) -> None:
        super().__init__(f"the effect of delivery {index} of the batch raised")
        self.index = index


async def _effects(statuses: list[str], effect_at: EffectAt) -> None:
    """Await the effect of each applied delivery, in arrival order."""
    for index, status in enumerate(statuses):
        if status == "applied":
            try:
                await effect_at(index)
            except Exception as error:
                raise EffectFailed(index) from error


async def _sqlite(db: aiosqlite.Connection, plan: Decisions, effect_at: EffectAt) -> list[str]:
    if db.in_transaction:
        raise ValueError(IDLE)
    await begin(db, ATTEMPTS)  # (a failed BEGIN owns no transaction)
    try:
        statuses, _ = await steps(db, plan, None)
        await _effects(statuses, effect_at)
        if not db.in_transaction:
            raise RuntimeError(ENDED)
        await db.commit()
    except BaseException:
        await rollback(db)
        raise
    return statuses


async def _pg(
    con: psycopg.AsyncConnection[Any], make: Callable[[], Decisions], effect_at: EffectAt
) -> list[str]:
    from psycopg.pq import TransactionStatus

    from asnackq.store.pg import asteps, call_plain, conflict, conflict_delay_s

    for attempt in range(ATTEMPTS):
        if con.info.transaction_status != TransactionStatus.IDLE:
            raise ValueError(IDLE)
        try:
            async with con.transaction():  # BEGIN ... COMMIT, or ROLLBACK and re-raise
                statuses, _ = await asteps(con, make(), None, call_plain)
                await _effects(statuses, effect_at)
                # (PostgreSQL answers COMMIT on an aborted transaction with a ROLLBACK, no error)
                status = _status(con)  # (read again: the effects ran meanwhile)
                if status != TransactionStatus.INTRANS:
                    raise RuntimeError(ABORTED if status == TransactionStatus.INERROR else ENDED)
                return list(statuses)
        except Exception as error:
            cause = error.__cause__ if isinstance(error, EffectFailed) else error
            if cause is None or not conflict(cause) or attempt == ATTEMPTS - 1:
                raise
        await asyncio.sleep(conflict_delay_s(attempt))
    raise AssertionError("unreachable")


def _status(con: psycopg.AsyncConnection[Any]) -> psycopg.pq.TransactionStatus:
    return con.info.transaction_status


async def _locked(con: object, make: Callable[[], Decisions], effect_at: EffectAt) -> list[str]:
    async with turn(con):
        if isinstance(con, aiosqlite.Connection):
            return await _sqlite(con, make(), effect_at)
        return await _pg(cast("psycopg.AsyncConnection[Any]", con), make, effect_at)


def check_connection(con: object) -> None:
    """Refuse anything but an aiosqlite or psycopg async connection (``ValueError``)."""
    if isinstance(con, aiosqlite.Connection):
        return
    with contextlib.suppress(ImportError):
        import psycopg

        if isinstance(con, psycopg.AsyncConnection):
            return
    raise ValueError(
        "a webhook receiver takes the application's aiosqlite.Connection or "
        f"psycopg.AsyncConnection, not {type(con).__name__}"
    )


async def receive(con: object, make: Callable[[], Decisions], effect_at: EffectAt) -> list[str]:
    """Run ``make()``'s inbox plan in a transaction of its own on ``con``, then await
    ``effect_at(i)`` for each applied delivery ``i`` inside it; the statuses once committed.
    Shielded from the caller's cancellation."""
    check_connection(con)
    task = asyncio.ensure_future(_locked(con, make, effect_at))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
        raise


async def on_file(store: SqliteStore, make: Callable[[], Decisions]) -> list[str]:
    """An inbox plan whose effects are statements (the sink's), on a store's own file: its
    first statement, the batch's rows (an ``INSERT``), begins the transaction itself (a
    store's connection has ``isolation_level`` ``IMMEDIATE``), then the plan's steps,
    COMMIT: no BEGIN of its own to send, as ``Store.run`` sends one (and polls it).  A
    file held by another process past the busy timeout is ``QueueBusy`` (nothing
    committed)."""
    db = store.db
    if db.in_transaction or db.isolation_level != "IMMEDIATE":
        raise ValueError("on_file runs on a store's own idle connection (SqliteStore.open)")
    try:
        statuses, _ = await steps(db, make(), None, own=True)
        await db.commit()
    except sqlite3.OperationalError as error:
        await rollback(db)
        if not busy(error):
            raise
        raise QueueBusy(f"the inbox is locked: {error}", store.health.failed()) from error
    except BaseException:
        await rollback(db)
        raise
    store.health.back()
    return statuses


async def prepare(con: object, schema: tuple[str, ...]) -> None:
    """Create ``schema``'s absent tables on ``con``, in a transaction of their own."""
    check_connection(con)
    async with turn(con):
        if isinstance(con, aiosqlite.Connection):
            if con.in_transaction:
                raise ValueError(IDLE)
            await adrive(con, w.plan_schema(schema), None, ATTEMPTS)
        else:
            await _pg_prepare(cast("psycopg.AsyncConnection[Any]", con), schema)


async def _pg_prepare(con: psycopg.AsyncConnection[Any], schema: tuple[str, ...]) -> None:
    from psycopg.pq import TransactionStatus

    from asnackq.store.pg import asteps, call_plain
    from asnackq.store.pg_sql import SCHEMAS, plan_open

    if con.info.transaction_status != TransactionStatus.IDLE:
        raise ValueError(IDLE)
    async with con.transaction():
        await asteps(con, plan_open(SCHEMAS[schema], True), None, call_plain)

"""The aiosqlite driver: the core's plans on a SQLite file, from asyncio.

Rules of this module:

* No state machine here: the driver runs ``worker.plan_*`` plans step by step, through
  aiosqlite's public API only (``execute_fetchall``, ``executemany``, ``commit``, ...).
  aiosqlite owns the connection's one thread; every await is one hop to it.
* A transaction is ``BEGIN IMMEDIATE``, the plan's statements, ``COMMIT``; a plan's
  statements do not grow with its batch (sets are one JSON parameter, fenced writes one
  ``executemany``), so neither do a transaction's hops (``HOPS``).
* ``SQLITE_BUSY`` from other processes is retried at BEGIN (nothing is written yet) with a
  bounded, jittered backoff (``asyncio.sleep``: the loop keeps running), then surfaces as
  ``QueueBusy``.  An exception before COMMIT rolls back and propagates unchanged (a
  failing ROLLBACK never hides it).
* The caller serialises transactions on a connection (one lock) and shields them from
  cancellation (``aio.AsyncQueue``): aiosqlite cannot stop a statement already sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

import aiosqlite

from asnackq.core import worker as w

__all__ = ["HOPS", "Make", "QueueBusy", "SqliteStore", "call_fault", "drive", "steps"]

T = TypeVar("T")
Make = Callable[[], w.Plan[Any]]  # builds a plan (again, when a store retries it)

# Awaits on the connection per transaction, at most, whatever its batch: BEGIN, the plan's
# statements, COMMIT.  A Dispatcher's cycle (finishes, extensions and claims): BEGIN, read
# the finished and extended jobs, write them, the quarantine, the claimable read, the
# lease, COMMIT.
# A cycle paced by a shared rate (``core.rate``): two more, the rate row's read and write.
HOPS = {"cycle": 7, "paced cycle": 9, "enqueue": 4, "inbox": 6}


class QueueBusy(sqlite3.OperationalError):
    """Raised when the queue file stayed locked by other processes beyond the retry bound."""


def call_fault(fault: w.Fault, point: str) -> None:
    """Call a fault hook: a plain call; one returning an awaitable is refused."""
    if fault is None:
        return
    result = fault(point)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"fault returned an awaitable at {point!r}; hooks must be plain calls")


async def begin(db: aiosqlite.Connection, attempts: int) -> None:
    """BEGIN IMMEDIATE, retrying SQLITE_BUSY with a bounded, jittered backoff (``QueueBusy``)."""
    for attempt in range(attempts):
        try:
            await db.execute_fetchall("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) and "busy" not in str(error):
                raise
            if attempt == attempts - 1:
                raise QueueBusy(f"queue locked after {attempts} attempts: {error}") from error
            await asyncio.sleep(random.uniform(0, 0.01 * 2**attempt))


async def steps(db: aiosqlite.Connection, plan: w.Plan[T], fault: w.Fault) -> tuple[T, bool]:
    """The plan's steps, in the caller's transaction: each step is one await (one hop);
    returns ``(result, changed)``."""
    reply: w.Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if isinstance(step, w.Sql):
            reply = [tuple(row) for row in await db.execute_fetchall(step.sql, step.params)]
        elif isinstance(step, w.SqlMany):
            reply = [((await db.executemany(step.sql, step.params)).rowcount,)]
        else:
            reply = None
            call_fault(fault, step.name)


async def rollback(db: aiosqlite.Connection) -> None:
    """Roll back if a transaction is open; a failing rollback never hides the original error."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error, ValueError):  # ValueError: closed
            await db.rollback()


async def drive(
    db: aiosqlite.Connection, plan: w.Plan[T], fault: w.Fault = None, attempts: int = 8
) -> T:
    """Run ``plan`` in one BEGIN IMMEDIATE transaction: COMMIT, or ROLLBACK and re-raise."""
    await begin(db, attempts)  # outside the try: a failed BEGIN owns no transaction
    try:
        result, changed = await steps(db, plan, fault)
        await db.commit()
    except BaseException:
        await rollback(db)
        raise
    if changed:
        call_fault(fault, w.AFTER_COMMIT)
    return result


class SqliteStore:
    """A DB file as a ``Store``: one aiosqlite connection (its own thread), plans run on it."""

    def __init__(
        self, db: aiosqlite.Connection, attempts: int = 8, closing: tuple[str, ...] = ()
    ) -> None:
        self.db, self.attempts, self.closing = db, attempts, closing

    @classmethod
    async def open(
        cls,
        path: Any,
        schema: tuple[str, ...],
        busy_s: float,
        attempts: int = 8,
        pragmas: tuple[str, ...] = w.PRAGMAS,
        closing: tuple[str, ...] = (),
    ) -> SqliteStore:
        """Open a DB file with ``pragmas``, creating ``schema`` through the core's plan.

        The schema goes first: its BEGIN waits out a file another process holds with the
        same bounded backoff as every transaction; once the schema is read, the PRAGMAs
        need no lock.
        """
        db = await aiosqlite.connect(path, timeout=busy_s, isolation_level=None)
        try:
            await drive(db, w.plan_schema(schema), None, attempts)
            for pragma in pragmas:
                await db.execute_fetchall(pragma)
        except BaseException:
            await db.close()
            raise
        return cls(db, attempts, closing)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    async def run(self, make: Make, fault: w.Fault = None) -> Any:
        """Run ``make()``'s plan in one transaction (made once: SQLite serialises writers,
        so a plan never meets a concurrent one)."""
        return await drive(self.db, make(), fault, self.attempts)

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self.db.execute_fetchall(sql, params)]

    async def close(self) -> None:
        """Run ``closing`` (best effort: another connection may still hold the file), close."""
        try:
            with contextlib.suppress(sqlite3.Error):  # e.g. SQLITE_BUSY: the file is shared
                for statement in self.closing:
                    await self.db.execute_fetchall(statement)
        finally:
            await self.db.close()

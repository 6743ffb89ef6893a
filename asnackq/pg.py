"""PostgreSQL: the core's plans driven through psycopg 3, sync and async.

Rules of this module:

* No state machine here.  Every transition is a ``worker.plan_*`` plan; the two drivers
  below run it step by step, answering each ``Sql`` step with the PostgreSQL text
  ``asnackq.pg_sql`` keys to the core's own statement (``SQL_CHANGES`` is answered from the
  previous statement's row count).
* A transaction that meets a deadlock or a concurrent intake of the same id is rolled
  back and its plan made again and re-run (bounded, jittered); ``make`` is a zero-argument
  callable returning a fresh plan.  Fault hooks of a rolled-back try run again.
* Connections are in autocommit mode: the drivers write BEGIN and COMMIT themselves.
  A failing ROLLBACK never hides the original error.
* A session checks (or creates) its schema when it opens (``pg_sql.plan_open``).
* ``BorrowedStore``: an application's own session, on which intakes run inside the
  application's open transaction (``asnackq.borrowed``'s rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.pg_sql import SCHEMAS, Params, plan_open, text, translate
from asnackq.targets import one_line, shown

__all__ = [
    "AsyncStore",
    "Unreachable",
    "aconnect",
    "apump",
    "client_cursor",
    "connect",
    "drive",
    "translate",
]

Make = Callable[[], w.Plan[Any]]
Hooks = Callable[[w.Fault, str], None]  # how an async layer calls a fault hook


class Unreachable(ConnectionError):
    """Raised when no session could be opened: the server is down, or refused the login."""


# --- conflicts and sessions -------------------------------------------------------


def _conflict(error: BaseException) -> bool:
    """Whether a transaction failed only because another one ran at the same time."""
    if isinstance(error, errors.DeadlockDetected | errors.SerializationFailure):
        return True
    return isinstance(error, errors.UniqueViolation) and error.diag.constraint_name in CONFLICT_KEYS


# Unique keys a concurrent intake may hit first (the plan read before the other committed).
CONFLICT_KEYS = {"jobs_id_key"}


def _backoff(attempt: int) -> float:
    return random.uniform(0, 0.005 * 2**attempt)


# A session whose client vanished mid-transaction (a host lost, a network cut) would hold
# its row locks until TCP gives up: the server ends it after 10 s idle in a transaction
# (no transaction of ours waits on the client: sends happen between transactions).
SQL_SESSION = "SET idle_in_transaction_session_timeout = 10000"


def _refused(url: str, error: psycopg.Error) -> Exception:
    """A failed connection as one line, without the password (libpq may echo the URL)."""
    why = one_line(error).replace(url, shown(url))
    if isinstance(error, psycopg.OperationalError):
        return Unreachable(f"cannot connect to {shown(url)}: {why}")
    return ValueError(f"not a usable PostgreSQL URL {shown(url)}: {why}")


# --- the sync driver ----------------------------------------------------------------


def connect(
    url: str, schema: tuple[str, ...] = w.SCHEMA, *, create: bool = True, read_only: bool = False
) -> psycopg.Connection[Any]:
    """A session on ``url`` with ``schema`` (the core's tuple) checked or created."""
    try:
        con = psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.Error as error:
        raise _refused(url, error) from None
    try:
        con.execute(SQL_SESSION)
        drive(con, lambda: plan_open(SCHEMAS[schema], create and not read_only))
        if read_only:
            con.execute("SET default_transaction_read_only = on")
    except BaseException:
        con.close()
        raise
    return con


def drive(
    con: psycopg.Connection[Any],
    make: Make,
    fault: w.Fault = None,
    attempts: int = 8,
    first: w.Plan[Any] | None = None,
) -> Any:
    """Run the plan ``first`` (default: ``make()``) in one transaction on ``con``.

    A conflict with a concurrent transaction rolls back and runs ``make()`` again.
    """
    plan = make() if first is None else first  # validated before anything is sent
    for attempt in range(attempts):
        con.execute("BEGIN")  # outside the try: a failed BEGIN owns no transaction
        try:
            result, changed = _run(con, plan, fault)
            con.execute("COMMIT")
        except BaseException as error:
            _rollback(con)
            if not _conflict(error) or attempt == attempts - 1:
                raise
            time.sleep(_backoff(attempt))
            plan = make()
            continue
        if changed and fault is not None:
            fault(w.AFTER_COMMIT)
        return result
    raise AssertionError("unreachable")


def _run(con: psycopg.Connection[Any], plan: w.Plan[Any], fault: w.Fault) -> tuple[Any, bool]:
    """The sync pump loop: each step is one round trip (executemany: one pipeline)."""
    reply: list[tuple[Any, ...]] | None = None
    count = 0
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if isinstance(step, w.Sql) and step.sql == w.SQL_CHANGES:
            reply = [(count,)]
        elif isinstance(step, w.Sql):
            cursor = con.execute(*translate(step.sql, step.params))
            count = cursor.rowcount
            reply = cursor.fetchall() if cursor.description is not None else []
        elif isinstance(step, w.SqlMany):
            with con.cursor() as cursor:
                cursor.executemany(text(step.sql), step.params)
                reply = [(cursor.rowcount,)]
        else:
            reply = None
            if fault is not None:
                fault(step.name)


def client_cursor(con: psycopg.Connection[Any]) -> psycopg.ClientCursor[Any]:
    """A cursor binding parameters client-side (as SQLite does: ``? IS NULL`` works)."""
    return psycopg.ClientCursor(con)


def _rollback(con: psycopg.Connection[Any]) -> None:
    if con.info.transaction_status != TransactionStatus.IDLE:
        with contextlib.suppress(psycopg.Error):
            con.execute("ROLLBACK")


# --- the async driver ---------------------------------------------------------------


async def aconnect(
    url: str, schema: tuple[str, ...] = w.SCHEMA, *, create: bool = True
) -> psycopg.AsyncConnection[Any]:
    """The async twin of ``connect``."""
    try:
        con = await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.Error as error:
        raise _refused(url, error) from None
    try:
        await con.execute(SQL_SESSION)
        await apump(con, lambda: plan_open(SCHEMAS[schema], create))
    except BaseException:
        await con.close()
        raise
    return con


async def apump(
    con: psycopg.AsyncConnection[Any],
    make: Make,
    fault: w.Fault = None,
    attempts: int = 8,
    first: w.Plan[Any] | None = None,
    call: Hooks | None = None,
) -> Any:
    """The async twin of ``drive``; ``call(fault, point)`` runs each hook (default: plain)."""
    call = call or _call
    plan = make() if first is None else first
    for attempt in range(attempts):
        await con.execute("BEGIN")
        try:
            result, changed = await _arun(con, plan, fault, call)
            await con.execute("COMMIT")
        except BaseException as error:
            await _arollback(con)
            if not _conflict(error) or attempt == attempts - 1:
                raise
            await asyncio.sleep(_backoff(attempt))
            plan = make()
            continue
        if changed:
            call(fault, w.AFTER_COMMIT)
        return result
    raise AssertionError("unreachable")


def _call(fault: w.Fault, point: str) -> None:
    if fault is not None:
        fault(point)


async def _arun(
    con: psycopg.AsyncConnection[Any], plan: w.Plan[Any], fault: w.Fault, call: Hooks
) -> tuple[Any, bool]:
    reply: list[tuple[Any, ...]] | None = None
    count = 0
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if isinstance(step, w.Sql) and step.sql == w.SQL_CHANGES:
            reply = [(count,)]
        elif isinstance(step, w.Sql):
            cursor = await con.execute(*translate(step.sql, step.params))
            count = cursor.rowcount
            reply = await cursor.fetchall() if cursor.description is not None else []
        elif isinstance(step, w.SqlMany):
            async with con.cursor() as cursor:
                await cursor.executemany(text(step.sql), step.params)
                reply = [(cursor.rowcount,)]
        else:
            reply = None
            call(fault, step.name)


async def _arollback(con: psycopg.AsyncConnection[Any]) -> None:
    if con.info.transaction_status != TransactionStatus.IDLE:
        with contextlib.suppress(psycopg.Error):
            await con.execute("ROLLBACK")


class AsyncStore:
    """One async session: plans, reads and the transaction state (``AsyncQueue``, sink)."""

    def __init__(self, con: psycopg.AsyncConnection[Any], attempts: int, call: Hooks) -> None:
        self.con, self.attempts, self.call = con, attempts, call

    async def transact(self, plan: w.Plan[Any], make: Make, fault: w.Fault = None) -> Any:
        return await apump(self.con, make, fault, self.attempts, plan, self.call)

    async def read(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        cursor = await self.con.execute(*translate(sql, params))
        return await cursor.fetchall()

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    async def close(self) -> None:
        await self.con.close()


class BorrowedStore:
    """An application's async session as a store: plans inside its open transaction
    (``asnackq.borrowed``'s rules), each under a savepoint, re-run after a conflict."""

    def __init__(self, con: psycopg.AsyncConnection[Any], attempts: int) -> None:
        self.con, self.attempts = con, attempts

    @classmethod
    async def adopt(
        cls, con: psycopg.AsyncConnection[Any], schema: tuple[str, ...], attempts: int
    ) -> BorrowedStore:
        """Check (or create) ``schema`` in a transaction of its own."""
        if con.info.transaction_status != TransactionStatus.IDLE:
            from asnackq.borrowed import BUSY

            raise ValueError(BUSY)
        async with con.transaction():
            await _arun(con, plan_open(SCHEMAS[schema], True), None, _call)
        return cls(con, attempts)

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    async def transact(self, plan: w.Plan[Any], make: Make, fault: w.Fault = None) -> Any:
        if self.con.info.transaction_status != TransactionStatus.INTRANS:
            from asnackq.borrowed import NO_TRANSACTION

            raise ValueError(NO_TRANSACTION)
        for attempt in range(self.attempts):
            try:
                async with self.con.transaction():  # a savepoint: the caller's stays open
                    result, _ = await _arun(self.con, plan, fault, _call)
                return result
            except Exception as error:
                if not _conflict(error) or attempt == self.attempts - 1:
                    raise
                await asyncio.sleep(_backoff(attempt))
                plan = make()
        raise AssertionError("unreachable")

    async def read(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        cursor = await self.con.execute(*translate(sql, params))
        return await cursor.fetchall()

    async def close(self) -> None:
        """Nothing: the session is the application's."""

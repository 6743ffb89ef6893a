"""Transactions asnackq begins and commits on an application's connection, with the
application's own effect awaited inside them (a webhook receiver's inbox: ``core.inbox``).

Rules of this module:

* The connection is the application's: an ``aiosqlite.Connection`` or a psycopg
  ``AsyncConnection``; anything else is a ``ValueError``.  asnackq never closes it.
* One transaction at a time on it: each takes ``turn(con)``, the lock every intake on the
  connection takes (``asnackq.store.turns``; the effect's own intakes, in the same task,
  re-enter it and commit with the transaction).  Under the turn the connection must be idle:
  one with a transaction open is refused (``ValueError``), nothing written.
* A transaction is BEGIN (IMMEDIATE on SQLite, retried while another process holds the
  file: ``QueueBusy``), the plan's steps, the effect awaited at the plan's hook point,
  COMMIT.  Anything raised before COMMIT rolls back every write, the inbox's and the
  effect's, and propagates (a failing ROLLBACK never hides it); an exception of the effect
  arrives as ``EffectFailed``, its cause the effect's own.  An effect that ends the transaction
  (COMMIT, ROLLBACK) or, on PostgreSQL, leaves it aborted (a failed statement it caught: the
  server would answer COMMIT with a silent ROLLBACK) is refused at COMMIT: a ``RuntimeError``,
  everything rolled back.  On PostgreSQL a transaction
  that met a concurrent one (deadlock, serialization failure) runs again from BEGIN,
  effect included (bounded, jittered): it rolled back, so nothing of it stayed.
* The transaction runs in a task of its own under ``asyncio.shield``: a cancelled caller
  never splits it (the task finishes, then the cancellation is raised).
* Each plan step is one step of the connection's own driver (``sqlite_aio.steps``,
  ``pg.asteps``): a plan run here never uses ``SQL_CHANGES``, which needs a whole plan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import aiosqlite

from asnackq.core import worker as w
from asnackq.store.sqlite_aio import adrive, begin, rollback, steps
from asnackq.store.turns import turn

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "ATTEMPTS",
    "IDLE",
    "EffectFailed",
    "Hooks",
    "check_connection",
    "prepare",
    "pump",
    "transact",
]

T = TypeVar("T")
Hooks = Callable[[str], Awaitable[None]]  # awaited at each hook point of a plan
Run = Callable[[w.Plan[w.Reply]], Awaitable[tuple[w.Reply, bool]]]
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
    """Raised when the application's effect raised: the transaction rolled back, nothing of
    it stays; ``__cause__`` is the effect's exception."""


def _one(step: w.Step) -> w.Plan[w.Reply]:
    """A plan of one step: its reply is the result."""
    reply = yield step
    return reply, False


async def pump(plan: w.Plan[T], run: Run, hooks: Hooks) -> T:
    """The plan's steps inside the caller's transaction: each statement through ``run``,
    each hook point awaited."""
    reply: w.Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value[0]  # type: ignore[no-any-return]
        if isinstance(step, w.Hook):
            try:
                await hooks(step.name)
            except Exception as error:
                raise EffectFailed(f"the effect raised {type(error).__name__}") from error
            reply = None
        else:
            reply, _ = await run(_one(step))


async def _sqlite(db: aiosqlite.Connection, plan: w.Plan[T], hooks: Hooks) -> T:
    if db.in_transaction:
        raise ValueError(IDLE)
    await begin(db, ATTEMPTS)  # (a failed BEGIN owns no transaction)
    try:
        result = await pump(plan, lambda one: steps(db, one, None), hooks)
        if not db.in_transaction:
            raise RuntimeError(ENDED)
        await db.commit()
    except BaseException:
        await rollback(db)
        raise
    return result


async def _pg(con: psycopg.AsyncConnection[Any], make: Callable[[], w.Plan[T]], hooks: Hooks) -> T:
    from psycopg.pq import TransactionStatus

    from asnackq.store.pg import asteps, call_plain, conflict, conflict_delay_s

    for attempt in range(ATTEMPTS):
        if con.info.transaction_status != TransactionStatus.IDLE:
            raise ValueError(IDLE)
        try:
            async with con.transaction():  # BEGIN ... COMMIT, or ROLLBACK and re-raise
                result = await pump(make(), lambda one: asteps(con, one, None, call_plain), hooks)
                # (PostgreSQL answers COMMIT on an aborted transaction with a ROLLBACK, no error)
                status = _status(con)  # (read again: the effect ran meanwhile)
                if status != TransactionStatus.INTRANS:
                    raise RuntimeError(ABORTED if status == TransactionStatus.INERROR else ENDED)
                return result
        except Exception as error:
            cause = error.__cause__ if isinstance(error, EffectFailed) else error
            if cause is None or not conflict(cause) or attempt == ATTEMPTS - 1:
                raise
        await asyncio.sleep(conflict_delay_s(attempt))
    raise AssertionError("unreachable")


def _status(con: psycopg.AsyncConnection[Any]) -> psycopg.pq.TransactionStatus:
    return con.info.transaction_status


async def _locked(con: object, make: Callable[[], w.Plan[T]], hooks: Hooks) -> T:
    async with turn(con):
        if isinstance(con, aiosqlite.Connection):
            return await _sqlite(con, make(), hooks)
        return await _pg(cast("psycopg.AsyncConnection[Any]", con), make, hooks)


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


async def transact(con: object, make: Callable[[], w.Plan[T]], hooks: Hooks) -> T:
    """Run ``make()``'s plan in a transaction of its own on ``con``, awaiting ``hooks`` at
    its hook points; shielded from the caller's cancellation."""
    check_connection(con)
    task = asyncio.ensure_future(_locked(con, make, hooks))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
        raise


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

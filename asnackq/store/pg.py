"""PostgreSQL: the core's plans driven through psycopg 3, sync and async.

Rules of this module:

* No state machine here.  Every transition is a ``worker.plan_*`` plan; the two drivers
  below run it step by step, answering each ``Sql`` step with the PostgreSQL text
  ``asnackq.store.pg_sql`` keys to the core's own statement (``SQL_CHANGES`` is answered from the
  previous statement's row count).
* A transaction that meets a deadlock or a concurrent intake of the same id is rolled
  back and its plan made again and re-run (bounded, jittered); ``make`` is a zero-argument
  callable returning a fresh plan (without it, a conflict is raised).  Fault hooks of a
  rolled-back try run again.
* Connections are in autocommit mode: the drivers write BEGIN and COMMIT themselves.
  A failing ROLLBACK never hides the original error.
* A session checks (or creates) its schema when it opens (``pg_sql.plan_open``).
* ``BorrowedStore``: an application's own session, on which intakes run inside the
  application's open transaction (``asnackq.store.borrowed``'s rules).
* ``AsyncStore`` (the worker's and the sink's) outlives its connections: a lost session is
  opened again and a cut transaction re-run, or its cut COMMIT looked up (``asnackq.store.outage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.store.outage import CommitUnknown, Health, StoreUnavailable
from asnackq.store.pg_sql import SCHEMAS, Params, plan_open, text, translate
from asnackq.store.targets import one_line, shown

__all__ = [
    "AsyncStore",
    "BorrowedStore",
    "CommitCut",
    "Unreachable",
    "aconnect",
    "adrive",
    "client_cursor",
    "connect",
    "drive",
]

Make = Callable[[], w.Plan[Any]]
RESOLVE_S = 300.0  # how long a lost COMMIT's outcome is sought before CommitUnknown
RECONNECT_TIMEOUT_S = 3  # a reconnection attempt's connect timeout
Hooks = Callable[[w.Fault, str], None]  # how an async layer calls a fault hook


class Unreachable(ConnectionError):
    """Raised when no session could be opened: the server is down, or refused the login."""


class CommitCut(Exception):
    """Raised by ``adrive`` when the session was lost while its COMMIT was on the way: the
    transaction ``begun`` (its id, and the server's start time) may or may not have
    committed; ``result`` is what the plan returned."""

    def __init__(self, begun: tuple[str, str], result: Any, changed: bool) -> None:
        super().__init__(f"the session was lost during COMMIT of transaction {begun[0]}")
        self.begun, self.result, self.changed = begun, result, changed


# --- conflicts and sessions -------------------------------------------------------


def _conflict(error: BaseException) -> bool:
    """Whether a transaction failed only because another one ran at the same time."""
    if isinstance(error, errors.DeadlockDetected | errors.SerializationFailure):
        return True
    return isinstance(error, errors.UniqueViolation) and error.diag.constraint_name in CONFLICT_KEYS


# Unique keys a concurrent intake may hit first (the plan read before the other committed).
CONFLICT_KEYS = {"jobs_id_key", "pg_type_typname_nsp_index"}  # (and two first CREATE TABLEs)


def _backoff(attempt: int) -> float:
    return random.uniform(0, 0.005 * 2**attempt)


# A session whose client vanished mid-transaction (a host lost, a network cut) would hold
# its row locks until TCP gives up: the server ends it after 10 s idle in a transaction
# (no transaction of ours waits on the client: sends happen between transactions).
SQL_SESSION = "SET idle_in_transaction_session_timeout = 10000"
# Before its COMMIT, an async transaction that wrote learns its id (one round trip; one
# that only read has none, and nothing to lose): after a lost COMMIT, a new session asks
# the server whether that transaction committed.  Only the server that gave the id can
# say: after a crash, an id whose records never reached the disk is given to another
# transaction, so a server restarted since answers "restarted" (unknown).
SQL_XACT = "SELECT pg_current_xact_id_if_assigned()::text, pg_postmaster_start_time()::text"
SQL_XACT_STATUS = """SELECT CASE WHEN pg_postmaster_start_time()::text = %s
  THEN pg_xact_status(%s::xid8) ELSE 'restarted' END"""
# A peer that vanished (a cut network) is noticed within seconds, not at TCP's minutes:
# keepalives on an idle session, and a bound on data left unacknowledged.
TCP_OPTIONS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


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
        opening = partial(plan_open, SCHEMAS[schema], create and not read_only)
        drive(con, opening(), make=opening)
        if read_only:
            con.execute("SET default_transaction_read_only = on")
    except BaseException:
        con.close()
        raise
    return con


def drive(
    con: psycopg.Connection[Any],
    plan: w.Plan[Any],
    fault: w.Fault = None,
    *,
    make: Make | None = None,
    attempts: int = 8,
) -> Any:
    """Run ``plan`` in one transaction on ``con``.

    A conflict with a concurrent transaction rolls back and runs ``make()`` again.
    """
    for attempt in range(attempts):
        con.execute("BEGIN")  # outside the try: a failed BEGIN owns no transaction
        try:
            result, changed = _steps(con, plan, fault)
            con.execute("COMMIT")
        except BaseException as error:
            _rollback(con)
            if make is None or not _conflict(error) or attempt == attempts - 1:
                raise
            time.sleep(_backoff(attempt))
            plan = make()
            continue
        if changed and fault is not None:
            fault(w.AFTER_COMMIT)
        return result
    raise AssertionError("unreachable")


def _steps(con: psycopg.Connection[Any], plan: w.Plan[Any], fault: w.Fault) -> tuple[Any, bool]:
    """The plan's steps: each step is one round trip (executemany: one pipeline)."""
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
    url: str, schema: tuple[str, ...] = w.SCHEMA, *, create: bool = True, timeout_s: int = 10
) -> psycopg.AsyncConnection[Any]:
    """The async twin of ``connect``."""
    try:
        con = await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=timeout_s, **TCP_OPTIONS
        )
    except psycopg.Error as error:
        raise _refused(url, error) from None
    try:
        await con.execute(SQL_SESSION)
        opening = partial(plan_open, SCHEMAS[schema], create)
        await adrive(con, opening(), make=opening)
    except BaseException:
        await con.close()
        raise
    return con


async def adrive(
    con: psycopg.AsyncConnection[Any],
    plan: w.Plan[Any],
    fault: w.Fault = None,
    *,
    make: Make | None = None,
    attempts: int = 8,
    call: Hooks | None = None,
) -> Any:
    """The async twin of ``drive``; ``call(fault, point)`` runs each hook (default: plain).

    A session lost while its COMMIT was on the way raises ``CommitCut`` (the transaction's
    id, the plan's result): whether it committed is for the caller to learn.
    """
    call = call or _call
    for attempt in range(attempts):
        await con.execute("BEGIN")
        begun: tuple[str | None, str] = (None, "")
        try:
            result, changed = await _asteps(con, plan, fault, call)
            cursor = await con.execute(SQL_XACT)
            begun = await cursor.fetchone() or begun
            await con.execute("COMMIT")
        except BaseException as error:
            if begun[0] is not None and con.closed:
                raise CommitCut((begun[0], begun[1]), result, changed) from error
            await _arollback(con)
            if make is None or not _conflict(error) or attempt == attempts - 1:
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


async def _asteps(
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
    """One async session on ``url`` that outlives its connections: plans, reads, the
    transaction state (``AsyncQueue``, the sink).

    A lost session is opened again (``Health``: capped, jittered backoff, counted); until
    then every call raises ``StoreUnavailable`` at once.  A transaction cut before its
    COMMIT committed nothing: its plan is made again and re-run on the new session (as for
    a deadlock).  A transaction whose COMMIT was cut is looked up by its id
    (``pg_xact_status``) on the new session for up to ``resolve_s`` (``CommitUnknown``
    after that): committed, its result stands; aborted, its plan is re-run.
    """

    def __init__(
        self,
        url: str,
        schema: tuple[str, ...],
        con: psycopg.AsyncConnection[Any],
        attempts: int,
        call: Hooks,
        resolve_s: float = RESOLVE_S,
    ) -> None:
        self.url, self.schema, self.attempts, self.call = url, schema, attempts, call
        self.con: psycopg.AsyncConnection[Any] | None = con
        self.resolve_s = resolve_s
        self.health = Health()
        self.why = ""  # the last failure, for StoreUnavailable's message

    @classmethod
    async def open(
        cls, url: str, schema: tuple[str, ...], attempts: int, call: Hooks, resolve_s: float
    ) -> AsyncStore:
        return cls(url, schema, await aconnect(url, schema), attempts, call, resolve_s)

    async def run(self, make: Make, fault: w.Fault = None) -> Any:
        plan = make()
        for _ in range(self.attempts):
            con = await self.session()
            try:
                return await adrive(
                    con, plan, fault, make=make, attempts=self.attempts, call=self.call
                )
            except CommitCut as cut:
                self._lost(cut.__cause__)
                self.health.cut_commits += 1
                if await self._committed(*cut.begun):
                    if cut.changed:
                        self.call(fault, w.AFTER_COMMIT)
                    return cut.result
            except psycopg.OperationalError as error:
                if not con.closed:
                    raise
                self._lost(error)
            self.health.reruns += 1
            plan = make()
        raise StoreUnavailable(f"the session was lost {self.attempts} times in a row: {self.why}")

    async def read(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        return await self._query(*translate(sql, params))

    async def _query(self, sql: Any, params: Any) -> list[tuple[Any, ...]]:
        con = await self.session()
        try:
            cursor = await con.execute(sql, params)
            return await cursor.fetchall()
        except psycopg.OperationalError as error:
            if not con.closed:
                raise
            self._lost(error)
            raise StoreUnavailable(self.why) from None

    async def session(self) -> psycopg.AsyncConnection[Any]:
        """The open session, or a new one (``StoreUnavailable`` while none can be had)."""
        if self.con is not None and not self.con.closed:
            return self.con
        self.health.lost()
        wait = self.health.wait_s()
        if wait > 0:
            raise StoreUnavailable(f"{self.why} (next try in {wait * 1000:.0f} ms)", wait)
        try:
            self.con = await aconnect(self.url, self.schema, timeout_s=RECONNECT_TIMEOUT_S)
        except (Unreachable, psycopg.OperationalError) as error:
            self.why = one_line(error).replace(self.url, shown(self.url))
            raise StoreUnavailable(self.why, self.health.failed()) from None
        self.health.back()
        return self.con

    def _lost(self, error: BaseException | None) -> None:
        self.health.lost()
        why = "closed" if error is None else one_line(error)
        self.why = f"lost the session to {shown(self.url)}: {why}"

    async def _committed(self, xid: str, started: str) -> bool:
        """Whether transaction ``xid`` committed, asked on a new session (``CommitUnknown``
        if no session answers within ``resolve_s``, or the server restarted meanwhile)."""
        deadline = time.monotonic() + self.resolve_s
        while True:
            try:
                ((status,),) = await self._query(SQL_XACT_STATUS, (started, xid))
            except StoreUnavailable as error:
                if time.monotonic() + error.retry_in_s > deadline:
                    raise CommitUnknown(
                        f"COMMIT of transaction {xid} unconfirmed: {error}"
                    ) from None
                await asyncio.sleep(error.retry_in_s)
                continue
            if status == "restarted":
                raise CommitUnknown(f"COMMIT of transaction {xid} cut by a server restart")
            if status != "in progress":  # (the old session may still be ending)
                return bool(status == "committed")
            if time.monotonic() > deadline:
                raise CommitUnknown(f"COMMIT of transaction {xid} still in progress")
            await asyncio.sleep(0.05)

    @property
    def in_transaction(self) -> bool:
        con = self.con
        if con is None or con.closed:
            return False
        return con.info.transaction_status != TransactionStatus.IDLE

    async def close(self) -> None:
        if self.con is not None:
            await self.con.close()


class BorrowedStore:
    """An application's async session as a store: plans inside its open transaction
    (``asnackq.store.borrowed``'s rules), each under a savepoint, re-run after a conflict."""

    def __init__(self, con: psycopg.AsyncConnection[Any], attempts: int) -> None:
        self.con, self.attempts = con, attempts

    @classmethod
    async def adopt(
        cls, con: psycopg.AsyncConnection[Any], schema: tuple[str, ...], attempts: int
    ) -> BorrowedStore:
        """Check (or create) ``schema`` in a transaction of its own."""
        if con.info.transaction_status != TransactionStatus.IDLE:
            from asnackq.store.borrowed import BUSY

            raise ValueError(BUSY)
        async with con.transaction():
            await _asteps(con, plan_open(SCHEMAS[schema], True), None, _call)
        return cls(con, attempts)

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    async def run(self, make: Make, fault: w.Fault = None) -> Any:
        plan = make()
        if self.con.info.transaction_status != TransactionStatus.INTRANS:
            from asnackq.store.borrowed import NO_TRANSACTION

            raise ValueError(NO_TRANSACTION)
        for attempt in range(self.attempts):
            try:
                async with self.con.transaction():  # a savepoint: the caller's stays open
                    result, _ = await _asteps(self.con, plan, fault, _call)
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

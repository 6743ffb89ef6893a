"""PostgreSQL stores: the worker's and the sink's session that outlives its connections, and
an application's borrowed session.  Both run the core's plans through ``asnackq.store.pg``.

Rules of this module:

* ``AsyncStore`` (the worker's and the sink's) outlives its connections: a lost session is
  opened again (capped, jittered backoff: ``asnackq.store.outage``) and a cut transaction
  re-run, or its cut COMMIT looked up by the transaction's id.  Its slow walks from the
  front are a scout's, on a second session opened when first needed and closed once no
  scout has used it for ``SCOUT_IDLE_S`` (``pg_walks``).
* ``BorrowedStore``: an application's own session, on which intakes run inside the
  application's open transaction (``asnackq.store.borrowed``'s rules).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.store.outage import (
    BUSY,
    NO_TRANSACTION,
    CommitUnknown,
    Health,
    StoreUnavailable,
)
from asnackq.store.pg import (
    SQL_XACT_STATUS,
    CommitCut,
    Hooks,
    Unreachable,
    aconnect,
    adrive,
    asteps,
    call_plain,
    conflict,
    conflict_delay_s,
    ended,
)
from asnackq.store.pg_sql import SCHEMAS, Params, plan_open, translate
from asnackq.store.pg_walks import Walks
from asnackq.store.targets import one_line, scrubbed, shown
from asnackq.store.turns import turn

__all__ = ["RECONNECT_TIMEOUT_S", "RESOLVE_S", "SCOUT_NAME", "AsyncStore", "BorrowedStore"]

RESOLVE_S = 300.0  # how long a lost COMMIT's outcome is sought before CommitUnknown
RECONNECT_TIMEOUT_S = 3  # a reconnection attempt's connect timeout
OPEN_WAIT_S = 30.0  # how long a store's first session is sought
SCOUT_NAME = "asnackq scout"  # the scouts' session's application_name (pg_stat_activity)
SCOUT_CLOSE_S = 5.0  # how long a closing store waits for its scouts to end
SCOUT_IDLE_S = 60.0  # the scouts' session is closed once no scout has used it this long


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
        self.give_up_at = math.inf  # (time.monotonic) see ``give_up_after``
        self.health = Health()
        self.why = ""  # the last failure, for StoreUnavailable's message
        self.walks = Walks(scout=self._scout)  # where its claims' walks start (``pg_walks``)
        self.scout_con: psycopg.AsyncConnection[Any] | None = None  # (the scouts' session)
        self.scouting = asyncio.Lock()
        self.scouts_idle: asyncio.TimerHandle | None = None  # (``_close_idle``'s timer)
        self.scouts_closing: set[asyncio.Future[None]] = set()
        self.scouts_ended = False  # (the store closes: no timer is set again)

    @classmethod
    async def open(
        cls, url: str, schema: tuple[str, ...], attempts: int, call: Hooks, resolve_s: float
    ) -> AsyncStore:
        """A store on its first session.  A session that ends while it opens (a killed
        backend, a restart: an ``OperationalError`` once connected) is opened again, as a
        lost session is, for ``OPEN_WAIT_S`` at most; a server that cannot be reached
        (``Unreachable``) or any other error is the caller's at once."""
        health, gives_up = Health(), time.monotonic() + OPEN_WAIT_S
        while True:
            try:
                return cls(url, schema, await aconnect(url, schema), attempts, call, resolve_s)
            except psycopg.OperationalError:
                wait = health.failed()
                if time.monotonic() + wait > gives_up:
                    raise
            await asyncio.sleep(wait)

    async def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        plan = make()
        for _ in range(self.attempts):
            con = await self.session()
            try:
                return await adrive(
                    con,
                    plan,
                    fault,
                    make=make,
                    attempts=self.attempts,
                    call=self.call,
                    walks=self.walks,
                )
            except CommitCut as cut:
                self._lost(cut.__cause__)
                self.health.cut_commits += 1
                if await self._committed(*cut.begun):
                    if cut.changed:
                        self.call(fault, w.AFTER_COMMIT)
                    return cut.result
            except psycopg.Error as error:
                if not await ended(con, error):
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
        except psycopg.Error as error:
            if not await ended(con, error):
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
            self.why = scrubbed(one_line(error), self.url)
            raise StoreUnavailable(self.why, self.health.failed()) from None
        self.health.back()
        return self.con

    async def _scout(
        self, sql: str, params: dict[str, Any], begun: Callable[[], None] | None = None
    ) -> list[tuple[Any, ...]]:
        """A claim's walk from the front, without locks, on a session of the scouts' own
        (``pg_walks``): the queue's session goes on claiming from its floors meanwhile.
        Opened when first needed, and again after a failure (which the walks meet as a
        scout that failed: the claim then walks from the front itself).  ``begun`` is
        called as the walk starts, once the session is there (after the scouts' lock, and
        any connect)."""
        async with self.scouting:  # (one scout at a time: a claim's two statements may both go)
            con = self.scout_con
            if con is None or con.closed:
                con = self.scout_con = await aconnect(
                    self.url,
                    self.schema,
                    create=False,
                    timeout_s=RECONNECT_TIMEOUT_S,
                    application_name=SCOUT_NAME,
                )
            if begun is not None:
                begun()
            try:
                cursor = await con.execute(sql, params)
                return await cursor.fetchall()
            except BaseException:
                self.scout_con = None
                await con.close()
                raise
            finally:
                if self.scouts_idle is not None:
                    self.scouts_idle.cancel()
                if not self.scouts_ended:
                    loop = asyncio.get_running_loop()
                    self.scouts_idle = loop.call_later(SCOUT_IDLE_S, self._close_idle)

    def _close_idle(self) -> None:
        """Close the scouts' session no scout has used for ``SCOUT_IDLE_S`` (walks from the
        front quick again: the claims walk them on the queue's session).  A scout on its
        way keeps it, and its end sets this timer again; the next scout opens another."""
        self.scouts_idle = None
        con = self.scout_con
        if con is None or self.scouting.locked():
            return
        self.scout_con = None
        closing = asyncio.ensure_future(con.close())
        self.scouts_closing.add(closing)
        closing.add_done_callback(self._closed_idle)

    def _closed_idle(self, closing: asyncio.Future[None]) -> None:
        self.scouts_closing.discard(closing)
        if not closing.cancelled():
            closing.exception()  # (a session that failed as it closed: nothing to tell)

    def _lost(self, error: BaseException | None) -> None:
        self.health.lost()
        why = "closed" if error is None else scrubbed(one_line(error), self.url)
        self.why = f"lost the session to {shown(self.url)}: {why}"

    async def _committed(self, xid: str, started: str) -> bool:
        """Whether transaction ``xid`` committed, asked on a new session (``CommitUnknown``
        if no session answers within ``resolve_s``, or the server restarted meanwhile)."""
        resolving = time.monotonic() + self.resolve_s
        while True:
            deadline = min(resolving, self.give_up_at)
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

    def give_up_after(self, seconds: float) -> None:
        """Seek a cut COMMIT's outcome for ``seconds`` from now at most (a closing run's
        bound on waiting for its database; ``CommitUnknown`` after)."""
        self.give_up_at = time.monotonic() + seconds

    @property
    def in_transaction(self) -> bool:
        con = self.con
        if con is None or con.closed:
            return False
        return con.info.transaction_status != TransactionStatus.IDLE

    async def close(self) -> None:
        try:
            await self._close_scouts()
        finally:
            if self.con is not None:
                await self.con.close()

    async def _close_scouts(self) -> None:
        """End the scouts' session first (a walk on it fails at once, where a cancelled one
        waits for the server to end it), then the scouts themselves."""
        self.scouts_ended = True
        if self.scouts_idle is not None:
            self.scouts_idle.cancel()
        if self.scout_con is not None:
            await self.scout_con.close()
        if self.scouts_closing:  # (an idle session's close on its way)
            await asyncio.wait(self.scouts_closing, timeout=SCOUT_CLOSE_S)
        scouts = self.walks.stop()
        if scouts:
            done, _ = await asyncio.wait(scouts, timeout=SCOUT_CLOSE_S)
            for scout in done:  # (their failures are the closing's: told to no one)
                if not scout.cancelled():
                    scout.exception()
        if self.scout_con is not None:  # (one opened meanwhile)
            await self.scout_con.close()


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
            raise ValueError(BUSY)
        async with con.transaction():
            await asteps(con, plan_open(SCHEMAS[schema], True), None, call_plain)
        return cls(con, attempts)

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    async def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        plan = make()
        async with turn(self.con):  # (one intake at a time on the connection)
            if self.con.info.transaction_status != TransactionStatus.INTRANS:
                raise ValueError(NO_TRANSACTION)
            for attempt in range(self.attempts):
                try:
                    async with self.con.transaction():  # a savepoint: the caller's stays open
                        result, _ = await asteps(self.con, plan, fault, call_plain)
                    return result
                except Exception as error:
                    if not conflict(error) or attempt == self.attempts - 1:
                        raise
                    await asyncio.sleep(conflict_delay_s(attempt))
                    plan = make()
        raise AssertionError("unreachable")

    async def read(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        cursor = await self.con.execute(*translate(sql, params))
        return await cursor.fetchall()

    async def close(self) -> None:
        """Nothing: the session is the application's."""

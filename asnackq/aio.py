"""The asyncio layer: the core's plans, driven off the event loop (the Dispatcher: ``dispatch``).

Rules of this module:

* No state machine and no driver here: every transition is a ``worker.plan_*`` plan, and
  on a file the core's own sqlite3 driver runs it, whole, on the connection's thread: one
  hop per transaction, not per statement (each hop waits for the busy event loop to hand
  over the GIL; the sink's ACKs wait for its commits).
* One connection and one ``asyncio.Lock`` per queue: two coroutines' transactions never
  interleave.  A transaction runs in its own task under ``asyncio.shield``: a cancelled
  caller waits for the COMMIT or ROLLBACK, then re-raises - never a split write.
* No transaction is ever open across a network await: sends happen between plans.
* ``SQLITE_BUSY`` from other processes is retried at BEGIN (nothing is written yet) with
  a bounded, jittered backoff (on the connection's thread), then surfaces as ``QueueBusy``.
* A queue is a *store*: a file on its own thread (``SqliteStore``) or a ``postgresql://``
  URL through psycopg (``asnackq.pg.AsyncStore``); the same face, the same plans.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar

from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.outage import Health
from asnackq.targets import is_url

__all__ = ["AsyncQueue", "QueueBusy", "epoch_ms"]  # and, lazily, Dispatcher and Summary

T = TypeVar("T")
AsyncSend = Callable[..., Awaitable[object]]


class QueueBusy(sqlite3.OperationalError):
    """Raised when the queue file stayed locked by other processes beyond the retry bound."""


def check_async_fault(fault: object) -> w.Fault:
    """A fault hook must be a plain callable: one returning a coroutine is refused."""
    if inspect.iscoroutinefunction(fault):
        raise TypeError("fault must be a plain callable, not a coroutine function")
    return w.check_fault(fault)


def call_fault(fault: w.Fault, point: str) -> None:
    if fault is None:
        return
    result = fault(point)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"fault returned an awaitable at {point!r}; hooks must be plain calls")


def begin(con: sqlite3.Connection, attempts: int) -> None:
    """BEGIN IMMEDIATE, retrying SQLITE_BUSY with a bounded, jittered backoff (``QueueBusy``).

    Runs on the connection's own thread: its waits never block the event loop.
    """
    for attempt in range(attempts):
        try:
            con.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) and "busy" not in str(error):
                raise
            if attempt == attempts - 1:
                raise QueueBusy(f"queue locked after {attempts} attempts: {error}") from error
            time.sleep(random.uniform(0, 0.01 * 2**attempt))


def run_plan(con: sqlite3.Connection, plan: w.Plan[T], fault: w.Fault, attempts: int) -> T:
    """One transaction on the connection's thread: the retried BEGIN, then the core's driver."""
    begin(con, attempts)  # outside the driver: a failed BEGIN owns no transaction
    return w.transact(con, plan, None if fault is None else partial(call_fault, fault))


def connect_file(
    path: Any, schema: tuple[str, ...], busy_s: float, attempts: int, pragmas: tuple[str, ...]
) -> sqlite3.Connection:
    """Open a DB file with ``pragmas``, creating ``schema`` through the core's plan.

    The schema goes first: its BEGIN waits out a file another process holds with the same
    bounded backoff as every transaction (``QueueBusy`` after it); once the schema is
    read, the PRAGMAs need no lock.
    """
    con = sqlite3.connect(path, timeout=busy_s, isolation_level=None, check_same_thread=False)
    try:
        run_plan(con, w.plan_schema(schema), None, attempts)
        for pragma in pragmas:
            con.execute(pragma).fetchall()
    except BaseException:
        con.close()
        raise
    return con


def close_file(con: sqlite3.Connection, closing: tuple[str, ...]) -> None:
    """Run ``closing`` (best effort: another connection may still hold the file), then close."""
    try:
        with contextlib.suppress(sqlite3.Error):  # e.g. SQLITE_BUSY: the file is shared
            for statement in closing:
                con.execute(statement).fetchall()
    finally:
        con.close()


def fetch_rows(con: sqlite3.Connection, sql: str, params: Any) -> list[tuple[Any, ...]]:
    return con.execute(sql, params).fetchall()


class Store(Protocol):
    """Where plans run: one session, driven by one task at a time."""

    @property
    def in_transaction(self) -> bool: ...

    async def transact(
        self, plan: w.Plan[Any], make: Callable[[], w.Plan[Any]], fault: w.Fault = None
    ) -> Any:
        """Run ``plan`` in one transaction; ``make()`` builds it again if it must be retried."""

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]: ...

    async def close(self) -> None: ...


class SqliteStore:
    """A DB file as a ``Store``: one sqlite3 connection, owned by one thread of its own.

    Each transaction is one hop to that thread, where the core's own driver runs the plan
    from BEGIN to COMMIT: a statement never waits for the event loop (nor the loop for a
    statement, a busy file or an fsync).
    """

    def __init__(
        self,
        con: sqlite3.Connection,
        thread: ThreadPoolExecutor,
        attempts: int = 8,
        closing: tuple[str, ...] = (),
    ) -> None:
        self.con, self.thread, self.attempts, self.closing = con, thread, attempts, closing

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
        thread = ThreadPoolExecutor(1, thread_name_prefix="asnackq-sqlite")
        try:
            con = await asyncio.get_running_loop().run_in_executor(
                thread, connect_file, path, schema, busy_s, attempts, pragmas
            )
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(con, thread, attempts, closing)

    async def _call(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.thread, function, *args)

    @property
    def in_transaction(self) -> bool:
        return self.con.in_transaction

    async def transact(
        self, plan: w.Plan[Any], make: Callable[[], w.Plan[Any]], fault: w.Fault = None
    ) -> Any:
        return await self._call(run_plan, self.con, plan, fault, self.attempts)

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        return await self._call(fetch_rows, self.con, sql, params)

    async def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        """Have ``callback`` see every statement (it is called on the connection's thread)."""
        await self._call(self.con.set_trace_callback, callback)

    async def close(self) -> None:
        try:
            await self._call(close_file, self.con, self.closing)
        finally:
            self.thread.shutdown(wait=False)


async def open_store(
    target: Any,
    schema: tuple[str, ...],
    busy_s: float = 1.0,
    attempts: int = 8,
    pragmas: tuple[str, ...] = w.PRAGMAS,
    closing: tuple[str, ...] = (),
    resolve_s: float = 300.0,
) -> Store:
    """A DB file (with ``pragmas``; ``closing`` tried before it is closed) or a
    ``postgresql://`` URL, with ``schema`` (the core's tuple) in place (``resolve_s``: how
    long a URL's store seeks the outcome of a COMMIT whose answer was lost)."""
    if is_url(target):
        from asnackq import pg

        return await pg.AsyncStore.open(target, schema, attempts, call_fault, resolve_s)
    return await SqliteStore.open(target, schema, busy_s, attempts, pragmas, closing)


class AsyncQueue:
    """A queue driven through a ``Store``: the same validation, results and hooks as the core."""

    def __init__(self, db: Store, attempts: int = 8, limits: w.Limits = w.PRODUCT) -> None:
        self._db = db
        self._attempts = attempts
        self._lock = asyncio.Lock()
        self.limits = limits

    @classmethod
    async def connect(
        cls, path: Any, *, busy_s: float = 1.0, attempts: int = 8, limits: w.Limits = w.PRODUCT
    ) -> AsyncQueue:
        """Open a queue file (``open_queue``'s format and settings) or a ``postgresql://`` URL
        (``asnackq.pg``: the same tables in that database); close it with ``close()``.

        ``limits``: the ranges accepted (default ``PRODUCT``: ttl up to 30 days, leases and
        delays up to an hour; ``worker.CONTRACT`` gives the graded functions' ranges).

        A locked file is waited on for ``busy_s`` per try (SQLite's busy timeout), and BEGIN
        is tried ``attempts`` times with a jittered backoff before ``QueueBusy`` is raised.
        """
        target = path if is_url(path) else w.check_queue_path(path)
        if not 0 < busy_s <= 60:
            raise ValueError(f"busy_s must be in (0, 60]: {busy_s!r}")
        w.check_int(attempts, "attempts", 1, 100)
        return cls(await open_store(target, w.SCHEMA, busy_s, attempts), attempts, limits)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, path: Any, *, busy_s: float = 1.0, attempts: int = 8, limits: w.Limits = w.PRODUCT
    ) -> AsyncIterator[AsyncQueue]:
        """``async with AsyncQueue.open(path) as q:`` - closed on exit."""
        queue = await cls.connect(path, busy_s=busy_s, attempts=attempts, limits=limits)
        try:
            yield queue
        finally:
            await queue.close()

    async def close(self) -> None:
        async with self._lock:
            await self._db.close()

    @property
    def in_transaction(self) -> bool:
        return bool(self._db.in_transaction)

    @property
    def health(self) -> Health | None:
        """The store's session and its outages (a ``postgresql://`` store's; None for a file)."""
        return getattr(self._db, "health", None)

    async def _run(self, make: Callable[[], w.Plan[T]], fault: w.Fault = None) -> T:
        """Run one plan under the lock, shielded: cancellation never splits the transaction.

        ``make`` builds the plan, validating it before any I/O (a store may build it again
        to retry a transaction that met a concurrent one).
        """
        plan = make()

        async def locked() -> T:
            async with self._lock:
                result: T = await self._db.transact(plan, make, fault)
                return result

        task = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task])  # let COMMIT or ROLLBACK land, then re-raise
            raise

    async def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """A read-only query outside any write transaction."""
        async with self._lock:
            return await self._db.read(sql, params)

    async def enqueue(
        self, event: dict[str, Any], now_ms: int, ttl_ms: int, max_attempts: int = 3
    ) -> bool:
        make = partial(w.plan_enqueue, event, now_ms, ttl_ms, max_attempts, limits=self.limits)
        return bool(await self._run(make))

    async def enqueue_many(
        self, items: list[tuple[dict[str, Any], int, int]], now_ms: int
    ) -> list[bool | w.Conflict]:
        make = partial(w.plan_enqueue_many, items, now_ms, limits=self.limits)
        results: list[bool | w.Conflict] = await self._run(make)
        return results

    async def claim(
        self, owner: str, now_ms: int, lease_ms: int = 1000, fault: w.Fault = None
    ) -> w.Ticket | None:
        make = partial(w.plan_claim, owner, now_ms, lease_ms, limits=self.limits)
        result: w.Ticket | None = await self._run(make, check_async_fault(fault))
        return result

    async def claim_many(
        self, owner: str, now_ms: int, lease_ms: int, count: int
    ) -> list[w.Ticket]:
        make = partial(w.plan_claim_many, owner, now_ms, lease_ms, count, limits=self.limits)
        result: list[w.Ticket] = await self._run(make)
        return result

    async def finish(
        self, ticket: w.Ticket, outcome: str, now_ms: int, delay_ms: int = 0, fault: w.Fault = None
    ) -> str | bool:
        make = partial(w.plan_finish, ticket, outcome, now_ms, delay_ms, limits=self.limits)
        result: str | bool = await self._run(make, check_async_fault(fault))
        return result

    async def finish_many(self, results: list[tuple[w.Ticket, str, int, int]]) -> list[str | bool]:
        make = partial(w.plan_finish_many, results, limits=self.limits)
        statuses: list[str | bool] = await self._run(make)
        return statuses

    async def finish_and_claim(
        self,
        results: list[tuple[w.Ticket, str, int, int]],
        owner: str,
        now_ms: int,
        lease_ms: int,
        count: int,
    ) -> tuple[list[str | bool], list[w.Ticket]]:
        make = partial(
            w.plan_finish_and_claim, results, owner, now_ms, lease_ms, count, limits=self.limits
        )
        outcome: tuple[list[str | bool], list[w.Ticket]] = await self._run(make)
        return outcome

    async def extend(
        self, ticket: w.Ticket, now_ms: int, lease_ms: int, fault: w.Fault = None
    ) -> w.Ticket | bool:
        make = partial(w.plan_extend, ticket, now_ms, lease_ms, limits=self.limits)
        result: w.Ticket | bool = await self._run(make, check_async_fault(fault))
        return result

    async def extend_many(
        self, tickets: list[w.Ticket], now_ms: int, lease_ms: int
    ) -> list[w.Ticket | bool]:
        extended: list[w.Ticket | bool] = await self._run(
            partial(w.plan_extend_many, tickets, now_ms, lease_ms, limits=self.limits)
        )
        return extended

    async def cycle(
        self,
        results: Sequence[tuple[w.Ticket, str, int, int]],
        held: Sequence[w.Ticket],
        owner: str,
        now_ms: int,
        lease_ms: int,
        count: int,
    ) -> w.Cycle:
        make = partial(
            w.plan_cycle, results, held, owner, now_ms, lease_ms, count, limits=self.limits
        )
        outcome: w.Cycle = await self._run(make)
        return outcome

    async def redrive(
        self, job_id: str, now_ms: int, ttl_ms: int, note: str, fault: w.Fault = None
    ) -> bool:
        make = partial(w.plan_redrive, job_id, now_ms, ttl_ms, note, limits=self.limits)
        return bool(await self._run(make, check_async_fault(fault)))

    async def run_once(
        self,
        owner: str,
        clock: Callable[[], int],
        send: Callable[[dict[str, Any]], Awaitable[object]],
        jitter: float,
        lease_ms: int = 1000,
    ) -> dict[str, Any] | None:
        """The core's ``run_once`` with an async ``send``, awaited outside any transaction."""
        w.check_run_args(owner, clock, send, jitter, lease_ms, self.limits)
        first = w.check_now(clock(), "first clock reading", self.limits)
        ticket = await self.claim(owner, first, lease_ms)
        if ticket is None:
            return None
        mine = dict(ticket)
        outcome, delay = await classify(send, mine, jitter)
        now = w.second_reading(clock, first, self.limits)
        return w.delivery_result(mine, await self.finish(dict(mine), outcome, now, delay))


async def classify(
    send: AsyncSend, ticket: w.Ticket, jitter: float, *extra: Any
) -> tuple[str, int]:
    """The async twin of ``worker.classify``: the judgement itself is ``worker.judge_send``."""
    try:
        ack = await send(w.fresh_event(ticket), *extra)
    except (w.Retryable, w.Permanent) as error:
        return w.judge_send(ticket, jitter, error=error)
    return w.judge_send(ticket, jitter, ack)


def __getattr__(name: str) -> Any:
    """``Dispatcher`` and ``Summary`` live in ``asnackq.dispatch``; importable here too."""
    if name in ("Dispatcher", "Summary"):
        from asnackq import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

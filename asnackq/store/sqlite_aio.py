"""The aiosqlite driver: the core's plans on a SQLite file, from asyncio.

Rules of this module:

* No state machine here: the driver runs ``worker.plan_*`` plans step by step, through
  aiosqlite's public API only (``execute_fetchall``, ``executemany``, ``commit``, ...).
  aiosqlite owns the connection's one thread and runs its calls in the order made; each
  wait for a reply is one hop to that thread and back through the event loop.
* A transaction is ``BEGIN IMMEDIATE``, the plan's statements, ``COMMIT``; a plan's
  statements do not grow with its batch (sets are one JSON parameter, fenced writes and
  inserts one set statement, ``SETS``, or one ``executemany``), so neither do a
  transaction's hops (``HOPS``).
* A reply crosses from the connection's thread to the event loop one row at a time, each
  row a wait for the GIL while the loop runs Python: a cycle's reads of a row per job come
  back as one row (``ROWS``), its counted writes without ``RETURNING`` (``COUNTED``).
* Statements that need no reply of each other are sent at once, one hop for all (``sent``):
  a plan's ``Batch`` (``at_once``: in a transaction other than a store's own, a statement,
  then only reads), and a plan's first step, with BEGIN.
  A store's connection begins a transaction before any write (``isolation_level``
  ``IMMEDIATE``: sqlite3 sends ``BEGIN IMMEDIATE`` before a write outside one), so a write
  never runs outside a transaction: one sent with a BEGIN that was refused, or after a
  statement that failed and ended the transaction, runs in a transaction of its own that
  is rolled back.  COMMIT is never sent before every reply of the transaction came back
  without a failure, and a failure is raised only once every statement sent with it has
  run (ROLLBACK follows them on the thread).  On any other connection (an application's)
  only a first step that reads goes with BEGIN.
* ``SQLITE_BUSY`` from other processes is retried at BEGIN (nothing is written yet) with a
  bounded, jittered backoff (``asyncio.sleep``: the loop keeps running), then surfaces as
  ``QueueBusy``; so does a statement or COMMIT refused for another process's lock (a
  reader's transaction keeps a COMMIT waiting), after its ROLLBACK.  ``QueueBusy`` is a
  ``StoreUnavailable``: nothing was committed, and the store's ``Health`` counts the time
  the file was held, so a Dispatcher waits the file out as it waits out a server away.
  On the store's own connection BEGIN itself does not wait in SQLite's busy handler
  (whose sleeps grow to 100 ms, so a lock freed after 60 ms is taken after 78): it is
  tried again after a tenth of the time it has waited (``POLL_S``: 0.5 to 50 ms,
  jittered), for as long as the handler would have waited, the connection's busy timeout
  kept for every other statement.
* Any other exception before COMMIT rolls back and propagates unchanged (a failing
  ROLLBACK never hides it).
* The caller serialises transactions on a connection (one lock) and shields them from
  cancellation (``aio.AsyncQueue``): aiosqlite cannot stop a statement already sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import re
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Sequence
from operator import itemgetter
from typing import Any, NamedTuple, TypeVar

import aiosqlite

from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store.attempts import SQL_RECORD, SQLITE_RECORD_SET
from asnackq.store.outage import Health, StoreUnavailable
from asnackq.store.sets import SetText, as_set, settle_set

__all__ = [
    "HOPS",
    "QueueBusy",
    "SqliteStore",
    "adrive",
    "call_fault",
    "connected",
    "opened",
    "steps",
]

T = TypeVar("T")
JOIN_S = 30.0  # how long a failed connect waits for its connection's thread to end


@contextlib.asynccontextmanager
async def connected(*args: Any, **kwargs: Any) -> AsyncIterator[aiosqlite.Connection]:
    """``async with aiosqlite.connect(*args, **kwargs)`` that a cancel does not cut short.

    aiosqlite answers each call from its connection's thread through the event loop; a
    connect or close whose caller is cancelled goes on in that thread, and its answer to a
    loop that has closed meanwhile (a command stopped by SIGTERM while sampling) is a
    traceback on stderr.  Here a cancelled caller waits for the connect (then closes the
    connection) or the close to end, then is cancelled.  (A cancel of every task at once,
    as ``asyncio.run`` makes when its main coroutine ends, reaches the connect itself: no
    public call of aiosqlite waits for its thread then.)"""

    con, cancel = await _to_the_end(asyncio.ensure_future(opened(*args, **kwargs)))
    if cancel is not None:
        with contextlib.suppress(Exception):  # (the cancel is what the caller gets)
            await _to_the_end(asyncio.ensure_future(con.close()))
        raise cancel
    try:
        yield con
    except BaseException:
        with contextlib.suppress(Exception):  # (the body's failure or cancel goes on)
            await _closed(con)
        raise
    await _closed(con)


async def opened(*args: Any, **kwargs: Any) -> aiosqlite.Connection:
    """``await aiosqlite.connect(*args, **kwargs)``; a connect that fails returns once its
    connection's thread has ended.  aiosqlite's failed connect queues a stop for that
    thread whose answer nobody awaits: an answer to a loop that has closed meanwhile (the
    failure ends ``asyncio.run``) is a traceback on stderr."""
    pending = aiosqlite.connect(*args, **kwargs)
    try:
        return await pending
    except Exception:  # (a cancel may reach a connect still running: that one goes on)
        thread = getattr(pending, "_thread", None)
        if isinstance(thread, threading.Thread) and thread.is_alive():
            await asyncio.to_thread(thread.join, JOIN_S)
        raise


async def _closed(con: aiosqlite.Connection) -> None:
    """``con`` closed, the close waited for to its end if the caller is cancelled meanwhile
    (then cancelled, whatever came of the close)."""
    _, cancel = await _to_the_end(asyncio.ensure_future(con.close()))
    if cancel is not None:
        raise cancel


async def _to_the_end(task: asyncio.Future[T]) -> tuple[T, asyncio.CancelledError | None]:
    """``task``'s result, waited for to its end however often the caller is cancelled
    meanwhile, and the caller's cancel (None: not cancelled).  A cancelled caller whose
    task failed is cancelled (the failure its cause), never handed the failure instead."""
    cancel = await _landed(task)
    if cancel is not None and (task.cancelled() or task.exception() is not None):
        raise cancel from None if task.cancelled() else task.exception()
    return task.result(), cancel


async def _landed(task: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """``task`` done, waited for however often the caller is cancelled meanwhile; the
    caller's cancel (None: not cancelled), for the caller to raise."""
    cancel = None
    while not task.done():
        try:
            await asyncio.wait({task})  # (its failure is not raised here; a cancel is)
        except asyncio.CancelledError as error:
            cancel = cancel or error
    return cancel


# Hops per transaction, at most, whatever its batch.  A Dispatcher's cycle (finishes,
# extensions and claims): BEGIN with the read of the finished and extended jobs (and the
# insert of its requests' answers, when it keeps them: ``asnackq.store.attempts``); their
# write with the claims' reads (whether the quarantine has work, the claimable jobs, those
# never attempted); the lease; COMMIT.  One more when the quarantine has work (it runs with
# the claims' reads again).  A cycle paced by a shared rate (``core.rate``): two more, the
# rate row's read and write.  An intake: BEGIN with the read of the jobs, the insert, COMMIT.
# An inbox batch (``core.inbox``): BEGIN with its rows' insert, the moves and the stock (one
# ``Batch``), COMMIT.
HOPS = {"cycle": 4, "quarantine": 1, "records": 0, "paced cycle": 6, "enqueue": 3, "inbox": 3}
# A busy BEGIN is tried again after a tenth of the time it has waited so far (jittered),
# within these bounds: a freed lock is taken within about a tenth of the wait, and a wait of
# a second costs some 60 tries.
POLL_S = (0.0005, 0.05)


class QueueBusy(sqlite3.OperationalError, StoreUnavailable):
    """Raised when the queue file stayed locked by other processes beyond the retry bound:
    the transaction committed nothing (a ``StoreUnavailable``: try again later)."""


def call_fault(fault: w.Fault, point: str) -> None:
    """Call a fault hook: a plain call; one returning an awaitable is refused."""
    if fault is None:
        return
    result = fault(point)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise TypeError(f"fault returned an awaitable at {point!r}; hooks must be plain calls")


async def begin(
    db: aiosqlite.Connection,
    attempts: int,
    busy_ms: int | None = None,
    first: tuple[w.Sql | w.SqlMany, ...] = (),
) -> list[Any] | None:
    """BEGIN IMMEDIATE, retrying SQLITE_BUSY with a bounded, jittered backoff (``QueueBusy``).

    ``busy_ms``: the connection's busy timeout, which BEGIN then does without: it is polled
    (``POLL_S``) for ``attempts`` times that long instead.  None (a connection that is not
    the store's own): BEGIN waits in SQLite's busy handler, ``attempts`` times.

    ``first`` (with ``busy_ms``): the statements of the plan's first step (``with_begin``),
    sent with the first BEGIN; returns, once BEGIN held, each one's reply or exception (for
    the caller to raise in its transaction), or None when that BEGIN was refused (what they
    read outside the transaction is dropped, what they wrote rolled back: send them in it)."""
    if busy_ms is not None:
        return await poll_begin(db, attempts, busy_ms, first)
    for attempt in range(attempts):
        try:
            await db.execute_fetchall("BEGIN IMMEDIATE")
            return None
        except sqlite3.OperationalError as error:
            if not busy(error):
                raise
            if attempt == attempts - 1:
                raise QueueBusy(f"queue locked after {attempts} attempts: {error}") from error
            await asyncio.sleep(random.uniform(0, 0.01 * 2**attempt))
    return None


async def poll_begin(
    db: aiosqlite.Connection,
    attempts: int,
    busy_ms: int,
    first: tuple[w.Sql | w.SqlMany, ...] = (),
) -> list[Any] | None:
    """BEGIN IMMEDIATE without the busy handler, tried again every ``POLL_S`` while busy.

    The first try is one hop that also puts the busy timeout back (and sends ``first``:
    see ``begin``); after a refusal the timeout stays 0 for the plain BEGINs that follow
    (the caller's lock keeps every other statement off this connection meanwhile) and is
    put back however the wait ends."""
    timeout = f"PRAGMA busy_timeout = {busy_ms}"
    script = db.executescript(f"PRAGMA busy_timeout = 0; BEGIN IMMEDIATE; {timeout}")
    try:
        outcome, *replies = await sent([script, *queued(db, first)])
    except BaseException:  # cancelled: whatever BEGIN did has landed (``sent``)
        await rollback(db)
        raise
    if not isinstance(outcome, BaseException):
        return replies
    await rollback(db)  # (a BEGIN that held, then failed: never left open)
    if not isinstance(outcome, sqlite3.OperationalError):
        raise outcome
    refused = outcome
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + attempts * busy_ms / 1000
    try:
        while busy(refused):
            if loop.time() >= deadline:
                raise QueueBusy(f"queue locked after {attempts} attempts: {refused}") from refused
            pause = min(max((loop.time() - began) / 10, POLL_S[0]), POLL_S[1])
            await asyncio.sleep(random.uniform(0.5, 1.5) * pause)
            try:
                await db.execute_fetchall("BEGIN IMMEDIATE")
                return None
            except sqlite3.OperationalError as error:
                refused = error
        raise refused
    finally:
        with contextlib.suppress(sqlite3.Error, ValueError):  # (ValueError: closed)
            await db.execute_fetchall(timeout)


def busy(error: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused for another connection's lock."""
    return "locked" in str(error) or "busy" in str(error)


# A cycle's finishes and extensions (``w.SQL_SETTLE``, one fenced write per job) as one
# UPDATE over a JSON array of them (``sets``): SQLite plans the statement once, not once
# per row (19 against 28 us a job).  The same fence and the same new values, row for row;
# the rows were read under the same lock first.  Each job is found by its id, the array
# read once from the front: the status test (``+``: no index condition) could otherwise
# take ``jobs_by_status`` and read every leased job once per row of the array.
# ``json_extract``, not ``->>`` (SQLite 3.38): a run that keeps no requests' answers needs
# no more than the core does (``RETURNING``: 3.35).
SQLITE_SETTLE_SET = """
UPDATE jobs SET status = x.status, reason = x.reason,
  available_at = coalesce(x.available_at, jobs.available_at),
  owner = x.new_owner, lease_until = x.new_lease_until
FROM (SELECT json_extract(value, '$[0]') AS id, json_extract(value, '$[1]') AS token,
  json_extract(value, '$[2]') AS owner, json_extract(value, '$[3]') AS attempt,
  json_extract(value, '$[4]') AS lease_until, json_extract(value, '$[5]') AS status,
  json_extract(value, '$[6]') AS reason, json_extract(value, '$[7]') AS available_at,
  json_extract(value, '$[8]') AS new_owner, json_extract(value, '$[9]') AS new_lease_until
  FROM json_each(?)) AS x
WHERE jobs.id = x.id AND +jobs.status = 'leased' AND jobs.token = x.token
  AND jobs.owner = x.owner AND jobs.attempts = x.attempt
  AND jobs.lease_until = x.lease_until"""
# An intake's new jobs (``w.SQL_INSERT_JOB``, one row per job) as one INSERT over a JSON
# array of the rows (12 against 17-18 us a job), inserted in the array's order (``key``) so
# that each job's seq follows the intake's order, as row-by-row inserts number them.  A job
# id is an identifier (``w.check_identifier``): no NUL, which ``json_extract`` would end it at.
SQLITE_INSERT_SET = """
INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at, deadline,
  owner, lease_until, reason)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), 'pending', 0,
  json_extract(value, '$[2]'), 0, json_extract(value, '$[3]'), json_extract(value, '$[4]'),
  NULL, NULL, NULL
FROM json_each(?) ORDER BY key"""
SETS = {
    w.SQL_SETTLE: settle_set(SQLITE_SETTLE_SET),
    w.SQL_INSERT_JOB: SetText(SQLITE_INSERT_SET, itemgetter(0), None),
    SQL_RECORD: SetText(SQLITE_RECORD_SET, None, None),
}


# A statement's rows cross from aiosqlite's thread to the event loop one step each, and
# sqlite3 lets the GIL go for every step: while the loop runs Python (an application's
# coroutines, a producer, the Dispatcher's own sends) the thread waits for it again at each
# row.  A read of 500 rows took 275 ms against 2.7 ms as one row, with four busy coroutines
# on the loop.  So a cycle's reads of a row per job (the jobs it settles, the jobs it
# claims, in any lane) come back as one row (``ROWS``): the statement itself as a CTE, its
# rows as one JSON array, decoded here into the same tuples in the statement's order (its
# last ``ORDER BY``: a seq or an id, each unique; Python orders text by code point, as
# SQLite's BINARY collation orders UTF-8).  JSON carries integers, text and NULL exactly;
# a reply with any other value (a REAL or a BLOB another program wrote into a job: SQLite
# writes a REAL to JSON with 15 digits, an infinite one as no JSON, and a BLOB not at all),
# or too long for one value (``SQLITE_LIMIT_LENGTH``), is read again by the statement
# itself.  And the writes whose rows the plan only counts (the lease, the poisoning:
# ``_write_set``) run without ``RETURNING``: one empty row per row changed (``rowcount``),
# one step in all.
class RowsText(NamedTuple):
    """A read of many rows as one: its text, and the column its rows are ordered by."""

    text: str
    order: int | None  # (None: in no order)


ORDER_COLUMNS = {"seq": 0, "id": 1}  # a claim's rows: (seq, id, ...)
_LAST_ORDER = re.compile(r"ORDER BY (\w+)(?!.*ORDER BY)", re.DOTALL)


def one_row(sql: str, columns: int, claim: bool) -> RowsText:
    """``sql`` (a read of ``columns`` columns; ``claim``: of a claim, its first the seq) as a
    read of one row: the rows' JSON array, a row holding a BLOB as null."""
    names = [f"c{i}" for i in range(columns)]
    blob = " OR ".join(f"typeof({name}) = 'blob'" for name in names[1 if claim else 0 :])
    last = _LAST_ORDER.search(sql)
    if claim != (last is not None) or (last is not None and last[1] not in ORDER_COLUMNS):
        raise AssertionError(f"no known order of {' '.join(sql.split())[:80]!r}")
    return RowsText(
        f"WITH r({', '.join(names)}) AS ({sql})\n"
        f"SELECT json_group_array(CASE WHEN {blob} THEN NULL"
        f" ELSE json_array({', '.join(names)}) END) FROM r",
        None if last is None else ORDER_COLUMNS[last[1]],
    )


class Inexact(Exception):
    """A reply of ``one_row`` that does not hold its rows exactly (a REAL, a BLOB)."""


def _inexact(text: str) -> float:
    raise Inexact(text)


def rows_of(array: str, order: int | None) -> list[tuple[Any, ...]]:
    """The rows of a ``one_row`` reply, ordered by their column ``order`` (``Inexact``: one
    of them holds a REAL or a BLOB; SQLite writes an infinite REAL as ``Inf``, no JSON)."""
    try:
        parsed = json.loads(array, parse_float=_inexact)
    except ValueError as error:
        raise Inexact(array) from error
    if None in parsed:
        raise Inexact("a BLOB")
    rows = list(map(tuple, parsed))
    return rows if order is None else sorted(rows, key=itemgetter(order))


def _rows_texts() -> dict[str, RowsText]:
    claims = {
        w.SQL_NEXT_CLAIMABLE: 6,
        w.SQL_NEXT_FRESH: 6,
        w.SQL_NEXT_RECLAIMABLE: 8,
        w.SQL_NEXT_FRESH_RECLAIMING: 8,
    }
    texts = {w.SQL_JOBS: one_row(w.SQL_JOBS, 9, claim=False)}
    for sql, columns in claims.items():
        for variant in (sql, *(lane[sql] for lane in LANE_VARIANTS)):
            texts[variant] = one_row(variant, columns, claim=True)
    return texts


LANE_VARIANTS = (lanes.LANE_TEXTS, lanes.PLAIN_TEXTS, lanes.ORDERED_TEXTS)
ROWS = _rows_texts()
COUNTED = {
    sql: sql.replace("\nRETURNING seq", "")
    for core in (w.SQL_LEASE, w.SQL_LEASE_RECLAIMING, w.SQL_POISON)
    for sql in (core, w.ONE[core])
}


async def steps(
    db: aiosqlite.Connection,
    plan: w.Plan[T],
    fault: w.Fault,
    reply: w.Reply = None,
    own: bool = False,
) -> tuple[T, bool]:
    """The plan's steps, in the caller's transaction: each step is one hop (a ``Batch``
    too); returns ``(result, changed)``.  ``reply``: the reply to its step last taken;
    ``own``: see ``at_once``."""
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        reply = await run_step(db, step, fault, own)


async def run_step(
    db: aiosqlite.Connection, step: w.Step, fault: w.Fault, own: bool = False
) -> w.Reply:
    """One step of a plan: a statement, a batch of them (one hop), or a hook point."""
    if isinstance(step, w.Batch):
        if at_once(step.steps, own):
            return replied(await sent(queued(db, step.steps)))
        return [await statement(db, one) for one in step.steps]
    if isinstance(step, w.Hook):
        call_fault(fault, step.name)
        return None
    return await statement(db, step)


async def statement(
    db: aiosqlite.Connection, step: w.Sql | w.SqlMany, as_one: bool = True
) -> list[Any]:
    """A statement's rows, or (``SqlMany``) ``[(rowcount,)]``; a read of many rows as one
    (``ROWS``) unless ``as_one`` is False: see ``queued``."""
    if isinstance(step, w.SqlMany):
        one = as_set(SETS, step.sql, step.params)
        cursor = await (db.execute(*one) if one else db.executemany(step.sql, step.params))
        return [(cursor.rowcount,)]
    rows = ROWS.get(step.sql) if as_one else None
    if rows is not None:
        with contextlib.suppress(Inexact):  # (then read again, as it is)
            return rows_of(await one_array(db, rows.text, step.params), rows.order)
    counted = COUNTED.get(step.sql)
    if counted is not None:
        cursor = await db.execute(counted, step.params)
        return [()] * cursor.rowcount
    return [tuple(row) for row in await db.execute_fetchall(step.sql, step.params)]


async def one_array(db: aiosqlite.Connection, text: str, params: Any) -> str:
    """The JSON array a ``one_row`` text reads (``Inexact``: longer than a value can be)."""
    try:
        ((array,),) = await db.execute_fetchall(text, params)
    except sqlite3.DataError as error:
        if getattr(error, "sqlite_errorcode", None) != sqlite3.SQLITE_TOOBIG:
            raise
        raise Inexact("too long") from error
    return array  # type: ignore[no-any-return]


def queued(db: aiosqlite.Connection, statements: Sequence[w.Sql | w.SqlMany]) -> list[Any]:
    """The calls of ``statements``, to be sent at once: each read of many rows as one
    (``ROWS``), unless a write follows it among them (a reply with a value JSON does not
    carry is read again once the others have run: only reads may have run in between)."""
    writes = [at for at, one in enumerate(statements) if not isinstance(one, w.Read)]
    last = writes[-1] if writes else -1
    return [statement(db, one, as_one=at > last) for at, one in enumerate(statements)]


async def sent(calls: list[Awaitable[Any]]) -> list[Any]:
    """Each call's reply or exception, the calls (on one connection) sent at once: each is
    started here (``Started``), so all are queued for the connection's thread, in order,
    before any reply is awaited, and the thread runs them back to back.  Its replies come
    back in that order too, so only the last is waited for: no task per call.  A caller
    cancelled meanwhile waits for every call to land before the cancellation goes on (a
    statement sent cannot be taken back: what follows it, ROLLBACK, must know what it did)."""
    started = [Started(call) for call in calls]
    last = next((call.reply for call in reversed(started) if call.reply is not None), None)
    if last is not None:
        try:
            await asyncio.shield(last)
        except asyncio.CancelledError:
            await asyncio.wait([last])
            raise
        except BaseException:  # (its failure is its reply, taken below)
            pass
    return [await call.outcome() for call in started]


class Started:
    """A call on the connection, stepped until it waits for its reply: by then aiosqlite has
    queued its statement for the connection's thread (each of its calls does so first)."""

    def __init__(self, call: Awaitable[Any]) -> None:
        self.steps = call.__await__()
        self.reply: asyncio.Future[Any] | None = None  # what it waits for
        self.value: Any = None  # its reply or exception, when it needed no wait
        try:
            waiting = self.steps.send(None)
        except StopIteration as stop:
            self.value = stop.value
        except Exception as error:  # (refused before it was queued: a closed connection)
            self.value = error
        else:
            if not asyncio.isfuture(waiting):  # (nothing queued yet: the order is unknown)
                self.steps.close()
                raise TypeError(f"sent takes calls that wait for their reply first: {call!r}")
            self.reply = waiting

    async def outcome(self) -> Any:
        """The call's reply, or its exception, once its reply (and any call it then makes:
        ``statement``'s reading again) has come back."""
        waiting = self.reply
        if waiting is None:
            return self.value
        while True:
            if not waiting.done():  # (a call it made again, or a call sent alone)
                await self.landed(waiting)
            try:
                waiting = self.steps.send(None)
            except StopIteration as stop:
                return stop.value
            except Exception as error:
                return error
            if not asyncio.isfuture(waiting):
                self.steps.close()
                raise RuntimeError(f"a call sent at once waited for {waiting!r}")

    async def landed(self, waiting: asyncio.Future[Any]) -> None:
        """``waiting`` done, however often the caller is cancelled meanwhile (as ``sent``'s
        calls: what follows, ROLLBACK, must know what it did); then the cancel goes on."""
        cancel = await _landed(waiting)
        if cancel is not None:
            if not waiting.cancelled():
                waiting.exception()  # (retrieved: the cancel is what the caller gets)
            self.steps.close()
            raise cancel


def replied(replies: list[Any]) -> list[Any]:
    """``replies`` (``sent``'s), or the first exception among them raised."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def at_once(statements: tuple[w.Sql | w.SqlMany, ...], own: bool) -> bool:
    """Whether ``statements`` (a batch's, in order) may be sent at once: each after the
    first only reads, or the transaction is ``own``: a store's, on its own connection,
    which begins a transaction before any write (``isolation_level`` ``IMMEDIATE``), so a
    write sent after a statement that failed and ended the transaction runs in one of its
    own, rolled back with the rest.  On any other connection (an application's, whose
    transaction the caller may not end) such a write could land outside the transaction:
    that batch goes one statement at a time."""
    return own or all(isinstance(one, w.Read) for one in statements[1:])


def with_begin(db: aiosqlite.Connection, step: w.Step | None) -> tuple[w.Sql | w.SqlMany, ...]:
    """The statements of a plan's first step that go with BEGIN: any step's on a connection
    that begins a transaction before a write (``isolation_level`` set), else only those of
    a step that reads; () for a hook."""
    if isinstance(step, w.Batch):
        statements = step.steps
    elif isinstance(step, (w.Sql, w.SqlMany)):
        statements = (step,)
    else:
        return ()
    if db.isolation_level is not None or all(isinstance(one, w.Read) for one in statements):
        return statements
    return ()


async def rollback(db: aiosqlite.Connection) -> None:
    """Roll back if a transaction is open; a failing rollback never hides the original error."""
    if db.in_transaction:
        with contextlib.suppress(sqlite3.Error, ValueError):  # ValueError: closed
            await db.rollback()


async def adrive(
    db: aiosqlite.Connection,
    plan: w.Plan[T],
    fault: w.Fault = None,
    attempts: int = 8,
    busy_ms: int | None = None,
    own: bool = False,
) -> T:
    """Run ``plan`` in one BEGIN IMMEDIATE transaction: COMMIT, or ROLLBACK and re-raise
    (``busy_ms``: see ``begin``; the plan's first step is sent with BEGIN: ``with_begin``;
    ``own``: a store's transaction on its own connection, see ``at_once``)."""
    done: tuple[T, bool]
    try:
        step: w.Step | None = plan.send(None)  # (before BEGIN: a plan does no I/O)
    except StopIteration as stop:
        step, done = None, stop.value
    first = with_begin(db, step) if busy_ms is not None else ()
    # outside the try: a failed BEGIN owns no transaction
    replies = await begin(db, attempts, busy_ms, first)
    try:
        if step is not None:
            if first and replies is not None:  # (sent with BEGIN)
                got = replied(replies)
                reply: w.Reply = got if isinstance(step, w.Batch) else got[0]
            else:
                reply = await run_step(db, step, fault, own)
            done = await steps(db, plan, fault, reply, own)
        result, changed = done
        await db.commit()
    except sqlite3.OperationalError as error:
        await rollback(db)
        if busy(error) and not isinstance(error, QueueBusy):
            raise QueueBusy(f"queue locked: {error}") from error
        raise
    except BaseException:
        await rollback(db)
        raise
    if changed:
        call_fault(fault, w.AFTER_COMMIT)
    return result


class SqliteStore:
    """A DB file as a ``Store``: one aiosqlite connection (its own thread), plans run on it."""

    def __init__(
        self,
        db: aiosqlite.Connection,
        attempts: int = 8,
        closing: tuple[str, ...] = (),
        busy_ms: int | None = None,
    ) -> None:
        self.db, self.attempts, self.closing, self.busy_ms = db, attempts, closing, busy_ms
        self.health = Health()  # the spells the file was held by others

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
        need no lock.  From then on a write outside a transaction begins one (``IMMEDIATE``:
        see the module's rules).
        """
        db = await opened(path, timeout=busy_s, isolation_level=None)
        busy_ms = max(1, round(busy_s * 1000))
        try:
            await adrive(db, w.plan_schema(schema), None, attempts, busy_ms)
            for pragma in pragmas:
                await db.execute_fetchall(pragma)
        except BaseException:
            await db.close()
            raise
        db.isolation_level = "IMMEDIATE"
        return cls(db, attempts, closing, busy_ms)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    async def run(self, make: w.Make, fault: w.Fault = None) -> Any:
        """Run ``make()``'s plan in one transaction (made once: SQLite serialises writers,
        so a plan never meets a concurrent one)."""
        try:
            result = await adrive(self.db, make(), fault, self.attempts, self.busy_ms, own=True)
        except QueueBusy as error:
            error.retry_in_s = self.health.failed()
            raise
        self.health.back()
        return result

    async def read(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        try:
            rows = await self.db.execute_fetchall(sql, params)
        except sqlite3.OperationalError as error:
            if not busy(error):
                raise
            raise QueueBusy(f"queue locked: {error}", self.health.failed()) from error
        self.health.back()
        return [tuple(row) for row in rows]

    async def close(self) -> None:
        """Run ``closing`` (best effort: another connection may still hold the file), close."""
        try:
            with contextlib.suppress(sqlite3.Error):  # e.g. SQLITE_BUSY: the file is shared
                for statement in self.closing:
                    await self.db.execute_fetchall(statement)
        finally:
            await self.db.close()

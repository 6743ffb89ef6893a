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
* Connections are in autocommit mode: the drivers write BEGIN and COMMIT themselves.  The
  async driver sends BEGIN with a plan's first statement, as one query (``begun``): a
  round trip fewer for every transaction.  A plan's ``Batch`` (statements that need no
  reply of each other) goes in one round trip, psycopg's pipeline mode, BEGIN with it
  when it comes first (``AtOnce``; a settle naming a job twice, an extension then
  another, goes row by row, and its batch one statement at a time).  A statement that
  fails there fails the ones after it, as one by one the transaction would, and is
  raised as it would be (a session ended by the server says only that it closed).
  A failing ROLLBACK never hides the original error.
* Statements sent in a pipeline are never prepared (``prepare=False``): a statement that
  fails there aborts the rest of the pipeline, so the server never parses them, yet psycopg
  would count one it prepared there as prepared, and every later run of it on the session
  would fail (``InvalidSqlStatementName``).  A set statement runs for hundreds of jobs, so
  its parse is no cost that shows.
* A ``Batch``'s replies come in binary (a cycle's reads: hundreds of rows of integers, which
  the text format would have psycopg parse from decimal digits); psycopg loads them to the
  same Python types as from text (int, str, bool), by the same column types.
* The transaction's id (``SQL_XACT``, for a COMMIT whose answer is lost: ``CommitCut``)
  goes in the pipeline of a ``Batch``, or of a set's INSERT, while it is not known yet;
  once a write gave the transaction an id, no round trip of its own reads it before the
  COMMIT.  An intake is 3 round trips (BEGIN with its read, its INSERT, COMMIT), a
  Dispatcher's cycle 4 (BEGIN with its first read, its settle and reads, its lease,
  COMMIT), where each took one more.
* A session checks (or creates) its schema when it opens (``pg_sql.plan_open``).
* The stores built on these drivers (the worker's and the sink's session that outlives its
  connections, an application's borrowed session) are in ``asnackq.store.pg_session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.store.outage import Backoff
from asnackq.store.pg_sql import SCHEMAS, many, plan_open, text, translate
from asnackq.store.pg_walks import Walks
from asnackq.store.targets import one_line, scrubbed, shown

__all__ = [
    "SQL_XACT_STATUS",
    "CommitCut",
    "Hooks",
    "SessionLost",
    "Unreachable",
    "aconnect",
    "adrive",
    "asteps",
    "call_plain",
    "client_cursor",
    "conflict",
    "conflict_delay_s",
    "connect",
    "drive",
    "ended",
    "passing",
    "wait_until_reachable",
]

Hooks = Callable[[w.Fault, str], None]  # how an async layer calls a fault hook


class Unreachable(ConnectionError):
    """Raised when no session could be opened: the server is down, or refused the login."""


class SessionLost(psycopg.OperationalError):
    """Raised by ``drive`` when the session was lost before its COMMIT was sent: nothing of
    the transaction committed, and its plan may be made again and run on a new session."""


class CommitCut(Exception):
    """Raised by ``adrive`` when the session was lost while its COMMIT was on the way: the
    transaction ``begun`` (its id, and the server's start time) may or may not have
    committed; ``result`` is what the plan returned."""

    def __init__(self, begun: tuple[str, str], result: Any, changed: bool) -> None:
        super().__init__(f"the session was lost during COMMIT of transaction {begun[0]}")
        self.begun, self.result, self.changed = begun, result, changed


# --- conflicts and sessions -------------------------------------------------------


def conflict(error: BaseException) -> bool:
    """Whether a transaction failed only because another one ran at the same time."""
    if isinstance(error, errors.DeadlockDetected | errors.SerializationFailure):
        return True
    return isinstance(error, errors.UniqueViolation) and error.diag.constraint_name in CONFLICT_KEYS


# Unique keys a concurrent transaction may hit first (the plan read before the other
# committed): an intake's job or event, two first CREATE TABLEs, an endpoint added twice
# at once.
CONFLICT_KEYS = {
    "jobs_id_key",
    "pg_type_typname_nsp_index",
    "asnackq_endpoints_pkey",
    "asnackq_events_id_key",
}


def conflict_delay_s(attempt: int) -> float:
    """Seconds to wait before re-running a transaction after its ``attempt``-th conflict."""
    return random.uniform(0, 0.005 * 2**attempt)


# A session whose client vanished mid-transaction (a host lost, a network cut) would hold
# its row locks until TCP gives up: the server ends it after 10 s idle in a transaction
# (no transaction of ours waits on the client: sends happen between transactions).
#
# Every statement is planned for its own parameters and the table as it is now
# (``plan_cache_mode``): psycopg prepares a statement after a few runs, and the server's
# generic plan for it, made while ``jobs`` was nearly empty and without statistics, is a
# sequential scan that it keeps while the table grows to tens of thousands of live and dead
# rows.  Each lookup of jobs by id (every intake and every finish) then read the whole table:
# a Dispatcher beside a producer fell from 759 to 198 jobs/s within 30 s (issue 37).
SQL_SESSION = """SELECT set_config('idle_in_transaction_session_timeout', '10000', false),
  set_config('plan_cache_mode', 'force_custom_plan', false)"""
# A session that may claim does not plan bitmap scans either: without statistics (a new
# table, before autovacuum's first ANALYZE) the planner took a bitmap of every pending job
# and a sort for a claim of 64, where walking ``jobs_by_status`` reads 64 rows (``pg_sql``:
# the claims' shapes).  Nor sequential scans where an index serves: with statistics taken
# while many jobs were pending, the quarantine's check of budgets read the whole table every
# cycle (13 ms at 100,000 jobs, growing with the table and its dead rows; ``jobs_spent``
# holds exactly those jobs, but the planner takes one column against another to match a
# third of the rows).  A table no index serves is still read whole; and no JIT, which
# such a plan's cost would start (245 ms to compile a claim).  Nor a sort where an index
# gives the order: with statistics taken over done jobs (a held snapshot's table, whose
# done versions no vacuum removes), a claim's filters count almost no row, so a sort of
# the one row expected looked free, and a claim from its floor was planned as a walk of
# every pending entry of ``jobs_by_deadline`` (the smaller index), the floor a filter:
# under a held snapshot, every dead version of every job claimed since, 700 ms a claim
# after seven minutes of load (690 jobs/s); walking ``jobs_by_status`` in its order from
# the floor, 3 ms.  Nor an incremental sort, which ``enable_sort`` leaves (the same read of
# ``jobs_by_deadline``, sorted by seq within its status, when the statistics count some
# pending jobs but none never attempted).  A statement that needs a sort still sorts.
# A claim's read of lapsed leases names them as an array read from ``jobs_by_lease``
# (``pg_sql.LAPSED``): without it, it walked the entries of every lease in flight (as an
# endpoint lane's read still walks its lane's).  What the setting costs: a purge of dead
# jobs walks the dead entries past its cutoff.  A read-only session (the dashboard's,
# ``connect(read_only=True)``) keeps them all: its counts over many rows gain.
SQL_CLAIMING = (
    SQL_SESSION
    + ",\n  set_config('enable_bitmapscan', 'off', false),"
    + "\n  set_config('enable_seqscan', 'off', false),\n  set_config('jit', 'off', false),"
    + "\n  set_config('enable_sort', 'off', false),"
    + "\n  set_config('enable_incremental_sort', 'off', false)"
)
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
    why = scrubbed(one_line(error), url)
    if isinstance(error, psycopg.OperationalError):
        return Unreachable(f"cannot connect to {shown(url)}: {why}")
    return ValueError(f"not a usable PostgreSQL URL {shown(url)}: {why}")


# A server's refusal that waiting may end: it is starting up, shutting down or recovering
# ("the database system is ..."), or full.  Any other FATAL (a login, a missing database)
# lasts; a failure before the server answered (refused, no socket, a timeout) may not.
PASSING_REFUSALS = ("the database system is", "too many clients", "too many connections")


def passing(error: psycopg.OperationalError) -> bool:
    """Whether a failed connection may succeed later without anyone changing anything."""
    why = str(error)
    return "FATAL:" not in why or any(refusal in why for refusal in PASSING_REFUSALS)


def wait_until_reachable(url: str, wait_s: float, waiting: Callable[[str], None]) -> None:
    """Return once a session on ``url`` opens.  While the server is down or starting,
    try again (``outage.Backoff``: capped, jittered) for ``wait_s`` seconds at most, calling
    ``waiting(why)`` once; a lasting refusal, or the time up, raises ``Unreachable``."""
    deadline, failures = time.monotonic() + wait_s, 0
    while True:
        try:
            psycopg.connect(url, connect_timeout=3, **TCP_OPTIONS).close()
            return
        except psycopg.Error as error:
            delay = Backoff().delay_s(failures, random.random())
            if not (isinstance(error, psycopg.OperationalError) and passing(error)):
                raise _refused(url, error) from None
            if time.monotonic() + delay > deadline:
                raise _refused(url, error) from None
            if failures == 0:
                waiting(scrubbed(one_line(error), url))
        failures += 1
        time.sleep(delay)


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
        con.execute(SQL_SESSION if read_only else SQL_CLAIMING)
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
    make: w.Make | None = None,
    attempts: int = 8,
) -> Any:
    """Run ``plan`` in one transaction on ``con``.

    A conflict with a concurrent transaction rolls back and runs ``make()`` again.  A
    session lost before the COMMIT was sent raises ``SessionLost`` (nothing committed).
    """
    for attempt in range(attempts):
        committing = False
        try:
            con.execute("BEGIN")  # (a failed BEGIN owns no transaction)
            result, changed = _steps(con, plan, fault)
            committing = True
            con.execute("COMMIT")
        except BaseException as error:
            if con.closed and not committing and isinstance(error, psycopg.Error):
                raise SessionLost(one_line(error)) from error
            _rollback(con)
            if make is None or not conflict(error) or attempt == attempts - 1:
                raise
            time.sleep(conflict_delay_s(attempt))
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
    flat = w.one_by_one(plan)
    while True:
        try:
            step = flat.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if isinstance(step, w.Sql) and step.sql == w.SQL_CHANGES:
            reply = [(count,)]
        elif isinstance(step, w.Sql):
            cursor = con.execute(*translate(step.sql, step.params))
            count = cursor.rowcount
            reply = cursor.fetchall() if cursor.description is not None else []
        elif isinstance(step, w.SqlMany) and (one := many(step.sql, step.params)):
            reply = [(con.execute(*one).rowcount,)]
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


async def ended(con: psycopg.AsyncConnection[Any], error: psycopg.Error) -> bool:
    """Whether ``error`` ended the session: the connection is closed (a server's FATAL: a
    restart, a killed session, the idle-in-transaction timeout after a partition; a cut
    network), or a pipeline was left busy (closed here: nothing was committed on it)."""
    if not con.closed and "pipeline mode" in str(error):
        await con.close()
    return con.closed


async def aconnect(
    url: str,
    schema: tuple[str, ...] = w.SCHEMA,
    *,
    create: bool = True,
    timeout_s: int = 10,
    application_name: str | None = None,
) -> psycopg.AsyncConnection[Any]:
    """The async twin of ``connect`` (``application_name``: the session's, over the URL's)."""
    named: dict[str, Any] = dict(TCP_OPTIONS)
    if application_name is not None:
        named["application_name"] = application_name
    try:
        con = await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=timeout_s, **named
        )
    except psycopg.Error as error:
        raise _refused(url, error) from None
    try:
        await con.execute(SQL_CLAIMING)
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
    make: w.Make | None = None,
    attempts: int = 8,
    call: Hooks | None = None,
    walks: Walks | None = None,
) -> Any:
    """The async twin of ``drive``; ``call(fault, point)`` runs each hook (default: plain);
    ``walks``: the session's claims' floors (``asnackq.store.pg_walks``), if it keeps them.

    A session lost while its COMMIT was on the way raises ``CommitCut`` (the transaction's
    id, the plan's result): whether it committed is for the caller to learn.
    """
    call = call or call_plain
    for attempt in range(attempts):
        begun: tuple[str | None, str] = (None, "")
        xact: list[tuple[str | None, str]] = []
        try:
            result, changed = await asteps(
                con, plan, fault, call, begin=True, walks=walks, xact=xact
            )
            if xact:
                begun = xact[0]
            else:
                cursor = await con.execute(SQL_XACT)
                begun = await cursor.fetchone() or begun
            await con.execute("COMMIT")
        except BaseException as error:
            if walks is not None:
                walks.rollback()  # (a plan run again walks as this try did)
            if begun[0] is not None and con.closed:
                raise CommitCut((begun[0], begun[1]), result, changed) from error
            await _arollback(con)
            if make is None or not conflict(error) or attempt == attempts - 1:
                raise
            await asyncio.sleep(conflict_delay_s(attempt))
            plan = make()
            continue
        if changed:
            call(fault, w.AFTER_COMMIT)
        return result
    raise AssertionError("unreachable")


def call_plain(fault: w.Fault, point: str) -> None:
    """Run a fault hook as a plain call (``adrive``'s default ``Hooks``)."""
    if fault is not None:
        fault(point)


async def asteps(
    con: psycopg.AsyncConnection[Any],
    plan: w.Plan[Any],
    fault: w.Fault,
    call: Hooks,
    *,
    begin: bool = False,
    walks: Walks | None = None,
    xact: list[tuple[str | None, str]] | None = None,
) -> tuple[Any, bool]:
    """The plan's steps on ``con`` inside a transaction the caller holds (``_steps``' twin),
    or (``begin``) that they begin: BEGIN goes with the plan's first statement (or the one
    statement of its first ``SqlMany``: ``_one_statement``), in one round trip (``begun``),
    or alone before a first step of another kind (or none).  ``xact``: empty until a
    statement's round trip brought the transaction's id (see the module), then that id."""
    reply: Any = None
    count = 0
    flat = w.one_by_one(_sent_at_once(plan))
    if begin and walks is not None:
        walks.begin()  # (the transaction's floors: ``Walks.floored``)
    while True:
        try:
            step = flat.send(reply)
        except StopIteration as stop:
            if begin:
                await con.execute("BEGIN")
            return stop.value  # type: ignore[no-any-return]
        if isinstance(step, AtOnce):
            reply, count = await _pipelined(con, step, begin, walks, xact)
            begin = False
            continue
        if isinstance(step, w.SqlMany) and (one := _one_statement(step)) is not None:
            if begin:  # (with BEGIN, as a first statement is: a cycle's kept requests alone)
                begin, cursor = False, await begun(con, *one)
            elif xact is not None and not xact and PIPELINE:  # (with the read of the id)
                [reply], _ = await _pipelined(con, AtOnce((step,), (one,)), False, None, xact)
                continue
            else:
                cursor = await con.execute(*one)
            reply = [(cursor.rowcount,)]
            continue
        if begin and not isinstance(step, w.Sql):
            begin = False
            await con.execute("BEGIN")
        if isinstance(step, w.Sql) and step.sql == w.SQL_CHANGES:
            reply = [(count,)]
        elif isinstance(step, w.Sql):
            floored = None if walks is None else walks.floored(step.sql, step.params)
            sql, params = floored or translate(step.sql, step.params)
            if begin:
                begin, cursor = False, await begun(con, sql, params)
            else:
                cursor = await con.execute(sql, params)
            reply, count = await _walked(con, walks, step.sql, sql, floored, cursor)
        elif isinstance(step, w.SqlMany):
            async with con.cursor() as cursor:
                await cursor.executemany(text(step.sql), step.params)
                reply = [(cursor.rowcount,)]
        else:
            reply = None
            call(fault, step.name)


PIPELINE = psycopg.AsyncPipeline.is_supported()  # (libpq 14 on: the binary wheels')


class AtOnce(NamedTuple):
    """A ``Batch`` that ``asteps`` sends in one round trip (psycopg's pipeline mode), with
    the one statement that runs each ``SqlMany`` (``_one_statement``; None for a ``Sql``)."""

    steps: tuple[w.Sql | w.SqlMany, ...]
    sets: tuple[tuple[str, Any] | None, ...]


def _sent_at_once(plan: w.Plan[Any]) -> w.Plan[Any]:
    """``plan`` with each ``Batch`` of two or more statements that each go as one
    statement (``_one_statement``) given as ``AtOnce`` (where psycopg's libpq has pipeline
    mode); the rest as it was."""
    reply: w.Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if PIPELINE and isinstance(step, w.Batch) and len(step.steps) > 1:
            sets = tuple(
                None if isinstance(one, w.Sql) else _one_statement(one) for one in step.steps
            )
            paired = zip(step.steps, sets, strict=True)
            if all(isinstance(one, w.Sql) or found for one, found in paired):
                reply = yield AtOnce(step.steps, sets)  # type: ignore[misc]
                continue
        reply = yield step


def _one_statement(many_rows: w.SqlMany) -> tuple[str, Any] | None:
    """The one statement that runs a ``SqlMany``: its set statement (``many``), or its own
    text for its one row; None: it runs row by row (``executemany``)."""
    if len(many_rows.params) == 1:
        return text(many_rows.sql), many_rows.params[0]
    return many(many_rows.sql, many_rows.params)


async def _pipelined(
    con: psycopg.AsyncConnection[Any],
    batch: AtOnce,
    begin: bool,
    walks: Walks | None,
    xact: list[tuple[str | None, str]] | None = None,
) -> tuple[list[list[tuple[Any, ...]]], int]:
    """A ``Batch``'s statements (after BEGIN, if ``begin``) sent at once and answered in
    order: their replies, and the last one's row count.  A floored read that comes up short
    is read again from the front afterwards (``Walks.found``), as one by one it would be."""
    sent: list[tuple[str, Any, tuple[str, Any] | None]] = []
    params: Any
    for one, found in zip(batch.steps, batch.sets, strict=True):
        if isinstance(one, w.SqlMany):
            assert found is not None  # (``_sent_at_once``)
            sent.append((*found, None))
            continue
        floored = None if walks is None else walks.floored(one.sql, one.params)
        sql, params = floored or translate(one.sql, one.params)
        sent.append((sql, params, floored))
    async with con.pipeline():  # (its end sends the one Sync and reads every reply)
        if begin:
            await con.execute("BEGIN", prepare=False)
        cursors = [
            await con.execute(sql, params, prepare=False, binary=True) for sql, params, _ in sent
        ]
        ids = await _read_xact(con) if xact is not None and not xact else None
    if ids is not None:
        _note_xact(await ids.fetchone(), xact)
    replies: list[list[tuple[Any, ...]]] = []
    count = 0
    for one, cursor, (sql, _, floored) in zip(batch.steps, cursors, sent, strict=True):
        if isinstance(one, w.SqlMany):
            count = cursor.rowcount
            replies.append([(count,)])
            continue
        reply, count = await _walked(con, walks, one.sql, sql, floored, cursor)
        replies.append(reply)
    return replies, count


async def _read_xact(con: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]:
    """The read of the transaction's id in a pipeline (unprepared: see the module)."""
    return await con.execute(SQL_XACT, prepare=False)


def _note_xact(row: Any, xact: list[tuple[str | None, str]] | None) -> None:
    """Keep the transaction's id read with a statement, once a write has given it one."""
    if xact is not None and row is not None and row[0] is not None:
        xact.append((row[0], row[1]))


async def _walked(
    con: psycopg.AsyncConnection[Any],
    walks: Walks | None,
    statement: str,
    sql: str,
    floored: tuple[str, Any] | None,
    cursor: psycopg.AsyncCursor[Any],
) -> tuple[list[tuple[Any, ...]], int]:
    """A statement's reply and row count from its ``cursor``; a floored read (``floored``:
    its text and parameters) that came up short is read again from the front."""
    count = cursor.rowcount
    reply = await cursor.fetchall() if cursor.description is not None else []
    if walks is not None and floored and walks.found(statement, floored[1], reply):
        params = walks.again(statement, floored[1])  # (short: again from the front)
        cursor = await con.execute(sql, params, binary=True)  # (the same values as text)
        count = cursor.rowcount
        reply = await cursor.fetchall()
        walks.found(statement, params, reply)
    return reply, count


async def begun(
    con: psycopg.AsyncConnection[Any], sql: str, params: Any
) -> psycopg.AsyncCursor[Any]:
    """BEGIN and a statement in one round trip: one query of both (a query of two statements
    takes no parameter the server binds, so the statement's are bound here, as psycopg's
    client-side cursor binds them), never prepared; the cursor is on the statement's
    result.  A failing statement leaves the transaction begun (and failed): the caller rolls
    it back, as after any failing statement."""
    query = psycopg.AsyncClientCursor(con).mogrify(sql, params)
    cursor = await con.execute("BEGIN; " + query, prepare=False)
    cursor.nextset()
    return cursor


async def _arollback(con: psycopg.AsyncConnection[Any]) -> None:
    if con.info.transaction_status != TransactionStatus.IDLE:
        with contextlib.suppress(psycopg.Error):
            await con.execute("ROLLBACK")

"""PostgreSQL: the core's plans driven through psycopg 3, sync and async.

Rules of this module:

* No state machine here.  Every transition is a ``worker.plan_*`` plan; the two drivers
  below run it step by step, answering each ``Sql`` step with the PostgreSQL text that
  ``STATEMENTS`` keys to the core's own statement (``SQL_CHANGES`` is answered from the
  previous statement's row count).  A statement without a PostgreSQL text is a bug
  (``KeyError``), never a guess.
* The texts differ from SQLite's only where concurrent transactions demand it (SQLite
  serialises writers; here many claimers run at once, READ COMMITTED):
  - claims and the quarantine lock their rows ``FOR UPDATE SKIP LOCKED``: claimers never
    wait for each other, and a claim re-checks, on the row it locked, that the job is not
    spent (a job another transaction released a moment ago is never leased past its budget);
  - reading jobs by id (finish, extend, intake, redrive) locks them ``FOR UPDATE`` in id
    order: a plan decides on rows nobody else can change before its COMMIT, so every
    guarded write still changes exactly the rows the plan expects.
* A transaction that meets a deadlock or a concurrent intake of the same id is rolled
  back and its plan made again and re-run (bounded, jittered); ``make`` is a zero-argument
  callable returning a fresh plan.  Fault hooks of a rolled-back try run again.
* Connections are in autocommit mode: the drivers write BEGIN and COMMIT themselves.
  A failing ROLLBACK never hides the original error.
* Schemas are created idempotently under an advisory lock, with their version recorded
  in ``asnackq_schema``; a newer version than this code knows is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import psycopg
from psycopg import errors
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.targets import one_line, shown

__all__ = ["STATEMENTS", "AsyncStore", "Schema", "Unreachable", "aconnect", "apump",
           "connect", "drive", "placeholders", "register"]

Make = Callable[[], w.Plan[Any]]
Hooks = Callable[[w.Fault, str], None]    # how an async layer calls a fault hook
Params = tuple[Any, ...] | dict[str, Any]


class Unreachable(ConnectionError):
    """Raised when no session could be opened: the server is down, or refused the login."""


# --- statements ---------------------------------------------------------------------

def placeholders(sql: str) -> str:
    """SQLite's ``?`` and ``:name`` placeholders as psycopg's ``%s`` and ``%(name)s``."""
    return re.sub(r"(?<!:):([A-Za-z_]\w*)", r"%(\1)s", sql.replace("?", "%s"))


# The quarantine: lock the spent jobs nobody else holds, then end them (one reason each).
_QUARANTINE = """
WITH spent AS (
  SELECT seq FROM jobs WHERE status IN ('pending', 'leased') AND {spent}
    AND (status = 'pending' OR lease_until <= %(now)s)
  FOR UPDATE SKIP LOCKED)
UPDATE jobs SET status = 'dead', reason = '{reason}', owner = NULL, lease_until = NULL
FROM spent WHERE jobs.seq = spent.seq"""

# The :n lowest-seq claimable jobs nobody else is claiming, locked until COMMIT.  The
# lock re-reads each row: the values returned are the row's latest, and a job that is
# spent by now (released by another transaction since the quarantine) is not claimable.
_CLAIMABLE = """
  SELECT seq, id, qty, attempts, token, deadline FROM jobs
  WHERE status = '{status}' AND {ready} <= %(now)s
    AND deadline > %(now)s AND attempts < max_attempts
  ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED"""
PG_NEXT_CLAIMABLE = f"""
WITH pending AS ({_CLAIMABLE.format(status="pending", ready="available_at")}),
expired AS ({_CLAIMABLE.format(status="leased", ready="lease_until")})
SELECT * FROM pending UNION ALL SELECT * FROM expired ORDER BY seq LIMIT %(n)s"""

# Rows read to decide on are locked, in one order for every transaction.
PG_JOBS = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until, id
FROM jobs WHERE id = ANY(%s) ORDER BY id FOR UPDATE"""

PG_JOB = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until
FROM jobs WHERE id = %s FOR UPDATE"""

PG_LEASE = """
UPDATE jobs SET status = 'leased', attempts = attempts + 1, token = token + 1, owner = %s,
  lease_until = least(%s, deadline), reason = NULL
WHERE seq = ANY(%s) AND status IN ('pending', 'leased')"""

# Each core statement (or ``{marks}`` template) -> its PostgreSQL text.  In a template's
# text the IN-list becomes one array parameter.
STATEMENTS: dict[str, str] = {
    w.SQL_QUARANTINE_DEADLINE: _QUARANTINE.format(spent="deadline <= %(now)s",
                                                  reason="deadline"),
    w.SQL_QUARANTINE_EXHAUSTED: _QUARANTINE.format(spent="attempts >= max_attempts",
                                                   reason="exhausted"),
    w.SQL_NEXT_CLAIMABLE: PG_NEXT_CLAIMABLE,
    w.SQL_JOBS: PG_JOBS,
    w.SQL_JOB: PG_JOB,
    w.SQL_LEASE: PG_LEASE,
    **{sql: placeholders(sql) for sql in (w.SQL_INSERT_JOB, w.SQL_FINISH, w.SQL_EXTEND,
                                          w.SQL_AUDIT, w.SQL_REDRIVE, w.SQL_ACTIVE)},
}

_IN_LIST = re.compile(r"IN \(\?(?:,\?)*\)")


def register(statements: dict[str, str]) -> None:
    """Add PostgreSQL texts for another module's statements (the sink's)."""
    for sql, text in statements.items():
        if STATEMENTS.setdefault(sql, text) != text:
            raise ValueError(f"two PostgreSQL texts for {sql!r}")


@functools.lru_cache(maxsize=4096)
def _text(sql: str) -> tuple[str, int | None]:
    """The PostgreSQL text for ``sql`` and, for a template, how many parameters precede
    its IN-list (those after it become one array)."""
    found = STATEMENTS.get(sql)
    if found is not None:
        return found, None
    marks = _IN_LIST.search(sql)
    if marks is not None:
        found = STATEMENTS.get(f"{sql[:marks.start()]}IN ({{marks}}){sql[marks.end():]}")
        if found is not None:
            return found, sql.count("?", 0, marks.start())
    raise KeyError(f"no PostgreSQL text for the statement {' '.join(sql.split())[:90]!r}")


def translate(sql: str, params: Params) -> tuple[str, Params]:
    """A plan's statement and parameters, as PostgreSQL takes them."""
    text, head = _text(sql)
    if head is None:
        return text, params
    assert isinstance(params, tuple)
    return text, (*params[:head], list(params[head:]))


# --- schemas ------------------------------------------------------------------------

class Schema(NamedTuple):
    """A part of the database (``queue``, ``sink``): its version and its DDL."""

    part: str
    version: int
    tables: tuple[str, ...]     # every table it creates; the first one marks its presence
    ddl: tuple[str, ...]


QUEUE = Schema("queue", 1, ("jobs", "redrives"), (
    """CREATE TABLE IF NOT EXISTS jobs (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token BIGINT NOT NULL,
  available_at BIGINT NOT NULL, deadline BIGINT NOT NULL,
  owner TEXT, lease_until BIGINT, reason TEXT)""",
    """CREATE TABLE IF NOT EXISTS redrives (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL, token BIGINT NOT NULL, at_ms BIGINT NOT NULL, note TEXT NOT NULL)""",
    # As on SQLite, claims never visit done/dead rows: pending jobs in seq order, leases
    # by their end, deadlines by status, spent budgets in a partial index.
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq)",
    "CREATE INDEX IF NOT EXISTS jobs_by_deadline ON jobs (status, deadline)",
    "CREATE INDEX IF NOT EXISTS jobs_by_lease ON jobs (lease_until) WHERE status = 'leased'",
    "CREATE INDEX IF NOT EXISTS jobs_spent ON jobs (status) WHERE attempts >= max_attempts",
))

# The core's schema (and, registered, the sink's) -> its PostgreSQL schema.
SCHEMAS: dict[tuple[str, ...], Schema] = {w.SCHEMA: QUEUE}

SQL_LOCK_SCHEMA = "SELECT pg_advisory_xact_lock(1634626401, 1)"   # every opener, in turn
SQL_PRESENT = "SELECT to_regclass(%s) IS NOT NULL"
SQL_VERSIONS = """CREATE TABLE IF NOT EXISTS asnackq_schema (part TEXT PRIMARY KEY,
  version INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())"""
SQL_VERSION = "SELECT version FROM asnackq_schema WHERE part = %s"
SQL_RECORD_VERSION = """INSERT INTO asnackq_schema (part, version) VALUES (%s, %s)
ON CONFLICT (part) DO NOTHING"""
for _native in (SQL_LOCK_SCHEMA, SQL_PRESENT, SQL_VERSIONS, SQL_VERSION, SQL_RECORD_VERSION,
                *QUEUE.ddl):
    STATEMENTS[_native] = _native


def plan_open(schema: Schema, create: bool) -> Generator[w.Step, Any, tuple[None, bool]]:
    """Check (and with ``create``, complete) a schema, in one transaction.

    Nothing is written when the recorded version is current; without ``create`` an
    absent schema is a ``ValueError``; a newer version than this code knows, too.
    """
    yield w.Sql(SQL_LOCK_SCHEMA)
    [(present,)] = yield w.Sql(SQL_PRESENT, (schema.tables[0],))
    version = None
    if present and (yield w.Sql(SQL_PRESENT, ("asnackq_schema",)))[0][0]:
        rows = yield w.Sql(SQL_VERSION, (schema.part,))
        version = rows[0][0] if rows else None
    if version is not None and version > schema.version:
        raise ValueError(f"the {schema.part} schema is at version {version}, newer than this "
                         f"asnackq knows ({schema.version}): upgrade asnackq")
    if version == schema.version:
        return None, False
    if not create:
        if not present:
            raise ValueError(f"no {schema.part} here (no {schema.tables[0]} table)")
        return None, False
    for statement in (SQL_VERSIONS, *schema.ddl):
        yield w.Sql(statement)
    yield w.Sql(SQL_RECORD_VERSION, (schema.part, schema.version))
    return None, True


# --- errors and URLs ----------------------------------------------------------------

def _conflict(error: BaseException) -> bool:
    """Whether a transaction failed only because another one ran at the same time."""
    if isinstance(error, errors.DeadlockDetected | errors.SerializationFailure):
        return True
    return isinstance(error, errors.UniqueViolation) and \
        error.diag.constraint_name in CONFLICT_KEYS


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

def connect(url: str, schema: tuple[str, ...] = w.SCHEMA, *, create: bool = True,
            read_only: bool = False) -> psycopg.Connection[Any]:
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


def drive(con: psycopg.Connection[Any], make: Make, fault: w.Fault = None,
          attempts: int = 8, first: w.Plan[Any] | None = None) -> Any:
    """Run the plan ``first`` (default: ``make()``) in one transaction on ``con``.

    A conflict with a concurrent transaction rolls back and runs ``make()`` again.
    """
    plan = make() if first is None else first    # validated before anything is sent
    for attempt in range(attempts):
        con.execute("BEGIN")           # outside the try: a failed BEGIN owns no transaction
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
                cursor.executemany(_text(step.sql)[0], step.params)
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

async def aconnect(url: str, schema: tuple[str, ...] = w.SCHEMA, *,
                   create: bool = True) -> psycopg.AsyncConnection[Any]:
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


async def apump(con: psycopg.AsyncConnection[Any], make: Make, fault: w.Fault = None,
                attempts: int = 8, first: w.Plan[Any] | None = None,
                call: Hooks | None = None) -> Any:
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


async def _arun(con: psycopg.AsyncConnection[Any], plan: w.Plan[Any], fault: w.Fault,
                call: Hooks) -> tuple[Any, bool]:
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
                await cursor.executemany(_text(step.sql)[0], step.params)
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


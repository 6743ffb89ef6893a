"""Each delivery attempt's answer, kept: status, latency and the first KiB of the body.

Rules of this module:

* The product's own table ``asnackq_attempts``, on SQLite and PostgreSQL alike, never part
  of the contract's schema: one row per request a Dispatcher made (a re-send under the same
  lease is a request of its own), in the order made. A run that keeps them creates the table
  when it starts.
* The rows of a cycle's requests are written in the cycle's own transaction, before the
  core's plan and sent with its first read, in one statement (one insert over a JSON array
  of them: ``SQLITE_RECORD_SET``, ``PG_RECORD_SET``; a row alone is bound as it is), so
  keeping them adds no transaction, no commit and no round trip (on PostgreSQL, where
  libpq has pipeline mode: without it, one); a cycle that commits nothing keeps its rows
  for the next.
* What is kept of an answer: its status (none when no answer came), the request's latency,
  a verdict (what the sender made of it: ``ok``, ``retry``, ``permanent``, ``bad_ack``,
  ``away``, ``timing_out``, ``tls``, ``overloaded``, ``gone``, ``error``) and the first
  ``EXCERPT_BYTES`` of its body, as text (undecodable bytes and NUL replaced by U+FFFD:
  PostgreSQL's text holds no NUL). Headers are not kept.
* A claim records at most ``PER_CLAIM`` requests (its first ones): a receiver answering 429
  for an hour does not grow the table by the hour.
* A row is kept under its job's ``seq`` (``job``, looked up by id in the insert itself), in
  an index by ``(job, seq)``: jobs' seqs follow the order they were enqueued in, so a cycle's
  rows land at the index's end whatever the ids (random ids, UUIDs, by the job's id would
  land each on a page of its own: a transaction of 500 rows changed some 500 pages, each
  copied to the rollback journal and synced).  A row without a job (written by an earlier
  asnackq, whose table had no ``job``, or for a job no longer there) is found by its id, in
  an index of those rows alone.  A table of an earlier asnackq gets the column and the
  indexes when a run that keeps the answers starts (its rows are kept as they are, without a
  job); until then, readers and purges read it by id.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from asnackq.core import worker as w
from asnackq.store.reads import fetch

__all__ = [
    "EXCERPT_BYTES",
    "PER_CLAIM",
    "PG_TEXTS",
    "SQL_CREATE",
    "SQL_INDEXES",
    "SQL_OF_JOB",
    "SQL_OF_JOB_PG",
    "Record",
    "has_job",
    "of_job",
    "plan_create",
    "recorded",
]

T = TypeVar("T")

EXCERPT_BYTES = 1024
PER_CLAIM = 20
VERDICTS = (
    "ok",
    "retry",
    "permanent",
    "bad_ack",
    "away",
    "timing_out",
    "tls",
    "overloaded",
    "gone",
    "error",
)

SQL_CREATE = (
    """CREATE TABLE IF NOT EXISTS asnackq_attempts (seq INTEGER PRIMARY KEY,
  id TEXT NOT NULL, token INTEGER NOT NULL, attempt INTEGER NOT NULL, at_ms INTEGER NOT NULL,
  status INTEGER, latency_ms INTEGER NOT NULL, verdict TEXT NOT NULL, answer TEXT NOT NULL,
  job INTEGER)""",
)
# The indexes (after the column, in a table of an earlier asnackq): the rows with a job by
# its seq, the rows without one by id (each index holds its rows alone: a new row lands at
# the first one's end, and an earlier table's history is not indexed twice); the earlier
# indexes dropped (of every row by id; of every row by job, NULLs with them).
SQL_INDEXES = (
    "CREATE INDEX IF NOT EXISTS asnackq_attempts_keyed ON asnackq_attempts(job, seq)"
    " WHERE job IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS asnackq_attempts_unkeyed ON asnackq_attempts(id, seq)"
    " WHERE job IS NULL",
    "DROP INDEX IF EXISTS asnackq_attempts_by_job",
    "DROP INDEX IF EXISTS asnackq_attempts_of_job",
)
# The table's columns (none: no table) and whether ``job`` is one of them (an earlier
# asnackq's table has none), in one read; and its addition.
SQL_HAS_JOB = """SELECT count(*), coalesce(sum(name = 'job'), 0)
FROM pragma_table_info('asnackq_attempts')"""
SQL_HAS_JOB_PG = """SELECT count(*), count(*) FILTER (WHERE attname = 'job') FROM pg_attribute
WHERE attrelid = to_regclass('asnackq_attempts') AND attnum > 0 AND NOT attisdropped"""
SQL_ADD_JOB = "ALTER TABLE asnackq_attempts ADD COLUMN job INTEGER"
# Creating the table takes the schema's lock first: PostgreSQL's CREATE ... IF NOT EXISTS
# is no guard against a concurrent one (two workers starting at once); SQLite's BEGIN
# IMMEDIATE is the lock already.
SQL_LOCK = "SELECT 1"
SQL_RECORD = """INSERT INTO asnackq_attempts
  (id, token, attempt, at_ms, status, latency_ms, verdict, answer, job)
SELECT x.*, (SELECT seq FROM jobs WHERE jobs.id = x.column1)
FROM (VALUES (?, ?, ?, ?, ?, ?, ?, ?)) AS x"""
# A job's rows: those under its seq, then (an earlier asnackq's) those under its id alone.
# Each through its index, named: SQLite's statistics (``ANALYZE``) count a NULL as a value,
# so on a table of an earlier asnackq's rows alone they would read every row for a seq's.
SQL_OF_JOB = """SELECT token, attempt, at_ms, status, latency_ms, verdict, answer FROM (
  SELECT * FROM asnackq_attempts INDEXED BY asnackq_attempts_keyed
    WHERE job IS NOT NULL AND job = (SELECT seq FROM jobs WHERE id = ?)
  UNION ALL SELECT * FROM asnackq_attempts INDEXED BY asnackq_attempts_unkeyed
    WHERE job IS NULL AND id = ?) AS a ORDER BY seq"""
SQL_OF_JOB_PG = re.sub(r" INDEXED BY \w+", "", SQL_OF_JOB)
# The same in a table of an earlier asnackq (no ``job``).
SQL_OF_JOB_BY_ID = """SELECT token, attempt, at_ms, status, latency_ms, verdict, answer
FROM asnackq_attempts WHERE id = ? ORDER BY seq"""
# The PostgreSQL texts (``asnackq.store.pg_sql``).
PG_TEXTS = {
    SQL_CREATE[0]: """CREATE TABLE IF NOT EXISTS asnackq_attempts (
  seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id TEXT NOT NULL,
  token BIGINT NOT NULL, attempt INTEGER NOT NULL, at_ms BIGINT NOT NULL, status INTEGER,
  latency_ms INTEGER NOT NULL, verdict TEXT NOT NULL, answer TEXT NOT NULL, job BIGINT)""",
    **{index: index for index in SQL_INDEXES},
    SQL_HAS_JOB: SQL_HAS_JOB_PG,
    SQL_HAS_JOB_PG: SQL_HAS_JOB_PG,  # (a read plan's, on a reader or driven)
    SQL_ADD_JOB: "ALTER TABLE asnackq_attempts ADD COLUMN job BIGINT",
    SQL_LOCK: "SELECT pg_advisory_xact_lock(1634626401, 1)",  # (pg_sql.SQL_LOCK_SCHEMA's)
    SQL_RECORD: """INSERT INTO asnackq_attempts
  (id, token, attempt, at_ms, status, latency_ms, verdict, answer, job)
SELECT x.*, (SELECT seq FROM jobs WHERE jobs.id = x.column1)
FROM (VALUES (%s, %s::bigint, %s::int, %s::bigint, %s::int, %s::int, %s, %s)) AS x""",
    SQL_OF_JOB: SQL_OF_JOB_PG.replace("?", "%s"),
    SQL_OF_JOB_PG: SQL_OF_JOB_PG.replace("?", "%s"),  # (a read plan's, driven)
    SQL_OF_JOB_BY_ID: SQL_OF_JOB_BY_ID.replace("?", "%s"),
}
# A cycle's rows on PostgreSQL: one INSERT over a JSON array of them (``pg_sql.SETS``).
PG_RECORD_SET = """INSERT INTO asnackq_attempts
  (id, token, attempt, at_ms, status, latency_ms, verdict, answer, job)
SELECT r ->> 0, (r ->> 1)::bigint, (r ->> 2)::int, (r ->> 3)::bigint, (r ->> 4)::int,
  (r ->> 5)::int, r ->> 6, r ->> 7, (SELECT seq FROM jobs WHERE jobs.id = r ->> 0)
FROM jsonb_array_elements(%s::jsonb) AS r"""
# The same on SQLite (``sqlite_aio.SETS``), in the array's order (``key``): the rows keep the
# order of the cycle's requests in ``seq``.  No text kept holds a NUL (``excerpt``), which
# ``json_extract`` would end the text at.
SQLITE_RECORD_SET = """INSERT INTO asnackq_attempts
  (id, token, attempt, at_ms, status, latency_ms, verdict, answer, job)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
  json_extract(value, '$[3]'), json_extract(value, '$[4]'), json_extract(value, '$[5]'),
  json_extract(value, '$[6]'), json_extract(value, '$[7]'),
  (SELECT seq FROM jobs WHERE jobs.id = json_extract(value, '$[0]'))
FROM json_each(?) ORDER BY key"""


class Record(NamedTuple):
    """One request of a delivery and what came of it."""

    id: str
    token: int
    attempt: int
    at_ms: int
    status: int | None
    latency_ms: int
    verdict: str
    answer: str


def excerpt(body: bytes) -> str:
    """The first ``EXCERPT_BYTES`` of an answer's body, as text (NUL replaced too: a
    receiver's NUL byte would otherwise fail the cycle's transaction on PostgreSQL)."""
    return body[:EXCERPT_BYTES].decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def plan_create() -> w.Plan[None]:
    """Create the table and its indexes if absent; give an earlier asnackq's table its
    ``job`` column and the indexes (its rows kept as they are)."""
    for statement in (SQL_LOCK, *SQL_CREATE):
        yield w.Sql(statement)
    ((_, keyed),) = yield from fetch(SQL_HAS_JOB)
    if not keyed:
        yield w.Sql(SQL_ADD_JOB)
    for statement in SQL_INDEXES:
        yield w.Sql(statement)
    return None, True


def has_job(on_sqlite: bool) -> w.Plan[bool | None]:
    """A read plan: None without the table, else whether it has its ``job`` column (one
    read: a job's requests, or a purge's batch, cost no more reads of the catalog than
    with ``has_table`` alone)."""
    ((columns, keyed),) = yield from fetch(SQL_HAS_JOB if on_sqlite else SQL_HAS_JOB_PG)
    return (bool(keyed) if columns else None), False


FIELDS = ("token", "attempt", "at_ms", "status", "latency_ms", "verdict", "answer")


def of_job(job_id: str, on_sqlite: bool) -> w.Plan[list[dict[str, Any]]]:
    """A read plan: each request kept of the job, oldest first (none without the table)."""
    keyed, _ = yield from has_job(on_sqlite)
    if keyed is None:
        return [], False
    if not keyed:
        rows = yield from fetch(SQL_OF_JOB_BY_ID, (job_id,))
    else:
        rows = yield from fetch(SQL_OF_JOB if on_sqlite else SQL_OF_JOB_PG, (job_id, job_id))
    return [dict(zip(FIELDS, row, strict=True)) for row in rows], False


def recorded(plan: w.Plan[T], rows: Sequence[Record]) -> w.Plan[T]:
    """``plan`` with ``rows`` written in its transaction (which then commits): their insert
    goes first, in one ``Batch`` with the plan's first step when that step only reads (a
    cycle's first step: the insert is sent with BEGIN and that read, no hop of its own)."""
    if not rows:
        return (yield from plan)
    insert = w.SqlMany(SQL_RECORD, list(rows))
    try:
        step = plan.send(None)
    except StopIteration as stop:
        yield insert
        return stop.value[0], True
    reads = step.steps if isinstance(step, w.Batch) else (step,)
    reply: w.Reply
    if not all(isinstance(one, w.Read) for one in reads):
        yield insert
        reply = yield step
    else:
        replies = yield w.Batch((insert, *reads))
        assert replies is not None
        reply = replies[1:] if isinstance(step, w.Batch) else replies[1]
    result, _ = yield from resumed(plan, reply)
    return result, True


def resumed(plan: w.Plan[T], reply: w.Reply) -> w.Plan[T]:
    """The rest of a plan whose step last taken is answered by ``reply``."""
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        reply = yield step

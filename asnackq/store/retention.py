"""How long finished jobs are kept: a purge of done (and, when asked, dead) jobs whose
end is a horizon ago, with what the product kept of them.

Rules of this module:

* A done job's ``available_at`` is the time it finished (the core's finish sets it), so a
  done job goes when that is at or before ``cutoff_ms``.  A dead job's death time is not
  kept (the quarantine leaves ``available_at`` as it was), so a dead job goes only when
  both its deadline and its ``available_at`` are at or before the cutoff.  The jobs are
  read by status in ``seq`` order (the status index), never a pending or leased one.
* One batch (at most ``limit`` jobs) a transaction: the jobs' rows go, guarded by their
  status (PostgreSQL re-checks it on a row a concurrent redrive changed: a job redriven
  meanwhile is not purged), and in the same transaction what the product kept of exactly
  those jobs: their requests (``asnackq_attempts``), their traces (``asnackq_job_traces``)
  and their redrive records (``redrives``, whose tokens would otherwise count against a
  new job of the same id); a delivery's row (``asnackq_deliveries``), and its event
  (``asnackq_events``) once none of its deliveries is left (an event no endpoint took
  stays).  Each batch is audited by a row of ``asnackq_purges``
  (when, the cutoff, the status, how many): the product's own table, made by the first
  purge, never by ``open_queue``.
* A purged id is forgotten: enqueued (or published) again, it is new (the horizon is how long an
  id's enqueue stays a no-op).  Pending and leased jobs are never purged.
* The statements are SQLite's; ``PG_TEXTS`` holds PostgreSQL's.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from asnackq.core import worker as w
from asnackq.store.attempts import has_job
from asnackq.store.reads import fetch, has_table

__all__ = [
    "MAX_LIMIT",
    "PG_TEXTS",
    "PURGEABLE",
    "SQL_CREATE",
    "SQL_PURGES",
    "Batch",
    "check_purge",
    "plan_create",
    "plan_purge",
    "plan_purged_before",
]

PURGEABLE = ("done", "dead")
MAX_LIMIT = 10_000  # jobs a transaction
SQL_LOCK = "SELECT 1"  # (PostgreSQL: the schema's lock, as every product table takes it)
SQL_CREATE = """CREATE TABLE IF NOT EXISTS asnackq_purges (seq INTEGER PRIMARY KEY,
  at_ms INTEGER NOT NULL, cutoff_ms INTEGER NOT NULL, status TEXT NOT NULL,
  jobs INTEGER NOT NULL)"""
# A run's batches go on from the last seq the one before reached (``after``): a batch never
# steps again over the rows its run deleted (on PostgreSQL, dead rows until a vacuum).
_PURGE = """DELETE FROM jobs WHERE status = '{status}' AND seq IN (
  SELECT seq FROM jobs WHERE status = '{status}' AND seq > {after}
    AND available_at <= {cutoff}{also}
  ORDER BY seq LIMIT {limit})
RETURNING seq, id"""
# On PostgreSQL the batch is read once, as an array, and its jobs found by seq alone (the
# outer status test is no index condition: ``IS TRUE``, status is never NULL).  With
# statistics taken before most jobs were done, an ``IN`` was planned as a loop reading the
# batch once per done job, and a status condition as a walk of every done job.
_PG_PURGE = _PURGE.replace(
    "status = '{status}' AND seq IN (\n", "(status = '{status}') IS TRUE AND seq = ANY(ARRAY(\n"
).replace("LIMIT {limit})", "LIMIT {limit}))")
_NAMED = {"after": ":after", "cutoff": ":cutoff", "limit": ":limit"}
_PG_NAMED = {"after": "%(after)s", "cutoff": "%(cutoff)s", "limit": "%(limit)s"}
SQL_PURGE = {
    "done": _PURGE.format(status="done", also="", **_NAMED),
    "dead": _PURGE.format(status="dead", also=" AND deadline <= :cutoff", **_NAMED),
}
# The purged jobs' kept requests (``asnackq.store.attempts``): under their seqs, then those
# without a job under their ids, each through its index, named (``attempts.SQL_OF_JOB``);
# in an earlier asnackq's table (no ``job``), by id.
SQL_ATTEMPTS = """DELETE FROM asnackq_attempts INDEXED BY asnackq_attempts_keyed
WHERE job IS NOT NULL AND job IN (SELECT value FROM json_each(?))"""
SQL_ATTEMPTS_UNKEYED = """DELETE FROM asnackq_attempts INDEXED BY asnackq_attempts_unkeyed
WHERE job IS NULL AND id IN (SELECT value FROM json_each(?))"""
SQL_ATTEMPTS_BY_ID = "DELETE FROM asnackq_attempts WHERE id IN (SELECT value FROM json_each(?))"
# What else the product kept of the purged jobs, by their ids (one JSON array): table,
# statement.
KEPT = (
    (
        "asnackq_job_traces",
        "DELETE FROM asnackq_job_traces WHERE job_id IN (SELECT value FROM json_each(?))",
    ),
    ("redrives", "DELETE FROM redrives WHERE id IN (SELECT value FROM json_each(?))"),
)
# A purged delivery's row goes, and its event with it once no delivery of it is left.
SQL_DELIVERIES = """DELETE FROM asnackq_deliveries WHERE job IN (SELECT value FROM json_each(?))
RETURNING event"""
SQL_EVENTS = """DELETE FROM asnackq_events WHERE id IN (SELECT value FROM json_each(?))
  AND NOT EXISTS (SELECT 1 FROM asnackq_deliveries AS d WHERE d.event = asnackq_events.id)"""
SQL_AUDIT = "INSERT INTO asnackq_purges (at_ms, cutoff_ms, status, jobs) VALUES (?, ?, ?, ?)"
SQL_PURGES = """SELECT at_ms, cutoff_ms, status, jobs FROM asnackq_purges
ORDER BY seq DESC LIMIT ?"""
SQL_PURGED_BEFORE = "SELECT max(cutoff_ms) FROM asnackq_purges"
_ANY = "= ANY(ARRAY(SELECT json_array_elements_text(%s::json)))"
PG_TEXTS = {
    SQL_LOCK: "SELECT pg_advisory_xact_lock(1634626401, 1)",  # (pg_sql.SQL_LOCK_SCHEMA's)
    SQL_CREATE: """CREATE TABLE IF NOT EXISTS asnackq_purges (
  seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, at_ms BIGINT NOT NULL,
  cutoff_ms BIGINT NOT NULL, status TEXT NOT NULL, jobs INTEGER NOT NULL)""",
    SQL_PURGE["done"]: _PG_PURGE.format(status="done", also="", **_PG_NAMED),
    SQL_PURGE["dead"]: _PG_PURGE.format(
        status="dead", also=" AND deadline <= %(cutoff)s", **_PG_NAMED
    ),
    SQL_ATTEMPTS: "DELETE FROM asnackq_attempts WHERE job IS NOT NULL AND job = ANY(ARRAY("
    "SELECT json_array_elements_text(%s::json)::bigint))",
    SQL_ATTEMPTS_UNKEYED: f"DELETE FROM asnackq_attempts WHERE job IS NULL AND id {_ANY}",
    SQL_ATTEMPTS_BY_ID: f"DELETE FROM asnackq_attempts WHERE id {_ANY}",
    KEPT[0][1]: f"DELETE FROM asnackq_job_traces WHERE job_id {_ANY}",
    KEPT[1][1]: f"DELETE FROM redrives WHERE id {_ANY}",
    SQL_DELIVERIES: f"DELETE FROM asnackq_deliveries WHERE job {_ANY} RETURNING event",
    SQL_EVENTS: f"""DELETE FROM asnackq_events WHERE id {_ANY}
  AND NOT EXISTS (SELECT 1 FROM asnackq_deliveries AS d WHERE d.event = asnackq_events.id)""",
    SQL_AUDIT: SQL_AUDIT.replace("?", "%s"),
    SQL_PURGES: SQL_PURGES.replace("?", "%s"),
    SQL_PURGED_BEFORE: SQL_PURGED_BEFORE,
}


def check_purge(cutoff_ms: object, status: object, limit: object) -> None:
    """Raise ``ValueError`` for a purge's bad input (before any transaction)."""
    w.check_int(cutoff_ms, "cutoff_ms", 0, w.MAX_NOW)
    if status not in PURGEABLE:
        raise ValueError(f"status must be one of {', '.join(PURGEABLE)}: {status!r}")
    w.check_int(limit, "limit", 1, MAX_LIMIT)


def plan_purged_before(on_sqlite: bool) -> w.Plan[int | None]:
    """A read plan: the latest cutoff a purge of the queue used (None: never purged)."""
    present, _ = yield from has_table("asnackq_purges", on_sqlite)
    if not present:
        return None, False
    ((cutoff,),) = yield from fetch(SQL_PURGED_BEFORE)
    return cutoff, False


def plan_create() -> w.Plan[None]:
    """Create the purges' audit table if absent."""
    yield w.Sql(SQL_LOCK)
    yield w.Sql(SQL_CREATE)
    return None, True


class Batch(NamedTuple):
    """What one batch purged: how many jobs, and the highest seq it reached."""

    jobs: int
    last_seq: int


def plan_purge(
    cutoff_ms: int, status: str, limit: int, at_ms: int, on_sqlite: bool, after: int = 0
) -> w.Plan[Batch]:
    """One batch: up to ``limit`` jobs with ``status`` past ``after`` (a seq) that ended at
    or before ``cutoff_ms`` purged with what was kept of them, audited."""
    check_purge(cutoff_ms, status, limit)
    w.check_int(at_ms, "at_ms", 0, w.MAX_NOW)
    w.check_int(after, "after", 0, 2**63 - 1)
    return _purge(cutoff_ms, status, limit, at_ms, on_sqlite, after)


def _purge(
    cutoff_ms: int, status: str, limit: int, at_ms: int, on_sqlite: bool, after: int
) -> w.Plan[Batch]:
    rows = yield w.Sql(SQL_PURGE[status], {"after": after, "cutoff": cutoff_ms, "limit": limit})
    if not rows:
        return Batch(0, after), False
    ids = json.dumps([row[1] for row in rows])
    keyed, _ = yield from has_job(on_sqlite)
    if keyed:
        yield w.Sql(SQL_ATTEMPTS, (json.dumps([row[0] for row in rows]),))
        yield w.Sql(SQL_ATTEMPTS_UNKEYED, (ids,))
    elif keyed is not None:
        yield w.Sql(SQL_ATTEMPTS_BY_ID, (ids,))
    for table, statement in KEPT:
        present, _ = yield from has_table(table, on_sqlite)
        if present:
            yield w.Sql(statement, (ids,))
    present, _ = yield from has_table("asnackq_deliveries", on_sqlite)
    if present:
        events = yield w.Sql(SQL_DELIVERIES, (ids,))
        if events:
            yield w.Sql(SQL_EVENTS, (json.dumps(sorted({row[0] for row in events})),))
    yield w.Sql(SQL_AUDIT, (at_ms, cutoff_ms, status, len(rows)))
    return Batch(len(rows), max(row[0] for row in rows)), True

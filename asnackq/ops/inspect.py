"""The dashboard's reads about one job and about the work going on: a job's whole story, the
leases each owner holds, and done jobs per minute over the last hour.

Rules of this module:

* Only reads, with bound parameters: each read is a plan (``w.Plan`` of ``w.Sql`` steps)
  that the caller runs on a reader it opened read-only (``asnackq.store.readers``: sync,
  or aiosqlite in async code).  A job id is checked (``check_job_id``) before any read.
* The trace table ``asnackq_job_traces`` (``job_id``, W3C ``traceparent``) belongs to the
  tracing support and may be absent: a job then has no trace id.  It is looked up, never
  assumed, so a missing table is no error on either driver.
* The audit's verdict on one job is ``queries.describe`` over that job's row and its inbox
  row: the rule of ``asnackq audit``, without the audit's join over every job.
* An event (``core.events``) is inspected by its id: its type, key and intake time, and
  its deliveries by endpoint, each with its job's status and attempts and the requests
  kept of it; a delivery's story names its event and endpoint.  A queue without events
  has none, never an error.
* A done job's ``available_at`` is when it finished (the contract's ``finish`` sets it to
  its ``now_ms``): done per minute counts done jobs by ``available_at``.
"""

from __future__ import annotations

import re
from typing import Any

from asnackq.core import worker as w
from asnackq.core.inbox import RECORD_FIELDS, SQL_RECORD
from asnackq.ops.queries import ATTENTION, VIOLATIONS, as_json_value, describe
from asnackq.store import attempts
from asnackq.store.reads import fetch, has_table

__all__ = [
    "BAD_ID",
    "HOUR_MINUTES",
    "LEASES_LISTED",
    "check_job_id",
    "done_per_minute",
    "event_story",
    "inbox_record",
    "job_story",
    "leases",
    "stories",
    "trace_id",
    "verdict",
]

# The first seven columns are the audit's job tuple (``queries.AUDIT_SQL``), in its order.
SQL_JOB = """SELECT id, qty, status, reason, token, owner, lease_until,
  attempts, max_attempts, available_at, deadline FROM jobs WHERE id = ?"""
JOB_FIELDS = (
    *("id", "qty", "status", "reason", "token", "owner", "lease_until"),
    *("attempts", "max_attempts", "available_at", "deadline"),
)
SQL_JOB_REDRIVES = "SELECT token, at_ms, note FROM redrives WHERE id = ? ORDER BY seq"
BAD_ID = "a job id is 1-64 ASCII letters, digits, '_' or '-'"
TRACES = "asnackq_job_traces"
SQL_TRACE = f"SELECT traceparent FROM {TRACES} WHERE job_id = ?"
# W3C trace context: version (never ff), trace id and parent id (never all zeros), flags.
TRACEPARENT = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})([0-9a-f]{32})-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
)

# Each owner's leases, the ones ending first first: at most LEASES_LISTED of each, and at
# most LEASE_ROWS rows in all (the counts stay whole).
LEASES_LISTED = 10
LEASE_ROWS = 400
SQL_LEASES = """SELECT owner, held, id, token, lease_until FROM (
  SELECT owner, id, token, lease_until, count(*) OVER (PARTITION BY owner) AS held,
         row_number() OVER (PARTITION BY owner ORDER BY lease_until, id) AS n
  FROM jobs WHERE status = 'leased') AS leases
WHERE n <= ? ORDER BY held DESC, owner, n LIMIT ?"""

EVENTS = "asnackq_events"
SQL_EVENT = "SELECT id, type, key, created_ms, length(body) FROM asnackq_events WHERE id = ?"
EVENT_FIELDS = ("id", "type", "key", "created_ms", "bytes")
SQL_EVENT_DELIVERIES = """SELECT d.endpoint, d.job, j.status, j.reason, j.attempts,
  j.max_attempts, j.token, j.available_at, j.deadline
FROM asnackq_deliveries AS d LEFT JOIN jobs AS j ON j.id = d.job
WHERE d.event = ? ORDER BY d.endpoint"""
DELIVERY_FIELDS = (
    *("endpoint", "job", "status", "reason", "attempts"),
    *("max_attempts", "token", "available_at", "deadline"),
)
SQL_DELIVERY = "SELECT event, endpoint FROM asnackq_deliveries WHERE job = ?"

MINUTE_MS = 60_000
HOUR_MINUTES = 60
SQL_DONE_PER_MINUTE = """SELECT (available_at - :start) / 60000 AS minute, count(*) FROM jobs
WHERE status = 'done' AND available_at >= :start GROUP BY minute"""


def check_job_id(text: str) -> str:
    """``text`` if it is a job id (1-64 ASCII letters, digits, ``_`` or ``-``); else
    ``ValueError`` (a message that does not repeat the text)."""
    try:
        return w.check_identifier(text, "job id")
    except ValueError:
        raise ValueError(BAD_ID) from None


def job_story(job_id: str, now_ms: int, on_sqlite: bool) -> w.Plan[dict[str, Any] | None]:
    """A job's row (with its lease's and its deadline's time left), its redrives and its
    trace id; ``None`` when the queue does not hold it."""
    rows = yield from fetch(SQL_JOB, (check_job_id(job_id),))
    if not rows:
        return None, False
    job = dict(zip(JOB_FIELDS, rows[0], strict=True))
    leased = job["status"] == "leased"
    job["lease_left_ms"] = job["lease_until"] - now_ms if leased else None
    job["deadline_left_ms"] = job["deadline"] - now_ms
    redrives = [
        {"token": token, "at_ms": at_ms, "note": note}
        for token, at_ms, note in (yield from fetch(SQL_JOB_REDRIVES, (job_id,)))
    ]
    traced, _ = yield from trace_id(job_id, on_sqlite)
    tried, _ = yield from attempts.of_job(check_job_id(job_id), on_sqlite)
    delivery, _ = yield from delivery_of(job_id, on_sqlite)
    story = {"job": job, "redrives": redrives, "trace_id": traced, "attempts": tried}
    return {**story, "delivery": delivery}, False


def stories(
    job_id: str, now_ms: int, on_sqlite: bool
) -> w.Plan[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """The job's story and the event's of the id (either None: no such job or event)."""
    job, _ = yield from job_story(job_id, now_ms, on_sqlite)
    event, _ = yield from event_story(job_id, on_sqlite)
    return (job, event), False


def delivery_of(job_id: str, on_sqlite: bool) -> w.Plan[dict[str, Any] | None]:
    """The event and endpoint of a delivery's job (None: the job is no delivery)."""
    present, _ = yield from has_table("asnackq_deliveries", on_sqlite)
    rows = (yield from fetch(SQL_DELIVERY, (job_id,))) if present else []
    return (dict(zip(("event", "endpoint"), rows[0], strict=True)) if rows else None), False


def event_story(event_id: str, on_sqlite: bool) -> w.Plan[dict[str, Any] | None]:
    """An event and its deliveries by endpoint (each with its job's status and attempts,
    and the requests kept of it); ``None`` when the queue holds no such event."""
    present, _ = yield from has_table(EVENTS, on_sqlite)
    rows = (yield from fetch(SQL_EVENT, (check_job_id(event_id),))) if present else []
    if not rows:
        return None, False
    deliveries = []
    for row in (yield from fetch(SQL_EVENT_DELIVERIES, (event_id,))):
        delivery = dict(zip(DELIVERY_FIELDS, row, strict=True))
        delivery["requests"], _ = yield from attempts.of_job(delivery["job"], on_sqlite)
        deliveries.append(delivery)
    event = dict(zip(EVENT_FIELDS, rows[0], strict=True))
    return {"event": event, "deliveries": deliveries}, False


def trace_id(job_id: str, on_sqlite: bool) -> w.Plan[str | None]:
    """The trace id of the job's enqueue context, if the queue keeps one."""
    present, _ = yield from has_table(TRACES, on_sqlite)
    if not present:
        return None, False
    rows = yield from fetch(SQL_TRACE, (job_id,))
    found = rows and isinstance(rows[0][0], str) and TRACEPARENT.fullmatch(rows[0][0])
    return (found.group(1) if found else None), False


def inbox_record(job_id: str) -> w.Plan[dict[str, Any] | None]:
    """The sink's inbox row for ``job_id`` (``None`` without one)."""
    rows = yield from fetch(SQL_RECORD, (check_job_id(job_id),))
    return (dict(zip(RECORD_FIELDS, rows[0], strict=True)) if rows else None), False


def verdict(
    job: dict[str, Any] | None, inbox: dict[str, Any] | None, now_ms: int
) -> dict[str, Any]:
    """The audit's stage and flags for one job (each flag with its kind and meaning)."""
    job_row = tuple(job[k] for k in JOB_FIELDS[:7]) if job else (None,) * 7
    inbox_row = tuple(inbox[k] for k in RECORD_FIELDS[:5]) if inbox else (None,) * 5
    described = describe(job_row, inbox_row, now_ms)
    return {
        "stage": described["stage"],
        "flags": [
            {"flag": flag, "kind": "violation", "why": VIOLATIONS[flag]}
            if flag in VIOLATIONS
            else {"flag": flag, "kind": "attention", "why": ATTENTION[flag]}
            for flag in described["flags"]
        ],
    }


def leases(now_ms: int) -> w.Plan[list[dict[str, Any]]]:
    """Who holds what: each owner's count of leased jobs and its first ``LEASES_LISTED``
    (id, token, time left; negative once expired), the owners holding most first."""
    owners: dict[str, dict[str, Any]] = {}
    for owner, held, job_id, token, until in (
        yield from fetch(SQL_LEASES, (LEASES_LISTED, LEASE_ROWS))
    ):
        entry = owners.setdefault(owner, {"owner": owner, "count": held, "jobs": []})
        left = until - now_ms if type(until) is int else None  # (None: a row written by hand)
        row = {"id": job_id, "token": token, "left_ms": left}
        entry["jobs"].append({key: as_json_value(value) for key, value in row.items()})
    return list(owners.values()), False


def done_per_minute(now_ms: int) -> w.Plan[dict[str, Any]]:
    """Done jobs in each of the last ``HOUR_MINUTES`` minutes of the clock, the current
    (partial) one last, the oldest first (jobs finished at ``now_ms`` or later, on a clock
    ahead of this one, count in the last): each minute's start, its count and its done/s.
    The minutes are the clock's own (aligned to whole minutes), so a job stays in the same
    minute from one reading to the next: unchanged data shows unchanged counts."""
    start = (now_ms // MINUTE_MS - HOUR_MINUTES + 1) * MINUTE_MS
    counts = [0] * HOUR_MINUTES
    for minute, count in (yield from fetch(SQL_DONE_PER_MINUTE, {"start": start})):
        counts[min(int(minute), HOUR_MINUTES - 1)] += count
    minutes = [
        {"at_ms": start + i * MINUTE_MS, "done": count, "per_s": round(count / 60, 2)}
        for i, count in enumerate(counts)
    ]
    return {"at_ms": now_ms, "minutes": minutes, "done": sum(counts)}, False

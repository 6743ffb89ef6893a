"""Operators' reads: stats, dead jobs, redrive history, and the evidence audit.

Everything here only reads (the one write, ``redrive_by_reason``, goes through the core's
audited ``redrive``, one job per transaction).  Files are opened read-only through SQLite
URIs, so inspecting never creates a file, takes a write lock or changes a byte; a
``postgresql://`` URL is read in read-only transactions (``asnackq.store.sessions``).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from asnackq.core import events as ev
from asnackq.core import tracing
from asnackq.core import worker as w
from asnackq.core.budget import Budget, Intake, Item, intakes
from asnackq.core.inbox import SINK_TABLE
from asnackq.ops import per_endpoint
from asnackq.store import job_traces, readers, reads, retention, sessions
from asnackq.store.attempts import of_job
from asnackq.store.readers import read_only
from asnackq.store.reads import fetch
from asnackq.store.sessions import Reader, Session
from asnackq.store.targets import Target, is_url

__all__ = [
    "ATTENTION",
    "AUDIT_SQL",
    "REASONS",
    "SQL_INBOX_COUNTS",
    "SQL_JOB_STATES",
    "VIOLATIONS",
    "Audit",
    "Intake",
    "audit",
    "dead",
    "enqueue_all",
    "history",
    "plan_audit",
    "plan_stats",
    "redrive",
    "redrive_by_reason",
    "stats",
]

REASONS = w.DEAD_REASONS
CHUNK = 1000  # intakes per transaction in a bulk enqueue
DEFAULT_BUDGET = Budget()


def enqueue_all(
    path: Target,
    items: Sequence[Item],
    advance: Callable[[list[bool | w.Conflict]], object] | None = None,
    budget: Budget = DEFAULT_BUDGET,
    *,
    to: Sequence[str] | None = None,
    max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
) -> list[bool | w.Conflict]:
    """Enqueue plain events (``budget``: a day, 5 attempts by default; see
    ``asnackq.core.budget``) or ``(event, ttl_ms, max_attempts)`` items, mixed as needed,
    ``CHUNK`` per transaction.

    Each chunk is the core's ``enqueue_many`` (validated before any change); ``advance``
    is called with each committed chunk's results (a progress bar; where to resume when a
    later chunk fails).  Items with ``data`` are events, fanned out to the queue's
    endpoints (``to``: those named) by ``asnackq.core.events``' intake, True new.
    """
    triples = intakes(items, Budget.of(*budget, w.PRODUCT))
    results: list[bool | w.Conflict] = []
    tracer = tracing.tracer()
    with sessions.open_session(path, create=True) as store:
        for start in range(0, len(triples), CHUNK):
            chunk = triples[start : start + CHUNK]
            if to is not None or any(ev.is_event(item[0]) for item in chunk):
                intake = partial(ev.plan_intake, chunk, w.epoch_ms(), to=to, limits=w.PRODUCT)
                found = store.run(partial(intake, max_bytes=max_event_bytes))
                done = [r.created if isinstance(r, ev.Published) else r for r in found]
            else:
                make = partial(w.plan_enqueue_many, chunk, w.epoch_ms(), limits=w.PRODUCT)
                done = (
                    job_traces.intake(store.run, tracer, make, chunk) if tracer else store.run(make)
                )
            results += done
            if advance is not None:
                advance(done)
    return results


def stats(con: Reader, now_ms: int) -> dict[str, Any]:
    """Jobs by status and dead reason, queue lag, attempts, expired leases, and each
    endpoint's state, deliveries and workers (``ops.per_endpoint``) at ``now_ms``."""
    return reads.run(con, plan_stats(now_ms, on_sqlite=isinstance(con, sqlite3.Connection)))


def plan_stats(now_ms: int, on_sqlite: bool = True) -> w.Plan[dict[str, Any]]:
    """``stats`` as a read plan (``on_sqlite``: the reader's dialect)."""
    by_status = dict.fromkeys(w.STATUSES, 0)
    by_status.update((yield from fetch("SELECT status, count(*) FROM jobs GROUP BY status")))
    reasons: dict[str, int] = dict(
        (
            yield from fetch(
                "SELECT reason, count(*) FROM jobs WHERE status = 'dead' GROUP BY reason"
            )
        )
    )
    attempts = {
        str(n): count
        for n, count in (
            yield from fetch(
                "SELECT attempts, count(*) FROM jobs GROUP BY attempts ORDER BY attempts"
            )
        )
    }
    ((oldest,),) = yield from fetch(
        "SELECT min(available_at) FROM jobs WHERE status = 'pending' AND available_at <= ?",
        (now_ms,),
    )
    expired = [
        {"id": job_id, "owner": owner, "token": token, "expired_ms": now_ms - until}
        for job_id, owner, token, until in (
            yield from fetch(
                "SELECT id, owner, token, lease_until FROM jobs WHERE status = 'leased'"
                " AND lease_until <= ? ORDER BY lease_until",
                (now_ms,),
            )
        )
    ]
    return {
        "jobs": sum(by_status.values()),
        "by_status": by_status,
        "dead_by_reason": reasons,
        # How long the oldest claimable job has been waiting (since it became available).
        "oldest_pending_ms": None if oldest is None else now_ms - oldest,
        "attempts": attempts,
        "expired_leases": len(expired),
        "expired": expired[:20],
        "endpoints": (yield from per_endpoint.plan_endpoints(now_ms, on_sqlite))[0],
    }, False


def dead(con: Reader, reason: str | None = None) -> list[dict[str, Any]]:
    """The dead jobs in seq order (optionally only one reason)."""
    sql = (
        "SELECT id, qty, reason, attempts, max_attempts, token FROM jobs"
        " WHERE status = 'dead' AND (:reason IS NULL OR reason = :reason) ORDER BY seq"
    )
    keys = ("id", "qty", "reason", "attempts", "max_attempts", "token")
    return [dict(zip(keys, row, strict=True)) for row in con.execute(sql, {"reason": reason})]


def history(con: Reader, job_id: str, on_sqlite: bool = True) -> dict[str, Any]:
    """A job's current row, its redrive records and the requests kept of it
    (``asnackq.store.attempts``), oldest first."""
    w.check_identifier(job_id, "job_id")
    row = con.execute(
        "SELECT status, reason, attempts, token FROM jobs WHERE id = ?", (job_id,)
    ).fetchone()
    if row is None:
        raise ValueError(f"no job {job_id!r}")
    redrives = [
        {"token": token, "at_ms": at_ms, "note": note}
        for token, at_ms, note in con.execute(
            "SELECT token, at_ms, note FROM redrives WHERE id = ? ORDER BY seq", (job_id,)
        )
    ]
    status, reason, attempts, token = row
    return {
        "id": job_id,
        "status": status,
        "reason": reason,
        "attempts": attempts,
        "token": token,
        "redrives": redrives,
        "requests": reads.run(con, of_job(job_id, on_sqlite)),
    }


def redrive(store: Session, job_id: str, now_ms: int, ttl_ms: int, note: str) -> None:
    """The core's audited redrive, with the product's ranges (a ttl of up to 30 days); in the
    job's trace when tracing is on (``asnackq.store.job_traces``)."""
    make = partial(w.plan_redrive, job_id, now_ms, ttl_ms, note, limits=w.PRODUCT)
    tracer = tracing.tracer()
    if tracer is None:
        store.run(make)
    else:
        job_traces.redrive(store, tracer, job_id, make, note)


def redrive_by_reason(
    path: Target, reason: str, now_ms: int, ttl_ms: int, note: str
) -> list[dict[str, Any]]:
    """Redrive every dead job with ``reason``, each in its own audited transaction."""
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {', '.join(REASONS)}: {reason!r}")
    w.check_redrive("x", now_ms, ttl_ms, note, w.PRODUCT)  # validate before any change
    with sessions.open_session(path) as store:
        done = []
        for job in dead(store, reason):
            try:
                redrive(store, job["id"], now_ms, ttl_ms, note)
            except ValueError as error:  # redriven or changed by someone else meanwhile
                done.append({"id": job["id"], "redriven": False, "why": str(error)})
            else:
                done.append({"id": job["id"], "redriven": True})
        return done


# --- the audit: how far the evidence reaches for each job --------------------------------

# Each job's final state, and the sink's inbox size and ids delivered more than once: the
# lab's evidence next to the audit (asnackq.lab.evidence).
SQL_JOB_STATES = "SELECT id, qty, status, reason, token FROM jobs"
SQL_INBOX_COUNTS = """SELECT count(*), count(CASE WHEN deliveries > 1 THEN 1 END)
FROM asnackq_webhook_inbox"""

# The audit's rows, a page at a time inside one read transaction (a consistent view, a page
# of memory): each job with its inbox record, then each inbox record with no job.  The
# first column is the page's key (the scan's own order); the rest are the audit's tuples.
AUDIT_PAGE = 1000
AUDIT_SQL = (
    """SELECT j.seq, j.id, j.qty, j.status, j.reason, j.token, j.owner, j.lease_until,
       i.id, m.qty, i.first_token, i.last_token, i.deliveries, NULL
FROM jobs AS j LEFT JOIN sink.asnackq_webhook_inbox AS i ON i.id = j.id
LEFT JOIN sink.stock_moves AS m ON m.id = i.id
WHERE j.seq > ? ORDER BY j.seq LIMIT ?""",
    """SELECT i.rowid, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       i.id, m.qty, i.first_token, i.last_token, i.deliveries, i.first_seen_ms
FROM sink.asnackq_webhook_inbox AS i LEFT JOIN sink.stock_moves AS m ON m.id = i.id
WHERE i.rowid > ? AND i.id NOT IN (SELECT id FROM jobs)
ORDER BY i.rowid LIMIT ?""",
)

# What must never happen, and what only needs attention (harmless, or evidence to show).
VIOLATIONS = {
    "done-without-inbox-row": "done, but the sink has no inbox row: the effect is missing",
    "qty-mismatch": "the inbox qty differs from the job's qty",
    "orphan-inbox-row": "an inbox row for an id the queue does not hold",
    "token-never-issued": "the inbox names a token the queue never issued for the job",
    "wrong-type": "a column holds a value of another type than the schema's (written by hand?)",
    "stock-mismatch": "the sink's stock differs from the sum of its inbox rows' qty",
}
ATTENTION = {
    "applied-not-done": "effect applied, job not yet done: a re-send is pending and harmless",
    "dead-after-applied": "dead, but its effect was applied (every ACK was lost)",
    "lease-expired": "leased, the lease has expired: awaiting reclaim",
    "purged": "an inbox row of a job the queue purged (asnackq purge) before this row's cutoff",
}


# The types the audit's tuples hold (``AUDIT_SQL``); None where a column may be NULL.
JOB_TYPES = ((str,), (int,), (str,), (str, type(None)), (int,), (str, type(None)))
LEASE_TYPES = (int, type(None))
INBOX_TYPES = ((str,), (int,), (int, type(None)), (int, type(None)), (int,))


def well_typed(job: tuple[Any, ...], inbox: tuple[Any, ...]) -> bool:
    """Whether every value of an audit row has its column's type (SQLite lets a hand-written
    row hold text in an INTEGER column): a row that does not is judged ``wrong-type`` and
    nothing more."""

    def fits(value: Any, kinds: tuple[type, ...]) -> bool:
        return type(value) in kinds  # (exact: a bool or a float is no int here)

    job_ok = job[0] is None or (
        all(map(fits, job[:6], JOB_TYPES))
        and job[2] in w.STATUSES
        and (fits(job[6], LEASE_TYPES) if job[2] != "leased" else fits(job[6], (int,)))
    )
    inbox_ok = inbox[0] is None or all(map(fits, inbox, INBOX_TYPES))
    return job_ok and inbox_ok


def stage(job: tuple[Any, ...], inbox: tuple[Any, ...], now_ms: int) -> str:
    """How far the evidence for one job reaches."""
    if not well_typed(job, inbox):
        return "malformed"
    status, lease_until = job[2], job[6]
    if status in ("done", "dead"):
        return str(status)
    if inbox[0] is not None:
        return "applied"
    if status == "leased":
        return "leased-live" if now_ms < lease_until else "leased-expired"
    return "queued"


def judge(job: tuple[Any, ...], inbox: tuple[Any, ...], now_ms: int) -> list[str]:
    """The violation and attention flags of one audit row."""
    job_id, qty, status, _, token, _, lease_until = job
    inbox_id, inbox_qty, first_token, last_token, _ = inbox
    if not well_typed(job, inbox):
        return ["wrong-type"]
    if job_id is None:
        return ["orphan-inbox-row"]
    flags = []
    if inbox_id is None:
        if status == "done":
            flags.append("done-without-inbox-row")
    else:
        if inbox_qty != qty:
            flags.append("qty-mismatch")
        if any(t is not None and not 1 <= t <= token for t in (first_token, last_token)):
            flags.append("token-never-issued")
        if status in ("pending", "leased"):
            flags.append("applied-not-done")
        elif status == "dead":
            flags.append("dead-after-applied")
    if status == "leased" and inbox_id is None and lease_until <= now_ms:
        flags.append("lease-expired")
    return flags


def as_json_value(value: Any) -> Any:
    """A stored value as JSON can hold it: a blob as SQLite writes its literal (``x'00'``),
    a float that is no number as text."""
    if isinstance(value, bytes):
        return f"x'{value.hex()}'"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def describe(job: tuple[Any, ...], inbox: tuple[Any, ...], now_ms: int) -> dict[str, Any]:
    job_id, qty, status, reason, token, owner, lease_until = map(as_json_value, job)
    inbox_id, inbox_qty, first_token, last_token, deliveries = map(as_json_value, inbox)
    entry: dict[str, Any] = {
        "id": job_id or inbox_id,
        "stage": stage(job, inbox, now_ms) if job_id is not None else "orphan",
        "flags": judge(job, inbox, now_ms),
    }
    if job_id is not None:
        entry["job"] = {
            "qty": qty,
            "status": status,
            "reason": reason,
            "token": token,
            "owner": owner,
            "lease_until": lease_until,
        }
    entry["inbox"] = (
        None
        if inbox_id is None
        else {
            "qty": inbox_qty,
            "first_token": first_token,
            "last_token": last_token,
            "deliveries": deliveries,
        }
    )
    return entry


@dataclass(frozen=True, kw_only=True)
class Audit:
    """A queue audited against its sink DB: how far each job's evidence reached
    (``stages``), how many jobs each flag holds (``flags``, a violation's or one that needs a
    look), the violations in all, the sink's stock and its inbox's sum of qty, up to
    ``limit`` flagged jobs of each kind (``listed``: ``violations``, ``attention``) and the
    job asked about, if any."""

    stages: dict[str, int]
    flags: dict[str, int]
    violations: int
    stock: int
    inbox_qty_sum: int
    listed: dict[str, list[dict[str, Any]]]
    job: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        """The audit as JSON-ready data (``asnackq audit --json``)."""
        return asdict(self)


def audit(
    queue: Target,
    sink_db: Target,
    now_ms: int,
    *,
    job_id: str | None = None,
    limit: int = 50,
    busy_s: float = 5.0,
) -> Audit:
    """Audit a queue against a sink DB; ``violations`` > 0 means something must never be."""
    if is_url(queue) or is_url(sink_db):  # the same audit, on local copies
        with read_only(queue, "jobs", busy_s=busy_s) as con:
            purged_before = reads.run(con, retention.plan_purged_before(not is_url(queue)))
        with readers.local_copies(queue, sink_db) as (queue_copy, sink_copy):
            return _audit(queue_copy, sink_copy, now_ms, job_id, limit, busy_s, purged_before)
    return _audit(queue, sink_db, now_ms, job_id, limit, busy_s, None)


def _audit(
    queue: Target,
    sink_db: Target,
    now_ms: int,
    job_id: str | None,
    limit: int,
    busy_s: float,
    purged_before: int | None,
) -> Audit:
    queue, sink_db = Path(queue), Path(sink_db)
    with (
        read_only(sink_db, SINK_TABLE, "sink DB", busy_s),
        read_only(queue, "jobs", busy_s=busy_s) as con,
    ):
        return reads.run(con, plan_audit(sink_db, now_ms, job_id, limit, purged_before))


def purged_entry(
    job: tuple[Any, ...], inbox: tuple[Any, ...], first_seen: Any, purged_before: int | None
) -> dict[str, Any] | None:
    """An inbox row the queue holds no job for, first seen before a purge's cutoff: the
    job was (as far as the queue can tell) purged.  None for any other row."""
    if job[0] is not None or purged_before is None or type(first_seen) is not int:
        return None
    if first_seen > purged_before or not well_typed(job, inbox):
        return None
    return {"id": inbox[0], "stage": "purged", "flags": ["purged"], "first_seen_ms": first_seen}


def plan_audit(
    sink_db: Path, now_ms: int, job_id: str | None, limit: int, purged_before: int | None = None
) -> w.Plan[Audit]:
    """``audit`` as a read plan on the queue file (the sink DB is attached, read-only); an
    inbox row of a job purged before ``purged_before`` is no orphan (``purged_entry``)."""
    if purged_before is None:  # (a file's own; a copy's is given: the copy has no purges)
        purged_before, _ = yield from retention.plan_purged_before(on_sqlite=True)
    yield from fetch("ATTACH DATABASE ? AS sink", (f"{sink_db.resolve().as_uri()}?mode=ro",))
    stages: dict[str, int] = {}
    flags: dict[str, int] = dict.fromkeys([*VIOLATIONS, *ATTENTION], 0)
    listed: dict[str, list[dict[str, Any]]] = {"violations": [], "attention": []}
    selected = None
    yield from fetch("BEGIN")  # (after the ATTACH: SQLite attaches outside a transaction)
    for sql in AUDIT_SQL:
        after = 0
        while page := (yield from fetch(sql, (after, AUDIT_PAGE))):
            after = page[-1][0]
            for row in page:
                job, inbox = row[1:8], row[8:13]
                entry = purged_entry(job, inbox, row[13], purged_before)
                if entry is not None:
                    found, name = entry["flags"], entry["stage"]
                else:
                    found = judge(job, inbox, now_ms)
                    name = stage(job, inbox, now_ms) if job[0] is not None else "orphan"
                stages[name] = stages.get(name, 0) + 1
                for flag in found:
                    flags[flag] += 1
                if job_id is not None and (job[0] or inbox[0]) == job_id:
                    selected = entry or describe(job, inbox, now_ms)
                if found:
                    kind = "violations" if set(found) & VIOLATIONS.keys() else "attention"
                    if len(listed[kind]) < limit:
                        listed[kind].append(entry or describe(job, inbox, now_ms))
    ((stock,),) = yield from fetch("SELECT total FROM sink.stock")
    ((inbox_sum,),) = yield from fetch("SELECT coalesce(sum(qty), 0) FROM sink.stock_moves")
    yield from fetch("COMMIT")
    if stock != inbox_sum:
        flags["stock-mismatch"] = 1
    if job_id is not None and selected is None:
        raise ValueError(f"no job {job_id!r} in the queue or the sink")
    violations = sum(flags[name] for name in VIOLATIONS)
    return Audit(
        stages=stages,
        flags=flags,
        violations=violations,
        stock=stock,
        inbox_qty_sum=inbox_sum,
        listed=listed,
        job=selected,
    ), False

"""Ordered delivery through a transactional outbox (seed 003): one dispatcher, in ``seq`` order.

Rules of this module (the style of ``worker.py``; standard library only):

* ``accept`` writes the order and its outbox row in one transaction, as a plan driven by
  ``worker.drive``; the same id and qty again is ``False``, another qty ``Conflict``.
  The same plan (``plan_accept``) runs inside an application's own transaction from
  asyncio (``asnackq.store.borrowed.Source``).
* ``pending`` reads unsent rows in insertion order ``seq`` (never by id or time) and leaves
  no transaction open: the read is over before anything is sent.
* ``dispatch`` marks an item sent only after a strict ``True`` ACK, and stops at the
  first failure, re-raising the original error: earlier items stay sent, the failed one
  and everything after it stay unsent, and the next run resumes there.  Exactly-once
  *sending* is impossible; the sink's inbox absorbs the re-send.
* ``send`` gets a copy; marking uses the values originally selected.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from typing import Any

from asnackq.core.worker import (
    BadAck,
    Conflict,
    Plan,
    Sql,
    check_callable,
    check_con,
    check_event,
    check_identifier,
    check_int,
    drive,
    open_db,
    write_one,
)

__all__ = [
    "SOURCE_SCHEMA",
    "accept",
    "dispatch",
    "mark_sent",
    "open_source",
    "pending",
    "plan_accept",
]

SOURCE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  sent INTEGER NOT NULL DEFAULT 0 CHECK (sent IN (0, 1)))""",
    # Within sent = 0 the index is ordered by rowid = seq: the pending read never scans history.
    "CREATE INDEX IF NOT EXISTS outbox_by_sent ON outbox(sent)",
)
SQL_ORDER = "SELECT qty FROM orders WHERE id = ?"
SQL_INSERT_ORDER = "INSERT INTO orders (id, qty) VALUES (?, ?)"
SQL_INSERT_OUTBOX = "INSERT INTO outbox (id, qty, sent) VALUES (?, ?, 0)"
SQL_PENDING = "SELECT id, qty FROM outbox WHERE sent = 0 ORDER BY seq LIMIT ?"
SQL_UNSENT = "SELECT 1 FROM outbox WHERE id = ? AND sent = 0"
SQL_MARK_SENT = "UPDATE outbox SET sent = 1 WHERE id = ? AND sent = 0"

Hook = Callable[[str, str], object] | None


def open_source(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open (creating tables only when absent) a source DB; existing rows are kept."""
    return open_db(path, SOURCE_SCHEMA)


def accept(con: sqlite3.Connection, event: dict[str, Any]) -> bool:
    """Accept an order and its outbox row in one transaction (True), or recognise it (False)."""
    plan = plan_accept(event)
    return bool(drive(check_con(con), plan))


def plan_accept(event: object) -> Plan[bool]:
    """Validate an order and return its plan (result: True accepted, False already there)."""
    return _accept(*check_event(event))


def _accept(job_id: str, qty: int) -> Plan[bool]:
    rows = yield Sql(SQL_ORDER, (job_id,))
    if rows:
        if rows[0][0] != qty:
            raise Conflict(f"order {job_id!r} exists with qty {rows[0][0]}, not {qty}")
        return False, False
    yield from write_one(SQL_INSERT_ORDER, (job_id, qty))
    yield from write_one(SQL_INSERT_OUTBOX, (job_id, qty))
    return True, True


def pending(con: sqlite3.Connection, limit: int = 16) -> list[dict[str, Any]]:
    """Up to ``limit`` (1-16) unsent items in ``seq`` order; reading changes nothing."""
    check_int(limit, "limit", 1, 16)
    rows = check_con(con).execute(SQL_PENDING, (limit,)).fetchall()
    return [{"id": job_id, "qty": qty} for job_id, qty in rows]


def mark_sent(con: sqlite3.Connection, event_id: str) -> bool:
    """Mark one item sent: False when it is missing or already sent."""
    check_identifier(event_id, "event id")
    return bool(drive(check_con(con), _mark_sent(event_id)))


def _mark_sent(event_id: str) -> Plan[bool]:
    if not (yield Sql(SQL_UNSENT, (event_id,))):
        return False, False
    yield from write_one(SQL_MARK_SENT, (event_id,))
    return True, True


def dispatch(
    con: sqlite3.Connection,
    send: Callable[[dict[str, Any]], object],
    limit: int = 16,
    hook: Hook = None,
) -> list[str]:
    """Send one bounded batch in order; return the ids marked sent, or re-raise at the first
    failure (the read is closed before the first send)."""
    check_callable(send, "send")
    if hook is not None:
        check_callable(hook, "hook")
    marked: list[str] = []
    for item in pending(con, limit):
        ack = send(dict(item))  # a copy: send may mutate what it gets
        if ack is not True:
            raise BadAck(f"send returned {ack!r} for {item['id']!r}; only True is an ACK")
        if hook is not None:
            hook("after-delivery", item["id"])  # verified ACK in hand, row not yet marked
        if mark_sent(con, item["id"]):
            marked.append(item["id"])
    return marked

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

Events of any JSON value (``{"id", "data", "type"?, "key"?}``, ``core.events``) are
accepted too, by ``core.events``' own plan and nothing else: one body made and its size
checked (``max_event_bytes``, 256 KiB unless given, at most 1 MiB) before any statement,
the same event again ``False``, the same id with another type, key or data a
``Conflict``, and the event stored (``asnackq_events``) with one delivery per enabled
endpoint taking its type, all in the accept's transaction (inside the application's own
from asyncio, on SQLite or PostgreSQL: ``asnackq.store.borrowed.Source``).  A source DB
holds the queue's tables beside its own (``TABLES``): its endpoints are added, and its
events' deliveries sent, as a queue's.  An event leaves by its deliveries, each a job
with its lease, retries and dead letter, sent by the queue's worker (``asnackq work
SOURCE --endpoint NAME``), never by ``dispatch``: ``pending`` and ``dispatch`` read the
``{id, qty}`` rows only, and their order and stop-at-the-first-failure are the seed's,
unchanged.  An event's ``key`` is kept on each of its deliveries: the order of a key's
deliveries to an endpoint is the worker's to keep, not the outbox's.  (Why not outbox
rows: a row per event would be a second set of the events' rules, and one dispatcher to
one sink, stopped by its first failure, would let one endpoint hold up every other.)
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from typing import Any

from asnackq.core import events as ev
from asnackq.core import worker as w
from asnackq.core.budget import DEFAULT_MAX_ATTEMPTS, DEFAULT_TTL_MS
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
    "TABLES",
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
# What a source DB holds: its orders and outbox, and the queue's tables, where its events'
# deliveries are jobs (its endpoints and events tables are made by their first change).
TABLES = (*SOURCE_SCHEMA, *w.SCHEMA)
SQL_ORDER = "SELECT qty FROM orders WHERE id = ?"
SQL_INSERT_ORDER = "INSERT INTO orders (id, qty) VALUES (?, ?)"
SQL_INSERT_OUTBOX = "INSERT INTO outbox (id, qty, sent) VALUES (?, ?, 0)"
SQL_PENDING = "SELECT id, qty FROM outbox WHERE sent = 0 ORDER BY seq LIMIT ?"
SQL_UNSENT = "SELECT 1 FROM outbox WHERE id = ? AND sent = 0"
SQL_MARK_SENT = "UPDATE outbox SET sent = 1 WHERE id = ? AND sent = 0"

Hook = Callable[[str, str], object] | None


def open_source(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open (creating tables only when absent) a source DB; existing rows are kept."""
    return open_db(path, TABLES)


def accept(
    con: sqlite3.Connection,
    event: dict[str, Any],
    *,
    now_ms: int | None = None,
    max_event_bytes: int = ev.DEFAULT_MAX_BYTES,
) -> bool:
    """Accept an order and its outbox row, or an event with its deliveries, in one
    transaction (True), or recognise it (False)."""
    plan = plan_accept(event, now_ms, max_event_bytes=max_event_bytes)
    return bool(drive(check_con(con), plan))


def plan_accept(
    event: object, now_ms: int | None = None, *, max_event_bytes: int = ev.DEFAULT_MAX_BYTES
) -> Plan[bool]:
    """Validate an order ``{id, qty}`` or an event ``{id, data, type?, key?}`` and return
    its plan (result: True accepted, False already there).  ``now_ms`` (None: the wall
    clock) is an event's intake time; its deliveries get the default budget of a job
    (``core.budget``: a day, 5 attempts; an endpoint's list of delays its own)."""
    ev.check_max_bytes(max_event_bytes)
    if now_ms is not None:
        w.check_now(now_ms, limits=w.PRODUCT)
    if not ev.is_event(event):
        return _accept(*check_event(event))
    now = w.epoch_ms() if now_ms is None else now_ms
    triple = (event, DEFAULT_TTL_MS, DEFAULT_MAX_ATTEMPTS)
    intake = ev.plan_intake([triple], now, max_bytes=max_event_bytes)
    return _publish(intake)


def _publish(intake: Plan[list[Any]]) -> Plan[bool]:
    """An event's intake: a known event with another body is a ``Conflict`` (nothing
    written)."""
    [found], changed = yield from intake
    if isinstance(found, Conflict):
        raise found
    return bool(found.created), changed


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

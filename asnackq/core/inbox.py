"""The inboxes as plans: the sink's (each id's effect applied once, decided in arrival
order) and a webhook receiver's (each ``webhook-id``'s effect once ever).

Rules of this module (standard library only, like the rest of ``core``):

* An id seen for the first time is ``applied`` (its row and the effect in one transaction);
  the same id with the same content again is a ``duplicate`` (no effect, the delivery
  counted); other content is a ``conflict`` (nothing changes).  The sink's content is
  its event's qty; a webhook's, the SHA-256 of its body's bytes.
* ``plan_inbox`` decides a whole batch (a group commit) exactly as if its deliveries had
  come one by one, in a fixed number of statements whatever the batch's size.
* ``plan_webhook`` decides one delivery.  Its row is written first, with
  ``ON CONFLICT DO NOTHING``: on PostgreSQL a concurrent delivery of the same id waits for
  that row's transaction, then finds it; only then does the plan yield the ``EFFECT`` hook,
  where its driver awaits the application's effect inside the same transaction
  (``asnackq.store.effects``).  Its rows are in a table of its own
  (``asnackq_webhook_inbox``), beside the application's tables.
* The statements are SQLite's; ``asnackq.store.pg_sql`` keys its PostgreSQL texts to them.
"""

from __future__ import annotations

import re

from asnackq.core.worker import MAX_NOW, Hook, Plan, Sql, SqlMany, check_int, json_set

__all__ = [
    "EFFECT",
    "RECORD_FIELDS",
    "SINK_SCHEMA",
    "SQL_ADD_STOCK",
    "SQL_APPLY",
    "SQL_KNOWN",
    "SQL_RECORD",
    "SQL_SEEN_AGAIN",
    "SQL_STOCK",
    "SQL_WEBHOOK_AGAIN",
    "SQL_WEBHOOK_DIGEST",
    "SQL_WEBHOOK_FIRST",
    "SQL_WEBHOOK_RECORD",
    "WEBHOOK_FIELDS",
    "WEBHOOK_SCHEMA",
    "decide",
    "plan_inbox",
    "plan_webhook",
]

SINK_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS inbox (id TEXT PRIMARY KEY, qty INTEGER NOT NULL,
  first_token INTEGER, last_token INTEGER, deliveries INTEGER NOT NULL,
  applied_at_ms INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL)""",
    "CREATE TABLE IF NOT EXISTS stock (one INTEGER PRIMARY KEY CHECK (one = 1),"
    " total INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO stock (one, total) VALUES (1, 0)",
)
SQL_KNOWN = "SELECT id, qty FROM inbox WHERE id IN (SELECT value FROM json_each(?))"
SQL_APPLY = """INSERT INTO inbox (id, qty, first_token, last_token, deliveries, applied_at_ms,
  last_seen_ms) VALUES (?, ?, ?, ?, 1, ?, ?)"""
SQL_SEEN_AGAIN = """UPDATE inbox SET deliveries = deliveries + 1,
  last_token = coalesce(?, last_token), last_seen_ms = ? WHERE id = ?"""
SQL_ADD_STOCK = "UPDATE stock SET total = total + ? WHERE one = 1"
SQL_STOCK = "SELECT total FROM stock WHERE one = 1"
SQL_RECORD = """SELECT id, qty, first_token, last_token, deliveries, applied_at_ms, last_seen_ms
FROM inbox WHERE id = ?"""
RECORD_FIELDS = (
    "id",
    "qty",
    "first_token",
    "last_token",
    "deliveries",
    "applied_at_ms",
    "last_seen_ms",
)


def decide(known: dict[str, int], event_id: str, qty: int) -> str:
    """The inbox decision for one event, given the ids already applied (updated in place)."""
    if event_id not in known:
        known[event_id] = qty
        return "applied"
    return "duplicate" if known[event_id] == qty else "conflict"


def plan_inbox(batch: list[tuple[str, int, int | None]], now_ms: int) -> Plan[list[str]]:
    """One group commit as a plan (run by the store's driver): decisions in arrival order.

    Result: the status of each ``(id, qty, token)``: applied, duplicate or conflict.
    """
    rows = yield Sql(SQL_KNOWN, (json_set(sorted({event_id for event_id, _, _ in batch})),))
    known: dict[str, int] = {row[0]: row[1] for row in rows or ()}
    statuses = [decide(known, event_id, qty) for event_id, qty, _ in batch]
    applied = [item for item, s in zip(batch, statuses, strict=True) if s == "applied"]
    again = [item for item, s in zip(batch, statuses, strict=True) if s == "duplicate"]
    if applied:
        yield SqlMany(
            SQL_APPLY, [(i, qty, token, token, now_ms, now_ms) for i, qty, token in applied]
        )
        yield Sql(SQL_ADD_STOCK, (sum(qty for _, qty, _ in applied),))
    if again:
        yield SqlMany(SQL_SEEN_AGAIN, [(token, now_ms, i) for i, _, token in again])
    return statuses, bool(applied or again)


# --- a webhook receiver's inbox: each webhook-id's effect once ever ---------------------

WEBHOOK_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS asnackq_webhook_inbox (id TEXT PRIMARY KEY,
  body_sha256 TEXT NOT NULL, first_token INTEGER, last_token INTEGER,
  deliveries INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL)""",
)
SQL_WEBHOOK_FIRST = """INSERT INTO asnackq_webhook_inbox (id, body_sha256, first_token, last_token,
  deliveries, first_seen_ms, last_seen_ms) VALUES (?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (id) DO NOTHING RETURNING id"""
SQL_WEBHOOK_DIGEST = "SELECT body_sha256 FROM asnackq_webhook_inbox WHERE id = ?"
SQL_WEBHOOK_AGAIN = """UPDATE asnackq_webhook_inbox SET deliveries = deliveries + 1,
  last_token = coalesce(?, last_token), last_seen_ms = ? WHERE id = ?"""
WEBHOOK_FIELDS = (
    "id",
    "body_sha256",
    "first_token",
    "last_token",
    "deliveries",
    "first_seen_ms",
    "last_seen_ms",
)
SQL_WEBHOOK_RECORD = f"SELECT {', '.join(WEBHOOK_FIELDS)} FROM asnackq_webhook_inbox WHERE id = ?"
EFFECT = "effect"  # the hook point where the driver awaits the application's effect
WEBHOOK_ID = re.compile(r"[!-~]{1,256}")  # the Standard Webhooks id a receiver accepts
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def plan_webhook(event_id: str, body_sha256: str, token: int | None, now_ms: int) -> Plan[str]:
    """One delivery of a webhook as a plan: applied (the ``EFFECT`` hook yielded), duplicate
    or conflict; ``body_sha256`` is the hex SHA-256 of the body's bytes."""
    if type(event_id) is not str or not WEBHOOK_ID.fullmatch(event_id):
        raise ValueError("a webhook id must be 1-256 visible ASCII characters")
    if type(body_sha256) is not str or not SHA256_HEX.fullmatch(body_sha256):
        raise ValueError("body_sha256 must be 64 lower-case hex digits")
    if token is not None:
        check_int(token, "token", 1, 10**15)
    check_int(now_ms, "now_ms", 0, MAX_NOW)
    return _webhook(event_id, body_sha256, token, now_ms)


def _webhook(event_id: str, digest: str, token: int | None, now_ms: int) -> Plan[str]:
    first = yield Sql(SQL_WEBHOOK_FIRST, (event_id, digest, token, token, now_ms, now_ms))
    if first:
        yield Hook(EFFECT)  # the effect, after the row: the row and the effect commit together
        return "applied", True
    rows = yield Sql(SQL_WEBHOOK_DIGEST, (event_id,))
    if not rows:  # (a row that kept this one out, yet is not visible: try again later)
        raise RuntimeError(f"the inbox row of {event_id!r} is not visible to this transaction")
    if rows[0][0] != digest:
        return "conflict", False
    yield Sql(SQL_WEBHOOK_AGAIN, (token, now_ms, event_id))
    return "duplicate", True

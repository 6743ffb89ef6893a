"""The sink's inbox as plans: each id's effect applied once, decided in arrival order.

Rules of this module (standard library only, like the rest of ``core``):

* An id seen for the first time is ``applied`` (its row and the stock change in one
  transaction); the same id and qty again is a ``duplicate`` (no effect, the delivery
  counted); another qty is a ``conflict`` (nothing changes).
* ``plan_inbox`` decides a whole batch (a group commit) exactly as if its deliveries had
  come one by one, in a fixed number of statements whatever the batch's size.
* The statements are SQLite's; ``asnackq.store.pg_sql`` keys its PostgreSQL texts to them.
"""

from __future__ import annotations

from asnackq.core.worker import Plan, Sql, SqlMany, json_set

__all__ = [
    "RECORD_FIELDS",
    "SINK_SCHEMA",
    "SQL_ADD_STOCK",
    "SQL_APPLY",
    "SQL_KNOWN",
    "SQL_RECORD",
    "SQL_SEEN_AGAIN",
    "SQL_STOCK",
    "decide",
    "plan_inbox",
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

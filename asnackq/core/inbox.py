"""The inbox as a plan: each delivery's id applied once ever, a batch of concurrent
deliveries (a group commit) decided in one transaction, in arrival order.

Rules of this module (standard library only, like the rest of ``core``):

* One set of rules, for every receiver (``asnackq.sink.receiver.WebhookReceiver``) and for
  the sink (``asnackq sink``, whose stock effect is one receiver's effect): an id seen for
  the first time is ``applied`` (its row and its effect in one transaction); the same id
  with the same content again is a ``duplicate`` (no effect, the delivery counted in its
  row); other content is a ``conflict`` (nothing changes).  The content is a digest the
  receiver chooses: a webhook's is the SHA-256 of its body's bytes; the sink's, of its
  event's canonical form (so the same id and qty with other whitespace is a duplicate).
* ``plan_receive`` decides a whole batch exactly as if its deliveries had come one by one
  (the same id twice in one batch: the second is decided against the first), in a fixed
  number of statements whatever the batch's size.  Its first write is the batch's new
  rows, ``INSERT ... ON CONFLICT DO NOTHING RETURNING id``: on PostgreSQL a concurrent
  delivery of the same id (another replica) waits for that row's transaction, then finds
  it; only ids whose row was not written are read back.
* The rows come first, the effects after them: an effect given as statements (``Effect``:
  the sink's stock) is yielded by the plan itself for the applied deliveries, in arrival
  order; an application's async effect is awaited by the driver after the plan
  (``asnackq.store.effects``), inside the same transaction.
* Rows live in a table of their own (``asnackq_webhook_inbox``), beside the application's.
* The statements are SQLite's; ``asnackq.store.pg_sql`` keys its PostgreSQL texts to them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Generator
from typing import NamedTuple

from asnackq.core.worker import (
    MAX_NOW,
    Batch,
    Plan,
    Reply,
    Sql,
    SqlMany,
    Step,
    check_int,
    json_set,
)

__all__ = [
    "MAX_BATCH",
    "RECORD_FIELDS",
    "SINK_SCHEMA",
    "SINK_TABLE",
    "SINK_TABLES",
    "SQL_ADD_STOCK",
    "SQL_AGAIN",
    "SQL_DIGESTS",
    "SQL_FIRST",
    "SQL_MOVE",
    "SQL_RECORD",
    "SQL_STOCK",
    "SQL_WEBHOOK_RECORD",
    "WEBHOOK_FIELDS",
    "WEBHOOK_SCHEMA",
    "Arrival",
    "Effect",
    "event_digest",
    "plan_receive",
    "plan_stock",
]

WEBHOOK_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS asnackq_webhook_inbox (id TEXT PRIMARY KEY,
  body_sha256 TEXT NOT NULL, first_token INTEGER, last_token INTEGER,
  deliveries INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL)""",
)
# The batch's new rows: one JSON array of [id, digest, token, now_ms], each id's first arrival
# (``->>``: SQLite 3.38 or later; ``RETURNING``: 3.35).
SQL_FIRST = """INSERT INTO asnackq_webhook_inbox (id, body_sha256, first_token, last_token,
  deliveries, first_seen_ms, last_seen_ms)
SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 2, 1, value ->> 3, value ->> 3
FROM json_each(?) WHERE true ON CONFLICT (id) DO NOTHING RETURNING id"""
SQL_DIGESTS = """SELECT id, body_sha256 FROM asnackq_webhook_inbox
WHERE id IN (SELECT value FROM json_each(?))"""
SQL_AGAIN = """UPDATE asnackq_webhook_inbox SET deliveries = deliveries + 1,
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
WEBHOOK_ID = re.compile(r"[!-~]{1,256}")  # the Standard Webhooks id a receiver accepts
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_BATCH = 10_000


class Arrival(NamedTuple):
    """One delivery to decide: its id, its content's digest (64 hex digits), its token."""

    event_id: str
    digest: str
    token: int | None


# Statements of the applied deliveries' effects (their indexes in the batch, in order).
Effect = Callable[[list[int]], Generator[Step, Reply, None]]


def plan_receive(
    batch: list[Arrival], now_ms: int, effect: Effect | None = None
) -> Plan[list[str]]:
    """One batch as a plan: the status of each delivery, applied, duplicate or conflict,
    decided in arrival order; ``effect``'s statements for the applied ones."""
    if type(batch) is not list or not 1 <= len(batch) <= MAX_BATCH:
        raise ValueError(f"a batch is a list of 1-{MAX_BATCH} arrivals")
    for arrival in batch:
        check_arrival(arrival)
    check_int(now_ms, "now_ms", 0, MAX_NOW)
    return _receive(list(batch), now_ms, effect)


def check_arrival(arrival: object) -> None:
    """Refuse anything but an ``Arrival`` of a webhook id, a hex SHA-256 and a token."""
    if type(arrival) is not Arrival:
        raise ValueError(f"an arrival must be an Arrival, not {type(arrival).__name__}")
    event_id, digest, token = arrival
    if type(event_id) is not str or not WEBHOOK_ID.fullmatch(event_id):
        raise ValueError("a webhook id must be 1-256 visible ASCII characters")
    if type(digest) is not str or not SHA256_HEX.fullmatch(digest):
        raise ValueError("a digest must be 64 lower-case hex digits (a SHA-256)")
    if token is not None:
        check_int(token, "token", 1, 10**15)


def _receive(batch: list[Arrival], now_ms: int, effect: Effect | None) -> Plan[list[str]]:
    firsts = {arrival.event_id: arrival for arrival in reversed(batch)}  # each id's first
    rows = [[a.event_id, a.digest, a.token, now_ms] for _, a in sorted(firsts.items())]
    written = yield Sql(SQL_FIRST, (json.dumps(rows, separators=(",", ":")),))
    new = {row[0] for row in written or ()}
    seen: dict[str, str] = {}  # each id's recorded digest, as the batch goes
    if len(new) < len(firsts):
        seen = yield from _recorded(sorted(firsts.keys() - new))
    statuses = [decide(seen, arrival) for arrival in batch]
    again = sorted(  # (in id order: replicas lock rows in one order; stable within an id)
        (a for a, status in zip(batch, statuses, strict=True) if status == "duplicate"),
        key=lambda a: a.event_id,
    )
    if again:
        yield SqlMany(SQL_AGAIN, [(a.token, now_ms, a.event_id) for a in again])
    applied = [i for i, status in enumerate(statuses) if status == "applied"]
    if effect is not None and applied:
        yield from effect(applied)
    return statuses, bool(new or again)


def _recorded(ids: list[str]) -> Generator[Step, Reply, dict[str, str]]:
    rows = yield Sql(SQL_DIGESTS, (json_set(ids),))
    recorded: dict[str, str] = {row[0]: row[1] for row in rows or ()}
    for event_id in ids:
        if event_id not in recorded:  # (a row kept this one out, yet is not visible)
            raise RuntimeError(f"the inbox row of {event_id!r} is not visible to this transaction")
    return recorded


def decide(seen: dict[str, str], arrival: Arrival) -> str:
    """The decision for one delivery, given each id's recorded digest (updated in place)."""
    if arrival.event_id not in seen:
        seen[arrival.event_id] = arrival.digest
        return "applied"
    return "duplicate" if seen[arrival.event_id] == arrival.digest else "conflict"


# --- the sink's stock: its effect, as statements ---------------------------------------

SINK_SCHEMA = (
    *WEBHOOK_SCHEMA,
    "CREATE TABLE IF NOT EXISTS stock_moves (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)"
    " WITHOUT ROWID",  # (one b-tree, keyed by id)
    "CREATE TABLE IF NOT EXISTS stock (one INTEGER PRIMARY KEY CHECK (one = 1),"
    " total INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO stock (one, total) VALUES (1, 0)",
)
SINK_TABLE = "stock_moves"  # the table that marks a sink's DB (readers look for it)
SINK_TABLES = ("asnackq_webhook_inbox", "stock_moves", "stock")
SQL_MOVE = "INSERT INTO stock_moves (id, qty) VALUES (?, ?)"
SQL_ADD_STOCK = "UPDATE stock SET total = total + ? WHERE one = 1"
SQL_STOCK = "SELECT total FROM stock WHERE one = 1"
# An event's record (``GET /events/{id}``, the dashboard): its inbox row and its qty.
RECORD_FIELDS = (
    "id",
    "qty",
    "first_token",
    "last_token",
    "deliveries",
    "applied_at_ms",
    "last_seen_ms",
)
SQL_RECORD = """SELECT i.id, m.qty, i.first_token, i.last_token, i.deliveries, i.first_seen_ms,
  i.last_seen_ms FROM asnackq_webhook_inbox AS i JOIN stock_moves AS m ON m.id = i.id
WHERE i.id = ?"""


def event_digest(event_id: str, qty: int) -> str:
    """The digest of a checked event's canonical form, ``{"id":"...","qty":N}`` (its id is
    ``[A-Za-z0-9_-]``: nothing to escape): the same id and qty, the same digest."""
    return hashlib.sha256(b'{"id":"%s","qty":%d}' % (event_id.encode(), qty)).hexdigest()


def plan_stock(moves: list[tuple[str, int]]) -> Generator[Step, Reply, None]:
    """The sink's effect for its applied events ``(id, qty)``: each move kept, stock += qty
    (one step: a driver may send both at once)."""
    yield Batch((SqlMany(SQL_MOVE, moves), Sql(SQL_ADD_STOCK, (sum(qty for _, qty in moves),))))

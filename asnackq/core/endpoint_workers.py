"""What each worker says of the endpoints it serves: breaker, current limit, sends in flight.

Rules of this module (the style of ``worker.py``; standard library only):

* One product table, ``asnackq_endpoint_workers``: a row per (endpoint, owner), on SQLite
  and PostgreSQL (``asnackq.store.pg_sql``), never part of the contract's schema, made by
  a worker's first note (``plan_note(..., tables=True)``).
* A note is one worker's whole report, in a short transaction of its own and two
  statements whatever the number of endpoints: one upsert of every row it reports (a JSON
  array), then one delete of its owner's rows for endpoints it no longer reports and of
  anyone's rows not seen for ``FORGET_MS`` (workers that stopped or were killed).
* A row is only what a worker said at ``seen_ms``: a reader shows rows seen within
  ``FRESH_MS`` of its clock, and an endpoint without one has no worker.
* Everything is checked before the plan exists: a refusal is one ``ValueError`` line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

from asnackq.core import worker as w

__all__ = [
    "FORGET_MS",
    "FRESH_MS",
    "SCHEMA",
    "SQL_FORGET",
    "SQL_NOTE",
    "SQL_SEEN",
    "Seen",
    "check_seen",
    "plan_note",
]

FRESH_MS = 15_000  # a row older than this is no worker's any more
FORGET_MS = 3_600_000  # a row older than this is deleted by anyone's next note
MAX_ROWS = 10_000
MAX_LIMIT = 1 << 20

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS asnackq_endpoint_workers (endpoint TEXT NOT NULL,
  owner TEXT NOT NULL, breaker TEXT NOT NULL CHECK (breaker IN ('closed', 'open')),
  limit_now INTEGER NOT NULL, in_flight INTEGER NOT NULL, seen_ms INTEGER NOT NULL,
  PRIMARY KEY (endpoint, owner))""",
)
# A note's rows: one JSON array of [endpoint, breaker, limit_now, in_flight].  (``WHERE
# true``: SQLite's parser wants it between an INSERT's SELECT and its ON CONFLICT.)
SQL_NOTE = """INSERT INTO asnackq_endpoint_workers
  (endpoint, owner, breaker, limit_now, in_flight, seen_ms)
SELECT json_extract(value, '$[0]'), :owner, json_extract(value, '$[1]'),
  json_extract(value, '$[2]'), json_extract(value, '$[3]'), :now
FROM json_each(:rows) WHERE true
ON CONFLICT (endpoint, owner) DO UPDATE SET breaker = excluded.breaker,
  limit_now = excluded.limit_now, in_flight = excluded.in_flight, seen_ms = excluded.seen_ms"""
SQL_FORGET = """DELETE FROM asnackq_endpoint_workers
WHERE (owner = :owner AND endpoint NOT IN (SELECT value FROM json_each(:names)))
  OR seen_ms < :forget"""
# The rows seen since ``:since``, as a reader shows them.
SQL_SEEN = """SELECT endpoint, owner, breaker, limit_now, in_flight, seen_ms
FROM asnackq_endpoint_workers WHERE seen_ms >= ? ORDER BY endpoint, owner"""


class Seen(NamedTuple):
    """What a worker says of one endpoint it serves: whether its breaker is open, its limit
    of sends in flight now (concurrency "auto": the adaptive limit) and its sends in flight."""

    endpoint: str
    breaker_open: bool
    limit: int
    in_flight: int


def check_seen(rows: object) -> list[Seen]:
    """A note's rows, checked: each ``(endpoint, breaker_open, limit, in_flight)``, every
    endpoint once."""
    if type(rows) not in (list, tuple) or len(rows) > MAX_ROWS:  # type: ignore[arg-type]
        raise ValueError(f"rows must be a list of at most {MAX_ROWS} (endpoint, ...) tuples")
    checked = []
    for row in rows:  # type: ignore[attr-defined]
        if type(row) not in (tuple, list, Seen) or len(row) != 4:
            raise ValueError("a row is (endpoint, breaker_open, limit, in_flight)")
        name, is_open, limit, in_flight = row
        w.check_identifier(name, "endpoint name")
        if type(is_open) is not bool:
            raise ValueError(f"breaker_open must be True or False: {is_open!r}")
        w.check_int(limit, "limit", 0, MAX_LIMIT)
        w.check_int(in_flight, "in_flight", 0, MAX_LIMIT)
        checked.append(Seen(name, is_open, limit, in_flight))
    if len({row.endpoint for row in checked}) < len(checked):
        raise ValueError("rows name an endpoint twice")
    return checked


def plan_note(owner: object, rows: object, now_ms: object, *, tables: bool = True) -> w.Plan[int]:
    """Plan ``owner``'s note of the endpoints it serves (``rows``: ``Seen`` values, or
    tuples of theirs) at ``now_ms``; its other rows go.  ``tables``: make the table if
    absent first.  The result: the rows noted."""
    name = w.check_identifier(owner, "owner")
    return _note(name, check_seen(rows), w.check_now(now_ms, limits=w.PRODUCT), tables)


def _json(values: Iterable[object]) -> str:
    return json.dumps(list(values), separators=(",", ":"))


def _note(owner: str, rows: list[Seen], now_ms: int, tables: bool) -> w.Plan[int]:
    if tables:
        for statement in SCHEMA:
            yield w.Sql(statement)
    said = _json(
        [r.endpoint, "open" if r.breaker_open else "closed", r.limit, r.in_flight] for r in rows
    )
    yield w.Sql(SQL_NOTE, {"owner": owner, "now": now_ms, "rows": said})
    names = _json(row.endpoint for row in rows)
    yield w.Sql(SQL_FORGET, {"owner": owner, "names": names, "forget": now_ms - FORGET_MS})
    return len(rows), True

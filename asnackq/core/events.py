"""Events of any JSON value, fanned out to a queue's endpoints in the intake's transaction.

Rules of this module (the style of ``worker.py``; standard library only):

* An event is a dict ``{"id", "data", "type"?, "key"?}``: the id the job-id rule, ``type``
  a dotted name, ``key`` 1-128 printable characters, ``data`` any JSON value.  A dict
  with ``qty`` and no ``data`` is the contract's ``{id, qty}`` event, taken by the core's
  own plan exactly as before; an intake may mix both kinds.
* The body every attempt sends is made once, at intake: Standard Webhooks' payload
  ``{"data", "timestamp", "type"}`` (``type`` only when given; the timestamp is the
  intake's, ISO 8601 UTC in milliseconds), compact JSON with sorted keys, UTF-8.  Its size
  is refused past the queue's ``max_event_bytes`` before any statement.
* The same id again with the same ``type``, ``key`` and ``data`` (compared as a SHA-256 of
  the canonical JSON of the three, never of the timestamp) is ``False`` and writes nothing;
  with another, a ``worker.Conflict``, as a job's qty is.
* A new event is stored (``asnackq_events``) with one delivery per enabled endpoint that
  takes its type (``to``: the endpoints named; an unknown name refuses the whole intake),
  all in the intake's transaction: each delivery a ``jobs`` row of qty 1 (its own lease,
  token, attempts, deadline, dead letter and redrive) and an ``asnackq_deliveries`` row.
  A disabled endpoint gets no delivery, as Svix creates none for one.
* A delivery's job id is its endpoint's lane (``core.lanes``), ``-``, and the event's
  intake number (``asnackq_events.seq``) in 16 digits: within a lane, ids sort in enqueue
  order, and a lane's claim is a range of an index.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Generator, Iterable
from typing import Any, NamedTuple

from asnackq.core import endpoints as ep
from asnackq.core import lanes
from asnackq.core import worker as w

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAX_BYTES",
    "MAX_DIGITS",
    "SCHEMA",
    "SQL_BODY",
    "SQL_INSERT_DELIVERY",
    "SQL_INSERT_EVENT",
    "SQL_KNOWN",
    "SQL_PRESENT",
    "SQL_SEQS",
    "Event",
    "Published",
    "check_max_bytes",
    "check_to",
    "is_event",
    "plan_intake",
    "takes",
]

DEFAULT_MAX_BYTES = 256 * 1024  # a stored body's size, by default
MAX_BYTES = 1024 * 1024  # the most a queue may allow
MAX_KEY = 128
# The longest integer in an event's data: asnackq's receivers read JSON from outside strictly
# (``asnackq.wire.strict_json``) and refuse a longer one, so no body carries it.
MAX_DIGITS = 30
MAX_TYPE = 128
TYPE_RULE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
KEYS = frozenset({"id", "data", "type", "key"})

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS asnackq_events (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, type TEXT, key TEXT, digest TEXT NOT NULL, body BLOB NOT NULL,
  created_ms INTEGER NOT NULL)""",
    lanes.DELIVERIES,
    "CREATE INDEX IF NOT EXISTS asnackq_deliveries_by_event ON asnackq_deliveries (event)",
    lanes.LANE_INDEX,
    lanes.KEY_INDEX,
)
# The tables and indexes ``SCHEMA`` (and the endpoints') makes: present, nothing to make (on
# PostgreSQL no schema lock is taken, so that intakes inside applications' transactions do
# not wait for each other's COMMIT).
NAMES = (
    "asnackq_endpoints",
    "asnackq_endpoint_changes",
    "asnackq_events",
    "asnackq_deliveries",
    "asnackq_deliveries_by_event",
    "asnackq_jobs_by_lane",
    "asnackq_deliveries_by_key",
)
SQL_PRESENT = (
    "SELECT count(*) FROM sqlite_master WHERE name IN ("
    + ", ".join(f"'{name}'" for name in NAMES)
    + ")"
)
SQL_KNOWN = """SELECT id, digest FROM asnackq_events
WHERE id IN (SELECT value FROM json_each(?))"""
SQL_INSERT_EVENT = """INSERT INTO asnackq_events (id, type, key, digest, body, created_ms)
VALUES (?, ?, ?, ?, ?, ?)"""
SQL_SEQS = "SELECT id, seq FROM asnackq_events WHERE id IN (SELECT value FROM json_each(?))"
SQL_INSERT_DELIVERY = (
    "INSERT INTO asnackq_deliveries (job, event, endpoint, key) VALUES (?, ?, ?, ?)"
)
# What a delivery sends: its event's id (the ``webhook-id``) and stored body.
SQL_BODY = """SELECT e.id, e.body FROM asnackq_deliveries AS d
JOIN asnackq_events AS e ON e.id = d.event WHERE d.job = ?"""


class Event(NamedTuple):
    """A checked event: its id, type, key, digest and the body every attempt sends."""

    id: str
    type: str | None
    key: str | None
    digest: str
    body: bytes


class Published(NamedTuple):
    """An intake of an event: whether it was new, and the deliveries it created, as
    ``(endpoint, job id)`` pairs by endpoint name (none for a known event)."""

    id: str
    created: bool
    deliveries: tuple[tuple[str, str], ...] = ()


class Intake(NamedTuple):
    """An event with its budget, as the plan takes it."""

    event: Event
    ttl_ms: int
    max_attempts: int


def is_event(item: object) -> bool:
    """Whether an intake's item is an event of this module (a dict with ``data``), not the
    contract's ``{id, qty}``."""
    return type(item) is dict and "data" in item


def check_max_bytes(value: object) -> int:
    return w.check_int(value, "max_event_bytes", 1, MAX_BYTES)


def check_to(to: object) -> tuple[str, ...] | None:
    """The endpoints an intake names (None: those its types route to)."""
    if to is None:
        return None
    if not isinstance(to, list | tuple) or not 1 <= len(to) <= ep.MAX_TYPES:
        raise ValueError(f"to must be a list of 1-{ep.MAX_TYPES} endpoint names")
    names = tuple(w.check_identifier(name, "an endpoint name in to") for name in to)
    if len(set(names)) < len(names):
        raise ValueError("to names an endpoint twice")
    return names


def check_event(event: object, now_ms: int, max_bytes: int) -> Event:
    """An event's fields checked, and its body made (``ValueError``: one line, no data)."""
    if type(event) is not dict or not {"id", "data"} <= event.keys() <= KEYS:
        keys = sorted(map(str, event))[:8] if isinstance(event, dict) else type(event).__name__
        raise ValueError(f"an event is a dict of id, data, and optionally type and key: {keys}")
    event_id = w.check_identifier(event["id"], "event id")
    kind, key = _type(event.get("type")), _key(event.get("key"))
    digest = hashlib.sha256(_json([kind, key, event["data"]], event_id)).hexdigest()
    payload = {"data": event["data"], "timestamp": timestamp(now_ms)}
    body = _json(payload if kind is None else {**payload, "type": kind}, event_id)
    if len(body) > max_bytes:
        raise ValueError(
            f"event {event_id!r}: its body is {len(body)} bytes, over the queue's "
            f"max_event_bytes {max_bytes}"
        )
    return Event(event_id, kind, key, digest, body)


def _type(value: object) -> str | None:
    if value is None:
        return None
    if type(value) is not str or len(value) > MAX_TYPE or not TYPE_RULE.fullmatch(value):
        raise ValueError(
            f"an event type is dotted names of [A-Za-z0-9_-] (at most {MAX_TYPE} "
            f"characters), such as order.created: {str(value)[:130]!r}"
        )
    return value


def _key(value: object) -> str | None:
    if value is None:
        return None
    if type(value) is not str or not 1 <= len(value) <= MAX_KEY or not value.isprintable():
        raise ValueError(f"an event key is 1-{MAX_KEY} printable characters on one line")
    return value


def _flaw(value: object) -> str | None:
    """What keeps ``value`` from being a body every receiver reads as sent (None: nothing):
    a key that is not a string (``json.dumps`` would write ``{1: 2}`` as ``{"1": 2}``: two
    values, one body), an integer a strict reader refuses, a string UTF-8 cannot carry."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict | list | tuple):
            if id(item) in seen:  # (a cycle: json.dumps refuses it)
                continue
            seen.add(id(item))
        if isinstance(item, dict):
            if not all(type(key) is str for key in item):
                return "an object key is not a string"
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif type(item) is int and not -(10**MAX_DIGITS) < item < 10**MAX_DIGITS:
            return f"an integer of more than {MAX_DIGITS} digits"
        elif isinstance(item, str) and not item.isascii() and not encodes_utf8(item):
            return "a string holds an unpaired surrogate (\\ud800-\\udfff)"
    return None


def encodes_utf8(text: str) -> bool:
    """Whether UTF-8 can carry ``text`` (no unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json(value: object, event_id: str) -> bytes:
    flaw = _flaw(value)
    if flaw is not None:
        raise ValueError(f"event {event_id!r}: data is not JSON: {flaw}")
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"event {event_id!r}: data is not JSON: {error}") from None
    return text.encode("utf-8", errors="strict")


def timestamp(now_ms: int) -> str:
    """``now_ms`` as Standard Webhooks' payloads write it: ISO 8601, UTC, milliseconds."""
    at = datetime.datetime.fromtimestamp(now_ms / 1000, datetime.UTC)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def takes(types: tuple[str, ...], kind: str | None) -> bool:
    """Whether an endpoint of ``types`` (none: every type) takes an event of ``kind``:
    ``order.paid`` exactly, ``order.*`` every type below ``order``."""
    if not types:
        return True
    if kind is None:
        return False
    return any(kind == t or (t.endswith(".*") and kind.startswith(t[:-1])) for t in types)


def budget(
    endpoint: ep.Endpoint, ttl_ms: int, max_attempts: int, limits: w.Limits
) -> tuple[int, int]:
    """A delivery's ``(ttl_ms, max_attempts)``: a list of delays gives one attempt more than
    its delays (at most 16) and a ttl that outlasts them (within ``limits``); exponential
    retries keep the intake's budget."""
    if not isinstance(endpoint.retry, ep.Delays):
        return ttl_ms, max_attempts
    tries = min(16, len(endpoint.retry.ms) + 1)
    waits = sum(endpoint.retry.ms[: tries - 1]) + w.HOUR_MS
    return min(limits.ttl_ms, max(ttl_ms, waits)), tries


# --- the plan -----------------------------------------------------------------------------

Item = tuple[object, object, object]  # (event, ttl_ms, max_attempts), either kind


def plan_intake(
    items: Iterable[Item],
    now_ms: object,
    *,
    to: object = None,
    max_bytes: object = DEFAULT_MAX_BYTES,
    limits: w.Limits = w.PRODUCT,
    tables: bool = True,
) -> w.Plan[list[Any]]:
    """Plan an intake of events and contract events, mixed, in one transaction: for each
    item in order, a ``Published`` (an event), or True / False / a ``Conflict`` (a contract
    event, as ``worker.plan_enqueue_many``).  ``tables``: create the product's tables if
    absent first.  Everything is checked before the plan exists."""
    now = w.check_now(now_ms, limits=limits)
    most, names = check_max_bytes(max_bytes), check_to(to)
    listed = list(items)
    plain: list[Item] = []
    intakes: list[Intake] = []
    for event, ttl, tries in listed:
        if is_event(event):
            ttl_ms = w.check_int(ttl, "ttl_ms", 1, limits.ttl_ms)
            attempts = w.check_int(tries, "max_attempts", 1, 16)
            intakes.append(Intake(check_event(event, now, most), ttl_ms, attempts))
        else:
            w.check_enqueue(event, now, ttl, tries, limits)
            plain.append((event, ttl, tries))
    if not listed:
        raise ValueError("an intake needs at least one event")
    kinds = [is_event(event) for event, _, _ in listed]
    return _intake(kinds, plain, intakes, now, names, limits, tables)


def _intake(
    kinds: list[bool],
    plain: list[Item],
    intakes: list[Intake],
    now_ms: int,
    to: tuple[str, ...] | None,
    limits: w.Limits,
    tables: bool,
) -> w.Plan[list[Any]]:
    """The contract's events by the core's own plan, then the events; results in order."""
    jobs: list[Any] = []
    if plain:
        jobs, _ = yield from w.plan_enqueue_many(plain, now_ms, limits=limits)
    published: list[Published | w.Conflict] = []
    if intakes:
        if tables:
            yield from _tables()
        published = yield from _publish(intakes, now_ms, to, limits)
    firsts, seconds = iter(jobs), iter(published)
    results = [next(seconds) if kind else next(firsts) for kind in kinds]
    changed = any(r is True or (isinstance(r, Published) and r.created) for r in results)
    return results, changed


def _tables() -> Generator[w.Step, Any, None]:
    """The product's tables, made if any is absent."""
    [(present,)] = yield w.Sql(SQL_PRESENT)
    if present < len(NAMES):
        for statement in (*ep.SCHEMA, *SCHEMA):
            yield w.Sql(statement)


def _publish(
    intakes: list[Intake], now_ms: int, to: tuple[str, ...] | None, limits: w.Limits
) -> Generator[w.Step, Any, list[Published | w.Conflict]]:
    """Store each new event with its deliveries; a known one is False or a Conflict."""
    rows = yield w.Sql(SQL_KNOWN, (w.json_set(i.event.id for i in intakes),))
    known: dict[str, str] = dict(rows)
    fresh: list[Intake] = []
    results: list[Published | w.Conflict] = []
    for intake in intakes:
        event = intake.event
        if event.id not in known:
            known[event.id] = event.digest
            fresh.append(intake)
            results.append(Published(event.id, True))
        elif known[event.id] != event.digest:
            results.append(w.Conflict(f"event {event.id!r} exists with another type, key or data"))
        else:
            results.append(Published(event.id, False))
    if not fresh:
        return results
    routes = yield from _routes(fresh, to)
    made = yield from _store(fresh, routes, now_ms, limits)
    return [
        r._replace(deliveries=made[r.id]) if isinstance(r, Published) and r.created else r
        for r in results
    ]


def _routes(
    fresh: list[Intake], to: tuple[str, ...] | None
) -> Generator[w.Step, Any, dict[str, list[ep.Endpoint]]]:
    """Each new event's enabled endpoints: those ``to`` names (all of them must exist), or
    those whose types take the event's."""
    rows = yield w.Sql(ep.SQL_READ, (None,))
    found = sorted((ep.endpoint_of(row) for row in rows), key=lambda e: e.name)
    if to is not None:
        unknown = sorted(set(to) - {e.name for e in found})
        if unknown:
            raise ep.NoSuchEndpoint(f"to names no endpoint of this queue: {', '.join(unknown)}")
    enabled = [e for e in found if e.enabled]
    return {
        i.event.id: [
            e for e in enabled if (e.name in to if to is not None else takes(e.types, i.event.type))
        ]
        for i in fresh
    }


def _store(
    fresh: list[Intake], routes: dict[str, list[ep.Endpoint]], now_ms: int, limits: w.Limits
) -> Generator[w.Step, Any, dict[str, tuple[tuple[str, str], ...]]]:
    """Insert the new events, then their deliveries: jobs rows and the rows naming them."""
    events = [(*i.event[:4], i.event.body, now_ms) for i in fresh]
    yield from _insert(SQL_INSERT_EVENT, events)
    seqs: dict[str, int] = dict((yield w.Sql(SQL_SEQS, (w.json_set(e[0] for e in events),))))
    jobs, rows, made = [], [], {}
    for intake in fresh:
        event, pairs = intake.event, []
        for endpoint in routes[event.id]:
            job = lanes.delivery_id(endpoint.name, seqs[event.id])
            ttl_ms, tries = budget(endpoint, intake.ttl_ms, intake.max_attempts, limits)
            jobs.append((job, 1, tries, now_ms, now_ms + ttl_ms))
            rows.append((job, event.id, endpoint.name, event.key))
            pairs.append((endpoint.name, job))
        made[event.id] = tuple(pairs)
    if jobs:
        yield from _insert(w.SQL_INSERT_JOB, jobs)
        yield from _insert(SQL_INSERT_DELIVERY, rows)
    return made


def _insert(sql: str, params: list[tuple[Any, ...]]) -> Generator[w.Step, Any, None]:
    rows = yield w.SqlMany(sql, params)
    if rows != [(len(params),)]:
        raise RuntimeError(f"inserts changed {rows} rows, expected {len(params)}")

"""Each endpoint as an operator sees it: its state, its deliveries by status, its oldest
pending delivery's age, and what its workers say of its breaker and limit.

Rules of this module:

* Only reads, as plans (``w.Plan`` of ``w.Sql`` steps) that ``ops.stats``, the dashboard's
  watcher and ``/metrics`` run on a reader opened read-only; a queue without endpoints (or
  without events, or without workers' notes) reads as having none, never as an error.
* The deliveries' counts are one statement for every endpoint (for each ``CHUNK`` of
  them): for each endpoint and status, a count over its lane's range of the index
  ``jobs(status, id)`` (``core.lanes``): an index-only range, no row of the table read and
  no sort, whatever the backlog.  The range is the lane's: a plain job whose id was made
  to fall in it (``<name>_<6 hex>-...``) would count there too (the claims check the
  delivery row, and so does the oldest-pending look-up; the counts do not, which would
  read a row of ``asnackq_deliveries`` per delivery: 14 times the cost on 100,000).
* An endpoint's oldest pending age is how long its first pending delivery in its lane's
  order (the enqueue order) has waited since its event's intake: one index step, however
  long the backlog.
* What workers say (``core.endpoint_workers``) counts only when said within ``FRESH_MS``:
  an endpoint with no such row has "no worker".
"""

from __future__ import annotations

from typing import Any

from asnackq.core import endpoint_workers as ew
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store.reads import fetch

__all__ = ["COUNTED", "NO_WORKER", "plan_endpoints"]

NO_WORKER = "no worker"
CHUNK = 1000  # endpoints counted per statement (3 parameters each: SQLite takes 32,766)
COUNTED = ("pending", "leased", "done", "dead")
TABLES = ("asnackq_endpoints", "asnackq_deliveries", "asnackq_endpoint_workers")
SQL_TABLES = {
    True: "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?, ?)",
    False: "SELECT tablename FROM pg_catalog.pg_tables"
    " WHERE schemaname = current_schema() AND tablename IN (?, ?, ?)",
}
SQL_STATES = """SELECT name, state, disabled_reason, disabled_at_ms FROM asnackq_endpoints
ORDER BY name"""
# A lane's range of ids (``lanes.Lane.params``); on PostgreSQL compared in the "C" collation,
# the one its ids sort in and its index is made in.
IN_RANGE = {
    True: "j.id >= r.column2 AND j.id < r.column3",
    False: 'j.id COLLATE "C" >= r.column2 AND j.id COLLATE "C" < r.column3',
}
ORDERED = {True: "j.id", False: 'j.id COLLATE "C"'}


def sql_counts(endpoints: int, on_sqlite: bool) -> str:
    """The one statement of every endpoint's counts: a row per endpoint of ``(name,
    pending, leased, done, dead, oldest pending intake ms)``; its parameters are each
    endpoint's ``(name, lane_lo, lane_hi)``."""
    rng = IN_RANGE[on_sqlite]
    counts = ",\n  ".join(
        f"(SELECT count(*) FROM jobs AS j WHERE j.status = '{status}' AND {rng})"
        for status in COUNTED
    )
    oldest = f"""(SELECT e.created_ms FROM jobs AS j
    JOIN asnackq_deliveries AS d ON d.job = j.id JOIN asnackq_events AS e ON e.id = d.event
    WHERE j.status = 'pending' AND {rng} AND d.endpoint = r.column1
    ORDER BY {ORDERED[on_sqlite]} LIMIT 1)"""
    values = ", ".join(["(?, ?, ?)"] * endpoints)
    return f"SELECT r.column1,\n  {counts},\n  {oldest}\nFROM (VALUES {values}) AS r"


def ranges(names: list[str]) -> list[str]:
    """The parameters of ``sql_counts``: each endpoint's name and its lane's range."""
    found: list[str] = []
    for name in names:
        lane = lanes.Lane(name).params()
        found += [name, lane["lane_lo"], lane["lane_hi"]]
    return found


def plan_endpoints(now_ms: int, on_sqlite: bool = True) -> w.Plan[list[dict[str, Any]]]:
    """Every endpoint of the queue, by name: its state (and why and since when disabled),
    its deliveries' counts (``backlog`` pending, ``in_flight`` leased, ``done``, ``dead``),
    ``oldest_pending_ms``, and its workers' notes (``breaker``: closed, open, "open on k
    of n" workers or no worker; ``limit``: their limits added up)."""
    present = {row[0] for row in (yield from fetch(SQL_TABLES[on_sqlite], TABLES))}
    if "asnackq_endpoints" not in present:
        return [], False
    states = yield from fetch(SQL_STATES)
    names = [row[0] for row in states]
    counts: dict[str, tuple[Any, ...]] = {}
    if "asnackq_deliveries" in present:
        for start in range(0, len(names), CHUNK):
            some = names[start : start + CHUNK]
            rows = yield from fetch(sql_counts(len(some), on_sqlite), ranges(some))
            counts.update((row[0], row[1:]) for row in rows)
    seen: dict[str, list[dict[str, Any]]] = {}
    if "asnackq_endpoint_workers" in present:
        for endpoint, owner, breaker, limit, in_flight, at in (
            yield from fetch(ew.SQL_SEEN, (now_ms - ew.FRESH_MS,))
        ):
            said = {"owner": owner, "breaker": breaker, "limit": limit, "in_flight": in_flight}
            seen.setdefault(endpoint, []).append({**said, "seen_ms_ago": max(0, now_ms - at)})
    return [
        one(row, counts.get(row[0], (0, 0, 0, 0, None)), seen.get(row[0], []), now_ms)
        for row in states
    ], False


def one(
    state: tuple[Any, ...], counts: tuple[Any, ...], workers: list[dict[str, Any]], now_ms: int
) -> dict[str, Any]:
    name, enabled, reason, since = state
    pending, leased, done, dead, oldest = counts
    return {
        "name": name,
        "state": enabled,
        "disabled_reason": reason,
        "disabled_at_ms": since,
        "backlog": pending,
        "oldest_pending_ms": None if oldest is None else max(0, now_ms - oldest),
        "in_flight": leased,
        "done": done,
        "dead": dead,
        "breaker": breaker(workers),
        "limit": sum(said["limit"] for said in workers) if workers else None,
        "workers": workers,
    }


def breaker(workers: list[dict[str, Any]]) -> str:
    """The breaker as the workers say it: closed, open, open on k of n, or no worker."""
    if not workers:
        return NO_WORKER
    opened = sum(said["breaker"] == "open" for said in workers)
    if opened in (0, len(workers)):
        return "open" if opened else "closed"
    return f"open on {opened} of {len(workers)}"

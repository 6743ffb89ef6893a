"""Lanes: a claim that takes only one endpoint's deliveries, or only the jobs that are not.

Rules of this module (standard library only):

* The core's claim statements stay the core's: a lane is a set of statement texts keyed
  to them (``LANE_TEXTS``), each the core's text with the lane's condition added, row for row
  the same claim otherwise (quarantine, reclaims, poison, fresh claims ahead, the lease).
  A plan runs in a lane through ``substituted``, which swaps the texts and adds the lane's
  parameters; a read (``SQL_ACTIVE``: the run's "anything left?") through ``text``.
* An endpoint's lane (``lane_of``) is a prefix its deliveries' job ids begin with,
  ``<prefix>-``: its claim reads the range ``[prefix + "-", prefix + ".")`` of an index
  on ``jobs(status, id)`` in id order (the ids sort in enqueue order), so it reads its own
  rows only.  The prefix is made from the endpoint's name alone, so no table assigns it,
  and each row read is also checked against ``asnackq_deliveries`` (a primary-key look-up):
  a plain job whose id happens to fall in the range is never taken by the lane.
* The plain lane (``PLAIN``: a sink's worker) takes every job that is not a delivery,
  through the same texts (``PLAIN_TEXTS``) with ``NOT EXISTS`` that look-up.
* An ordered lane (``Lane(name, ordered=True)``: an ordered endpoint's) claims through
  ``ORDERED_TEXTS``: its own deliveries, of which one with a key is taken only while no
  other delivery of that endpoint and key is leased and none earlier (lower id, so enqueued
  before it) is pending.  Of the pending and leased deliveries of one key at most one
  passes that test in any one snapshot (the leased one, else the earliest), so a claim of
  n rows takes at most one per key, and a key is held while its head waits for a retry.
  Done and dead release a key; a delivery without a key is unordered.  The test reads the
  key's deliveries (``KEY_INDEX``) from the lane's oldest pending or leased one on, and a
  claim tests each row it reads past (a key's held backlog ahead of claimable rows too).
  A redriven delivery of a key is its earliest pending one: it goes after the key's
  delivery in flight, if any, and before the key's later pending ones; those done while
  it was dead stay done, so a receiver sees it after them.  The lane's "anything left?"
  (``SQL_ACTIVE``) counts a held delivery as left.
* The quarantine is not a lane's: a spent job dies by its own deadline or budget, whoever
  claims, exactly as the core decides.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Generator
from typing import Any, NamedTuple, TypeVar

from asnackq.core import worker as w

__all__ = [
    "DELIVERIES",
    "KEY_INDEX",
    "LANE_INDEX",
    "LANE_TEXTS",
    "ORDERED_TEXTS",
    "PLAIN",
    "PLAIN_TEXTS",
    "Lane",
    "delivery_id",
    "lane_of",
    "substituted",
    "text",
]

T = TypeVar("T")

DELIVERIES = """CREATE TABLE IF NOT EXISTS asnackq_deliveries (job TEXT PRIMARY KEY,
  event TEXT NOT NULL, endpoint TEXT NOT NULL, key TEXT)"""
# A lane's claim is a range of this index (a queue without events never has it, so a
# plain queue's writes maintain no more indexes than the core's).
LANE_INDEX = "CREATE INDEX IF NOT EXISTS asnackq_jobs_by_lane ON jobs (status, id)"
# An ordered lane's test reads a key's deliveries through this index (keyless ones: not in it).
KEY_INDEX = """CREATE INDEX IF NOT EXISTS asnackq_deliveries_by_key
  ON asnackq_deliveries (endpoint, key, job) WHERE key IS NOT NULL"""
COUNTER_DIGITS = 16


def lane_of(endpoint: str) -> str:
    """The prefix of an endpoint's deliveries' ids: its name (at most 24 characters, ``-``
    as ``_``) and 6 hex digits of its SHA-256, joined by ``_``: no ``-`` in it."""
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:6]
    return f"{endpoint[:24].replace('-', '_')}_{digest}"


def delivery_id(endpoint: str, number: int) -> str:
    """The job id of the delivery of event number ``number`` to ``endpoint``."""
    return f"{lane_of(endpoint)}-{number:0{COUNTER_DIGITS}d}"


class Lane(NamedTuple):
    """Whose jobs a claim takes: one endpoint's deliveries (``ordered``: one at a time per
    key, in enqueue order), or (``endpoint`` None) every job that is not a delivery."""

    endpoint: str | None
    ordered: bool = False

    def params(self) -> dict[str, Any]:
        if self.endpoint is None:
            return {}
        prefix = lane_of(self.endpoint)
        return {"lane": self.endpoint, "lane_lo": prefix + "-", "lane_hi": prefix + "."}


PLAIN = Lane(None)

_MINE = (
    "id >= :lane_lo AND id < :lane_hi AND EXISTS (SELECT 1 FROM asnackq_deliveries AS d"
    " WHERE d.job = jobs.id AND d.endpoint = :lane)"
)
# An ordered lane's: its own, and a keyed one only if no other of its key is leased and
# none earlier is pending.  The key's deliveries are read from the lane's oldest pending or
# leased job on (two seeks of ``LANE_INDEX``, once a statement): older ones are done or dead.
_OLDEST = (
    "min(coalesce((SELECT min(id) FROM jobs AS a WHERE a.status = 'pending'"
    " AND a.id >= :lane_lo AND a.id < :lane_hi), :lane_hi),"
    " coalesce((SELECT min(id) FROM jobs AS a WHERE a.status = 'leased'"
    " AND a.id >= :lane_lo AND a.id < :lane_hi), :lane_hi))"
)
_ORDERED = (
    "id >= :lane_lo AND id < :lane_hi AND EXISTS (SELECT 1 FROM asnackq_deliveries AS d"
    " WHERE d.job = jobs.id AND d.endpoint = :lane AND (d.key IS NULL OR NOT EXISTS ("
    "SELECT 1 FROM asnackq_deliveries AS k JOIN jobs AS o ON o.id = k.job"
    f" WHERE k.endpoint = :lane AND k.key = d.key AND k.job >= {_OLDEST} AND k.job <> d.job"
    " AND (o.status = 'leased' OR (o.status = 'pending' AND k.job < d.job)))))"
)
_NOT_DELIVERIES = "NOT EXISTS (SELECT 1 FROM asnackq_deliveries AS d WHERE d.job = jobs.id)"
# Where the core's claim statements read claimable (or active) jobs, and how they order them.
_CLAIMABLE = re.compile(r"WHERE status (?:= '(?:pending|leased)'|IN \('pending', 'leased'\))")
_BY_SEQ = re.compile(r"((?::now|attempts = 0)\s+)ORDER BY seq( LIMIT :n)")


def _variant(sql: str, condition: str, by_id: bool) -> str:
    """``sql`` with ``condition`` added to each of its reads of claimable (or active) jobs,
    and (``by_id``) each of those read in id order: the same statement otherwise.  (The
    outer ``ORDER BY seq LIMIT :n)`` of a union orders seqs only and is ordered by seq
    either way: within a lane, id order is seq order.)"""
    out, found = _CLAIMABLE.subn(lambda m: f"{m[0]} AND {condition}", sql)
    if not found:
        raise AssertionError(f"no claimable read in {' '.join(sql.split())[:80]!r}")
    if by_id:
        out = _BY_SEQ.sub(lambda m: f"{m[1]}ORDER BY id{m[2]}", out)
    return out


CLAIMS = (
    w.SQL_NEXT_CLAIMABLE,
    w.SQL_NEXT_FRESH,
    w.SQL_NEXT_RECLAIMABLE,
    w.SQL_NEXT_FRESH_RECLAIMING,
    w.SQL_ACTIVE,
)
# The core's statement -> an endpoint's lane's text, and the plain lane's.
LANE_TEXTS = {sql: _variant(sql, _MINE, by_id=True) for sql in CLAIMS}
PLAIN_TEXTS = {sql: _variant(sql, _NOT_DELIVERIES, by_id=False) for sql in CLAIMS}
# An ordered lane's: its claims held per key; what is left, as any endpoint lane's.
ORDERED_TEXTS = {
    sql: LANE_TEXTS[sql] if sql == w.SQL_ACTIVE else _variant(sql, _ORDERED, by_id=True)
    for sql in CLAIMS
}


def text(
    lane: Lane, sql: str, params: tuple[Any, ...] | dict[str, Any]
) -> tuple[str, tuple[Any, ...] | dict[str, Any]]:
    """A statement and its parameters as ``lane`` runs them (others: unchanged)."""
    found = _texts(lane).get(sql)
    if found is None:
        return sql, params
    return found, {**(params if isinstance(params, dict) else {}), **lane.params()}


def _texts(lane: Lane) -> dict[str, str]:
    if lane.endpoint is None:
        return PLAIN_TEXTS
    return ORDERED_TEXTS if lane.ordered else LANE_TEXTS


def substituted(plan: w.Plan[T], lane: Lane) -> Generator[w.Step, Any, tuple[T, bool]]:
    """``plan`` with its claim statements in ``lane``'s texts; every other step as it is."""
    reply: w.Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            result: tuple[T, bool] = stop.value
            return result
        reply = yield in_lane(step, lane)


def in_lane(step: w.Step, lane: Lane) -> w.Step:
    """One step in ``lane``'s texts: a statement (a ``Read`` stays a ``Read``), or each of a
    ``Batch``'s statements."""
    if isinstance(step, w.Batch):
        return w.Batch(tuple(in_lane(one, lane) for one in step.steps))  # type: ignore[misc]
    if isinstance(step, w.Sql):
        sql, params = text(lane, step.sql, step.params)
        return step._replace(sql=sql, params=params)
    return step

"""A send rate shared by every worker of a queue: permits taken with the claims, as plans.

Rules of this module (the style of ``worker.py``; standard library only):

* The limit is a row of ``asnackq_rate`` in the queue's own database, one per key: its
  emission interval ``T`` (microseconds per send, ``1 / rate``), its ``burst`` ``B`` and
  its *theoretical arrival time* ``tat_us`` (GCRA, the virtual-scheduling form): the next
  free send slot.  A permit is a slot: a time at which one send may go, never earlier.
* Permits are taken in the claim's own transaction (``plan_paced_cycle``): read the row
  (locked) and the database's clock in one statement, decide how many slots the claim
  may take, ``yield from`` the core's cycle plan for exactly that many claims, and write
  back only the slots the claims used: unused permits are returned before COMMIT.
* Slots are granted ``T`` apart, from ``lead`` after the database's clock (the claimer's
  own estimate of its transaction's time, at most ``MAX_LEAD_US``: its tickets reach it
  before their slots, not overdue in a bunch) up to ``HORIZON_US`` after that, and never
  before ``now + lead - (B - 1) * T``: at most ``B`` sends at once after an idle spell,
  at most ``rate`` a second after that, however many workers claim.
* The clock is the database's (SQLite: the machine's, read by SQLite; PostgreSQL: the
  server's ``clock_timestamp()``), read after the row is locked: a worker's own clock,
  skewed or stepped, plays no part.  A slot further ahead than any grant could have made
  means the database's clock stepped back (or the interval shrank): the row goes on from
  one horizon ahead of the clock (no stall beyond it, no burst).
* A slot is spent when it is taken: a send that fails spent it (it was a request); a
  ticket dropped unsent lets its slot pass with time, holding nothing afterwards; a
  ticket whose slot passed unsent takes a new one (``again``) before any claim does.
* The table is created by the product's surfaces (``plan_rate_setup``), never by
  ``open_queue``: the contract's schema stays exact.  The row is the queue's: a worker
  given no rate of its own takes it (``plan_shared_rate``); removing it
  (``plan_rate_clear``) lets every claim go unpaced, also those of a run paced so far.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from asnackq.core import worker as w

__all__ = [
    "HORIZON_US",
    "MAX_BURST",
    "MAX_LEAD_US",
    "MAX_SEND_RATE",
    "MIN_SEND_RATE",
    "SQL_RATE_CLEAR",
    "SQL_RATE_CLOCK",
    "SQL_RATE_EXISTS",
    "SQL_RATE_READ",
    "SQL_RATE_SET",
    "SQL_RATE_SHARED",
    "SQL_RATE_SPEND",
    "SQL_RATE_TABLE",
    "Grant",
    "Paced",
    "Rate",
    "check_rate",
    "grant",
    "plan_paced_cycle",
    "plan_rate_clear",
    "plan_rate_setup",
    "plan_shared_rate",
    "rate_of",
]

MAX_SEND_RATE = 100_000.0  # sends per second: an emission interval of at least 10 us
MIN_SEND_RATE = 0.001  # sends per second: an emission interval of at most 1000 s
MAX_BURST = 100_000
HORIZON_US = 250_000  # how far past its lead a claim may take slots (0.25 s)
MAX_LEAD_US = 250_000  # the longest lead a claim may ask for
DEFAULT_KEY = "sends"

SQL_RATE_TABLE = """CREATE TABLE IF NOT EXISTS asnackq_rate (key TEXT PRIMARY KEY,
  interval_us INTEGER NOT NULL, burst INTEGER NOT NULL, tat_us INTEGER NOT NULL)"""
# A new rate or burst replaces the old for every worker; the next slot is kept.
SQL_RATE_SET = """INSERT INTO asnackq_rate (key, interval_us, burst, tat_us) VALUES (?, ?, ?, 0)
ON CONFLICT (key) DO UPDATE SET interval_us = excluded.interval_us, burst = excluded.burst"""
# The row and the database's clock (epoch microseconds), read under the write lock.
SQL_RATE_READ = """SELECT interval_us, burst, tat_us,
  CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)
FROM asnackq_rate WHERE key = ?"""
SQL_RATE_SPEND = "UPDATE asnackq_rate SET tat_us = ? WHERE key = ? RETURNING key"
# The database's clock alone.
SQL_RATE_CLOCK = "SELECT CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
# Whether the table is there (a queue no rate was ever set on has none), the rate, its removal.
SQL_RATE_EXISTS = (
    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'asnackq_rate'"
)
SQL_RATE_SHARED = "SELECT interval_us, burst FROM asnackq_rate WHERE key = ?"
SQL_RATE_CLEAR = "DELETE FROM asnackq_rate WHERE key = ? RETURNING key"


class Rate(NamedTuple):
    """A shared send rate: ``per_s`` sends a second, bursts of at most ``burst``, on ``key``."""

    per_s: float
    burst: int = 1
    key: str = DEFAULT_KEY

    @property
    def interval_us(self) -> int:
        """Microseconds between two slots (at least 1)."""
        return max(1, round(1_000_000 / self.per_s))


def check_rate(per_s: object, burst: object = 1, key: object = DEFAULT_KEY) -> Rate:
    """A valid ``Rate``: ``per_s`` a finite number in [MIN_SEND_RATE, MAX_SEND_RATE],
    ``burst`` an int in 1..MAX_BURST, ``key`` an identifier; ``ValueError`` otherwise."""
    if not (
        isinstance(per_s, int | float)
        and type(per_s) is not bool
        and math.isfinite(per_s)
        and MIN_SEND_RATE <= per_s <= MAX_SEND_RATE
    ):
        raise ValueError(
            f"rate must be a number of sends per second in {MIN_SEND_RATE:g}..{MAX_SEND_RATE:g}: "
            f"{per_s!r}"
        )
    return Rate(
        float(per_s),
        w.check_int(burst, "burst", 1, MAX_BURST),
        w.check_identifier(key, "rate key"),
    )


class Grant(NamedTuple):
    """The permits of one transaction: how many, from which slot, and the clock then."""

    permits: int  # slots the claims may take
    start_us: int  # the first slot
    now_us: int  # the database's clock when the row was read
    interval_us: int


class Paced(NamedTuple):
    """A paced cycle's result: the core's cycle, the wait before each send (in microseconds
    after the database's clock reading ``now_us``): first the ``again`` held tickets that
    got a new slot, then the claimed tickets in order; and whether the permits, not the
    jobs, cut the claims short (more may be claimable soon), and then when the next permit
    may be granted: asking earlier only reads the row again."""

    cycle: w.Cycle
    waits_us: list[int]
    now_us: int
    short: bool
    again: int = 0
    retry_us: int = 0  # short: how long after ``now_us`` a permit may be granted again


def grant(row: tuple[Any, ...], wanted: int, lead_us: int = 0) -> Grant:
    """The slots a claim of ``wanted`` with ``lead_us`` may take on the rate row
    ``(interval_us, burst, tat_us, now_us)`` (the rule in one place; pure)."""
    interval, burst, tat, now = (int(value) for value in row)
    tolerance = (burst - 1) * interval  # how far behind the clock a slot may be
    ahead = now + MAX_LEAD_US + HORIZON_US + interval  # the furthest any grant leaves it
    first = now + lead_us  # the claimer's tickets reach it by then
    if tat > ahead:  # the clock stepped back: go on from one horizon ahead
        tat = first + HORIZON_US
    start = max(tat, first - tolerance)
    room = first + HORIZON_US - start
    permits = 0 if room < 0 else min(wanted, room // interval + 1)
    return Grant(permits, start, now, interval)


def plan_rate_setup(rate: Rate) -> w.Plan[None]:
    """Plan the rate's row (and its table, when absent): the rate and burst of ``rate``
    replace any earlier ones for every worker of the queue."""
    return _setup(rate.key, rate.interval_us, rate.burst)


def _setup(key: str, interval_us: int, burst: int) -> w.Plan[None]:
    yield w.Sql(SQL_RATE_TABLE)
    yield w.Sql(SQL_RATE_SET, (key, interval_us, burst))
    return None, True


def plan_shared_rate(key: str = DEFAULT_KEY) -> w.Plan[Rate | None]:
    """Plan reading the queue's shared rate on ``key`` (None: it has none); changes nothing."""
    tables = yield w.Sql(SQL_RATE_EXISTS)
    rows = (yield w.Sql(SQL_RATE_SHARED, (key,))) if tables and tables[0][0] else None
    if not rows:
        return None, False
    return rate_of(rows[0], key), False


def rate_of(row: tuple[Any, ...], key: str) -> Rate:
    """The ``Rate`` of a row's ``(interval_us, burst)``; ``ValueError`` for a row out of
    range (written by hand, or by something else): one clear line, never a division by 0."""
    interval_us, burst = row[0], row[1]
    if type(interval_us) is not int or interval_us < round(1_000_000 / MAX_SEND_RATE):
        raise ValueError(
            f"the queue's rate row {key!r} is out of range: interval_us {interval_us!r}"
            " (set it again with work --rate R, or remove it with work --rate off)"
        )
    try:
        return check_rate(1_000_000 / interval_us, burst, key)
    except ValueError as error:
        raise ValueError(
            f"the queue's rate row {key!r} is out of range: {error}"
            " (set it again with work --rate R, or remove it with work --rate off)"
        ) from None


def plan_rate_clear(key: str = DEFAULT_KEY) -> w.Plan[bool]:
    """Plan removing the queue's shared rate on ``key``: whether there was one."""
    tables = yield w.Sql(SQL_RATE_EXISTS)
    removed = (yield w.Sql(SQL_RATE_CLEAR, (key,))) if tables and tables[0][0] else None
    return bool(removed), bool(removed)


def plan_paced_cycle(
    rate: Rate,
    results: Iterable[tuple[w.Ticket, str, int, int]],
    held: Iterable[w.Ticket],
    owner: object,
    now_ms: object,
    lease_ms: object,
    count: object,
    fresh: object = 0,
    *,
    again: object = 0,
    lead_us: object = 0,
    limits: w.Limits = w.CONTRACT,
    own: bool = False,
) -> w.Plan[Paced]:
    """``worker.plan_cycle`` whose claims take the rate's permits in the same transaction
    (``own``: of a run's own tickets, as ``plan_cycle`` takes them).

    ``again`` permits come first: new slots for tickets already held whose slots passed
    unsent.  The claims (``count``, then ``fresh``) are cut to the permits left; the slots
    nobody used go back before COMMIT.  A cycle that wants no permit reads none.
    ``lead_us`` (0..MAX_LEAD_US): how long after the database's reading the first slot may
    be, at the earliest (see ``grant``).
    """
    settled, kept = list(results), list(held)
    wants = tuple(
        w.check_int(value, name, 0, 1024)
        for value, name in ((again, "again"), (count, "count"), (fresh, "fresh"))
    )
    lead = w.check_int(lead_us, "lead_us", 0, MAX_LEAD_US)
    w.plan_cycle(settled, kept, owner, now_ms, lease_ms, *wants[1:], limits=limits, own=own).close()
    return _paced(rate, (settled, kept, owner, now_ms, lease_ms), wants, lead, limits, own)


# A cycle's results, held tickets, owner, now and lease, as ``worker.plan_cycle`` takes them.
CycleArgs = tuple[list[tuple[w.Ticket, str, int, int]], list[w.Ticket], object, object, object]


def _paced(
    rate: Rate,
    cycle_args: CycleArgs,
    wants: tuple[int, ...],
    lead_us: int,
    limits: w.Limits,
    own: bool,
) -> w.Plan[Paced]:
    """``wants``: permits for held tickets again, claims, claims ahead."""
    permits, wanted, rows = Grant(0, 0, 0, 1), sum(wants), None
    if wanted:
        rows = yield w.Read(SQL_RATE_READ, (rate.key,))
        if rows:
            rate_of(rows[0][:2], rate.key)  # (a row out of range: one line, not a crash)
            permits = grant(rows[0], wanted, lead_us)
        else:  # the rate was removed: every claim goes, each slot at the clock's reading
            clock = yield w.Read(SQL_RATE_CLOCK)
            now_us = int(clock[0][0]) if clock else 0
            permits = Grant(wanted, now_us, now_us, 0)
    again = min(wants[0], permits.permits)
    count = min(wants[1], permits.permits - again)
    fresh = min(wants[2], permits.permits - again - count)
    result, changed = yield from w.plan_cycle(*cycle_args, count, fresh, limits=limits, own=own)
    used = again + len(result[2])
    slots = [permits.start_us + i * permits.interval_us for i in range(used)]
    if used and rows:  # only the slots used are spent; the rest are never written
        spent = yield w.Sql(SQL_RATE_SPEND, (slots[-1] + permits.interval_us, rate.key))
        if spent != [(rate.key,)]:  # the row was read under the same lock: a bug
            raise RuntimeError(f"the rate row {rate.key!r} was not written once: {spent}")
    waits = [max(0, slot - permits.now_us) for slot in slots]
    short = used == permits.permits < wanted
    # The next slot is free from ``tat`` on; ``grant`` hands it out once it falls within
    # its lead and horizon of the clock.
    tat = permits.start_us + used * permits.interval_us
    retry_us = max(0, tat - lead_us - HORIZON_US - permits.now_us) if short else 0
    return Paced(result, waits, permits.now_us, short, again, retry_us), changed or bool(again)

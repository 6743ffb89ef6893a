"""The synchronous core of asnackq: a SQLite lease queue with fencing tokens.

Rules of this file (the graded contract, steps 1-8, lives here and only here):

* Standard library only, no package imports: the grader loads this file by path.
* Every state transition is a *plan*: a generator that yields ``Sql`` steps (and
  receives their rows) and ``Hook`` points, and returns ``(result, changed)``.
  Plans contain no I/O.  ``drive`` below runs a plan on ``sqlite3``; the asyncio
  layer (``asnackq.aio``) runs the very same plans through ``aiosqlite``.  There is no
  second copy of the state machine anywhere.
* A plan's statements do not grow with its batch: a set of jobs is one JSON array
  parameter, a batch of fenced writes one ``SqlMany`` step.
* Statements that need no reply of each other go in one ``Batch`` (a write, then only
  ``Read`` steps), so an asynchronous driver sends them at once; a plan whose first step
  reads may have it sent along with BEGIN.
* Plans are created by ``plan_*`` functions that validate every input eagerly,
  so a ``ValueError`` is raised before any statement reaches the database.
* A driver wraps a plan in one ``BEGIN IMMEDIATE`` transaction.  An exception
  before COMMIT rolls everything back and propagates unchanged; ``after-commit``
  is called only when the plan reports that it changed the job it was about.
* Writes are guarded: the fence (status, token, owner, ...) is re-checked in the
  UPDATE's WHERE clause, and the plan checks that exactly one row changed.

A job's states (``token`` counts its leases and never goes back)::

    enqueue -> pending --claim: attempts+1, token+1--> leased --finish ok--------> done
                 ^  ^                                    |  |
                 |  +------ finish retry (within budget) -+  +--finish permanent--> dead
                 |    a lease that ended is taken over by the next claim (token+1)
                 |
                 |  quarantine (first step of every claim): a pending job, or a leased one
                 |  whose lease ended, past its deadline or out of attempts --> dead
                 |  (reason deadline or exhausted); so does a retry past budget or time
                 +-- redrive (dead only, audited): attempts 0, new deadline, token kept

Topics, in order: errors; values and checks; step 1 (retry delay); schema and statements;
plans (the state machine, free of I/O); the sqlite3 driver; the public API (steps 2-8).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sqlite3
import stat
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any, NamedTuple, TypedDict, TypeVar, cast

__all__ = [
    "AFTER_COMMIT",
    "CONTRACT",
    "DAY_MS",
    "DEAD_REASONS",
    "HOUR_MS",
    "MAX_LOSSES",
    "MAX_NOW",
    "OUTCOMES",
    "PRAGMAS",
    "PRODUCT",
    "RUN_ONCE_RETRY",
    "SCHEMA",
    "SQL_ACTIVE",
    "SQL_AUDIT",
    "SQL_CHANGES",
    "SQL_INSERT_JOB",
    "SQL_JOB",
    "SQL_JOBS",
    "SQL_LEASE",
    "SQL_LEASE_RECLAIMING",
    "SQL_NEXT_CLAIMABLE",
    "SQL_NEXT_FRESH",
    "SQL_NEXT_FRESH_RECLAIMING",
    "SQL_NEXT_RECLAIMABLE",
    "SQL_POISON",
    "SQL_QUARANTINE",
    "SQL_QUARANTINE_DUE",
    "SQL_QUARANTINE_DUE_RECLAIMING",
    "SQL_QUARANTINE_RECLAIMING",
    "SQL_REDRIVE",
    "SQL_SETTLE",
    "STATUSES",
    "BadAck",
    "Batch",
    "Conflict",
    "Cycle",
    "Fault",
    "Hook",
    "Limits",
    "Overloaded",
    "Permanent",
    "Plan",
    "Read",
    "Reply",
    "Retry",
    "Retryable",
    "Sql",
    "SqlMany",
    "Step",
    "Ticket",
    "Unavailable",
    "check_callable",
    "check_con",
    "check_enqueue",
    "check_event",
    "check_fault",
    "check_identifier",
    "check_int",
    "check_jitter",
    "check_now",
    "check_queue_path",
    "check_redrive",
    "check_run_args",
    "claim",
    "claim_many",
    "cycle",
    "delivery_result",
    "drive",
    "enqueue",
    "enqueue_many",
    "epoch_ms",
    "extend",
    "extend_many",
    "finish",
    "finish_many",
    "fresh_event",
    "json_set",
    "judge_send",
    "one_by_one",
    "open_db",
    "open_queue",
    "plan_claim",
    "plan_claim_many",
    "plan_cycle",
    "plan_enqueue",
    "plan_enqueue_many",
    "plan_extend",
    "plan_extend_many",
    "plan_finish",
    "plan_finish_many",
    "plan_redrive",
    "plan_schema",
    "redrive",
    "retry_delay",
    "run_file",
    "run_once",
    "second_reading",
    "write_one",
]


# --- errors ----------------------------------------------------------------------------


class Conflict(Exception):
    """Raised when an id is enqueued again with a different qty."""


class Retryable(Exception):
    """Raised by a sender when delivery may succeed later (timeouts, 5xx, resets)."""


class Unavailable(Retryable):
    """Raised by a sender when the receiver is not there (refused, reset, timeout, 502-504).

    An addition: ``run_once`` treats it as any ``Retryable``; the Dispatcher re-sends the
    job under the same lease, without spending an attempt, and pauses while it lasts.
    """


class Overloaded(Retryable):
    """Raised by a sender when the receiver is there but over its capacity (429, or 503 with
    ``Retry-After``); ``retry_after_s``: how long it asked to be left alone (None: unsaid).

    An addition: ``run_once`` treats it as any ``Retryable``; the Dispatcher keeps the job
    under its lease, spends no attempt, and sends it again no earlier than asked.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Permanent(Exception):
    """Raised by a sender when the receiver rejected the event for good (400, 409, ...)."""


class BadAck(Exception):
    """Raised when an answer is not evidence of completion (anything but a verified ACK)."""


# --- values and checks ---------------------------------------------------------------

MAX_NOW = 10**15 - 60_000
MAX_TOKEN = 10**15
TICKET_KEYS = frozenset({"id", "qty", "owner", "token", "attempt", "lease_until"})
OUTCOMES = ("ok", "retry", "permanent")
_IDENTIFIER = re.compile(r"[A-Za-z0-9_-]{1,64}")

T = TypeVar("T")
Fault = Callable[[str], object] | None


class Ticket(TypedDict):
    """A claim's ticket: a plain dict at run time, exactly these six keys (``TICKET_KEYS``)."""

    id: str
    qty: int
    owner: str
    token: int
    attempt: int
    lease_until: int


HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


class Limits(NamedTuple):
    """The longest ttl, lease and delay a surface accepts; times end ``max(...)`` before 10**15.

    The graded functions of this file keep ``CONTRACT``; the package's own surfaces
    (``AsyncQueue``, the Dispatcher, the command line) pass ``PRODUCT`` to the same plans.
    """

    ttl_ms: int = 60_000
    lease_ms: int = 60_000
    delay_ms: int = 60_000
    # How a lease that ended without a result counts (a worker that died, or lost its
    # database, while it held the job).  None, the contract's rule: its reclaim is an
    # attempt like any other.  A number: the reclaim spends no attempt, and the job is
    # dead ('poison') once its leases have ended without a result that many times since
    # its intake or redrive (``SQL_NEXT_RECLAIMABLE``).
    max_losses: int | None = None

    @property
    def max_now(self) -> int:
        return MAX_TOKEN - max(self.ttl_ms, self.lease_ms, self.delay_ms)


MAX_LOSSES = 100  # the product's bound on leases ended without a result (a poison job)
CONTRACT = Limits()
PRODUCT = Limits(ttl_ms=30 * DAY_MS, lease_ms=HOUR_MS, delay_ms=HOUR_MS, max_losses=MAX_LOSSES)


def epoch_ms() -> int:
    """The default clock: milliseconds since the epoch (the shared time base of ``now_ms``)."""
    return time.time_ns() // 1_000_000


def check_identifier(value: object, name: str) -> str:
    """Return ``value`` if it is an exact str of 1-64 ASCII letters, digits, ``_`` or ``-``."""
    if type(value) is not str or _IDENTIFIER.fullmatch(value) is None:
        raise ValueError(f"{name} must be 1-64 ASCII letters, digits, '_' or '-': {value!r}")
    return value


def check_int(value: object, name: str, low: int, high: int) -> int:
    """Return ``value`` if it is an exact int (never a bool) in ``low..high``."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} must be an int in {low}..{high}: {value!r}")
    return value


def check_now(value: object, name: str = "now_ms", limits: Limits = CONTRACT) -> int:
    """Return ``value`` if it is a valid millisecond timestamp of the shared time base."""
    return check_int(value, name, 0, limits.max_now)


def check_jitter(value: object) -> float:
    """Return ``value`` if it is a finite int or float (not bool) in 0..1."""
    # A range test alone: nan and the infinities fail it, and huge ints never overflow.
    if (type(value) is int or type(value) is float) and 0 <= value <= 1:
        return value
    raise ValueError(f"jitter must be a finite int or float in 0..1: {value!r}")


def check_fault(fault: object) -> Fault:
    """Return ``fault`` if it is ``None`` or callable."""
    if fault is not None and not callable(fault):
        raise ValueError(f"fault must be None or a callable: {fault!r}")
    return fault


def check_callable(value: object, name: str) -> Callable[..., Any]:
    """Return ``value`` if it is callable."""
    if not callable(value):
        raise ValueError(f"{name} must be callable: {value!r}")
    return value


def check_event(event: object) -> tuple[str, int]:
    """Return ``(id, qty)`` of an exact dict holding exactly ``id`` and ``qty``."""
    if type(event) is not dict or event.keys() != {"id", "qty"}:
        raise ValueError(f"event must be a dict with exactly 'id' and 'qty': {event!r}")
    return check_identifier(event["id"], "event id"), check_int(event["qty"], "qty", 1, 1000)


def check_ticket(ticket: object) -> Ticket:
    """Return a validated copy of a claim ticket (exact dict, exactly its six keys)."""
    if type(ticket) is dict and ticket.keys() == TICKET_KEYS and _sound(ticket):
        return cast(Ticket, dict(ticket))  # (the checks below, in one expression)
    if type(ticket) is not dict or ticket.keys() != TICKET_KEYS:
        raise ValueError(f"ticket must be a dict with exactly {sorted(TICKET_KEYS)}: {ticket!r}")
    check_identifier(ticket["id"], "ticket id")
    check_identifier(ticket["owner"], "ticket owner")
    check_int(ticket["qty"], "ticket qty", 1, 1000)
    check_int(ticket["token"], "ticket token", 1, MAX_TOKEN)
    check_int(ticket["attempt"], "ticket attempt", 1, 16)
    check_int(ticket["lease_until"], "ticket lease_until", 1, MAX_TOKEN)
    return cast(Ticket, dict(ticket))


def _sound(ticket: dict[str, Any]) -> bool:
    """Whether each value of a ticket's six passes ``check_ticket``'s check of it."""
    job_id, owner, qty = ticket["id"], ticket["owner"], ticket["qty"]
    token, attempt, until = ticket["token"], ticket["attempt"], ticket["lease_until"]
    return (
        type(job_id) is str
        and type(owner) is str
        and type(qty) is int
        and type(token) is int
        and type(attempt) is int
        and type(until) is int
        and 1 <= qty <= 1000
        and 1 <= token <= MAX_TOKEN
        and 1 <= attempt <= 16
        and 1 <= until <= MAX_TOKEN
        and _IDENTIFIER.fullmatch(job_id) is not None
        and _IDENTIFIER.fullmatch(owner) is not None
    )


def check_outcome(outcome: object) -> str:
    """Return ``outcome`` if it is exactly one of the strings ok, retry, permanent."""
    if type(outcome) is not str or outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}: {outcome!r}")
    return outcome


def check_queue_path(path: object) -> str:
    """Return ``path`` as a str naming a file (not ``:memory:``, not empty, not bytes)."""
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"path must be a str or os.PathLike naming a file: {path!r}")
    text = os.fspath(path)
    if type(text) is not str or text in ("", ":memory:") or "\0" in text:
        raise ValueError(f"path must name a local file, not {path!r}")
    return text


def check_enqueue(
    event: object, now_ms: object, ttl_ms: object, max_attempts: object, limits: Limits = CONTRACT
) -> tuple[str, int, int, int, int]:
    """An intake's inputs, checked in order: ``(id, qty, now_ms, ttl_ms, max_attempts)``."""
    job_id, qty = check_event(event)
    return (
        job_id,
        qty,
        check_now(now_ms, limits=limits),
        check_int(ttl_ms, "ttl_ms", 1, limits.ttl_ms),
        check_int(max_attempts, "max_attempts", 1, 16),
    )


def check_claim(
    owner: object, now_ms: object, lease_ms: object, limits: Limits = CONTRACT
) -> tuple[str, int, int]:
    """A claim's inputs, checked in order: ``(owner, now_ms, lease_ms)``."""
    return (
        check_identifier(owner, "owner"),
        check_now(now_ms, limits=limits),
        check_int(lease_ms, "lease_ms", 1, limits.lease_ms),
    )


def check_finish(
    ticket: object, outcome: object, now_ms: object, delay_ms: object, limits: Limits = CONTRACT
) -> tuple[Ticket, str, int, int]:
    """A finish's inputs, checked in order, with a copy of the ticket."""
    return (check_ticket(ticket), *_checked_outcome(outcome, now_ms, delay_ms, limits))


def _checked_outcome(
    outcome: object, now_ms: object, delay_ms: object, limits: Limits
) -> tuple[str, int, int]:
    """A finish's inputs after its ticket, checked in order."""
    return (
        check_outcome(outcome),
        check_now(now_ms, limits=limits),
        check_int(delay_ms, "delay_ms", 0, limits.delay_ms),
    )


def check_extend(
    tickets: Iterable[object], now_ms: object, lease_ms: object, limits: Limits = CONTRACT
) -> tuple[list[Ticket], int, int]:
    """Extensions' inputs, checked in order: copies of the tickets, ``now_ms``, ``lease_ms``."""
    return (
        [check_ticket(ticket) for ticket in tickets],
        check_now(now_ms, limits=limits),
        check_int(lease_ms, "lease_ms", 1, limits.lease_ms),
    )


def check_redrive(
    job_id: object, now_ms: object, ttl_ms: object, note: object, limits: Limits = CONTRACT
) -> tuple[str, int, int, str]:
    """A redrive's inputs, checked in order: ``(job_id, now_ms, ttl_ms, note)``."""
    return (
        check_identifier(job_id, "job_id"),
        check_now(now_ms, limits=limits),
        check_int(ttl_ms, "ttl_ms", 1, limits.ttl_ms),
        check_identifier(note, "note"),
    )


# --- step 1: retry delay -------------------------------------------------------


def retry_delay(attempt: int, base_ms: int, cap_ms: int, jitter: float) -> int:
    """Return ``floor(min(cap_ms, base_ms * 2**(attempt-1)) * jitter)``: cap first, then jitter."""
    return Retry(base_ms, cap_ms).delay(attempt, jitter)


class Retry(NamedTuple):
    """A retry policy: ``retry_delay``'s base and cap (``run_once`` uses 100 and 1000)."""

    base_ms: int = 100
    cap_ms: int = 1000

    def check(self, limits: Limits = CONTRACT) -> Retry:
        """Return this policy if base and cap are exact ints, ``1 <= base <= cap <= delay``."""
        check_int(self.base_ms, "base_ms", 1, limits.delay_ms)
        check_int(self.cap_ms, "cap_ms", self.base_ms, limits.delay_ms)
        return self

    def delay(self, attempt: int, jitter: float, limits: Limits = CONTRACT) -> int:
        """The delay before retry number ``attempt``: the policy checked within ``limits``."""
        check_int(attempt, "attempt", 1, 16)
        self.check(limits)
        check_jitter(jitter)
        return self._delay(attempt, jitter)

    def _delay(self, attempt: int, jitter: float) -> int:
        capped: int = min(self.cap_ms, self.base_ms * 2 ** (attempt - 1))
        return math.floor(capped * jitter)


RUN_ONCE_RETRY = Retry()


# --- schema and statements --------------------------------------------------------------

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token INTEGER NOT NULL,
  available_at INTEGER NOT NULL, deadline INTEGER NOT NULL,
  owner TEXT, lease_until INTEGER, reason TEXT)""",
    """CREATE TABLE IF NOT EXISTS redrives (seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL, token INTEGER NOT NULL, at_ms INTEGER NOT NULL, note TEXT NOT NULL)""",
    # Claims must not slow down as finished rows pile up.  Within one status an
    # index on (status) is ordered by rowid = seq; done/dead rows sit in their own
    # ranges and are never visited by the claim queries below.
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs(status)",
    "CREATE INDEX IF NOT EXISTS jobs_by_deadline ON jobs(status, deadline)",
    # Rows whose budget is spent, so quarantine finds them without a scan.
    "CREATE INDEX IF NOT EXISTS jobs_spent ON jobs(status) WHERE attempts >= max_attempts",
)

# The quarantine, in one statement: every spent job (pending, or leased with its lease
# ended) dies, by deadline when it is past it, else because its budget is exhausted.  Each
# branch of the UNION is an index lookup; the plan counts the reasons it returns.
_SPENT = """
  SELECT seq FROM jobs WHERE status = 'pending' AND deadline <= :now
  UNION SELECT seq FROM jobs WHERE status = 'leased' AND deadline <= :now
    AND lease_until <= :now
  UNION SELECT seq FROM jobs WHERE status = 'pending' AND attempts >= max_attempts{leased}"""
_LEASED_SPENT = """
  UNION SELECT seq FROM jobs WHERE status = 'leased' AND attempts >= max_attempts
    AND lease_until <= :now"""
_QUARANTINE = """
UPDATE jobs SET status = 'dead',
  reason = CASE WHEN deadline <= :now THEN 'deadline' ELSE 'exhausted' END,
  owner = NULL, lease_until = NULL
WHERE seq IN ({spent})
RETURNING reason"""
SQL_QUARANTINE = _QUARANTINE.format(spent=_SPENT.format(leased=_LEASED_SPENT))
# Whether the quarantine has a job to end: the same lookups, read only.  A claim reads it
# with its claimable jobs and runs the quarantine (and reads those again) only when it has
# work, which it mostly has not: the claim's reads then travel in one batch.
SQL_QUARANTINE_DUE = f"SELECT EXISTS ({_SPENT.format(leased=_LEASED_SPENT)})"
QUARANTINE_REASONS = ("deadline", "exhausted")
STATUSES = ("pending", "leased", "done", "dead")  # a job's, as the schema's CHECK lists them
# Why a job is dead: out of attempts, past its deadline, rejected by the receiver, or its
# leases ended without a result ``Limits.max_losses`` times (the product's claims only).
DEAD_REASONS = ("exhausted", "deadline", "permanent", "poison")

# The :n lowest-seq claimable jobs.  Leasing one job never makes another claimable or
# unclaimable at the same instant, so these are exactly what :n sequential claims take.
_CLAIMABLE_SEQS = """
  SELECT seq FROM (SELECT seq FROM jobs
      WHERE status = 'pending' AND available_at <= :now ORDER BY seq LIMIT :n)
  UNION ALL
  SELECT seq FROM (SELECT seq FROM jobs
      WHERE status = 'leased' AND lease_until <= :now ORDER BY seq LIMIT :n)
  ORDER BY seq LIMIT :n"""
SQL_NEXT_CLAIMABLE = f"""
SELECT seq, id, qty, attempts, token, deadline FROM jobs WHERE seq IN ({_CLAIMABLE_SEQS})
ORDER BY seq"""

# The product's claims (``Limits.max_losses``): a job whose lease ended without a result is
# taken again without spending an attempt, so the quarantine ends no leased job for its
# budget; ``SQL_NEXT_RECLAIMABLE`` reads, with each job, whether it is such a reclaim and how
# many of its leases have ended so since its intake or redrive: its claims (``token``, which
# every claim raises) less those that were attempts (``attempts``, which only a claim of a
# pending job raises), counted from the token its last redrive recorded.  The redrives are
# looked up only for a job whose count could reach the bound (``:losses``) without them:
# a reclaim after a crash costs no scan of the audit trail, however long it is.
SQL_QUARANTINE_RECLAIMING = _QUARANTINE.format(spent=_SPENT.format(leased=""))
SQL_QUARANTINE_DUE_RECLAIMING = f"SELECT EXISTS ({_SPENT.format(leased='')})"
SQL_NEXT_RECLAIMABLE = f"""
SELECT seq, id, qty, attempts, token, deadline, status = 'leased',
  CASE WHEN status = 'leased' AND token - attempts + 1 >= :losses THEN token - attempts
    - coalesce((SELECT max(r.token) FROM redrives AS r WHERE r.id = jobs.id), 0) ELSE 0 END
FROM jobs WHERE seq IN ({_CLAIMABLE_SEQS})
ORDER BY seq"""
SQL_NEXT_FRESH_RECLAIMING = """
SELECT seq, id, qty, attempts, token, deadline, 0, 0 FROM jobs
WHERE status = 'pending' AND available_at <= :now AND attempts = 0
ORDER BY seq LIMIT :n"""
SQL_LEASE_RECLAIMING = """
UPDATE jobs SET status = 'leased', attempts = attempts + (status = 'pending'),
  token = token + 1, owner = ?, lease_until = min(?, deadline), reason = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND status IN ('pending', 'leased')
RETURNING seq"""
SQL_POISON = """
UPDATE jobs SET status = 'dead', reason = 'poison', owner = NULL, lease_until = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND status = 'leased'
RETURNING seq"""

# Claims ahead of demand (a ticket that may wait, unsent, in a dispatcher's hands) take only
# jobs never attempted since their intake or redrive: a worker that dies holding such tickets
# spends each job's first attempt at most, whatever the number of such deaths.
SQL_NEXT_FRESH = """
SELECT seq, id, qty, attempts, token, deadline FROM jobs
WHERE status = 'pending' AND available_at <= :now AND attempts = 0
ORDER BY seq LIMIT :n"""

# Sets of jobs travel as one JSON array parameter (``json_each``): one statement, one
# SQLite step, however many jobs, so a transaction's statements do not grow with its batch.
# The plan has read the leased rows in the same transaction and computed each ticket from
# them, exactly as the statement does; it insists on the rows the statement returns.
SQL_LEASE = """
UPDATE jobs SET status = 'leased', attempts = attempts + 1, token = token + 1, owner = ?,
  lease_until = min(?, deadline), reason = NULL
WHERE seq IN (SELECT value FROM json_each(?)) AND status IN ('pending', 'leased')
RETURNING seq"""

SQL_JOB = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until
FROM jobs WHERE id = ?"""

SQL_JOBS = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until, id
FROM jobs WHERE id IN (SELECT value FROM json_each(?))"""

SQL_INSERT_JOB = """
INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at, deadline,
  owner, lease_until, reason)
VALUES (?, ?, 'pending', 0, ?, 0, ?, ?, NULL, NULL, NULL)"""

# The fence: a finish or extension lands only on the exact lease it names.
_FENCE = """id = :id AND status = 'leased' AND token = :token AND owner = :owner
  AND attempts = :attempt AND lease_until = :lease_until"""

# A finish (owner and lease cleared) or an extension (the same lease, a later end): one
# statement for both, so the finishes and extensions of a cycle are one ``executemany``.
SQL_SETTLE = f"""
UPDATE jobs SET status = :status, reason = :reason,
  available_at = coalesce(:available_at, available_at),
  owner = :new_owner, lease_until = :new_lease_until
WHERE {_FENCE}"""

SQL_AUDIT = "INSERT INTO redrives (id, token, at_ms, note) VALUES (?, ?, ?, ?)"

SQL_REDRIVE = """
UPDATE jobs SET status = 'pending', attempts = 0, available_at = :now, deadline = :deadline,
  owner = NULL, lease_until = NULL, reason = NULL
WHERE id = :id AND status = 'dead' AND token = :token"""

SQL_CHANGES = "SELECT changes()"

# A set of one key travels as the key itself: a statement on one row (a primary-key or
# unique-index lookup) costs less than reading a JSON array of one, and a claim or finish of
# one job is the contract's cycle.  The same statement otherwise, row for row.
SET_OF = "IN (SELECT value FROM json_each(?))"
ONE = {
    sql: sql.replace(SET_OF, "= ?")
    for sql in (SQL_LEASE, SQL_LEASE_RECLAIMING, SQL_POISON, SQL_JOBS)
}

# Read-only: how many jobs are still in flight (pending or leased).
SQL_ACTIVE = "SELECT count(*) FROM jobs WHERE status IN ('pending', 'leased')"


# --- plans: the state machine, free of I/O ----------------------------------------


class Sql(NamedTuple):
    """A statement for the driver to execute; the driver sends back all its rows."""

    sql: str
    params: tuple[Any, ...] | dict[str, Any] = ()


class Read(Sql):
    """A statement that only reads (a ``Sql`` otherwise): whatever failed before it, it
    changes nothing, so a driver may send it without waiting for the steps before it."""

    __slots__ = ()


class SqlMany(NamedTuple):
    """One statement over many parameter sets; the driver sends back ``[(rowcount,)]``."""

    sql: str
    params: list[Any]


class Batch(NamedTuple):
    """Statements a driver may send at once, in order.  A ``Read`` after the first may
    always go with it; a write only where one that follows a failure cannot land (a
    transaction that a failure aborts, or the driver's own on a connection that begins one
    before any write), else the driver sends the batch one by one.  The reply is the list of
    their replies (a driver sending them one by one sends back the same)."""

    steps: tuple[Sql | SqlMany, ...]


class Hook(NamedTuple):
    """A fault point inside the transaction; the driver calls ``fault(name)``."""

    name: str


Step = Sql | SqlMany | Batch | Hook
# A cycle's result: finish statuses, extended tickets (or False), claimed tickets, and the
# jobs its quarantine ended, by reason.
Cycle = tuple[list[str | bool], list[Ticket | bool], list[Ticket], dict[str, int]]
Reply = list[Any] | None  # a statement's rows, or a ``Batch``'s list of them
# A plan yields steps, receives their rows, and returns ``(result, changed)``.
Plan = Generator[Step, Reply, tuple[T, bool]]
Make = Callable[[], Plan[Any]]  # builds a plan (again, when a driver retries it)
AFTER_COMMIT = "after-commit"


PRAGMAS = ("PRAGMA journal_mode=DELETE", "PRAGMA synchronous=FULL")


def plan_schema(schema: Iterable[str]) -> Plan[None]:
    """Plan the creation of absent tables and indexes, in one transaction."""
    return _schema(tuple(schema))


def _schema(schema: tuple[str, ...]) -> Plan[None]:
    for statement in schema:
        yield Sql(statement)
    return None, False


def one_by_one(plan: Plan[T]) -> Generator[Sql | SqlMany | Hook, Reply, tuple[T, bool]]:
    """``plan``, each ``Batch`` yielded statement by statement (for a driver that sends one
    at a time): the plan receives the same replies."""
    reply: Reply = None
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if not isinstance(step, Batch):
            reply = yield step
            continue
        reply = []
        for one in step.steps:
            reply.append((yield one))


def write_one(sql: str, params: tuple[Any, ...] | dict[str, Any]) -> Generator[Step, Any, None]:
    """A plan step: execute a guarded write and insist that it changed exactly one row."""
    yield Sql(sql, params)
    rows = yield Sql(SQL_CHANGES)
    if rows != [(1,)]:  # the fence was checked under the same lock: this is a bug
        raise RuntimeError(f"guarded write changed {rows} rows, expected 1")


def _wrote(write: SqlMany, rows: Reply) -> None:
    """Insist that a guarded write per parameter set changed exactly one row each."""
    if rows != [(len(write.params),)]:
        raise RuntimeError(f"guarded writes changed {rows} rows, expected {len(write.params)}")


def _after(write: SqlMany | None, reads: list[Read]) -> Generator[Step, Any, list[Any]]:
    """Send ``reads`` in one batch, after ``write`` (checked by ``_wrote``) when given;
    returns the reads' replies."""
    if write is None:
        replies: list[Any] = yield Batch(tuple(reads))
        return replies
    wrote, *replies = yield Batch((write, *reads))
    _wrote(write, wrote)
    return replies


def json_set(keys: Iterable[Any]) -> str:
    """A set of ids or seqs (or of rows: flat arrays of them) as the one JSON array parameter
    a set statement reads."""
    return _COMPACT.encode(list(keys))


# (no check for cycles: a set holds ids, numbers and flat rows of them, never itself)
_COMPACT = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def _write_set(sql: str, head: tuple[Any, ...], keys: list[Any]) -> Generator[Step, Any, None]:
    """Execute a guarded write on the rows ``keys`` name, in one statement.

    ``sql`` takes the parameters ``head``, then the keys as one JSON array, and returns one
    row per row it changed: it must change exactly one row per key.
    """
    one = len(keys) == 1
    rows = yield Sql(ONE[sql], (*head, keys[0])) if one else Sql(sql, (*head, json_set(keys)))
    if len(rows) != len(keys):  # the plan read every row under the same lock: a bug
        raise RuntimeError(f"guarded writes changed {len(rows)} rows, expected {len(keys)}")


def _jobs(ids: Iterable[str]) -> Read:
    """The step reading the rows of the jobs ``ids`` (one statement, however many)."""
    unique = sorted(set(ids))
    return (
        Read(ONE[SQL_JOBS], (unique[0],))
        if len(unique) == 1
        else Read(SQL_JOBS, (json_set(unique),))
    )


def plan_enqueue(
    event: object,
    now_ms: object,
    ttl_ms: object,
    max_attempts: object = 3,
    *,
    limits: Limits = CONTRACT,
) -> Plan[bool]:
    """Validate an intake and return its plan (result: True inserted, False already there)."""
    return _enqueue(*check_enqueue(event, now_ms, ttl_ms, max_attempts, limits))


def _enqueue(job_id: str, qty: int, now_ms: int, ttl_ms: int, max_attempts: int) -> Plan[bool]:
    (result,) = yield from _intake([(job_id, qty, ttl_ms, max_attempts)], now_ms)
    if isinstance(result, Conflict):
        raise result
    return result, False


def _intake(
    items: list[tuple[str, int, int, int]], now_ms: int
) -> Generator[Step, Any, list[bool | Conflict]]:
    """Insert each new ``(id, qty, ttl_ms, max_attempts)``; True new, False already there.

    A known id with another qty is a ``Conflict`` (returned, not raised) and changes nothing.
    """
    rows = yield _jobs(item[0] for item in items)
    known: dict[str, int] = {row[-1]: row[0] for row in rows}
    results: list[bool | Conflict] = []
    inserts = []
    for job_id, qty, ttl_ms, max_attempts in items:
        if job_id not in known:
            known[job_id] = qty
            inserts.append((job_id, qty, max_attempts, now_ms, now_ms + ttl_ms))
            results.append(True)
        elif known[job_id] != qty:
            results.append(Conflict(f"job {job_id!r} exists with qty {known[job_id]}, not {qty}"))
        else:
            results.append(False)  # a duplicate intake keeps the whole row, budget included
    if inserts:
        rows = yield SqlMany(SQL_INSERT_JOB, inserts)
        if rows != [(len(inserts),)]:
            raise RuntimeError(f"inserts changed {rows} rows, expected {len(inserts)}")
    return results


def plan_enqueue_many(
    items: Iterable[tuple[object, object, object]], now_ms: object, *, limits: Limits = CONTRACT
) -> Plan[list[bool | Conflict]]:
    """Plan several intakes ``(event, ttl_ms, max_attempts)`` in one transaction.

    Each is judged exactly as a sequential ``enqueue`` would be; the result is the list of
    per-item results: True inserted, False already there, or a ``Conflict`` (nothing written
    for it).  Every item is validated before anything is planned.
    """
    checked = [
        check_enqueue(event, now_ms, ttl_ms, max_attempts, limits)
        for event, ttl_ms, max_attempts in items
    ]
    if not checked:
        raise ValueError("enqueue_many needs at least one event")
    return _enqueue_many([(i, qty, ttl, tries) for i, qty, _, ttl, tries in checked], checked[0][2])


def _enqueue_many(
    items: list[tuple[str, int, int, int]], now_ms: int
) -> Plan[list[bool | Conflict]]:
    results = yield from _intake(items, now_ms)
    return results, False


def plan_claim(
    owner: object, now_ms: object, lease_ms: object = 1000, *, limits: Limits = CONTRACT
) -> Plan[Ticket | None]:
    """Validate a claim and return its plan (result: a ticket dict, or None)."""
    return _claim(*check_claim(owner, now_ms, lease_ms, limits), limits.max_losses)


def _claim(
    owner: str, now_ms: int, lease_ms: int, losses: int | None = None
) -> Plan[Ticket | None]:
    tickets, _ = yield from _lease(Claim(owner, now_ms, lease_ms, 1, 0, losses))
    if not tickets:
        return None, False
    yield Hook("after-claim")
    return tickets[0], True


class Claiming(NamedTuple):
    """The statements of a claim: the contract's, or the product's (``Limits.max_losses``)."""

    due: str  # whether the quarantine has work
    quarantine: str
    next: str  # the lowest-seq claimable jobs
    fresh: str  # the lowest-seq jobs never attempted
    lease: str


CLAIMING = Claiming(
    SQL_QUARANTINE_DUE, SQL_QUARANTINE, SQL_NEXT_CLAIMABLE, SQL_NEXT_FRESH, SQL_LEASE
)
RECLAIMING = Claiming(
    SQL_QUARANTINE_DUE_RECLAIMING,
    SQL_QUARANTINE_RECLAIMING,
    SQL_NEXT_RECLAIMABLE,
    SQL_NEXT_FRESH_RECLAIMING,
    SQL_LEASE_RECLAIMING,
)


class Claim(NamedTuple):
    """A claim's arguments: ``many`` jobs (any), then ``fresh`` more never attempted."""

    owner: str
    now_ms: int
    lease_ms: int
    many: int
    fresh: int
    losses: int | None  # ``Limits.max_losses``: None for the contract's claims


def _lease(
    claim: Claim, before: SqlMany | None = None
) -> Generator[Step, Any, tuple[list[Ticket], dict[str, int]]]:
    """Quarantine spent jobs, then lease the ``many`` lowest-seq claimable jobs, then up to
    ``fresh`` more of the lowest-seq jobs never attempted (``SQL_NEXT_FRESH``).

    Exactly what those steps in turn do, in fewer statements: the reads go in one batch
    (after ``before``, a write of the plan's, when given): whether the quarantine has work
    (only then does it run, and the claims are read again after it), the claimable jobs,
    and ``many + fresh`` jobs never attempted, of which those the first read took are
    dropped (leased first, they would no longer be pending); then one lease for both.

    ``losses`` (``Limits.max_losses``): a reclaim of a lease that ended without a result
    spends no attempt, and a job whose leases ended so ``losses`` times is dead ('poison')
    instead of taken.  Returns the tickets and how many jobs ended, by reason.
    """
    owner, now_ms, lease_ms, count, fresh, losses = claim
    sql = CLAIMING if losses is None else RECLAIMING
    reads = [Read(sql.due, {"now": now_ms})]
    if count:
        params = {"now": now_ms, "n": count}
        reads.append(Read(sql.next, params if losses is None else {**params, "losses": losses}))
    if fresh:
        reads.append(Read(sql.fresh, {"now": now_ms, "n": count + fresh}))
    replies = yield from _after(before, reads)
    dead: list[Any] = []
    if replies[0] != [(0,)]:  # quarantine first: it commits even when nothing is claimable
        dead, *again = yield Batch((Sql(sql.quarantine, {"now": now_ms}), *reads[1:]))
        replies = [None, *again]
    ended = {reason: sum(1 for (why,) in dead if why == reason) for reason in QUARANTINE_REASONS}
    rows = replies[1] if count else []
    taken = {row[0] for row in rows}
    more = [row for row in replies[-1] if row[0] not in taken][:fresh] if fresh else []
    if losses is None:
        tickets = [_ticket(row, owner, now_ms + lease_ms, 1) for row in rows + more]
        if tickets:
            seqs = [row[0] for row in rows + more]
            yield from _write_set(sql.lease, (owner, now_ms + lease_ms), seqs)
        return tickets, ended
    tickets, ended["poison"] = yield from _retake(rows + more, owner, now_ms, lease_ms, losses)
    return tickets, ended


def _ticket(row: tuple[Any, ...], owner: str, lease_until: int, spent: int) -> Ticket:
    """The ticket of a claimed row ``(seq, id, qty, attempts, token, deadline, ...)``: the
    next token, the attempt ``spent`` (1) or not (0) by this claim, the lease within the
    deadline."""
    _, job_id, qty, attempts, token, deadline = row[:6]
    return {
        "id": job_id,
        "qty": qty,
        "owner": owner,
        "token": token + 1,
        "attempt": attempts + spent,
        "lease_until": deadline if deadline < lease_until else lease_until,  # (the min)
    }


def _retake(
    rows: list[tuple[Any, ...]], owner: str, now_ms: int, lease_ms: int, losses: int
) -> Generator[Step, Any, tuple[list[Ticket], int]]:
    """Lease the product's claimed ``rows`` (``Limits.max_losses``): a job whose lease ended
    without a result is leased again at the same attempt, unless this is its ``losses``-th
    such end: then it is dead ('poison').  Returns the tickets and the number poisoned."""
    poisoned: list[tuple[Any, ...]] = []
    taken: list[tuple[Any, ...]] = []
    for row in rows:  # (..., reclaim, its earlier lost leases where they could reach the bound)
        (poisoned if row[6] and row[7] + 1 >= losses else taken).append(row)
    tickets = [_ticket(row, owner, now_ms + lease_ms, 0 if row[6] else 1) for row in taken]
    if poisoned:
        yield from _write_set(SQL_POISON, (), [row[0] for row in poisoned])
    if tickets:
        lease = (owner, now_ms + lease_ms)
        yield from _write_set(SQL_LEASE_RECLAIMING, lease, [row[0] for row in taken])
    return tickets, len(poisoned)


def plan_claim_many(
    owner: object, now_ms: object, lease_ms: object, count: object, *, limits: Limits = CONTRACT
) -> Plan[list[Ticket]]:
    """Plan up to ``count`` claims at one instant in one transaction (result: list of tickets).

    Identical to ``count`` sequential claims at ``now_ms``: each job gets its own token.
    """
    many = check_int(count, "count", 1, 1024)
    return _claim_many(*check_claim(owner, now_ms, lease_ms, limits), many, limits.max_losses)


def _claim_many(
    owner: str, now_ms: int, lease_ms: int, count: int, losses: int | None = None
) -> Plan[list[Ticket]]:
    tickets, _ = yield from _lease(Claim(owner, now_ms, lease_ms, count, 0, losses))
    return tickets, bool(tickets)


def _matches(row: tuple[Any, ...], ticket: Ticket, now_ms: int) -> bool:
    """Whether a job row is still exactly the lease the ticket names, at ``now_ms``."""
    qty, status, attempts, _, token, deadline, owner, lease_until = row
    return bool(
        status == "leased"
        and qty == ticket["qty"]
        and owner == ticket["owner"]
        and token == ticket["token"]
        and attempts == ticket["attempt"]
        and lease_until == ticket["lease_until"]
        and now_ms < lease_until
        and now_ms < deadline
    )


_DONE: tuple[str, Any] = ("done", None)  # (``_decide``'s answer to "ok", taken without a call)


def _decide(row: tuple[Any, ...], outcome: str, now_ms: int, delay_ms: int) -> tuple[str, Any]:
    """The new (status, reason) of a fenced job after ``outcome``."""
    attempts, max_attempts, deadline = row[2], row[3], row[5]
    if outcome == "ok":
        return "done", None
    if outcome == "permanent":
        return "dead", "permanent"
    if attempts >= max_attempts:
        return "dead", "exhausted"
    if now_ms + delay_ms >= deadline:
        return "dead", "deadline"
    return "pending", "retry"


def plan_finish(
    ticket: object,
    outcome: object,
    now_ms: object,
    delay_ms: object = 0,
    *,
    limits: Limits = CONTRACT,
) -> Plan[str | bool]:
    """Validate a completion and return its plan (result: the new status, or False if stale)."""
    return _finish(*check_finish(ticket, outcome, now_ms, delay_ms, limits))


def _finish(ticket: Ticket, outcome: str, now_ms: int, delay_ms: int) -> Plan[str | bool]:
    (status,), _, write = yield from _settling([(ticket, outcome, now_ms, delay_ms)], [], now_ms, 0)
    yield from _landed(write)
    if status is False:
        return False, False  # a stale or late result never touches the current job
    yield Hook("after-finish")
    return status, True


def _landed(write: SqlMany | None) -> Generator[Step, Any, None]:
    """Send ``_settling``'s write, if any (alone), and insist on its rows."""
    if write is not None:
        _wrote(write, (yield write))


def _settling(
    results: list[tuple[Ticket, str, int, int]],
    held: list[Ticket],
    now_ms: int,
    lease_ms: int,
    ended: dict[str, int] | None = None,
) -> Generator[Step, Any, tuple[list[Any], list[Ticket | bool], SqlMany | None]]:
    """Finish each ``(ticket, outcome, now_ms, delay_ms)``, then extend each lease ``held``
    at ``now_ms``: each fenced on its own, as sequential calls would be; one read, one write.

    Returns the statuses, the extended tickets (or False) and the write that lands them
    (None: nothing lands), for the caller to send; the jobs that end dead are counted by
    reason into ``ended``, when given.
    """
    rows = yield _jobs([ticket["id"] for ticket, *_ in results] + [t["id"] for t in held])
    current = {row[-1]: row[:-1] for row in rows}
    statuses, finishes = _finishes(results, current, ended)
    extended, extensions = _extensions(held, current, now_ms, lease_ms)
    writes = finishes + extensions
    return statuses, extended, SqlMany(SQL_SETTLE, writes) if writes else None


def _finishes(
    results: list[tuple[Ticket, str, int, int]],
    current: dict[str, tuple[Any, ...]],
    ended: dict[str, int] | None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The status of each result (False if stale) and the writes of those that land.

    A finished job leaves ``current``: no longer leased, a second ticket for it is stale.
    """
    statuses: list[Any] = []
    updates = []
    for ticket, outcome, now_ms, delay_ms in results:
        row = current.get(ticket["id"])
        if row is None or not _matches(row, ticket, now_ms):
            statuses.append(False)
            continue
        del current[ticket["id"]]
        status, reason = _DONE if outcome == "ok" else _decide(row, outcome, now_ms, delay_ms)
        available_at = now_ms + delay_ms if status == "pending" else now_ms
        updates.append(
            dict(
                ticket,
                status=status,
                reason=reason,
                available_at=available_at,
                new_owner=None,
                new_lease_until=None,
            )
        )
        statuses.append(status)
        if status == "dead" and ended is not None:
            ended[reason] = ended.get(reason, 0) + 1
    return statuses, updates


def plan_finish_many(
    results: Iterable[tuple[Ticket, str, int, int]], *, limits: Limits = CONTRACT
) -> Plan[list[str | bool]]:
    """Plan several finishes ``(ticket, outcome, now_ms, delay_ms)`` in one transaction.

    Each ticket is fenced on its own, exactly as sequential finishes would be; the
    result is the list of per-ticket results.
    """
    checked = _checked_results(results, limits)
    if not checked:
        raise ValueError("finish_many needs at least one result")
    return _finish_many(checked)


def _checked_results(
    results: Iterable[tuple[Ticket, str, int, int]], limits: Limits, own: bool = False
) -> list[tuple[Ticket, str, int, int]]:
    """Validate each result as ``plan_finish`` does; return them with copied tickets
    (``own``: a run's own tickets, see ``plan_cycle``: neither checked nor copied)."""
    checked = []
    top = most = -1  # the limits' bounds: read once, where ``check_finish`` reads them
    for ticket, outcome, now_ms, delay_ms in results:
        # (the ticket first, as in ``check_finish``: before the limits are read)
        copy = ticket if own else check_ticket(ticket)
        if (  # (``check_finish``'s checks after the ticket's)
            type(now_ms) is int
            and type(delay_ms) is int
            and type(outcome) is str
            and outcome in OUTCOMES
        ):
            if top < 0:
                top, most = limits.max_now, limits.delay_ms
            if 0 <= now_ms <= top and 0 <= delay_ms <= most:
                checked.append((copy, outcome, now_ms, delay_ms))
                continue
        # (the first failing check says why, in check_finish's order)
        checked.append((copy, *_checked_outcome(outcome, now_ms, delay_ms, limits)))
    return checked


def _finish_many(results: list[tuple[Ticket, str, int, int]]) -> Plan[list[str | bool]]:
    statuses, _, write = yield from _settling(results, [], 0, 0)
    yield from _landed(write)
    return statuses, any(status is not False for status in statuses)


def plan_cycle(
    results: Iterable[tuple[Ticket, str, int, int]],
    held: Iterable[Ticket],
    owner: object,
    now_ms: object,
    lease_ms: object,
    count: object,
    fresh: object = 0,
    *,
    limits: Limits = CONTRACT,
    own: bool = False,
) -> Plan[Cycle]:
    """Plan a dispatcher's cycle: finishes, then extensions, then claims, in one transaction.

    Identical to ``finish_many(results)``, then ``extend_many(held, now_ms, lease_ms)``, then
    ``claim_many(owner, now_ms, lease_ms, count)``; each part may be empty (``count`` 0).
    Then up to ``fresh`` more claims, of jobs never attempted (``SQL_NEXT_FRESH``): the
    tickets a dispatcher keeps ahead of demand.  The result is ``(statuses, extended,
    tickets, ended)``: ``ended`` counts the jobs that ended dead in it (finished dead, or by
    the claim's quarantine), by reason.

    ``own``: the tickets are a run's own, each as a claim or extension of this module issued
    it and handed to no code outside the run since (a Dispatcher's, held by its ledger).
    They are neither checked again nor copied, and are not to change until the plan has
    run; every other input is checked as without ``own``, and each finish and extension is
    fenced by its job's row all the same.
    """
    if type(own) is not bool:
        raise ValueError(f"own must be a bool: {own!r}")
    checked = _checked_results(results, limits, own)
    if own:
        tickets = list(held)
        check_now(now_ms, limits=limits)  # (``check_extend``'s checks after the tickets')
        check_int(lease_ms, "lease_ms", 1, limits.lease_ms)
    else:
        tickets, _, _ = check_extend(held, now_ms, lease_ms, limits)
    many = check_int(count, "count", 0, 1024)
    ahead = check_int(fresh, "fresh", 0, 1024)
    claim = check_claim(owner, now_ms, lease_ms, limits)
    return _cycle(checked, tickets, *claim, many, ahead, limits.max_losses)


def _cycle(
    results: list[tuple[Ticket, str, int, int]],
    held: list[Ticket],
    owner: str,
    now_ms: int,
    lease_ms: int,
    count: int,
    fresh: int = 0,
    losses: int | None = None,
) -> Plan[Cycle]:
    ended: dict[str, int] = {}
    statuses: list[Any] = []
    extended: list[Ticket | bool] = []
    write = None  # the settle's, sent with the claims' reads
    if results or held:
        statuses, extended, write = yield from _settling(results, held, now_ms, lease_ms, ended)
    tickets: list[Ticket] = []
    quarantined: dict[str, int] = {}
    if count or fresh:
        claim = Claim(owner, now_ms, lease_ms, count, fresh, losses)
        tickets, quarantined = yield from _lease(claim, write)
    else:
        yield from _landed(write)
    for reason, n in quarantined.items():
        if n:
            ended[reason] = ended.get(reason, 0) + n
    changed = bool(tickets) or any(x is not False for x in (*statuses, *extended))
    return (statuses, extended, tickets, ended), changed


def plan_extend(
    ticket: object, now_ms: object, lease_ms: object, *, limits: Limits = CONTRACT
) -> Plan[Ticket | bool]:
    """Validate a lease extension and return its plan (result: the new ticket, or False)."""
    (mine,), now, lease = check_extend([ticket], now_ms, lease_ms, limits)
    return _extend(mine, now, lease)


def _extend(ticket: Ticket, now_ms: int, lease_ms: int) -> Plan[Ticket | bool]:
    _, (longer,), write = yield from _settling([], [ticket], now_ms, lease_ms)
    yield from _landed(write)
    if longer is False:
        return False, False
    yield Hook("after-extend")
    return longer, True


def plan_extend_many(
    tickets: Iterable[Ticket], now_ms: object, lease_ms: object, *, limits: Limits = CONTRACT
) -> Plan[list[Ticket | bool]]:
    """Plan several extensions at ``now_ms`` in one transaction (result: per-ticket results).

    Each ticket is fenced on its own, exactly as sequential ``extend`` calls would be.
    """
    checked, now, lease = check_extend(tickets, now_ms, lease_ms, limits)
    if not checked:
        raise ValueError("extend_many needs at least one ticket")
    return _extend_many(checked, now, lease)


def _extend_many(tickets: list[Ticket], now_ms: int, lease_ms: int) -> Plan[list[Ticket | bool]]:
    _, extended, write = yield from _settling([], tickets, now_ms, lease_ms)
    yield from _landed(write)
    return extended, any(longer is not False for longer in extended)


def _extensions(
    tickets: list[Ticket], current: dict[str, tuple[Any, ...]], now_ms: int, lease_ms: int
) -> tuple[list[Ticket | bool], list[dict[str, Any]]]:
    """Extend each lease still held, capped at the deadline and never shortened."""
    extended: list[Ticket | bool] = []
    updates = []
    for ticket in tickets:
        row = current.get(ticket["id"])
        if row is None or not _matches(row, ticket, now_ms):
            extended.append(False)
            continue
        new_until = max(ticket["lease_until"], min(now_ms + lease_ms, row[5]))
        current[ticket["id"]] = (*row[:7], new_until)  # what a sequential extend would see
        updates.append(
            {**ticket, "status": "leased", "reason": None, "available_at": None}
            | {"new_owner": ticket["owner"], "new_lease_until": new_until}
        )
        extended.append({**ticket, "lease_until": new_until})
    return extended, updates


def plan_redrive(
    job_id: object, now_ms: object, ttl_ms: object, note: object, *, limits: Limits = CONTRACT
) -> Plan[bool]:
    """Validate a redrive and return its plan (result: True; ValueError if the job is not dead)."""
    return _redrive(*check_redrive(job_id, now_ms, ttl_ms, note, limits))


def _redrive(job_id: str, now_ms: int, ttl_ms: int, note: str) -> Plan[bool]:
    rows = yield Sql(SQL_JOB, (job_id,))
    if not rows:
        raise ValueError(f"no job {job_id!r} to redrive")
    if rows[0][1] != "dead":
        raise ValueError(f"job {job_id!r} is {rows[0][1]}, not dead: only dead jobs are redriven")
    token = rows[0][4]  # kept: a lease generation is never reused
    yield from write_one(SQL_AUDIT, (job_id, token, now_ms, note))
    yield Hook("after-audit")
    yield from write_one(
        SQL_REDRIVE, {"id": job_id, "token": token, "now": now_ms, "deadline": now_ms + ttl_ms}
    )
    yield Hook("after-redrive")
    return True, True


# --- the sqlite3 driver -------------------------------------------------------------


def _rollback(con: sqlite3.Connection) -> None:
    """Roll back if a transaction is open; a failing rollback never hides the original error."""
    if con.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            con.execute("ROLLBACK")


def _execute(con: sqlite3.Connection, step: Sql | SqlMany) -> list[Any]:
    """One statement: its rows, or (``SqlMany``) ``[(rowcount,)]``."""
    if isinstance(step, SqlMany):
        return [(con.executemany(step.sql, step.params).rowcount,)]
    return con.execute(step.sql, step.params).fetchall()


def drive(con: sqlite3.Connection, plan: Plan[T], fault: Fault = None) -> T:
    """Run ``plan`` in one BEGIN IMMEDIATE transaction on ``con``: COMMIT and return its
    result, or ROLLBACK and re-raise.

    The sqlite3 driver of every plan; the package's own surfaces use it to run plans built
    with ``limits=PRODUCT``.
    """
    # outside the try: a failed BEGIN owns no transaction
    check_con(con).execute("BEGIN IMMEDIATE")
    result: T
    try:
        reply: Reply = None
        while True:
            try:
                step = plan.send(reply)
            except StopIteration as stop:
                result, changed = stop.value
                break
            if isinstance(step, Batch):
                reply = [_execute(con, one) for one in step.steps]
            elif isinstance(step, Hook):
                reply = None
                if fault is not None:
                    fault(step.name)
            else:
                reply = _execute(con, step)
        con.execute("COMMIT")
    except BaseException:
        _rollback(con)
        raise
    if changed and fault is not None:
        fault(AFTER_COMMIT)
    return result


def check_con(con: object) -> sqlite3.Connection:
    """Return ``con`` if it is a ``sqlite3.Connection``."""
    if not isinstance(con, sqlite3.Connection):
        raise ValueError(f"con must be a sqlite3.Connection: {con!r}")
    return con


# --- steps 2-6: the public sync API -------------------------------------------------


def open_queue(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open (creating tables only when absent) a queue file; the caller owns the connection."""
    return open_db(path, SCHEMA)


def open_db(path: str | os.PathLike[str], schema: Iterable[str]) -> sqlite3.Connection:
    """Open a DB file with the core's settings, running ``schema`` in one transaction."""
    filename = check_queue_path(path)
    con = sqlite3.connect(filename, timeout=1, isolation_level=None)
    try:
        for pragma in PRAGMAS:
            con.execute(pragma).fetchall()
        if not _present(con, schema):  # (present: no write lock taken, none waited for)
            drive(con, plan_schema(schema))
    except BaseException:
        con.close()
        raise
    return con


_CREATES = re.compile(r"\s*CREATE (?:TABLE|(?:UNIQUE )?INDEX) IF NOT EXISTS (\w+)\b")


def _present(con: sqlite3.Connection, schema: Iterable[str]) -> bool:
    """Whether every table and index of ``schema`` exists already (a read: a file another
    process writes without pause is not waited on for a write lock it does not need)."""
    names = set()
    for statement in schema:
        found = _CREATES.match(statement)
        if found is None:
            return False
        names.add(found[1])
    rows = con.execute("SELECT name FROM sqlite_master").fetchall()
    return names <= {name for (name,) in rows}


def enqueue(
    con: sqlite3.Connection, event: dict[str, Any], now_ms: int, ttl_ms: int, max_attempts: int = 3
) -> bool:
    """Insert a new pending job (True); the same id and qty again keeps the row (False)."""
    plan = plan_enqueue(event, now_ms, ttl_ms, max_attempts)
    return bool(drive(con, plan))


def enqueue_many(
    con: sqlite3.Connection,
    items: Iterable[tuple[dict[str, Any], int, int]],
    now_ms: int,
    *,
    limits: Limits = CONTRACT,
) -> list[bool | Conflict]:
    """Several ``(event, ttl_ms, max_attempts)`` intakes in one transaction (see the plan)."""
    plan = plan_enqueue_many(items, now_ms, limits=limits)
    return drive(con, plan)


def claim(
    con: sqlite3.Connection, owner: str, now_ms: int, lease_ms: int = 1000, fault: Fault = None
) -> Ticket | None:
    """Quarantine spent jobs, then lease the lowest-seq claimable job to ``owner``."""
    plan = plan_claim(owner, now_ms, lease_ms)
    return drive(con, plan, check_fault(fault))


def claim_many(
    con: sqlite3.Connection, owner: str, now_ms: int, lease_ms: int, count: int
) -> list[Ticket]:
    """Up to ``count`` claims at one instant in one transaction (an addition to the contract)."""
    plan = plan_claim_many(owner, now_ms, lease_ms, count)
    return drive(con, plan)


def finish(
    con: sqlite3.Connection,
    ticket: Ticket,
    outcome: str,
    now_ms: int,
    delay_ms: int = 0,
    fault: Fault = None,
) -> str | bool:
    """Record the outcome of the lease ``ticket`` names; False when that lease is stale."""
    plan = plan_finish(ticket, outcome, now_ms, delay_ms)
    return drive(con, plan, check_fault(fault))


def finish_many(
    con: sqlite3.Connection, results: Iterable[tuple[Ticket, str, int, int]]
) -> list[str | bool]:
    """Several finishes in one transaction, each fenced on its own (an addition)."""
    plan = plan_finish_many(results)
    return drive(con, plan)


def extend(
    con: sqlite3.Connection, ticket: Ticket, now_ms: int, lease_ms: int, fault: Fault = None
) -> Ticket | bool:
    """Extend a live lease, capped at the deadline: the new ticket, or False (an addition)."""
    plan = plan_extend(ticket, now_ms, lease_ms)
    return drive(con, plan, check_fault(fault))


def extend_many(
    con: sqlite3.Connection, tickets: Iterable[Ticket], now_ms: int, lease_ms: int
) -> list[Ticket | bool]:
    """Several extensions in one transaction, each fenced on its own (an addition)."""
    return drive(con, plan_extend_many(tickets, now_ms, lease_ms))


def cycle(
    con: sqlite3.Connection,
    results: Iterable[tuple[Ticket, str, int, int]],
    held: Iterable[Ticket],
    owner: str,
    now_ms: int,
    lease_ms: int,
    count: int,
    fresh: int = 0,
) -> Cycle:
    """Finishes, extensions, then claims, in one transaction (see ``plan_cycle``)."""
    return drive(con, plan_cycle(results, held, owner, now_ms, lease_ms, count, fresh))


def redrive(
    con: sqlite3.Connection, job_id: str, now_ms: int, ttl_ms: int, note: str, fault: Fault = None
) -> bool:
    """Re-queue a dead job with a fresh budget, recording an audit row in the same transaction."""
    plan = plan_redrive(job_id, now_ms, ttl_ms, note)
    return bool(drive(con, plan, check_fault(fault)))


# --- steps 7-8: one delivery -----------------------------------------------------------


def check_run_args(
    owner: object,
    clock: object,
    send: object,
    jitter: object,
    lease_ms: object,
    limits: Limits = CONTRACT,
) -> None:
    """Validate ``run_once``'s arguments, jitter first, before any clock reading."""
    check_jitter(jitter)
    check_identifier(owner, "owner")
    check_callable(clock, "clock")
    check_callable(send, "send")
    check_int(lease_ms, "lease_ms", 1, limits.lease_ms)


def fresh_event(ticket: Ticket) -> dict[str, Any]:
    """A new ``{id, qty}`` dict for one send: the sender may mutate it, never our ticket."""
    return {"id": ticket["id"], "qty": ticket["qty"]}


def judge_send(
    ticket: Ticket,
    jitter: float,
    ack: object = None,
    error: Retryable | Permanent | None = None,
    retry: Retry = RUN_ONCE_RETRY,
    limits: Limits = CONTRACT,
) -> tuple[str, int]:
    """Map a send's answer to ``(outcome, delay_ms)``: only the exact ``True`` is ok."""
    if isinstance(error, Retryable):
        return "retry", retry.delay(ticket["attempt"], jitter, limits)
    if isinstance(error, Permanent):
        return "permanent", 0
    if ack is not True:
        raise BadAck(f"send returned {ack!r} for {ticket['id']!r}; only True is an ACK")
    return "ok", 0


def classify(
    send: Callable[[dict[str, Any]], object], ticket: Ticket, jitter: float
) -> tuple[str, int]:
    """Send once and classify; exceptions other than Retryable/Permanent propagate unchanged."""
    try:
        ack = send(fresh_event(ticket))
    except (Retryable, Permanent) as error:
        return judge_send(ticket, jitter, error=error)
    return judge_send(ticket, jitter, ack)


def second_reading(clock: Callable[[], object], first: int, limits: Limits = CONTRACT) -> int:
    """Read the clock again; it must be valid and not earlier than ``first``."""
    now = check_now(clock(), "second clock reading", limits)
    if now < first:
        raise ValueError(f"clock went backwards: {now} < {first}")
    return now


def delivery_result(ticket: Ticket, status: str | bool) -> dict[str, Any]:
    """The result of one delivery: ``{'id', 'token', 'status'}``, ``stale`` if refused."""
    return {
        "id": ticket["id"],
        "token": ticket["token"],
        "status": "stale" if status is False else status,
    }


def run_once(
    con: sqlite3.Connection,
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict[str, Any]], object],
    jitter: float,
    lease_ms: int = 1000,
) -> dict[str, Any] | None:
    """Claim one job, send it outside any transaction, and finish it with a second reading."""
    check_run_args(owner, clock, send, jitter, lease_ms)
    check_con(con)
    first = check_now(clock(), "first clock reading")
    ticket = claim(con, owner, first, lease_ms)
    if ticket is None:
        return None
    mine = ticket.copy()  # our own copy: send may mutate what it gets or enqueue elsewhere
    outcome, delay = classify(send, mine, jitter)
    now = second_reading(clock, first)
    return delivery_result(mine, finish(con, mine.copy(), outcome, now, delay))


def run_file(
    path: str | os.PathLike[str],
    owner: str,
    clock: Callable[[], int],
    send: Callable[[dict[str, Any]], object],
    jitter: float,
    lease_ms: int = 1000,
) -> dict[str, Any] | None:
    """``run_once`` on an existing queue file, owning (and always closing) the connection."""
    check_run_args(owner, clock, send, jitter, lease_ms)
    filename = check_queue_path(path)
    try:
        regular = stat.S_ISREG(os.stat(filename).st_mode)
    except OSError:
        regular = False
    if not regular:
        raise FileNotFoundError(f"no queue file at {filename!r}")
    con = open_queue(filename)
    try:
        return run_once(con, owner, clock, send, jitter, lease_ms)
    finally:
        con.close()

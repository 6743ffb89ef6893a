"""PostgreSQL texts of the core's statements (the queue's, the inboxes', the endpoints'), and
the schemas.

Rules of this module:

* Each PostgreSQL text is keyed to the core's own statement text (``STATEMENTS``), so a
  plan runs unchanged and no rule exists twice; a set of jobs is one JSON array parameter
  in both dialects.  A statement without a text is a bug (``KeyError``), never a guess.
* The texts differ from SQLite's only where concurrent transactions demand it (SQLite
  serialises writers; here many claimers run at once, READ COMMITTED), or where the
  planner needs a shape whose plan does not depend on the table's statistics (the claims,
  the quarantine, the settle and the purge: the same rows, found through one index):
  - claims and the quarantine lock their rows ``FOR UPDATE SKIP LOCKED``: claimers never
    wait for each other, and a claim re-checks, on the row it locked, that the job is not
    spent (a job another transaction released a moment ago is never leased past its budget);
  - reading jobs by id (finish, extend, intake, redrive) locks them ``FOR UPDATE`` in id
    order: a plan decides on rows nobody else can change before its COMMIT, so every
    guarded write still changes exactly the rows the plan expects.
* Schemas are created idempotently under an advisory lock, with their version recorded
  in ``asnackq_schema``; a newer version than this code knows is refused.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from operator import itemgetter
from typing import Any, NamedTuple

from asnackq.core import endpoint_workers, endpoints, events, inbox, lanes, rate
from asnackq.core import worker as w
from asnackq.store import attempts, job_traces, reads, retention
from asnackq.store.sets import SetText, as_set, settle_set

__all__ = [
    "LAPSED",
    "QUEUE",
    "SCHEMAS",
    "SINK",
    "SQL_EARLIER_SINK",
    "STATEMENTS",
    "WEBHOOK",
    "Missing",
    "Params",
    "Schema",
    "placeholders",
    "plan_open",
    "text",
    "translate",
]

Params = tuple[Any, ...] | dict[str, Any]


def placeholders(sql: str) -> str:
    """SQLite's ``?`` and ``:name`` placeholders as psycopg's ``%s`` and ``%(name)s``."""
    return re.sub(r"(?<!:):([A-Za-z_]\w*)", r"%(\1)s", sql.replace("?", "%s"))


# Every claim's read is shaped so that one plan serves it whatever the table's statistics
# (none yet, taken on a full queue, or on one mostly done): a plan chosen from statistics
# that no longer describe the table read every pending row per claim (a bitmap scan and a
# sort, 5-20 ms at 20,000 pending) or walked the primary key past every done row.
#  - The quarantine's set is a union of parts, each one index's condition: pending
#    deadlines and leased ones (``jobs_by_deadline``, ``jobs_by_lease``), spent budgets
#    (``jobs_spent``).  Whether budgets are spent is a count of ``jobs_spent``'s rows: an
#    EXISTS was planned as a sequential scan that expects a match every third row.
#  - A claim walks ``jobs_by_status`` (``_walking``): it names pending jobs as
#    ``status = ANY(ARRAY['pending'])`` and orders them by ``status, seq``, an order only
#    that index gives (``status = 'pending'`` would let the primary key give ``seq`` order
#    too, and a planner whose statistics say every row is pending walks it past every done
#    row); its deadline is a filter (``deadline + 0``), never an index condition, so no plan
#    reads every pending job by deadline and sorts them.  A lane's claims walk their own
#    index and keep the plain texts (``_PLAIN``).
#  - The queue's sessions plan without bitmap scans (``pg.SQL_CLAIMING``): with no
#    statistics, a bitmap of every pending row and a sort look cheaper than the walk.  Nor
#    sorts (incremental ones either) where an index gives the order: with statistics taken
#    over done jobs, a claim's filters count almost no row, and a read of
#    ``jobs_by_deadline`` (the smaller index) and a sort of the one row expected looked
#    cheaper than the walk, the floor a filter.
#  - The check reads the deadline parts as the first passed deadline in ``jobs_by_deadline``'s
#    order (an EXISTS drops its ORDER BY): with statistics that count almost no pending or
#    leased job (taken over done jobs), an EXISTS was planned as a walk of every pending or
#    leased entry of ``jobs_by_status`` or ``jobs_by_lease``, each needing a sort here.
#    Their status is a value read when the plan runs (``_status_at_run``), so no partial
#    index on it (``jobs_by_lease``) is a way to the rows.
_SPENT_PARTS = {  # (condition, whether a part is read as its first deadline)
    "deadline": ("status = 'pending' AND deadline <= %(now)s", True),
    "lease and deadline": (
        "status = 'leased' AND lease_until <= %(now)s AND deadline <= %(now)s",
        True,
    ),
    "budget": ("status = 'pending' AND attempts >= max_attempts", False),
    "lease and budget": (
        "status = 'leased' AND lease_until <= %(now)s AND attempts >= max_attempts",
        False,
    ),
}
_CONTRACT_SPENT = ("deadline", "lease and deadline", "budget", "lease and budget")
_RECLAIMING_SPENT = ("deadline", "lease and deadline", "budget")


def _pg_due(parts: tuple[str, ...]) -> str:
    """Whether the quarantine has work: some row in one of ``parts``, locked by others or not."""
    tests = []
    for part in parts:
        condition, exists = _SPENT_PARTS[part]
        tests.append(
            f"(SELECT deadline FROM jobs WHERE {_status_at_run(condition)} ORDER BY deadline"
            " LIMIT 1) IS NOT NULL"
            if exists
            else f"(SELECT count(*) FROM jobs WHERE {condition}) > 0"
        )
    return "SELECT " + "\n  OR ".join(tests)


def _status_at_run(condition: str) -> str:
    """``condition`` with its status as a value the plan reads when it runs (an InitPlan):
    no partial index on that status (``jobs_by_lease``) can serve the read then, and
    ``jobs_by_deadline`` gives it in deadline order.  With statistics taken while no job
    was leased, a plan of the leased part read ``jobs_by_lease`` whole and sorted it (its
    estimate: one entry; under a held snapshot, every lease taken since: 40-60 ms a check,
    half a minute of the session's time in a minute of sustained load)."""
    found = re.fullmatch(r"status = '(\w+)'( AND .*)", condition, re.DOTALL)
    if found is None:
        raise AssertionError(f"no leading status in {condition!r}")
    return f"status = (SELECT '{found[1]}'::text){found[2]}"


def _pg_quarantine(parts: tuple[str, ...]) -> str:
    """The quarantine: lock the spent jobs nobody else holds, then end them (one reason
    each).  A job in two parts is locked twice by this transaction, and ended once; the
    jobs are then looked up by their keys (an ``IN`` was joined by a sequential scan)."""
    ctes = ",\n".join(
        f"p{n} AS (SELECT seq FROM jobs WHERE {_SPENT_PARTS[part][0]} FOR UPDATE SKIP LOCKED)"
        for n, part in enumerate(parts)
    )
    spent = " UNION ".join(f"SELECT seq FROM p{n}" for n in range(len(parts)))
    return f"""
WITH {ctes}
UPDATE jobs SET status = 'dead',
  reason = CASE WHEN deadline <= %(now)s THEN 'deadline' ELSE 'exhausted' END,
  owner = NULL, lease_until = NULL
WHERE seq = ANY(ARRAY({spent}))
RETURNING reason"""


PG_QUARANTINE = _pg_quarantine(_CONTRACT_SPENT)
PG_QUARANTINE_DUE = _pg_due(_CONTRACT_SPENT)

# The :n lowest-seq claimable jobs nobody else is claiming, locked until COMMIT.  The
# lock re-reads each row: the values returned are the row's latest, and a job that is
# spent by now (released by another transaction since the quarantine) is not claimable.
_CLAIMABLE = """
  SELECT seq, id, qty, attempts, token, deadline FROM jobs
  WHERE status = '{status}' AND {ready} <= %(now)s
    AND deadline > %(now)s AND attempts < max_attempts{also}
  ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED"""
# A claim's read of lapsed leases names them by seq too: the seqs of the leases ended by now,
# read from ``jobs_by_lease`` (its status test second, so no lane's condition goes into it),
# then those jobs in seq order through the primary key (the core's claims and the plain
# lane's; an endpoint's lane reads its own index in id order).  Its cost follows the lapsed
# leases: after a crash, 17-27 ms a claim at 100,000 of them, against 0.2-0.3 before, while
# each reclaim shortens the array (a drain of 30,000 took 1.3 s of claims against 2.2).
# The queue's sessions plan no sort (``pg.SQL_CLAIMING``): without the array the read walked
# ``jobs_by_status``'s entries of every lease in flight for the lapsed ones (6.8 ms a claim
# at 50,000 leases in flight, 0.2 so).  The same rows: a job the array names is leased and
# lapsed, the other tests as before.
LAPSED = """
    AND seq = ANY(ARRAY(SELECT seq FROM jobs
      WHERE lease_until <= %(now)s AND status = 'leased'))"""
PG_NEXT_CLAIMABLE = f"""
WITH pending AS ({_CLAIMABLE.format(status="pending", ready="available_at", also="")}),
expired AS ({_CLAIMABLE.format(status="leased", ready="lease_until", also=LAPSED)})
SELECT * FROM pending UNION ALL SELECT * FROM expired ORDER BY seq LIMIT %(n)s"""
PG_NEXT_FRESH = """
SELECT seq, id, qty, attempts, token, deadline FROM jobs
WHERE status = 'pending' AND available_at <= %(now)s AND attempts = 0
  AND deadline > %(now)s AND attempts < max_attempts
ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED"""

# The product's claims (``worker.Limits.max_losses``): a lease that ended without a result is
# taken again without spending an attempt, so only a pending job is spent by its budget.
PG_QUARANTINE_RECLAIMING = _pg_quarantine(_RECLAIMING_SPENT)
PG_QUARANTINE_DUE_RECLAIMING = _pg_due(_RECLAIMING_SPENT)
PG_NEXT_RECLAIMABLE = (
    """
WITH pending AS (
  SELECT seq, id, qty, attempts, token, deadline FROM jobs
  WHERE status = 'pending' AND available_at <= %(now)s
    AND deadline > %(now)s AND attempts < max_attempts
  ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED),
expired AS (
  SELECT seq, id, qty, attempts, token, deadline FROM jobs
  WHERE status = 'leased' AND lease_until <= %(now)s AND deadline > %(now)s"""
    + LAPSED
    + """
  ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED)
SELECT *, false, 0::bigint FROM pending
UNION ALL
SELECT *, true, CASE WHEN token - attempts + 1 >= %(losses)s THEN token - attempts
  - coalesce((SELECT max(r.token) FROM redrives AS r WHERE r.id = expired.id), 0) ELSE 0 END
FROM expired
ORDER BY seq LIMIT %(n)s"""
)
PG_NEXT_FRESH_RECLAIMING = """
SELECT seq, id, qty, attempts, token, deadline, false, 0::bigint FROM jobs
WHERE status = 'pending' AND available_at <= %(now)s AND attempts = 0
  AND deadline > %(now)s AND attempts < max_attempts
ORDER BY seq LIMIT %(n)s FOR UPDATE SKIP LOCKED"""
# A lease (and a poisoning) finds its jobs by seq alone: the status test (``IS TRUE``: the
# same test on a column that is never NULL) is no index condition.  With statistics that
# count almost no pending or leased job, a plan read every pending or leased entry of
# ``jobs_by_deadline`` and filtered them by seq (110-155 ms a lease of 300 under a held
# snapshot, 0.6-1.2 ms by seq).
PG_LEASE_RECLAIMING = """
UPDATE jobs SET status = 'leased',
  attempts = attempts + CASE WHEN status = 'pending' THEN 1 ELSE 0 END,
  token = token + 1, owner = %s, lease_until = least(%s, deadline), reason = NULL
WHERE seq = ANY(ARRAY(SELECT json_array_elements_text(%s::json)::bigint))
  AND (status IN ('pending', 'leased')) IS TRUE
RETURNING seq"""
PG_POISON = """
UPDATE jobs SET status = 'dead', reason = 'poison', owner = NULL, lease_until = NULL
WHERE seq = ANY(ARRAY(SELECT json_array_elements_text(%s::json)::bigint))
  AND (status = 'leased') IS TRUE
RETURNING seq"""

# The claims' plain texts, as a lane's claims take them (each lane adds its condition and
# walks its own index), and the core's claims as they walk ``jobs_by_status`` (see above).
_PLAIN = {
    w.SQL_NEXT_CLAIMABLE: PG_NEXT_CLAIMABLE,
    w.SQL_NEXT_FRESH: PG_NEXT_FRESH,
    w.SQL_NEXT_RECLAIMABLE: PG_NEXT_RECLAIMABLE,
    w.SQL_NEXT_FRESH_RECLAIMING: PG_NEXT_FRESH_RECLAIMING,
}
_PENDING_READ = re.compile(r"WHERE status = 'pending' AND (.*?)ORDER BY seq LIMIT", re.DOTALL)


def _walking(pg: str) -> str:
    """``pg`` with each read of pending jobs named by an array and ordered by ``status,
    seq`` (``jobs_by_status``'s order) and every deadline a filter: the same rows, in the
    same order (``status`` is the same for all of them)."""
    out, found = _PENDING_READ.subn(
        r"WHERE status = ANY(ARRAY['pending']) AND \1ORDER BY status, seq LIMIT", pg
    )
    if not found:
        raise AssertionError(f"no read of pending jobs in {' '.join(pg.split())[:80]!r}")
    return out.replace("deadline > %(now)s", "deadline + 0 > %(now)s")


# Rows read to decide on are locked, in one order for every transaction.
PG_JOBS = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until, id
FROM jobs WHERE id = ANY(ARRAY(SELECT json_array_elements_text(%s::json)))
ORDER BY id FOR UPDATE"""

PG_JOB = """
SELECT qty, status, attempts, max_attempts, token, deadline, owner, lease_until
FROM jobs WHERE id = %s FOR UPDATE"""

PG_LEASE = """
UPDATE jobs SET status = 'leased', attempts = attempts + 1, token = token + 1, owner = %s,
  lease_until = least(%s, deadline), reason = NULL
WHERE seq = ANY(ARRAY(SELECT json_array_elements_text(%s::json)::bigint))
  AND (status IN ('pending', 'leased')) IS TRUE
RETURNING seq"""

# A cycle's finishes and extensions (``w.SQL_SETTLE``, one fenced write per job) as one
# statement over a JSON array of them: the server plans and runs one UPDATE instead of one
# per job.  The same fence and the same new values, row for row; the rows were read and
# locked first (``PG_JOBS``).  A settle naming a job twice (an extension that leaves its
# lease where it was, then another) runs row by row: one UPDATE changes a row once.
# Each job is found by its id alone: the fence's status test (``IS TRUE``: the same test
# on a column that is never NULL) is no index condition, so no plan finds the jobs through
# ``jobs_by_lease``, whose entries for one lease's end are every job of its claim, and
# their dead versions (a settle of 300 took 33 ms so, 9 ms by id).  The ids are also given
# as an array (``id = ANY``): a join of the set to ``jobs`` alone may read the whole table
# into a hash (the set's size is unknown to the planner, 100 rows by its default), and the
# table grows with its dead versions: 65 ms a settle of 400 at 5,000 jobs, once analyzed.
# Each row travels as an array of its values (``sets.SETTLE_FIELDS``' order).
PG_SETTLE_SET = """
WITH x AS (SELECT r ->> 0 AS id, (r ->> 1)::bigint AS token, r ->> 2 AS owner,
  (r ->> 3)::bigint AS attempt, (r ->> 4)::bigint AS lease_until, r ->> 5 AS status,
  r ->> 6 AS reason, (r ->> 7)::bigint AS available_at, r ->> 8 AS new_owner,
  (r ->> 9)::bigint AS new_lease_until
  FROM jsonb_array_elements(%s::jsonb) AS r)
UPDATE jobs SET status = x.status, reason = x.reason,
  available_at = coalesce(x.available_at, jobs.available_at),
  owner = x.new_owner, lease_until = x.new_lease_until
FROM x
WHERE jobs.id = ANY(ARRAY(SELECT x.id FROM x)) AND jobs.id = x.id
  AND (jobs.status = 'leased') IS TRUE AND jobs.token = x.token
  AND jobs.owner = x.owner AND jobs.attempts = x.attempt AND jobs.lease_until = x.lease_until"""
# An intake's new jobs (``w.SQL_INSERT_JOB``, one row per job) as one INSERT over a JSON
# array of the rows: the same values, inserted in the array's order (so each job's seq
# follows the order of the intake, as row-by-row inserts number them).  Every set of rows
# sent as JSON is ``jsonb``: parsed once, each ``->>`` a lookup (on ``json`` each ``->>``
# parses its element again: the attempts' 8 columns cost 9-10 us a row, 5-6 so).
PG_INSERT_SET = """
INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at, deadline,
  owner, lease_until, reason)
SELECT x.value->>0, (x.value->>1)::integer, 'pending', 0, (x.value->>2)::integer, 0,
  (x.value->>3)::bigint, (x.value->>4)::bigint, NULL, NULL, NULL
FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS x(value, n)
ORDER BY x.n"""
# A core statement run for many rows -> its set statement (``sets.as_set``).
SETS = {
    w.SQL_SETTLE: settle_set(PG_SETTLE_SET),
    w.SQL_INSERT_JOB: SetText(PG_INSERT_SET, itemgetter(0), None),
    attempts.SQL_RECORD: SetText(attempts.PG_RECORD_SET, None, None),
}


def many(sql: str, params: list[Any]) -> tuple[str, tuple[str]] | None:
    """The one set statement (and its JSON parameter) that runs ``sql`` for every row of
    ``params`` on PostgreSQL, where there is one; else None (``executemany``)."""
    return as_set(SETS, sql, params)


# A set of one key: the key itself (``w.ONE``).
def _fenced_by_id(settle: str) -> str:
    """A settle of one job whose fence's status test is ``IS TRUE`` (no index condition):
    the job is found by its id, never through an index's leased entries (each lease's, and
    under a held snapshot each dead version's), which plans with statistics taken before any
    lease chose (``jobs_by_deadline``'s, here; 37,000 blocks, 270 ms a settle in a run)."""
    if settle.count("status = 'leased'") != 1:
        raise AssertionError("one fenced status test in a settle")
    return settle.replace("status = 'leased'", "(status = 'leased') IS TRUE")


ANY_SEQ = "= ANY(ARRAY(SELECT json_array_elements_text(%s::json)::bigint))"
ANY_ID = "= ANY(ARRAY(SELECT json_array_elements_text(%s::json)))"

# Each core statement -> its PostgreSQL text.
STATEMENTS: dict[str, str] = {
    w.SQL_QUARANTINE: PG_QUARANTINE,
    w.SQL_QUARANTINE_DUE: PG_QUARANTINE_DUE,
    w.SQL_QUARANTINE_DUE_RECLAIMING: PG_QUARANTINE_DUE_RECLAIMING,
    w.SQL_NEXT_CLAIMABLE: _walking(PG_NEXT_CLAIMABLE),
    w.SQL_NEXT_FRESH: _walking(PG_NEXT_FRESH),
    w.SQL_JOBS: PG_JOBS,
    w.SQL_JOB: PG_JOB,
    w.SQL_LEASE: PG_LEASE,
    w.SQL_QUARANTINE_RECLAIMING: PG_QUARANTINE_RECLAIMING,
    w.SQL_NEXT_RECLAIMABLE: _walking(PG_NEXT_RECLAIMABLE),
    w.SQL_NEXT_FRESH_RECLAIMING: _walking(PG_NEXT_FRESH_RECLAIMING),
    w.SQL_LEASE_RECLAIMING: PG_LEASE_RECLAIMING,
    w.SQL_POISON: PG_POISON,
    **{
        w.ONE[sql]: pg.replace(ANY_SEQ, "= %s").replace(ANY_ID, "= %s")
        for sql, pg in (
            (w.SQL_LEASE, PG_LEASE),
            (w.SQL_LEASE_RECLAIMING, PG_LEASE_RECLAIMING),
            (w.SQL_POISON, PG_POISON),
            (w.SQL_JOBS, PG_JOBS),
        )
    },
    # one job's settle: its status test no index condition, as in its set (``PG_SETTLE_SET``)
    w.SQL_SETTLE: _fenced_by_id(placeholders(w.SQL_SETTLE)),
    **{
        sql: placeholders(sql)
        for sql in (
            w.SQL_INSERT_JOB,
            w.SQL_AUDIT,
            w.SQL_REDRIVE,
            w.SQL_ACTIVE,
        )
    },
}


# The shared send rate (``core.rate``).  Its table is made under the schemas' lock: many
# workers start at once, and concurrent CREATE TABLE IF NOT EXISTS may collide.  The row is
# read by an UPDATE that locks it first, so the server's clock is read after the lock.
PG_RATE_TABLE = """DO $$ BEGIN
  PERFORM pg_advisory_xact_lock(1634626401, 1);
  CREATE TABLE IF NOT EXISTS asnackq_rate (key TEXT PRIMARY KEY,
    interval_us BIGINT NOT NULL, burst INTEGER NOT NULL, tat_us BIGINT NOT NULL);
END $$"""
PG_RATE_READ = """UPDATE asnackq_rate SET tat_us = tat_us WHERE key = %s
RETURNING interval_us, burst, tat_us,
  (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"""
STATEMENTS.update(
    {
        rate.SQL_RATE_TABLE: PG_RATE_TABLE,
        rate.SQL_RATE_READ: PG_RATE_READ,
        rate.SQL_RATE_CLOCK: "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
        rate.SQL_RATE_SET: placeholders(rate.SQL_RATE_SET),
        rate.SQL_RATE_EXISTS: "SELECT count(*) FROM pg_catalog.pg_tables"
        " WHERE schemaname = current_schema() AND tablename = 'asnackq_rate'",
        rate.SQL_RATE_SHARED: placeholders(rate.SQL_RATE_SHARED),
        rate.SQL_RATE_CLEAR: placeholders(rate.SQL_RATE_CLEAR),
        rate.SQL_RATE_SPEND: placeholders(rate.SQL_RATE_SPEND),
    }
)


# A queue's endpoints and their audited changes (``core.endpoints``): the tables are made
# under the schemas' lock, as the rate's; a change reads its row ``FOR UPDATE``, so two
# changes of one endpoint take turns and each decides on the other's result.
PG_ENDPOINT_DDL = (
    """CREATE TABLE IF NOT EXISTS asnackq_endpoints (name TEXT PRIMARY KEY, url TEXT NOT NULL,
    types TEXT NOT NULL, secrets TEXT NOT NULL, rate DOUBLE PRECISION, burst INTEGER NOT NULL,
    concurrency INTEGER, timeout_s DOUBLE PRECISION NOT NULL,
    retry_base_ms BIGINT, retry_cap_ms BIGINT, retry_delays TEXT,
    success TEXT NOT NULL CHECK (success IN ('ack', '2xx')),
    ordered INTEGER NOT NULL CHECK (ordered IN (0, 1)), headers TEXT NOT NULL,
    allow_networks TEXT NOT NULL DEFAULT '[]',
    state TEXT NOT NULL CHECK (state IN ('enabled', 'disabled')),
    disabled_reason TEXT, disabled_at_ms BIGINT,
    created_ms BIGINT NOT NULL, updated_ms BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS asnackq_endpoint_changes (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, endpoint TEXT NOT NULL,
    at_ms BIGINT NOT NULL, action TEXT NOT NULL CHECK (action IN
    ('add', 'update', 'rotate', 'disable', 'enable', 'remove')), note TEXT NOT NULL)""",
    endpoints.SCHEMA[2],
)
STATEMENTS.update(
    {
        **{
            sqlite: f"DO $$ BEGIN\n  PERFORM pg_advisory_xact_lock(1634626401, 1);\n  {pg};\nEND $$"
            for sqlite, pg in zip(endpoints.SCHEMA, PG_ENDPOINT_DDL, strict=True)
        },
        endpoints.SQL_PRESENT: "SELECT count(*) FROM pg_catalog.pg_tables"
        " WHERE schemaname = current_schema() AND tablename = 'asnackq_endpoints'",
        endpoints.SQL_LOCK: placeholders(endpoints.SQL_LOCK) + " FOR UPDATE",
        **{
            sql: placeholders(sql)
            for sql in (
                endpoints.SQL_READ,
                endpoints.SQL_INSERT,
                endpoints.SQL_WRITE,
                endpoints.SQL_DELETE,
                endpoints.SQL_AUDIT,
                endpoints.SQL_CHANGES,
            )
        },
    }
)


def text(sql: str) -> str:
    """The PostgreSQL text for ``sql``."""
    found = STATEMENTS.get(sql)
    if found is None:
        raise KeyError(f"no PostgreSQL text for the statement {' '.join(sql.split())[:90]!r}")
    return found


def translate(sql: str, params: Params) -> tuple[str, Params]:
    """A plan's statement and parameters, as PostgreSQL takes them."""
    return text(sql), params


# --- schemas ------------------------------------------------------------------------


class Missing(ValueError):
    """Raised when a database holds no such part (no ``jobs`` table, say) and none is made."""


class Schema(NamedTuple):
    """A part of the database (``queue``, ``sink``): its version and its DDL."""

    part: str
    version: int
    tables: tuple[str, ...]  # every table it creates; the first one marks its presence
    ddl: tuple[str, ...]


QUEUE = Schema(
    "queue",
    1,
    ("jobs", "redrives"),
    (
        """CREATE TABLE IF NOT EXISTS jobs (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL,
  status TEXT NOT NULL CHECK(status IN ('pending','leased','done','dead')),
  attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL, token BIGINT NOT NULL,
  available_at BIGINT NOT NULL, deadline BIGINT NOT NULL,
  owner TEXT, lease_until BIGINT, reason TEXT)""",
        """CREATE TABLE IF NOT EXISTS redrives (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL, token BIGINT NOT NULL, at_ms BIGINT NOT NULL, note TEXT NOT NULL)""",
        # As on SQLite, claims never visit done/dead rows: pending jobs in seq order, leases
        # by their end, deadlines by status, spent budgets in a partial index.
        "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq)",
        "CREATE INDEX IF NOT EXISTS jobs_by_deadline ON jobs (status, deadline)",
        "CREATE INDEX IF NOT EXISTS jobs_by_lease ON jobs (lease_until) WHERE status = 'leased'",
        "CREATE INDEX IF NOT EXISTS jobs_spent ON jobs (status) WHERE attempts >= max_attempts",
    ),
)

# A receiver's inbox (``core.inbox.plan_receive``), in the application's database or the
# sink's (shared by replicas).  Its first write is INSERT ... ON CONFLICT DO NOTHING over the
# batch's new ids, in id order: a concurrent delivery of the same id waits for the
# transaction that wrote the row, then finds it (READ COMMITTED: the next statement's
# snapshot sees it), and replicas writing overlapping batches lock rows in one order.
WEBHOOK = Schema(
    "webhook_inbox",
    1,
    ("asnackq_webhook_inbox",),
    (
        """CREATE TABLE IF NOT EXISTS asnackq_webhook_inbox (id TEXT PRIMARY KEY,
  body_sha256 TEXT NOT NULL, first_token BIGINT, last_token BIGINT,
  deliveries INTEGER NOT NULL, first_seen_ms BIGINT NOT NULL, last_seen_ms BIGINT NOT NULL)""",
    ),
)
# The sink: a receiver whose effect is the stock (version 1 was its own inbox table, which
# a sink refuses: ``asnackq.sink.stock``).
SQL_EARLIER_SINK = "SELECT count(*) FROM asnackq_schema WHERE part = 'sink' AND version = 1"
SINK = Schema(
    "sink",
    2,
    ("stock_moves", "asnackq_webhook_inbox", "stock"),
    (
        *WEBHOOK.ddl,
        "CREATE TABLE IF NOT EXISTS stock_moves (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS stock (one INTEGER PRIMARY KEY CHECK (one = 1),"
        " total BIGINT NOT NULL)",
        "INSERT INTO stock (one, total) VALUES (1, 0) ON CONFLICT (one) DO NOTHING",
    ),
)

# The core's schemas -> their PostgreSQL schemas.
SCHEMAS: dict[tuple[str, ...], Schema] = {
    w.SCHEMA: QUEUE,
    inbox.SINK_SCHEMA: SINK,
    inbox.WEBHOOK_SCHEMA: WEBHOOK,
}

# The inbox's statements -> their PostgreSQL texts.
STATEMENTS.update(
    {
        inbox.SQL_FIRST: """INSERT INTO asnackq_webhook_inbox (id, body_sha256, first_token,
  last_token, deliveries, first_seen_ms, last_seen_ms)
SELECT e->>0, e->>1, (e->>2)::bigint, (e->>2)::bigint, 1, (e->>3)::bigint, (e->>3)::bigint
FROM jsonb_array_elements(%s::jsonb) AS e ORDER BY e->>0
ON CONFLICT (id) DO NOTHING RETURNING id""",
        inbox.SQL_DIGESTS: f"SELECT id, body_sha256 FROM asnackq_webhook_inbox WHERE id {ANY_ID}",
        **{
            sql: placeholders(sql)
            for sql in (
                inbox.SQL_AGAIN,
                inbox.SQL_WEBHOOK_RECORD,
                inbox.SQL_MOVE,
                inbox.SQL_ADD_STOCK,
                inbox.SQL_STOCK,
                inbox.SQL_RECORD,
            )
        },
        **{sql: sql for sql in SINK.ddl},
        SQL_EARLIER_SINK: SQL_EARLIER_SINK,
    }
)

# The job traces' statements (``asnackq.store.job_traces``) -> their PostgreSQL texts.
STATEMENTS.update(
    {
        **job_traces.PG_TEXTS,
        **{sql: placeholders(sql) for sql in job_traces.SAME_TEXTS},
        **attempts.PG_TEXTS,
        **retention.PG_TEXTS,
        reads.SQL_HAS_TABLE_PG: placeholders(reads.SQL_HAS_TABLE_PG),  # (in a driven plan)
    }
)

# Events and their deliveries (``core.events``): the tables under the schemas' lock, as the
# endpoints'.  A lane's range is compared in the "C" collation (bytes), the order its ids
# are made to sort in, whatever the database's collation; its index is made so, and the
# ordered lanes' index of a key's deliveries (``lanes.KEY_INDEX``) too.
PG_EVENTS_DDL = (
    """CREATE TABLE IF NOT EXISTS asnackq_events (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id TEXT NOT NULL UNIQUE, type TEXT,
    key TEXT, digest TEXT NOT NULL, body BYTEA NOT NULL, created_ms BIGINT NOT NULL)""",
    events.SCHEMA[1],
    events.SCHEMA[2],
    'CREATE INDEX IF NOT EXISTS asnackq_jobs_by_lane ON jobs (status, id COLLATE "C")',
    """CREATE INDEX IF NOT EXISTS asnackq_deliveries_by_key
  ON asnackq_deliveries (endpoint, key, job COLLATE "C") WHERE key IS NOT NULL""",
)
_ANY_EVENT = "= ANY(ARRAY(SELECT json_array_elements_text(%s::json)))"
STATEMENTS.update(
    {
        **{
            sqlite: f"DO $$ BEGIN\n  PERFORM pg_advisory_xact_lock(1634626401, 1);\n  {pg};\nEND $$"
            for sqlite, pg in zip(events.SCHEMA, PG_EVENTS_DDL, strict=True)
        },
        events.SQL_PRESENT: "SELECT count(*) FROM pg_catalog.pg_class AS c JOIN"
        " pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = current_schema() AND c.relname IN ("
        + ", ".join(f"'{name}'" for name in events.NAMES)
        + ")",
        events.SQL_KNOWN: "SELECT id, digest FROM asnackq_events WHERE id " + _ANY_EVENT,
        events.SQL_SEQS: "SELECT id, seq FROM asnackq_events WHERE id " + _ANY_EVENT,
        **{
            sql: placeholders(sql)
            for sql in (events.SQL_INSERT_EVENT, events.SQL_INSERT_DELIVERY, events.SQL_BODY)
        },
    }
)

# What workers say of the endpoints they serve (``core.endpoint_workers``): the table under
# the schemas' lock, as the endpoints'; a note's rows are one JSON array, as on SQLite.
PG_ENDPOINT_WORKERS_DDL = """CREATE TABLE IF NOT EXISTS asnackq_endpoint_workers (
    endpoint TEXT NOT NULL, owner TEXT NOT NULL,
    breaker TEXT NOT NULL CHECK (breaker IN ('closed', 'open')), limit_now INTEGER NOT NULL,
    in_flight INTEGER NOT NULL, seen_ms BIGINT NOT NULL, PRIMARY KEY (endpoint, owner))"""
STATEMENTS.update(
    {
        endpoint_workers.SCHEMA[0]: "DO $$ BEGIN\n  PERFORM pg_advisory_xact_lock(1634626401, 1);"
        f"\n  {PG_ENDPOINT_WORKERS_DDL};\nEND $$",
        endpoint_workers.SQL_NOTE: """INSERT INTO asnackq_endpoint_workers
  (endpoint, owner, breaker, limit_now, in_flight, seen_ms)
SELECT e->>0, %(owner)s, e->>1, (e->>2)::integer, (e->>3)::integer, %(now)s
FROM jsonb_array_elements(%(rows)s::jsonb) AS e
ON CONFLICT (endpoint, owner) DO UPDATE SET breaker = excluded.breaker,
  limit_now = excluded.limit_now, in_flight = excluded.in_flight, seen_ms = excluded.seen_ms""",
        endpoint_workers.SQL_FORGET: """DELETE FROM asnackq_endpoint_workers
WHERE (owner = %(owner)s
    AND endpoint <> ALL(ARRAY(SELECT json_array_elements_text(%(names)s::json))))
  OR seen_ms < %(forget)s""",
    }
)

# A lane's claims (``core.lanes``): the core's PostgreSQL texts with the lane's condition
# on each read of claimable jobs, an endpoint's read in id order ("C") over its range.
_PG_MINE = (
    'id COLLATE "C" >= %(lane_lo)s AND id COLLATE "C" < %(lane_hi)s AND EXISTS (SELECT 1'
    " FROM asnackq_deliveries AS d WHERE d.job = jobs.id AND d.endpoint = %(lane)s)"
)
_PG_OLDEST = (
    "least("
    + ", ".join(  # (``lanes._OLDEST``)
        f"""(SELECT min(a.id COLLATE "C") FROM jobs AS a WHERE a.status = '{status}'"""
        ' AND a.id COLLATE "C" >= %(lane_lo)s AND a.id COLLATE "C" < %(lane_hi)s)'
        for status in ("pending", "leased")
    )
    + ")"
)
_PG_ORDERED = (  # (``lanes._ORDERED``: ids compared as bytes, as a lane's range is)
    'id COLLATE "C" >= %(lane_lo)s AND id COLLATE "C" < %(lane_hi)s AND EXISTS (SELECT 1'
    " FROM asnackq_deliveries AS d WHERE d.job = jobs.id AND d.endpoint = %(lane)s"
    " AND (d.key IS NULL OR NOT EXISTS (SELECT 1 FROM asnackq_deliveries AS k"
    " JOIN jobs AS o ON o.id = k.job WHERE k.endpoint = %(lane)s AND k.key = d.key"
    f' AND k.job COLLATE "C" >= {_PG_OLDEST} AND k.job <> d.job'
    " AND (o.status = 'leased' OR (o.status = 'pending'"
    ' AND k.job COLLATE "C" < d.job COLLATE "C")))))'
)
_PG_PLAIN = "NOT EXISTS (SELECT 1 FROM asnackq_deliveries AS d WHERE d.job = jobs.id)"
_PG_CLAIMABLE = re.compile(r"WHERE status (?:= '(?:pending|leased)'|IN \('pending', 'leased'\))")


def _pg_lane(pg: str, condition: str, by_id: bool) -> str:
    out, found = _PG_CLAIMABLE.subn(lambda m: f"{m[0]} AND {condition}", pg)
    if not found:
        raise AssertionError(f"no claimable read in {' '.join(pg.split())[:80]!r}")
    if by_id:
        out = out.replace("ORDER BY seq LIMIT %(n)s FOR", 'ORDER BY id COLLATE "C" LIMIT %(n)s FOR')
    return out


for _core in lanes.CLAIMS:
    _plain = _PLAIN.get(_core) or text(_core)
    # (an endpoint's reads walk its lane's index in id order: ``LAPSED`` would save them no
    # entry, and its array names the lapsed leases of every lane)
    _by_id = _plain.replace(LAPSED, "")
    STATEMENTS[lanes.LANE_TEXTS[_core]] = _pg_lane(_by_id, _PG_MINE, by_id=True)
    STATEMENTS[lanes.PLAIN_TEXTS[_core]] = _pg_lane(_plain, _PG_PLAIN, by_id=False)
    if _core != w.SQL_ACTIVE:  # (an ordered lane's is an endpoint lane's)
        STATEMENTS[lanes.ORDERED_TEXTS[_core]] = _pg_lane(_by_id, _PG_ORDERED, by_id=True)

SQL_LOCK_SCHEMA = "SELECT pg_advisory_xact_lock(1634626401, 1)"  # every opener, in turn
SQL_PRESENT = "SELECT to_regclass(%s) IS NOT NULL"
SQL_VERSIONS = """CREATE TABLE IF NOT EXISTS asnackq_schema (part TEXT PRIMARY KEY,
  version INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())"""
SQL_VERSION = "SELECT version FROM asnackq_schema WHERE part = %s"
SQL_RECORD_VERSION = """INSERT INTO asnackq_schema (part, version) VALUES (%s, %s)
ON CONFLICT (part) DO NOTHING"""
for _native in (
    SQL_LOCK_SCHEMA,
    SQL_PRESENT,
    SQL_VERSIONS,
    SQL_VERSION,
    SQL_RECORD_VERSION,
    *QUEUE.ddl,
    *WEBHOOK.ddl,
):
    STATEMENTS[_native] = _native


def plan_open(schema: Schema, create: bool) -> Generator[w.Step, Any, tuple[None, bool]]:
    """Check (and with ``create``, complete) a schema, in one transaction.

    Nothing is written when the recorded version is current; without ``create`` an
    absent schema is a ``ValueError``; a newer version than this code knows, too.
    """
    yield w.Sql(SQL_LOCK_SCHEMA)
    [(present,)] = yield w.Sql(SQL_PRESENT, (schema.tables[0],))
    version = None
    if present and (yield w.Sql(SQL_PRESENT, ("asnackq_schema",)))[0][0]:
        rows = yield w.Sql(SQL_VERSION, (schema.part,))
        version = rows[0][0] if rows else None
    if version is not None and version > schema.version:
        raise ValueError(
            f"the {schema.part} schema is at version {version}, newer than this "
            f"asnackq knows ({schema.version}): upgrade asnackq"
        )
    if version == schema.version:
        return None, False
    if not create:
        if not present:
            raise Missing(f"no {schema.part} here (no {schema.tables[0]} table)")
        return None, False
    for statement in (SQL_VERSIONS, *schema.ddl):
        yield w.Sql(statement)
    yield w.Sql(SQL_RECORD_VERSION, (schema.part, schema.version))
    return None, True

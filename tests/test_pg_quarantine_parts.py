"""The quarantine's index-shaped parts select what its single predicate selects.

The single predicate (the core's definition of a spent job, as one PostgreSQL text) is
written out here: for every combination of status, deadline, lease end and budget, the
parts end the same jobs with the same reasons, and their checks say the same; two sessions
quarantining at once end each job once.
"""

from __future__ import annotations

import itertools
import threading

import psycopg
import pytest

from asnackq.core import worker as w
from asnackq.store import pg, pg_sql

from .pgdb import query
from .settles import NOW, ODD_IDS, of_every_kind, settle

_OLD_SPENT = """
  SELECT seq FROM jobs WHERE status IN ('pending', 'leased')
    AND (deadline <= %(now)s OR {spent})
    AND (status = 'pending' OR lease_until <= %(now)s)"""
_OLD_QUARANTINE = f"""
WITH spent AS ({_OLD_SPENT}
  FOR UPDATE SKIP LOCKED)
UPDATE jobs SET status = 'dead',
  reason = CASE WHEN deadline <= %(now)s THEN 'deadline' ELSE 'exhausted' END,
  owner = NULL, lease_until = NULL
FROM spent WHERE jobs.seq = spent.seq
RETURNING jobs.reason"""
_OLD_RECLAIMING = "(status = 'pending' AND attempts >= max_attempts)"
OLD = {
    "contract": (
        _OLD_QUARANTINE.format(spent="attempts >= max_attempts"),
        f"SELECT EXISTS ({_OLD_SPENT.format(spent='attempts >= max_attempts')})",
    ),
    "reclaiming": (
        _OLD_QUARANTINE.format(spent=_OLD_RECLAIMING),
        f"SELECT EXISTS ({_OLD_SPENT.format(spent=_OLD_RECLAIMING)})",
    ),
}
NEW = {
    "contract": (pg_sql.PG_QUARANTINE, pg_sql.PG_QUARANTINE_DUE),
    "reclaiming": (pg_sql.PG_QUARANTINE_RECLAIMING, pg_sql.PG_QUARANTINE_DUE_RECLAIMING),
}
_INSERT = """INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,
  deadline, owner, lease_until) VALUES (%s, 1, %s, %s, 3, 1, 0, %s, %s, %s)"""
_STATE = "SELECT seq, status, reason, owner, lease_until FROM jobs ORDER BY seq"


def _race(url: str, sessions: int) -> list[int]:
    """How many jobs each of ``sessions`` quarantines started at once ended."""
    ended: list[int] = []
    barrier = threading.Barrier(sessions)

    def quarantine() -> None:
        with psycopg.connect(url, autocommit=True) as con:
            barrier.wait(timeout=30)
            ended.append(len(con.execute(pg_sql.PG_QUARANTINE, {"now": NOW}).fetchall()))

    threads = [threading.Thread(target=quarantine) for _ in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(ended) == sessions
    return ended


@pytest.fixture
def url(pg_db):
    url = pg_db()
    pg.connect(url).close()
    return url


def _every_combination(con: psycopg.Connection) -> None:
    """One row per status x deadline x lease end x attempts (before, at, after ``NOW``)."""
    times = (NOW - 1, NOW, NOW + 1)
    for n, (status, deadline, lease_until, attempts) in enumerate(
        itertools.product(w.STATUSES, times, (None, *times), (2, 3, 4))
    ):
        owner = None if lease_until is None else "o"
        con.execute(_INSERT, (f"j{n}", status, attempts, deadline, owner, lease_until))


def _run(con: psycopg.Connection, sql: str) -> tuple[list[str], list[tuple]]:
    """The reasons a quarantine returns and the table after it (rolled back)."""
    con.execute("BEGIN")
    try:
        reasons = sorted(r for (r,) in con.execute(sql, {"now": NOW}).fetchall())
        return reasons, con.execute(_STATE).fetchall()
    finally:
        con.execute("ROLLBACK")


@pytest.mark.parametrize("variant", ["contract", "reclaiming"])
def test_the_parts_end_the_jobs_the_single_predicate_ended(url, variant):
    with psycopg.connect(url, autocommit=True) as con:
        _every_combination(con)
        before = con.execute(_STATE).fetchall()
        old_reasons, old_after = _run(con, OLD[variant][0])
        new_reasons, new_after = _run(con, NEW[variant][0])
        assert old_after != before  # some jobs are spent
        assert new_reasons == old_reasons
        assert new_after == old_after


@pytest.mark.parametrize("variant", ["contract", "reclaiming"])
def test_the_parts_check_says_what_the_single_predicate_said_row_by_row(url, variant):
    with psycopg.connect(url, autocommit=True) as con:
        _every_combination(con)
        seqs = [seq for (seq, *_) in con.execute(_STATE).fetchall()]
        differ, due = [], 0
        for seq in seqs:
            con.execute("BEGIN")
            try:
                con.execute("DELETE FROM jobs WHERE seq <> %s", (seq,))
                old = con.execute(OLD[variant][1], {"now": NOW}).fetchone()
                new = con.execute(NEW[variant][1], {"now": NOW}).fetchone()
                due += old == (True,)
                if old != new:
                    differ.append((seq, old, new))
            finally:
                con.execute("ROLLBACK")
        assert differ == []
        assert 0 < due < len(seqs)


def test_two_sessions_quarantining_at_once_end_each_spent_job_once(url):
    """Rounds of spent jobs (some in two parts at once), two sessions racing on each round
    and a third holding one job: every job nobody holds ends once, the held one waits."""
    rounds, per_round = 40, 30
    with psycopg.connect(url, autocommit=True) as admin:
        for r in range(rounds):
            for i in range(per_round):
                deadline = NOW - 1 if i % 2 else NOW + 10**6
                attempts = 3 if i % 3 else 1  # spent budget, or a deadline alone
                leased = i % 5 == 0
                admin.execute(
                    _INSERT,
                    (
                        f"r{r}-{i}",
                        "leased" if leased else "pending",
                        attempts,
                        deadline,
                        "o" if leased else None,
                        NOW - 1 if leased else None,
                    ),
                )
            spent = admin.execute(
                "SELECT count(*) FROM jobs WHERE status IN ('pending', 'leased')"
                " AND (deadline <= %s OR attempts >= max_attempts)",
                (NOW,),
            ).fetchone()[0]
            holder = psycopg.connect(url)
            [(held,)] = holder.execute(
                "SELECT seq FROM jobs WHERE id = %s FOR UPDATE", (f"r{r}-1",)
            ).fetchall()
            ended = _race(url, 2)
            assert sum(ended) == spent - 1, r  # all but the held one, each once
            holder.rollback()
            holder.close()
            assert len(admin.execute(pg_sql.PG_QUARANTINE, {"now": NOW}).fetchall()) == 1
            assert admin.execute(
                "SELECT count(*) FROM jobs WHERE status IN ('pending', 'leased')"
                " AND (deadline <= %s OR attempts >= max_attempts)",
                (NOW,),
            ).fetchone() == (0,)
            del held


def test_the_settles_is_true_fence_lands_where_the_plain_status_test_does(url):
    """``(status = 'leased') IS TRUE`` keeps the rows ``status = 'leased'`` kept: a
    settle naming a job of every status, with matching and stale fences, lands on the
    same rows (status is NOT NULL; a WHERE keeps only TRUE either way)."""
    old = pg_sql.PG_SETTLE_SET.replace("(jobs.status = 'leased') IS TRUE", "jobs.status = 'leased'")
    assert old != pg_sql.PG_SETTLE_SET
    assert query(
        url,
        "SELECT is_nullable FROM information_schema.columns"
        " WHERE table_name = 'jobs' AND column_name = 'status'",
    ) == [("NO",)]
    settles = []
    with psycopg.connect(url, autocommit=True) as con:
        for n, status in enumerate(w.STATUSES):
            for stale in (False, True):
                job = f"s{n}-{stale}"
                con.execute(_INSERT, (job, status, 1, NOW + 10, "o", NOW + 5))
                settles.append(settle(job, stale))
        results = []
        found = pg_sql.many(w.SQL_SETTLE, settles)
        assert found is not None and found[0] == pg_sql.PG_SETTLE_SET
        for sql in (old, pg_sql.PG_SETTLE_SET):
            con.execute("BEGIN")
            try:
                con.execute(sql, found[1])
                results.append(con.execute(_STATE).fetchall())
            finally:
                con.execute("ROLLBACK")
        assert results[0] == results[1]
        assert sum(row[1] == "done" for row in results[0]) == 3  # the done two, one settled


def test_a_settle_as_one_set_lands_what_the_writes_row_by_row_land(url):
    """A cycle's settle sent as one statement over its rows (``pg_sql.many``) leaves every
    job as the core's fenced write run once per row leaves it: finishes, a retry, a death,
    an extension, stale fences, NULLs and ids that JSON must escape."""
    jobs = ODD_IDS + [f"j{n}" for n in range(7)]
    rows = of_every_kind(jobs)
    with psycopg.connect(url, autocommit=True) as con:
        for job in jobs:
            con.execute(_INSERT, (job, "leased", 1, NOW + 10, "o", NOW + 5))
        found = pg_sql.many(w.SQL_SETTLE, rows)
        assert found is not None and found[0] == pg_sql.PG_SETTLE_SET
        state = "SELECT id, status, reason, available_at, owner, lease_until FROM jobs ORDER BY seq"
        results = []
        for set_at_once in (False, True):
            con.execute("BEGIN")
            try:
                if set_at_once:
                    changed = con.execute(*found).rowcount
                else:
                    with con.cursor() as cursor:
                        cursor.executemany(pg_sql.text(w.SQL_SETTLE), rows)
                        changed = cursor.rowcount
                results.append((changed, con.execute(state).fetchall()))
            finally:
                con.execute("ROLLBACK")
    assert results[0] == results[1]
    assert results[1][0] == 10  # every row but the three stale ones
    assert ("back\\slash", "pending", "5xx", 2**62 + 1, None, None) in results[1][1]

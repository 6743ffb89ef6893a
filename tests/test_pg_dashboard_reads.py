"""The dashboard's reads of a few jobs by status read those jobs, not the table.

A read-only session as the dashboard opens it (``pg.connect(read_only=True)``, with the
queue's session settings), on a queue of done jobs with a few dead ones scattered among
them, VACUUM ANALYZE'd: the dead jobs' counts and list visit the dead rows.
"""

from __future__ import annotations

import psycopg
import pytest

from asnackq.store import pg, pg_sql

from .conftest import T0
from .pgdb import executed_plan, reads

JOBS = 20_000
DEAD = JOBS // 40
READS = {
    "dead by reason": "SELECT reason, count(*) FROM jobs WHERE status = 'dead' GROUP BY reason",
    "dead list": "SELECT id, qty, reason, attempts, max_attempts, token FROM jobs"
    " WHERE status = 'dead' AND (:reason IS NULL OR reason = :reason) ORDER BY seq",
}


@pytest.fixture
def reader(pg_db):
    url = pg_db()
    pg.connect(url).close()
    with psycopg.connect(url, autocommit=True) as con:
        con.execute(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
            " deadline, reason) SELECT 'j' || i, 1,"
            " CASE WHEN i %% 40 = 0 THEN 'dead' ELSE 'done' END, 1, 3, 1, 0, %s,"
            " CASE WHEN i %% 40 = 0 THEN 'exhausted' END FROM generate_series(1, %s) AS i",
            (T0, JOBS),
        )
        con.execute("VACUUM ANALYZE jobs")
    con = pg.connect(url, read_only=True)
    yield con
    con.close()


@pytest.mark.parametrize("name", READS)
def test_a_read_of_the_dead_jobs_visits_the_dead_rows(reader, name):
    plan = executed_plan(reader, pg_sql.placeholders(READS[name]), {"reason": None}, client=True)
    found = [r for r in reads(plan) if r.relation == "jobs"]
    assert sum(r.visited for r in found) <= 2 * DEAD, found

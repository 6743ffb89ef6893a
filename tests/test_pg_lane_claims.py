"""An endpoint's lane claims on PostgreSQL read a claim's worth of rows with fresh statistics.

A queue of jobs most of which are done, a third plain and the rest two endpoints'
deliveries, VACUUM ANALYZE'd: each lane's claim walks its lane's index (or the pending
jobs) and stops after about :n rows, reading no table whole.  (A lane's claims keep the
deadline as an index condition: with it a filter, as in the core's claims, an endpoint
lane's claim read every delivery and every pending job of its lane, and sorted them.)
"""

from __future__ import annotations

import psycopg
import pytest

from asnackq.core import events, lanes
from asnackq.core import worker as w
from asnackq.store import pg, pg_sql

from .conftest import T0
from .pgdb import executed_plan, reads

JOBS = 20_000
N = 64


@pytest.fixture
def con(pg_db):
    url = pg_db()
    pg.connect(url).close()
    with psycopg.connect(url, autocommit=True) as con:
        for sql in events.SCHEMA:
            con.execute(pg_sql.STATEMENTS[sql])
        _fill(con)
        con.execute("VACUUM ANALYZE")
        yield con


def _fill(con: psycopg.Connection) -> None:
    """Jobs in seq order: the oldest 70% done, then pending (every 20th leased); by
    ``i % 3`` a plain job, a delivery to ep-a, or one to ep-b."""
    con.execute(
        """INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,
          deadline)
        SELECT CASE i %% 3 WHEN 0 THEN 'plain-' || i
          WHEN 1 THEN %(a)s || '-' || lpad(i::text, 16, '0')
          ELSE %(b)s || '-' || lpad(i::text, 16, '0') END, 1,
          CASE WHEN i <= %(done)s THEN 'done' WHEN i %% 20 = 1 THEN 'leased' ELSE 'pending' END,
          0, 3, 1, 0, %(deadline)s
        FROM generate_series(1, %(jobs)s) AS i ORDER BY i""",
        {
            "a": lanes.lane_of("ep-a"),
            "b": lanes.lane_of("ep-b"),
            "done": int(JOBS * 0.7),
            "jobs": JOBS,
            "deadline": T0 + 3_600_000,
        },
    )
    con.execute(
        "UPDATE jobs SET owner = 'o', lease_until = %s WHERE status = 'leased'", (T0 + 60_000,)
    )
    con.execute(
        """INSERT INTO asnackq_deliveries (job, event, endpoint, key)
        SELECT id, 'e' || seq, CASE WHEN id LIKE 'ep_a%' THEN 'ep-a' ELSE 'ep-b' END,
          'k' || seq % 50 FROM jobs WHERE id NOT LIKE 'plain-%'"""
    )


@pytest.mark.parametrize(
    "lane", [lanes.PLAIN, lanes.Lane("ep-a")], ids=["plain lane", "endpoint lane"]
)
@pytest.mark.parametrize(
    "sql",
    [w.SQL_NEXT_CLAIMABLE, w.SQL_NEXT_FRESH, w.SQL_NEXT_RECLAIMABLE, w.SQL_NEXT_FRESH_RECLAIMING],
    ids=["claimable", "fresh", "reclaimable", "fresh reclaiming"],
)
def test_a_lanes_claim_reads_a_claims_worth_of_rows_with_fresh_statistics(con, lane, sql):
    text, params = lanes.text(lane, sql, {"now": T0, "n": N, "losses": 3})
    found = reads(executed_plan(con, *pg_sql.translate(text, params), client=True))
    queue = ("jobs", "asnackq_deliveries")
    assert not [r for r in found if r.kind == "Seq Scan" and r.relation in queue], found
    jobs = sum(r.visited for r in found if r.relation == "jobs")
    assert jobs <= 4 * N, found  # (a plain lane's jobs are a third of those pending)

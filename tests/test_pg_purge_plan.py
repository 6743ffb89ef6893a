"""A purge on PostgreSQL reads a batch's worth of rows whatever the table's statistics say.

Statistics taken while the queue had no done jobs (autovacuum's last ANALYZE before most
of them finished) make the planner expect one done row: the purge must still read its
batch once, not once per done job.
"""

from __future__ import annotations

import psycopg

from asnackq.store import pg, pg_sql, retention

from .conftest import T0
from .pgdb import executed_plan, reads

JOBS = 6_000
LIMIT = 200


def _join_filtered(node: dict) -> int:
    """Rows the plan's joins discarded."""
    own = node.get("Rows Removed by Join Filter", 0)
    return own + sum(_join_filtered(child) for child in node.get("Plans", ()))


def test_a_purge_reads_a_batch_once_with_statistics_of_a_queue_with_nothing_done(pg_db):
    url = pg_db()
    pg.connect(url).close()
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")
        con.execute(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
            " deadline) SELECT 'j' || i, 1, 'pending', 0, 3, 0, 0, %s"
            " FROM generate_series(1, %s) AS i",
            (T0, JOBS),
        )
        con.execute("VACUUM ANALYZE jobs")
        con.execute("UPDATE jobs SET status = 'done', attempts = 1 WHERE seq <= %s", (JOBS - 100,))
        plan = executed_plan(
            con,
            *pg_sql.translate(
                retention.SQL_PURGE["done"], {"after": 0, "cutoff": T0, "limit": LIMIT}
            ),
        )
        visited = sum(r.visited for r in reads(plan)) + _join_filtered(plan)
        assert visited <= 10 * LIMIT, plan

"""The sink's inbox on PostgreSQL: its statements keyed to ``http_sink``'s, registered with
``asnackq.pg_sql`` when a sink opens a ``postgresql://`` URL.

Rules of this module:

* Several sink processes (replicas, on one host or many) share one inbox.  The group
  commit's plan (``inbox.plan_inbox``) runs unchanged; only its first read differs:
  before reading which ids are known, it takes a transaction lock per id of the batch, in
  one global order.  A duplicate arriving at another replica at the same moment waits for
  the replica deciding it, then reads it applied: each effect once, no duplicate key, no
  deadlock (every replica takes those locks first, and the stock row after them).
* The read runs inside a function so that it sees what was committed while it waited
  (READ COMMITTED takes a statement's snapshot when the statement starts).
"""

from __future__ import annotations

from asnackq import pg_sql
from asnackq.inbox import (
    SINK_SCHEMA,
    SQL_ADD_STOCK,
    SQL_APPLY,
    SQL_KNOWN,
    SQL_RECORD,
    SQL_SEEN_AGAIN,
    SQL_STOCK,
)

__all__ = ["SINK"]

SQL_KNOWN_FUNCTION = """
CREATE OR REPLACE FUNCTION asnackq_inbox_known(ids TEXT[]) RETURNS TABLE (id TEXT, qty INTEGER)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  PERFORM pg_advisory_xact_lock(key) FROM (
    SELECT DISTINCT hashtextextended(one, 0) AS key FROM unnest(ids) AS one ORDER BY key) AS keys;
  RETURN QUERY SELECT inbox.id, inbox.qty FROM inbox WHERE inbox.id = ANY(ids);
END $$"""

SINK = pg_sql.Schema(
    "sink",
    1,
    ("inbox", "stock"),
    (
        """CREATE TABLE IF NOT EXISTS inbox (id TEXT PRIMARY KEY, qty INTEGER NOT NULL,
  first_token BIGINT, last_token BIGINT, deliveries INTEGER NOT NULL,
  applied_at_ms BIGINT NOT NULL, last_seen_ms BIGINT NOT NULL)""",
        "CREATE TABLE IF NOT EXISTS stock (one INTEGER PRIMARY KEY CHECK (one = 1),"
        " total BIGINT NOT NULL)",
        "INSERT INTO stock (one, total) VALUES (1, 0) ON CONFLICT (one) DO NOTHING",
        SQL_KNOWN_FUNCTION,
    ),
)

pg_sql.SCHEMAS[SINK_SCHEMA] = SINK
pg_sql.register(
    {
        SQL_KNOWN: "SELECT id, qty FROM asnackq_inbox_known("
        "ARRAY(SELECT json_array_elements_text(%s::json)))",
        **{
            sql: pg_sql.placeholders(sql)
            for sql in (SQL_APPLY, SQL_SEEN_AGAIN, SQL_ADD_STOCK, SQL_STOCK, SQL_RECORD)
        },
        **{sql: sql for sql in SINK.ddl},
    }
)

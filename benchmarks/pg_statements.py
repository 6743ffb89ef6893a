"""Where the PostgreSQL server's time goes per job: ``cpu_per_job.py``'s PostgreSQL run once,
then its statements by ``pg_stat_statements`` (with planning tracked), WAL bytes per job
and each table's inserts, updates and HOT updates.

    python benchmarks/pg_statements.py [--jobs 20000] [--concurrency 64]

Printed per statement, most expensive first: calls, rows, execution and planning time per
job (us), WAL records and bytes per job, and the statement's opening.
"""

from __future__ import annotations

import argparse

import psycopg
from cpu_per_job import run_worker
from pg_queue import database, fill

from asnackq.lab.pg_server import DURABLE, local_server

STATEMENTS = """
SELECT calls, rows, total_exec_time, total_plan_time, wal_records, wal_bytes,
  left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC LIMIT %s"""
TABLES = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
WHERE n_tup_ins + n_tup_upd > 0 ORDER BY relname"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    settings = {
        **DURABLE,
        "shared_preload_libraries": "pg_stat_statements",
        "pg_stat_statements.track_planning": "on",
    }
    with local_server(settings) as server, database(server.url(), "bench_stmts") as url:
        with psycopg.connect(url, autocommit=True) as con:
            con.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        fill(url, args.jobs, "p")
        with psycopg.connect(url, autocommit=True) as con:
            con.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
            row = con.execute("SELECT pg_current_wal_lsn()").fetchone()
            assert row is not None
            start = row[0]
        report = run_worker(url, args.concurrency, server.data)
        jobs = args.jobs
        print(", ".join(f"{name} {value:.1f}" for name, value in report.items()))
        with psycopg.connect(url, autocommit=True) as con:
            row = con.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (start,))
            wal = row.fetchone()
            assert wal is not None
            print(f"WAL bytes per job {float(wal[0]) / jobs:.0f}")
            print("calls rows exec_us/job plan_us/job wal_rec/job wal_B/job statement")
            for calls, rows, exec_ms, plan_ms, records, size, query in con.execute(
                STATEMENTS, (args.top,)
            ):
                print(
                    f"{calls} {rows} {exec_ms * 1e3 / jobs:.1f} {plan_ms * 1e3 / jobs:.1f}"
                    f" {records / jobs:.2f} {float(size) / jobs:.0f} {query}"
                )
            print("table inserts updates hot_updates")
            for table in con.execute(TABLES):
                print(*table)


if __name__ == "__main__":
    main()

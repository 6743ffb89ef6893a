"""An intake's new jobs and a cycle's kept requests on SQLite as one INSERT over a JSON array
(``sqlite_aio.SETS``): the same rows as the core's statement run once per row, numbered in
the same order."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.store import attempts, sqlite_aio
from asnackq.store.sets import as_set

from .settles import ODD_IDS

_JOBS = "SELECT * FROM jobs ORDER BY seq"
_KEPT = "SELECT * FROM asnackq_attempts ORDER BY seq"


def inserted(
    path: Path, sql: str, params: list[Any], state: str, as_one: bool, jobs: tuple[str, ...] = ()
) -> list[Any]:
    """What inserting ``params`` leaves in a fresh queue file (holding ``jobs``, numbered in
    that order): by the set or row by row."""
    con = w.open_queue(path)
    con.isolation_level = None
    for create in (*attempts.SQL_CREATE, *attempts.SQL_INDEXES):
        con.execute(create)
    for job in jobs:
        con.execute(w.SQL_INSERT_JOB, (job, 1, 3, 0, 60_000))
    found = as_set(sqlite_aio.SETS, sql, params)
    assert found is not None
    con.execute("BEGIN IMMEDIATE")
    cursor = con.execute(*found) if as_one else con.executemany(sql, params)
    assert cursor.rowcount == len(params)
    con.execute("COMMIT")
    rows = [tuple(row) for row in con.execute(state)]
    types = con.execute(f"SELECT * FROM ({state}) LIMIT 1").fetchone()
    con.close()
    return [rows, [type(v) for v in types]]


def test_an_intakes_jobs_as_one_set_land_what_the_inserts_row_by_row_land(tmp_path):
    """Ids that JSON escapes or that read as numbers, the largest times, in an order that is
    not the ids' order: the same rows, the same types, the same seqs."""
    now, ttl = w.MAX_TOKEN - w.PRODUCT.ttl_ms, w.PRODUCT.ttl_ms
    ids = ["z9", *ODD_IDS, *(f"j{n}" for n in range(300, 0, -7))]
    params = [(job, n % 1000 + 1, n % 16 + 1, now, now + ttl) for n, job in enumerate(ids)]
    by_rows = inserted(tmp_path / "a.db", w.SQL_INSERT_JOB, params, _JOBS, as_one=False)
    at_once = inserted(tmp_path / "b.db", w.SQL_INSERT_JOB, params, _JOBS, as_one=True)
    assert at_once == by_rows
    assert [row[1] for row in at_once[0]] == ids
    assert at_once[0][0] == (1, "z9", 1, "pending", 0, 1, 0, now, w.MAX_TOKEN, None, None, None)


def test_a_cycles_requests_as_one_set_land_what_the_inserts_row_by_row_land(tmp_path):
    """Answers with escapes, non-ASCII, U+FFFD, none; a status or none: the same rows, each
    under its job's seq (none for a job not there)."""
    odd = attempts.excerpt(b'\x00"\\\n\t\\u0041\xff' + "é😀\u2028".encode() + b'}{][,"')
    records = [
        attempts.Record("j2", 7, 2, 1_000, 503, 7, "away", odd),
        attempts.Record("j1", 1, 1, 1_001, None, 0, "timing_out", "no answer in 0.5 s"),
        attempts.Record("j2", 7, 2, 1_002, 200, 65_535, "ok", ""),
        attempts.Record("1e3", w.MAX_TOKEN, 16, w.MAX_TOKEN, 299, 3, "ok", '{"ack": 1}'),
    ]
    sql = attempts.SQL_RECORD
    jobs = ("j2", "j1")
    by_rows = inserted(tmp_path / "a.db", sql, list(records), _KEPT, False, jobs)
    at_once = inserted(tmp_path / "b.db", sql, list(records), _KEPT, True, jobs)
    assert at_once == by_rows
    assert [row[1:-1] for row in at_once[0]] == [tuple(r) for r in records]
    assert [row[-1] for row in at_once[0]] == [1, 2, 1, None]


def test_an_insert_naming_a_job_twice_or_of_one_row_runs_row_by_row():
    """A repeated id must meet the id's UNIQUE constraint as the row-by-row insert does."""
    row = ("a", 1, 3, 0, 1)
    assert as_set(sqlite_aio.SETS, w.SQL_INSERT_JOB, [row, row]) is None
    assert as_set(sqlite_aio.SETS, w.SQL_INSERT_JOB, [row]) is None
    assert as_set(sqlite_aio.SETS, w.SQL_INSERT_JOB, [row, ("b", 1, 3, 0, 1)]) is not None


async def test_an_intake_on_sqlite_inserts_its_jobs_in_one_statement(tmp_path):
    """Through aiosqlite: ``enqueue_many`` sends one INSERT for its new jobs, numbered in the
    intake's order; an id already there reads False, another qty a Conflict, as before."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "k", "qty": 2}, now_ms=5)
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        events = [{"id": f"e{n}", "qty": 1} for n in (3, 1, 2)]
        found = await q.enqueue_many([*events, {"id": "k", "qty": 2}, {"id": "k", "qty": 3}], 9)
        await q._db.db.set_trace_callback(None)
    assert found[:4] == [True, True, True, False] and isinstance(found[4], w.Conflict)
    assert len([s for s in seen if s.lstrip().startswith("INSERT INTO jobs")]) == 1
    con = sqlite3.connect(path)
    rows = con.execute("SELECT id, qty, status, available_at FROM jobs ORDER BY seq").fetchall()
    con.close()
    assert rows == [("k", 2, "pending", 5), *((f"e{n}", 1, "pending", 9) for n in (3, 1, 2))]

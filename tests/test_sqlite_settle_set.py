"""A cycle's settle on SQLite as one UPDATE over a JSON array (``sqlite_aio.SETS``).

The set statement must land exactly what the core's fenced write, run once per row, lands,
and must find each job by its id (reading the array once): a plan that walked the leased
jobs for every row of the array would make a settle of n jobs cost n times the lease.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store import sqlite_aio
from asnackq.store.sets import as_set

from .settles import NOW, ODD_IDS, of_every_kind, settle

_INSERT = """INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,
  deadline, owner, lease_until) VALUES (?, 1, ?, 1, 3, 1, ?, ?, ?, ?)"""
_STATE = "SELECT id, status, reason, available_at, owner, lease_until FROM jobs ORDER BY seq"


def queue(path: Path) -> sqlite3.Connection:
    con = w.open_queue(path)
    con.isolation_level = None
    return con


def landed(con: sqlite3.Connection, run: Any) -> tuple[int, list[Any]]:
    """What ``run(con)`` changes (its row count) and leaves, rolled back after."""
    con.execute("BEGIN IMMEDIATE")
    try:
        return run(con), con.execute(_STATE).fetchall()
    finally:
        con.execute("ROLLBACK")


def test_a_settle_as_one_set_lands_what_the_writes_row_by_row_land(tmp_path):
    """Finishes, a retry, a death, an extension, stale fences, NULLs, jobs of every status
    and ids that JSON must escape (or that read as numbers): the same rows changed, the
    same values left."""
    con = queue(tmp_path / "q.db")
    jobs = ODD_IDS + [f"j{n}" for n in range(10)]
    rows = of_every_kind(jobs)
    for job in jobs:
        con.execute(_INSERT, (job, "leased", NOW, NOW + 10, "o", NOW + 5))
    for n, status in enumerate(w.STATUSES):  # a fence that matches all but the status
        con.execute(_INSERT, (f"s{n}", status, NOW, NOW + 10, "o", NOW + 5))
        rows.append(settle(f"s{n}", stale=False))
    found = as_set(sqlite_aio.SETS, w.SQL_SETTLE, rows)
    assert found is not None and found[0] == sqlite_aio.SQLITE_SETTLE_SET
    by_rows = landed(con, lambda c: c.executemany(w.SQL_SETTLE, rows).rowcount)
    at_once = landed(con, lambda c: c.execute(*found).rowcount)
    assert at_once == by_rows
    assert by_rows[0] == 13  # 16 leased, 4 of them stale; the leased one of the statuses
    assert ("back\\slash", "pending", "5xx", 2**62 + 1, None, None) in by_rows[1]
    assert ("caf\u00e9 \u2603 \U0001f600", "leased", None, NOW, "o", NOW + 5) in by_rows[1]
    assert ('q"uote', "done", None, NOW, None, None) in by_rows[1]


def test_the_set_settle_reads_its_array_once_and_finds_each_job_by_id(tmp_path):
    """With fresh statistics, none, and a lane's index on (status, id): the array is
    scanned once, each of its rows finds its job through the id's index."""
    con = queue(tmp_path / "q.db")
    con.execute("BEGIN IMMEDIATE")
    for n in range(3_000):
        status = ("leased", "done", "pending")[n % 3]
        con.execute(_INSERT, (f"j{n}", status, NOW, NOW + 10, "o", NOW + 5))
    con.execute("COMMIT")

    def plan() -> list[str]:
        explained = con.execute("EXPLAIN QUERY PLAN " + sqlite_aio.SQLITE_SETTLE_SET, ("[]",))
        # (the array's scan: its virtual table's index number is SQLite's own business)
        return [re.sub(r" VIRTUAL TABLE INDEX .*", "", row[3]) for row in explained]

    expected = ["SCAN json_each", "SEARCH jobs USING INDEX sqlite_autoindex_jobs_1 (id=?)"]
    assert plan() == expected
    con.execute("ANALYZE")
    assert plan() == expected
    con.execute(lanes.LANE_INDEX)
    con.execute("ANALYZE")
    assert plan() == expected


def test_one_row_or_a_job_named_twice_runs_row_by_row():
    """One UPDATE changes a row once: a settle naming a job twice (an extension, then
    another) is no set; neither is a settle of one row (its own statement is cheaper)."""
    first = settle("a", stale=False) | {"status": "leased", "new_owner": "o"}
    assert as_set(sqlite_aio.SETS, w.SQL_SETTLE, [first, settle("a", stale=False)]) is None
    assert as_set(sqlite_aio.SETS, w.SQL_SETTLE, [settle("a", stale=False)]) is None
    assert as_set(sqlite_aio.SETS, w.SQL_JOBS, [settle("a", False), settle("b", False)]) is None


@pytest.mark.parametrize("count", [0, 1])
async def test_a_cycle_on_sqlite_settles_its_jobs_in_one_statement(tmp_path, count):
    """Through aiosqlite: a cycle finishing four jobs and extending two sends one UPDATE for
    the six (alone, or with the claims' reads), and lands each as finish and extend one by
    one would; a stale ticket lands nothing."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        for n in range(8):
            assert await q.enqueue({"id": f"j{n}", "qty": 1}, now_ms=NOW)
        tickets = [await q.claim("o", NOW + 1, lease_ms=30_000) for _ in range(7)]
        assert all(tickets)
        stale = dict(tickets[6], token=tickets[6]["token"] + 1)
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        outcomes = ("ok", "retry", "permanent", "ok")
        results = [(t, o, NOW + 2, 1_000) for t, o in zip(tickets, outcomes, strict=False)]
        results.append((stale, "ok", NOW + 2, 0))  # type: ignore[arg-type]
        statuses, extended, claimed, _ = await q.cycle(
            results, tickets[4:6], "o", NOW + 3, 60_000, count
        )
        await q._db.db.set_trace_callback(None)
    settles = [s for s in seen if s.lstrip().startswith("UPDATE jobs SET status = x.status")]
    assert len(settles) == 1
    assert not [s for s in seen if "coalesce(:available_at" in s]
    assert statuses == ["done", "pending", "dead", "done", False]
    assert [t["lease_until"] for t in extended] == [NOW + 3 + 60_000] * 2  # type: ignore[index]
    assert [t["id"] for t in claimed] == ["j7"] * count
    con = sqlite3.connect(path)
    state = con.execute("SELECT id, status, available_at, lease_until FROM jobs").fetchall()
    con.close()
    assert state[:7] == [
        ("j0", "done", NOW + 2, None),
        ("j1", "pending", NOW + 2 + 1_000, None),
        ("j2", "dead", NOW + 2, None),
        ("j3", "done", NOW + 2, None),
        ("j4", "leased", NOW, NOW + 3 + 60_000),
        ("j5", "leased", NOW, NOW + 3 + 60_000),
        ("j6", "leased", NOW, NOW + 1 + 30_000),
    ]

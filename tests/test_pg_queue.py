"""PostgreSQL specifics: the schema and its version, claims that skip locked rows, errors.

The queue's behaviour itself is the conformance suite's (``test_core_queue`` runs every
scenario on PostgreSQL through the sync and the async driver).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from functools import partial

import psycopg
import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.lab.pg_server import free_port
from asnackq.store import pg, pg_sql, sessions

from .conftest import T0
from .pgdb import done_statistics, executed_plan, query, reads


@pytest.fixture
def url(pg_db):
    return pg_db()


def test_the_schema_is_created_once_with_its_version(url):
    pg.connect(url).close()
    assert query(url, "SELECT part, version FROM asnackq_schema") == [("queue", 1)]
    tables = {
        name
        for (name,) in query(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    }
    assert tables == {"jobs", "redrives", "asnackq_schema"}
    created = query(url, "SELECT created_at FROM asnackq_schema")
    pg.connect(url).close()
    assert query(url, "SELECT created_at FROM asnackq_schema") == created  # nothing redone


def test_many_sessions_opening_an_empty_database_at_once_all_succeed(url):
    failures = []

    def open_one():
        try:
            pg.connect(url).close()
        except Exception as error:
            failures.append(error)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert query(url, "SELECT part, version FROM asnackq_schema") == [("queue", 1)]


def test_a_newer_schema_is_refused_and_an_absent_one_not_created(url):
    with pytest.raises(ValueError, match="no queue here"):
        pg.connect(url, create=False)
    assert query(url, "SELECT to_regclass('jobs')") == [(None,)]
    pg.connect(url).close()
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("UPDATE asnackq_schema SET version = 2")
    with pytest.raises(ValueError, match="version 2, newer than this asnackq knows"):
        pg.connect(url)
    with pytest.raises(ValueError, match="newer than this asnackq knows"):
        sessions.require(url)  # not mistaken for "no queue here"


async def test_async_queue_opens_a_url_with_the_product_limits(url):
    async with AsyncQueue.open(url) as queue:
        assert queue.limits == w.PRODUCT
        day = 24 * 3_600_000
        assert await queue.enqueue({"id": "a", "qty": 1}, T0, 30 * day) is True
        ticket = await queue.claim("w1", T0, 3_600_000)
        assert ticket["lease_until"] == T0 + 3_600_000
        assert await queue.finish(ticket, "retry", T0 + 1, 3_600_000) == "pending"


def test_claims_do_not_visit_finished_rows(url):
    con = pg.connect(url)
    with con.cursor() as cursor:
        cursor.execute(
            "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
            " available_at, deadline) SELECT 'd' || i, 1, 'done', 1, 3, 1, 0, 1"
            " FROM generate_series(1, 20000) AS i"
        )
        cursor.execute("ANALYZE jobs")
        for sql in (w.SQL_QUARANTINE, w.SQL_QUARANTINE_DUE, w.SQL_NEXT_CLAIMABLE):
            text, params = pg_sql.translate(sql, {"now": T0, "n": 8})
            plan = " ".join(row[0] for row in cursor.execute("EXPLAIN " + text, params))
            assert "Seq Scan on jobs" not in plan, plan
    con.close()


def test_claims_read_a_claims_worth_of_rows_whatever_the_statistics_say(url):
    """No statistics yet, statistics taken on a full queue that is now mostly done, and
    statistics that describe it: each claim's read walks its index and visits about as many
    rows as it claims; the quarantine's check of deadlines and leases visits none (it has no
    work).  (Its count of spent budgets is read from ``jobs_spent`` while the table's pages
    are marked all-visible; a transaction elsewhere that holds back VACUUM can make the
    planner read the table instead: that is not asserted here.)"""
    con = pg.connect(url)
    con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")  # the test takes them
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
        " available_at, deadline) SELECT 'p' || i, 1, 'pending', 0, 3, 0, 0, %s"
        " FROM generate_series(1, 8000) AS i",
        (T0 + 3_600_000,),
    )
    n = 16
    checked = (
        w.SQL_QUARANTINE_DUE,
        w.SQL_QUARANTINE_DUE_RECLAIMING,
        w.SQL_NEXT_CLAIMABLE,
        w.SQL_NEXT_FRESH,
        w.SQL_NEXT_RECLAIMABLE,
        w.SQL_NEXT_FRESH_RECLAIMING,
    )

    def check(state: str) -> None:
        for sql in checked:
            plan = executed_plan(con, *pg_sql.translate(sql, {"now": T0, "n": n, "losses": 3}))
            jobs = [r for r in reads(plan) if r.relation == "jobs" and not r.counted]
            assert jobs, (state, sql)
            kinds = {r.kind for r in jobs}
            assert not kinds & {"Seq Scan", "Bitmap Heap Scan"}, (state, sql, jobs)
            bound = 0 if sql in checked[:2] else 2 * n
            assert sum(r.visited for r in jobs) <= bound, (state, sql, jobs)

    check("no statistics")
    con.execute("ANALYZE jobs")
    con.execute("UPDATE jobs SET status = 'done' WHERE id < 'p7'")  # about 6,700 done
    check("statistics of a full queue")
    con.execute("VACUUM ANALYZE jobs")
    check("statistics of a queue mostly done")
    con.close()


def test_the_quarantines_check_counts_spent_budgets_by_their_index_with_statistics(url):
    """With statistics taken while many jobs are pending, the check of spent budgets (a
    count of pending jobs whose attempts reach their budget) was planned as a read of the
    whole table, every cycle; ``jobs_spent`` holds exactly those jobs.  A queue's session
    plans no sequential scan where an index serves (``pg.SQL_CLAIMING``), nor JIT."""
    con = pg.connect(url)  # (a queue's session, as claims run on)
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) SELECT 'j' || i, 1, CASE WHEN i %% 5 = 0 THEN 'pending' ELSE 'done' END,"
        " 1, 3, 1, 0, %s FROM generate_series(1, 100000) AS i",
        (T0 + 3_600_000,),
    )
    con.execute("ANALYZE jobs")
    plan = executed_plan(con, pg_sql.STATEMENTS[w.SQL_QUARANTINE_DUE_RECLAIMING], {"now": T0})
    assert all(read.kind != "Seq Scan" and read.visited < 100 for read in reads(plan)), reads(plan)
    [(jit,)] = con.execute("SHOW jit").fetchall()
    assert jit == "off"
    con.close()


def test_with_statistics_that_count_no_pending_job_a_lease_finds_its_jobs_by_seq(url):
    """Statistics taken while the table held only done jobs (a held snapshot's table of done
    versions) count no pending or leased job.  A lease of 300 was then planned as a walk of
    every pending and leased entry of ``jobs_by_deadline``, filtered by seq (110-155 ms under
    a held snapshot); a lease, a reclaiming lease and a poisoning find their jobs by seq."""
    con = pg.connect(url)
    done_statistics(con, T0 + 3_600_000, T0)
    seqs = "[" + ",".join(str(seq) for seq in range(96001, 96301)) + "]"
    for sql, params in (
        (w.SQL_LEASE, ("o", T0 + 60_000, seqs)),
        (w.SQL_LEASE_RECLAIMING, ("o", T0 + 60_000, seqs)),
        (w.SQL_POISON, (seqs,)),
    ):
        plan = executed_plan(con, pg_sql.STATEMENTS[sql], params)
        assert index_names(plan) == ["jobs_pkey"], (sql, index_names(plan))
    con.close()


def index_names(node: dict[str, object]) -> list[str]:
    """The indexes an executed plan's scans read, in plan order."""
    found = [str(node["Index Name"])] if "Index Name" in node else []
    for child in node.get("Plans", ()):  # type: ignore[attr-defined]
        found += index_names(child)
    return found


def test_a_cycles_settle_finds_its_jobs_by_id_whatever_the_statistics_say(url):
    """The settle of a cycle's finishes (one UPDATE over a JSON set) looks each job up by
    id, with no statistics and with statistics of the table: a read of the whole table
    per settle (a hash join over a scan of ``jobs``) grows with the table and its dead
    rows, 65 ms a settle of 400 at 5,000 jobs."""
    con = pg.connect(url)
    con.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")  # the test takes them
    con.execute(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline, owner, lease_until) SELECT 'j' || i, 1,"
        " CASE WHEN i <= 400 THEN 'leased' ELSE 'pending' END, 1, 3, 1, 0, %s, 'o', %s"
        " FROM generate_series(1, 5000) AS i",
        (T0 + 3_600_000, T0 + 60_000),
    )
    settles = [
        {
            **dict.fromkeys(("reason", "available_at", "new_owner", "new_lease_until")),
            **{"id": f"j{i}", "token": 1, "owner": "o", "attempt": 1},
            **{"lease_until": T0 + 60_000, "status": "done"},
        }
        for i in range(1, 401)
    ]
    found = pg_sql.many(w.SQL_SETTLE, settles)
    assert found is not None  # (one set statement for the 400)
    text, params = found

    def check(state: str) -> None:
        plan = executed_plan(con, text, params)
        jobs = [r for r in reads(plan) if r.relation == "jobs"]
        assert jobs and not {r.kind for r in jobs} & {"Seq Scan"}, (state, jobs)
        assert sum(r.visited for r in jobs) <= 2 * len(settles), (state, jobs)

    check("no statistics")
    con.execute("ANALYZE jobs")
    check("statistics")
    con.execute("UPDATE jobs SET status = 'done' WHERE status = 'pending'")  # dead versions
    con.execute("UPDATE jobs SET status = 'leased' WHERE status = 'done'")
    con.execute("ANALYZE jobs")
    check("statistics of a table of dead versions")
    con.close()


def test_a_claim_skips_rows_another_claim_holds(url):
    """Two claims at once never wait for each other and never take the same job."""
    one, two = pg.connect(url), pg.connect(url)
    pg.drive(
        one, w.plan_enqueue_many([({"id": f"j{i}", "qty": 1}, 10_000, 3) for i in range(4)], T0)
    )
    held = []

    def second_claim(point):  # runs inside the first claim's open transaction
        if point == "after-claim":
            held.append(pg.drive(two, w.plan_claim_many("w2", T0, 1000, 2)))

    first = pg.drive(one, w.plan_claim_many("w1", T0, 1000, 2))
    ticket = pg.drive(one, w.plan_claim("w1", T0, 1000), second_claim)
    assert [t["id"] for t in first] == ["j0", "j1"] and ticket["id"] == "j2"
    assert [t["id"] for t in held[0]] == ["j3"]
    one.close()
    two.close()


def test_an_unreachable_server_is_one_line_without_the_password():
    url = f"postgresql://someone:hunter2@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(pg.Unreachable) as raised:
        pg.connect(url)
    message = str(raised.value)
    assert "hunter2" not in message and "\n" not in message
    assert message.startswith("cannot connect to postgresql://someone:***@127.0.0.1:")
    assert "refused" in message


def test_a_refused_login_is_one_line_without_the_password(pg_server):
    with pytest.raises(pg.Unreachable) as raised:
        pg.connect(pg_server.tcp_url("intruder", "hunter2"))
    message = str(raised.value)
    assert "hunter2" not in message and "\n" not in message
    assert "password authentication failed" in message


def test_a_malformed_url_is_one_line_without_the_password():
    url = "postgresql://someone:hunter2@[::1/db"
    with pytest.raises(ValueError, match="not a usable PostgreSQL URL") as raised:
        pg.connect(url)
    assert "hunter2" not in str(raised.value) and "someone:***@" in str(raised.value)


def test_a_session_that_vanishes_mid_transaction_is_ended_by_the_server(url):
    con = pg.connect(url)
    assert con.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("10s",)
    con.close()


def test_a_statement_without_a_postgresql_text_is_a_bug_not_a_guess():
    with pytest.raises(KeyError, match="no PostgreSQL text"):
        pg_sql.translate("DELETE FROM jobs", ())


def test_concurrent_intakes_of_the_same_ids_insert_each_once(url):
    """Two sessions enqueue the same new ids at once: one inserts each, the other sees it
    there (a transaction that hit the other's key first is retried, not failed)."""
    sessions = [pg.connect(url), pg.connect(url)]
    results: list[list] = [[], []]
    go = threading.Barrier(2)

    def intake(n):
        go.wait()
        for start in range(0, 400, 40):
            items = [({"id": f"j{i}", "qty": 1}, 10_000, 3) for i in range(start, start + 40)]
            make = partial(w.plan_enqueue_many, items, T0)
            results[n] += pg.drive(sessions[n], make(), make=make)

    threads = [threading.Thread(target=intake, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for session in sessions:
        session.close()
    assert [a + b for a, b in zip(*results, strict=True)] == [1] * 400
    assert query(url, "SELECT count(*) FROM jobs") == [(400,)]


async def test_concurrent_async_intakes_of_the_same_ids_insert_each_once(url):
    async with AsyncQueue.open(url) as one, AsyncQueue.open(url) as two:
        items = [({"id": f"j{i}", "qty": 1}, 10_000, 3) for i in range(300)]
        got = await asyncio.gather(
            *(
                queue.enqueue_many(items[start : start + 30], T0)
                for start in range(0, 300, 30)
                for queue in (one, two)
            )
        )
    assert sum(r is True for batch in got for r in batch) == 300
    assert query(url, "SELECT count(*) FROM jobs") == [(300,)]


@pytest.mark.process
@pytest.mark.parametrize("required", [False, True])
def test_without_binaries_the_pg_tests_skip_or_fail_when_required(required, tmp_path):
    env = {
        **os.environ,
        "ASNACKQ_PG_BINDIR": str(tmp_path),
        "ASNACKQ_REQUIRE_PG": str(int(required)),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "tests/test_pg_queue.py",
            "-k",
            "schema_is_created",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    if required:
        assert run.returncode == 1, run.stdout
        assert "ASNACKQ_REQUIRE_PG=1 but PostgreSQL binaries" in run.stdout
    else:
        assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout
        assert "PostgreSQL binaries (initdb, pg_ctl) not found" in run.stdout

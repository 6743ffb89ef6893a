"""A PostgreSQL transaction's BEGIN goes with its plan's first statement: one round trip
fewer for every transaction, the statement's parameters bound client-side exactly as the
server would take them, and a first statement that fails leaves nothing open."""

from __future__ import annotations

import asyncio
import json
import tempfile
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.store import attempts, pg

from .pgdb import query
from .slow_commit import in_commit


def round_trips(trace: str) -> int:
    """The queries a libpq trace shows answered: one ReadyForQuery each."""
    return sum(1 for line in trace.splitlines() if "\tB\t" in line and "ReadyForQuery" in line)


async def traced_intake(con: psycopg.AsyncConnection, job_id: str) -> str:
    with tempfile.TemporaryFile("w+") as out:
        con.pgconn.trace(out.fileno())
        try:
            assert await pg.adrive(con, w.plan_enqueue({"id": job_id, "qty": 1}, 1_000, 60_000))
        finally:
            con.pgconn.untrace()
        out.seek(0)
        return out.read()


async def test_an_intake_is_three_round_trips_its_read_sent_with_begin(pg_db) -> None:
    con = await pg.aconnect(pg_db())
    try:
        trace = await traced_intake(con, "j1")
        # BEGIN with the read of the id, the INSERT with the read of the transaction's id
        # (which the INSERT gave it), COMMIT
        assert round_trips(trace) == 3, trace
        sent = [line for line in trace.splitlines() if "\tF\t" in line]
        assert sum("pg_current_xact_id_if_assigned" in line for line in sent) == 1
        first = trace.split("\tQuery\t", 1)[1]
        assert first.lstrip(' "').startswith("BEGIN;") and "FROM jobs WHERE id = 'j1'" in first
        assert con.info.transaction_status == TransactionStatus.IDLE
        rows = await (await con.execute("SELECT id, status FROM jobs")).fetchall()
        assert rows == [("j1", "pending")]
    finally:
        await con.close()


async def test_an_intake_cut_in_its_commit_names_the_transaction_its_insert_gave(pg_db):
    """The transaction's id comes back with the INSERT, in its round trip: a session cut
    while its COMMIT is on the way raises ``CommitCut`` naming that transaction, which the
    server then reports aborted (a deferred trigger holds the COMMIT a second)."""
    url = pg_db()
    con = await pg.aconnect(url)
    try:
        query(
            url,
            """CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$""",
        )
        query(
            url,
            """CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON jobs DEFERRABLE
            INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()""",
        )
        pid = con.info.backend_pid
        plan = w.plan_enqueue({"id": "j1", "qty": 1}, 1_000, 60_000)
        running = asyncio.ensure_future(pg.adrive(con, plan))
        await in_commit(url, pid)
        query(url, "SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(pg.CommitCut) as cut:
            await asyncio.wait_for(running, 30)
        assert cut.value.result is True
        status = query(url, "SELECT pg_xact_status(%s::xid8)", (cut.value.begun[0],))
        assert status == [("aborted",)]
        assert query(url, "SELECT count(*) FROM jobs") == [(0,)]
    finally:
        await con.close()


@pytest.mark.parametrize(
    "value",
    [
        "a'b\\c\"d",
        "é😀\u2028\t\n",
        "%s %(x)s $1 ?",
        "';ROLLBACK;SELECT '",
        2**62,
        -(2**63),
        0,
        None,
        True,
        json.dumps({"k": "v'\\\"é"}),
    ],
)
async def test_a_first_statements_parameters_arrive_as_sent(pg_db, value) -> None:
    con = await pg.aconnect(pg_db())
    try:
        cursor = await pg.begun(con, "SELECT %s", (value,))
        assert con.info.transaction_status == TransactionStatus.INTRANS
        [(back,)] = await cursor.fetchall()
        assert back == value
        await con.execute("ROLLBACK")
    finally:
        await con.close()


FAILING = {  # (a change that makes the statement fail, its undoing, the server's error)
    "the first statement": (
        "ALTER TABLE jobs RENAME TO jobs_away",
        "ALTER TABLE jobs_away RENAME TO jobs",
        psycopg.errors.UndefinedTable,
    ),
    "the INSERT sent with the read of the id": (
        "ALTER TABLE jobs ADD CONSTRAINT small CHECK (qty < 1)",
        "ALTER TABLE jobs DROP CONSTRAINT small",
        psycopg.errors.CheckViolation,
    ),
}


@pytest.mark.parametrize("failing", list(FAILING))
async def test_a_failing_statement_leaves_no_transaction_open(pg_db, failing) -> None:
    """A statement that fails in its round trip (with BEGIN; with the read of the
    transaction's id) raises the server's error, nothing lands, and the session goes on
    the same way."""
    change, undo, error = FAILING[failing]
    con = await pg.aconnect(pg_db())
    try:
        await con.execute(change)
        with pytest.raises(error):
            await pg.adrive(con, w.plan_enqueue({"id": "j1", "qty": 1}, 1_000, 60_000))
        assert con.info.transaction_status == TransactionStatus.IDLE
        await con.execute(undo)
        assert await (await con.execute("SELECT count(*) FROM jobs")).fetchall() == [(0,)]
        trace = await traced_intake(con, "j1")  # the session goes on, the same way
        assert round_trips(trace) == 3
    finally:
        await con.close()


async def test_a_hook_first_and_a_plan_of_no_step_run_inside_a_transaction(pg_db) -> None:
    """BEGIN goes alone before a first step that is no statement, and at the end of a plan
    that had none: the hook sees the transaction open, and each transaction ends idle."""
    con = await pg.aconnect(pg_db())
    seen: list[TransactionStatus] = []

    def hooked() -> w.Plan[bool]:
        yield w.Hook("first")
        return (yield from w.plan_enqueue({"id": "j1", "qty": 1}, 1_000, 60_000))

    def empty() -> w.Plan[None]:
        return None, False
        yield  # (a generator of no step)

    try:
        assert await pg.adrive(con, hooked(), lambda _: seen.append(con.info.transaction_status))
        assert seen == [TransactionStatus.INTRANS]
        assert await pg.adrive(con, empty()) is None
        assert con.info.transaction_status == TransactionStatus.IDLE
        rows = await (await con.execute("SELECT id FROM jobs")).fetchall()
        assert rows == [("j1",)]
    finally:
        await con.close()


async def traced(con: psycopg.AsyncConnection, plan: w.Plan[Any]) -> tuple[Any, str]:
    with tempfile.TemporaryFile("w+") as out:
        con.pgconn.trace(out.fileno())
        try:
            result = await pg.adrive(con, plan)
        finally:
            con.pgconn.untrace()
        out.seek(0)
        return result, out.read()


async def test_a_cycles_settle_and_claims_go_in_one_round_trip(pg_db) -> None:
    """A Dispatcher's cycle sends its settle and its claims' reads at once (a pipeline):
    BEGIN with the read of the finished jobs, then settle and reads with the transaction's
    id (the settle's), the lease, COMMIT - 4 round trips, not 8 - and lands as before."""
    con = await pg.aconnect(pg_db())
    try:
        for n in range(6):
            assert await pg.adrive(con, w.plan_enqueue({"id": f"j{n}", "qty": 1}, 1_000, 60_000))
        (_, _, held, _), trace = await traced(
            con, w.plan_cycle([], [], "w1", 2_000, 5_000, 4, limits=w.PRODUCT)
        )
        assert [t["id"] for t in held] == ["j0", "j1", "j2", "j3"]
        results = [(held[0], "ok", 2_100, 0), (held[1], "retry", 2_100, 50)]
        cycle = w.plan_cycle(results, [], "w1", 2_100, 5_000, 1, limits=w.PRODUCT)
        (statuses, _, more, _), trace = await traced(con, cycle)
        assert round_trips(trace) == 4, trace
        assert statuses == ["done", "pending"]
        assert [t["id"] for t in more] == ["j4"]
        # one job's settle (its own statement, not a set) goes with the reads too
        one = [(held[2], "ok", 2_200, 0)]
        cycle = w.plan_cycle(one, [], "w1", 2_200, 5_000, 1, limits=w.PRODUCT)
        (statuses, _, more, _), trace = await traced(con, cycle)
        assert round_trips(trace) == 4, trace
        assert statuses == ["done"] and [t["id"] for t in more] == ["j1"]  # (its retry, due)
        assert con.info.transaction_status == TransactionStatus.IDLE
        rows = await (await con.execute("SELECT id, status FROM jobs ORDER BY seq")).fetchall()
        assert [s for _, s in rows] == ["done", "leased", "done", "leased", "leased", "pending"]
    finally:
        await con.close()


async def test_a_failing_statement_sent_at_once_leaves_no_transaction_open(pg_db) -> None:
    """A statement of a batch sent at once that fails raises the server's error, and the
    transaction is rolled back; a conflict (an intake of an id another session committed
    while this one waited for it) is retried from a fresh plan, as one by one."""
    url = pg_db()
    con = await pg.aconnect(url)
    rows = [("a", 1, 3, 0, 60_000), ("b", 1, 3, 0, 60_000)]
    made = []

    def plan() -> w.Plan[int]:
        made.append(1)
        _, found = yield w.Batch((w.SqlMany(w.SQL_INSERT_JOB, rows), w.Read(w.SQL_JOB, ("a",))))
        return len(found), True

    try:
        await con.execute("ALTER TABLE jobs ADD CONSTRAINT small CHECK (qty < 1)")
        with pytest.raises(psycopg.errors.CheckViolation):
            await pg.adrive(con, plan())
        assert con.info.transaction_status == TransactionStatus.IDLE
        await con.execute("ALTER TABLE jobs DROP CONSTRAINT small")
        other = await pg.aconnect(url)
        try:
            await other.execute("BEGIN")
            await other.execute(
                "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token,"
                " available_at, deadline) VALUES ('b', 1, 'pending', 0, 3, 0, 0, 1)"
            )
            made.clear()
            running = asyncio.create_task(pg.adrive(con, plan(), make=plan, attempts=3))
            await asyncio.sleep(0.2)  # (the batch waits for the other intake's lock on b)
            await other.execute("COMMIT")
            with pytest.raises(psycopg.errors.UniqueViolation):
                await asyncio.wait_for(running, 30)
        finally:
            await other.close()
        assert len(made) == 3  # (the conflict's plan made again twice)
        assert con.info.transaction_status == TransactionStatus.IDLE
        ids = await (await con.execute("SELECT id FROM jobs ORDER BY seq")).fetchall()
        assert ids == [("b",)]
        assert await pg.adrive(con, w.plan_enqueue({"id": "c", "qty": 1}, 1_000, 60_000))
    finally:
        await con.close()


@pytest.mark.parametrize("ran", range(1, 7))
@pytest.mark.parametrize("batch", [True, False])
async def test_a_statement_failing_in_a_pipeline_leaves_no_later_one_unusable(
    pg_db, batch, ran
) -> None:
    """psycopg prepares a statement at its sixth run; in a pipeline whose first statement
    fails, the server never parses the ones after it.  Were they prepared there, psycopg
    would take them as prepared and every later run on the session would fail
    (``InvalidSqlStatementName``): a batch's read, an intake's read of its transaction id.
    The failing run comes after ``ran`` good ones (one of them is the sixth run of the read
    after the INSERT, whatever else on the session ran it)."""
    url = pg_db()
    con = await pg.aconnect(url)

    def plan(n: int) -> w.Plan[int]:
        if not batch:
            results = yield from w.plan_enqueue({"id": f"j{n}", "qty": 1}, 1_000, 60_000)
            return results
        row = (f"j{n}", 1, 3, 0, 60_000)
        _, found = yield w.Batch(
            (w.SqlMany(w.SQL_INSERT_JOB, [row]), w.Read(w.SQL_JOB, (f"j{n}",)))
        )
        return len(found), True

    try:
        # rolled back seven times first: psycopg prepares ROLLBACK too, and once it has, a
        # ROLLBACK no longer makes it forget the statements it prepared
        assert await pg.adrive(con, w.plan_enqueue({"id": "c", "qty": 1}, 1_000, 60_000))
        for _ in range(7):
            with pytest.raises(w.Conflict):
                await pg.adrive(con, w.plan_enqueue({"id": "c", "qty": 2}, 1_000, 60_000))
        for n in range(ran):
            assert await pg.adrive(con, plan(n))
        # (from another session: psycopg forgets its prepared statements after an ALTER)
        query(url, "ALTER TABLE jobs ADD CONSTRAINT small CHECK (qty < 1) NOT VALID")
        with pytest.raises(psycopg.errors.CheckViolation):
            await pg.adrive(con, plan(ran))
        query(url, "ALTER TABLE jobs DROP CONSTRAINT small")
        for n in range(ran + 1, ran + 4):
            assert await pg.adrive(con, plan(n))
        ids = await (await con.execute("SELECT id FROM jobs ORDER BY seq")).fetchall()
        kept = [*range(ran), *range(ran + 1, ran + 4)]
        assert [i for (i,) in ids] == ["c", *(f"j{n}" for n in kept)]
    finally:
        await con.close()


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
async def test_a_cycles_kept_requests_go_with_begin(pg_db, monkeypatch, rows, pipeline) -> None:
    """A cycle's kept requests are its first statement: sent with BEGIN, alone (a cycle with
    nothing else to write: 3 round trips) or, without a pipeline, before the claims' reads
    (6; pipelined with them and the transaction's id, 3); one row or a set, in order."""
    monkeypatch.setattr(pg, "PIPELINE", pipeline)
    kept = [
        attempts.Record(f"j{n % 2}", 1, 1, 1_000 + n, None if n else 503, n, "away", "x" * 900)
        for n in range(rows)
    ]
    con = await pg.aconnect(pg_db())
    try:
        await pg.adrive(con, attempts.plan_create())
        assert await pg.adrive(con, w.plan_enqueue({"id": "a", "qty": 1}, 1_000, 60_000))
        for count, expected in ((0, 3), (1, 3 if pipeline else 6)):
            cycle = w.plan_cycle([], [], "w1", 2_000, 5_000, count, limits=w.PRODUCT)
            (_, _, claimed, _), trace = await traced(con, attempts.recorded(cycle, kept))
            assert round_trips(trace) == expected, trace
            assert len(claimed) == count
        got = await (
            await con.execute("SELECT id, at_ms, status FROM asnackq_attempts ORDER BY seq")
        ).fetchall()
        assert got == [(r.id, r.at_ms, r.status) for r in kept] * 2
        assert con.info.transaction_status == TransactionStatus.IDLE
    finally:
        await con.close()

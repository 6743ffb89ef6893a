"""A PostgreSQL transaction's BEGIN goes with its plan's first statement: one round trip
fewer for every transaction, the statement's parameters bound client-side exactly as the
server would take them, and a first statement that fails leaves nothing open."""

from __future__ import annotations

import json
import tempfile

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from asnackq.core import worker as w
from asnackq.store import pg


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


async def test_an_intake_is_four_round_trips_its_read_sent_with_begin(pg_db) -> None:
    con = await pg.aconnect(pg_db())
    try:
        trace = await traced_intake(con, "j1")
        # BEGIN with the read of the id, the INSERT, the transaction's id, COMMIT
        assert round_trips(trace) == 4, trace
        first = trace.split("\tQuery\t", 1)[1]
        assert first.lstrip(' "').startswith("BEGIN;") and "FROM jobs WHERE id = 'j1'" in first
        assert con.info.transaction_status == TransactionStatus.IDLE
        rows = await (await con.execute("SELECT id, status FROM jobs")).fetchall()
        assert rows == [("j1", "pending")]
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


async def test_a_failing_first_statement_leaves_no_transaction_open(pg_db) -> None:
    con = await pg.aconnect(pg_db())
    try:
        await con.execute("ALTER TABLE jobs RENAME TO jobs_away")
        with pytest.raises(psycopg.errors.UndefinedTable):
            await pg.adrive(con, w.plan_enqueue({"id": "j1", "qty": 1}, 1_000, 60_000))
        assert con.info.transaction_status == TransactionStatus.IDLE
        await con.execute("ALTER TABLE jobs_away RENAME TO jobs")
        trace = await traced_intake(con, "j1")  # the session goes on, the same way
        assert round_trips(trace) == 4
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

"""Concurrent ``enqueue`` calls on one AsyncQueue share transactions (``store/intakes.py``),
and each call's fate is exactly what it would be alone: the same True/False/Conflict, the
same row, its own error - on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from asnackq.aio import AsyncQueue, Dispatcher, outlasting
from asnackq.core import worker as w
from asnackq.store.outage import Backoff, StoreUnavailable
from asnackq.store.session import Session

from . import pgdb
from .conftest import T0, away_once
from .pgdb import ended, sessions

COLUMNS = "id, qty, status, attempts, max_attempts, token, available_at, deadline"
REFUSE = {
    "sqlite": """CREATE TRIGGER refuse BEFORE INSERT ON jobs WHEN NEW.id = 'bad'
      BEGIN SELECT RAISE(ABORT, 'refused by the test'); END""",
    "pg": """CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN IF NEW.id = 'bad' THEN RAISE EXCEPTION 'refused by the test'; END IF;
      RETURN NEW; END $$;
      CREATE TRIGGER refuse BEFORE INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION refuse()""",
}


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.process)])
def targets(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    """A factory of fresh queue targets of one kind: files, or PostgreSQL databases."""
    if request.param == "pg":
        pg_db = request.getfixturevalue("pg_db")
        return request.param, pg_db
    names = iter(range(1000))
    return request.param, lambda: str(tmp_path / f"q{next(names)}.db")


def table(target: str) -> list[tuple[Any, ...]]:
    sql = f"SELECT {COLUMNS} FROM jobs ORDER BY id"
    if target.startswith("postgresql://"):
        with psycopg.connect(target) as con:
            return [tuple(row) for row in con.execute(sql).fetchall()]
    con = sqlite3.connect(target)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def execute(target: str, sql: str) -> None:
    if target.startswith("postgresql://"):
        with psycopg.connect(target, autocommit=True) as con:
            con.execute(sql)
        return
    con = sqlite3.connect(target)
    try:
        con.executescript(sql)
    finally:
        con.close()


def calls(rng: random.Random, n: int) -> list[tuple[dict[str, Any], int, int, int]]:
    """Intakes over a small pool of ids (repeats, same and other quantities) with their own
    clock readings and budgets."""
    return [
        (
            {"id": f"j{rng.randrange(12)}", "qty": rng.choice((1, 1, 2))},
            T0 + rng.randrange(3),
            rng.choice((60_000, 3_600_000)),
            rng.randint(1, 5),
        )
        for _ in range(n)
    ]


def outcome(result: Any) -> Any:
    return ("conflict", str(result)) if isinstance(result, w.Conflict) else result


async def sequential(target: str, intakes: list[Any]) -> list[Any]:
    results = []
    async with AsyncQueue.open(target) as q:
        for event, now, ttl, tries in intakes:
            try:
                results.append(await q.enqueue(event, now, ttl, tries))
            except w.Conflict as conflict:
                results.append(conflict)
    return [outcome(r) for r in results]


async def concurrent(target: str, intakes: list[Any]) -> list[Any]:
    async with AsyncQueue.open(target) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)  # the next calls queue behind one
        results = await asyncio.gather(
            *(q.enqueue(event, now, ttl, tries) for event, now, ttl, tries in intakes),
            return_exceptions=True,
        )
    return [outcome(r) for r in results]


async def test_concurrent_enqueues_give_each_call_its_sequential_result_and_row(targets):
    kind, fresh = targets
    rng = random.Random(37)
    seen: set[Any] = set()
    for _ in range(12 if kind == "sqlite" else 6):
        intakes = calls(rng, rng.randint(2, 40))
        alone, together = fresh(), fresh()
        async with AsyncQueue.open(alone) as q:
            await q.enqueue({"id": "warm", "qty": 1}, T0)
        expected = await sequential(alone, intakes)
        assert await concurrent(together, intakes) == expected
        assert table(together) == table(alone)
        seen |= {r[0] if isinstance(r, tuple) else r for r in expected}
    assert seen == {True, False, "conflict"}  # the mix had repeats and conflicts


@pytest.mark.process
async def test_calls_made_together_share_transactions_on_postgresql(pg_db):
    url = pg_db()
    async with AsyncQueue.open(url) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)
        results = await asyncio.gather(*(q.enqueue({"id": f"j{i}", "qty": 1}) for i in range(50)))
    assert results == [True] * 50
    with psycopg.connect(url) as con:
        row = con.execute("SELECT count(DISTINCT xmin::text) FROM jobs WHERE id <> 'warm'")
        transactions = row.fetchone()
    assert transactions is not None and transactions[0] <= 3  # 50 calls, not 50 COMMITs


def ticking(readings: list[int]) -> Callable[[], int]:
    """A clock whose every reading is a new millisecond, kept in ``readings``."""

    def clock() -> int:
        readings.append(T0 + 1_000 + len(readings))
        return readings[-1]

    return clock


async def test_calls_that_name_no_instant_take_their_transactions_clock_reading(targets):
    """The queue's clock is read as a shared transaction's plan is made, once for the calls
    that name no instant; a call that names one keeps it.  Each reading here is a new
    millisecond, so calls read one by one would each have their own."""
    _, fresh = targets
    target = fresh()
    readings: list[int] = []
    clock = ticking(readings)

    async with AsyncQueue.open(target, clock=clock) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)
        named = q.enqueue({"id": "named", "qty": 1}, T0 + 7, 60_000)
        unnamed = [q.enqueue({"id": f"u{i}", "qty": 1}, None, 60_000) for i in range(30)]
        assert await asyncio.gather(named, *unnamed) == [True] * 31
    rows = {row[0]: row for row in table(target)}
    assert rows["named"][6:] == (T0 + 7, T0 + 7 + 60_000)
    instants = {rows[f"u{i}"][6] for i in range(30)}
    assert instants <= set(readings)
    assert len(instants) <= 3  # one reading per transaction: 30 calls, not 30 readings
    for i in range(30):
        assert rows[f"u{i}"][7] == rows[f"u{i}"][6] + 60_000


async def test_handlers_that_enqueue_again_at_once_keep_sharing_one_transaction(targets):
    """Eight handlers, each enqueuing one event after another: the transaction after one
    that gave results waits for its callers to come back, so all eight share each
    transaction.  One handler starts a transaction alone and the other seven gather into
    the next while it runs: taken as soon as the lock was free, that next one would leave
    the first handler behind, and the two groups would alternate (20 transactions, not 11).
    Each transaction's calls share one clock reading, a new one each time here."""
    _, fresh = targets
    target = fresh()
    readings: list[int] = []
    clock = ticking(readings)

    async def handler(q: AsyncQueue, i: int) -> None:
        for k in range(10):
            assert await q.enqueue({"id": f"h{i}-{k}", "qty": 1})

    async with AsyncQueue.open(target, clock=clock) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)
        first = asyncio.ensure_future(handler(q, 0))
        for _ in range(10_000):  # until its transaction has taken its one call
            batch = q._intakes._open
            if batch is not None and batch.taken is not None:
                break
            await asyncio.sleep(0)
        assert batch is not None and batch.taken is not None
        await asyncio.gather(first, *(handler(q, i) for i in range(1, 8)))
    rows = [row for row in table(target) if row[0] != "warm"]
    assert len(rows) == 80
    assert len({row[6] for row in rows}) == 11  # its first alone, then all eight ten times


@pytest.mark.process
async def test_an_intakes_jobs_are_numbered_in_its_order_on_postgresql(pg_db):
    """``enqueue_many``'s rows go in as one INSERT over a JSON array: each job's seq follows
    the order given (claims take them in that order), not the ids' order."""
    url = pg_db()
    ids = ["m", "c", "x", "a", "q", "b"]
    async with AsyncQueue.open(url) as q:
        assert await q.enqueue_many([{"id": i, "qty": 1} for i in ids], T0) == [True] * 6
        assert await q.enqueue_many([{"id": "m", "qty": 1}, {"id": "z", "qty": 2}], T0) == [
            False,
            True,
        ]
    with psycopg.connect(url) as con:
        rows = con.execute("SELECT id, qty, max_attempts, available_at FROM jobs ORDER BY seq")
        assert [row[0] for row in rows.fetchall()] == [*ids, "z"]


async def test_an_error_that_belongs_to_one_call_reaches_that_caller_only(targets):
    kind, fresh = targets
    target = fresh()
    async with AsyncQueue.open(target) as q:
        await q.enqueue({"id": "known", "qty": 1}, T0)
        execute(target, REFUSE[kind])
        events = [
            {"id": "a", "qty": 1},
            {"id": "bad", "qty": 1},  # the database refuses this row
            {"id": "known", "qty": 2},  # a Conflict
            {"id": "b", "qty": 1},
            {"id": "known", "qty": 1},  # already there
        ]
        results = await asyncio.gather(*(q.enqueue(e) for e in events), return_exceptions=True)
        assert results[0] is True and results[3] is True and results[4] is False
        assert "refused by the test" in str(results[1])
        assert isinstance(results[2], w.Conflict)
        assert await q.enqueue({"id": "c", "qty": 1}) is True  # the queue goes on
    assert [row[0] for row in table(target)] == ["a", "b", "c", "known"]


async def test_a_bad_event_is_its_caller_s_value_error_and_changes_nothing(targets):
    _, fresh = targets
    target = fresh()
    async with AsyncQueue.open(target) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)
        bad = {"id": "no spaces allowed", "qty": 1}
        results = await asyncio.gather(
            q.enqueue({"id": "a", "qty": 1}),
            q.enqueue(bad),
            q.enqueue({"id": "b", "qty": 1}),
            return_exceptions=True,
        )
    assert results[0] is True and results[2] is True
    assert isinstance(results[1], ValueError)
    assert [row[0] for row in table(target)] == ["a", "b", "warm"]


async def test_a_cancelled_caller_waits_for_its_transaction_and_the_others_are_kept(targets):
    _, fresh = targets
    target = fresh()
    async with AsyncQueue.open(target) as q:
        await q.enqueue({"id": "warm", "qty": 1}, T0)
        tasks = [asyncio.ensure_future(q.enqueue({"id": f"j{i}", "qty": 1})) for i in range(8)]
        await asyncio.sleep(0)  # every call has joined its transaction
        rows_when_it_ended: list[int] = []
        tasks[3].add_done_callback(lambda _: rows_when_it_ended.append(len(table(target))))
        tasks[3].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[3], asyncio.CancelledError)
        assert rows_when_it_ended[0] >= 8  # it ended once its transaction had: warm + 7
        assert [r for i, r in enumerate(results) if i != 3] == [True] * 7
        # the cancelled call's job was in a transaction that committed, or in none
        again = await q.enqueue({"id": "j3", "qty": 1})
    ids = [row[0] for row in table(target)]
    assert ids == sorted([*(f"j{i}" for i in range(8)), "warm"])
    assert again in (True, False)


@pytest.mark.process
async def test_on_postgresql_intakes_run_on_their_own_session_beside_a_dispatcher(pg_db):
    url = pg_db()
    sent: list[str] = []
    everything = asyncio.Event()
    ids = [f"j{i}" for i in range(200)]

    async def send(event: dict[str, Any], token: int) -> bool:
        sent.append(event["id"])
        if set(sent) >= set(ids):
            everything.set()
        return True

    async with AsyncQueue.open(url) as q:
        dispatcher = Dispatcher(q, send, concurrency=16)
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        results: list[Any] = []
        for start in range(0, 200, 20):
            batch = [{"id": i, "qty": 1} for i in ids[start : start + 20]]
            results += await asyncio.gather(*(q.enqueue(e) for e in batch))
            results += await q.enqueue_many([batch[0], {"id": batch[1]["id"], "qty": 2}])
        assert sessions(url, scouts=False) == 2  # the queue's and its intakes'
        await asyncio.wait_for(everything.wait(), 60)
        dispatcher.stop()
        await running
    assert results.count(True) == 200 and results.count(False) == 10
    assert sum(isinstance(r, w.Conflict) for r in results) == 10
    assert sorted(sent) == sorted(ids)  # each job sent once
    assert {row[2] for row in table(url)} == {"done"}
    assert await ended(url)  # both sessions closed


async def test_an_intake_the_store_refused_before_it_ran_leaves_the_next_one_its_own(tmp_path):
    """The store away before a shared intake's plan ran: its callers get the outage, and an
    enqueue made after it gets a transaction of its own (none joins the failed one and waits
    for ever)."""
    from asnackq.store.outage import StoreUnavailable

    target = str(tmp_path / "q.db")
    async with AsyncQueue.open(target) as q:
        away_once(q._db)
        with pytest.raises(StoreUnavailable):
            await q.enqueue({"id": "lost", "qty": 1}, T0)
        found = await asyncio.wait_for(q.enqueue({"id": "next", "qty": 1}, T0), 30)
    assert found is True
    assert [row[0] for row in table(target)] == ["next"]


async def test_while_its_opening_backs_off_a_session_fails_at_once_without_trying():
    """A session that could not be opened is not tried again before its backoff's
    ``retry_in_s`` (a thousand enqueues during an outage make one attempt, not a thousand):
    each call is ``StoreUnavailable`` at once, naming the last failure's reason; once the
    backoff has run out, the next call tries again."""
    tries = 0

    async def refused() -> Any:
        nonlocal tries
        tries += 1
        raise ConnectionRefusedError(111, "connection refused by 127.0.0.1:9")

    def nothing() -> w.Plan[Any]:
        raise AssertionError("no plan runs without a session")

    held = Session(refused, Backoff(base_s=600.0, cap_s=600.0))
    with pytest.raises(StoreUnavailable) as first:
        await held.run(nothing)
    assert tries == 1 and first.value.retry_in_s >= 300.0
    for _ in range(1000):
        with pytest.raises(StoreUnavailable) as again:
            await held.run(nothing)
        assert 0 < again.value.retry_in_s <= first.value.retry_in_s
    assert tries == 1
    assert "connection refused by 127.0.0.1:9" in str(again.value)
    assert "next try in" in str(again.value)

    eager = Session(refused, Backoff(base_s=0.0, cap_s=0.0))  # (no wait between tries)
    for n in range(1, 4):
        with pytest.raises(StoreUnavailable):
            await eager.run(nothing)
        assert tries == 1 + n


@pytest.mark.process
async def test_a_first_intake_while_the_server_refuses_sessions_is_an_outage(pg_db, pg_server):
    """The intakes' own session opens at the first intake: while the database takes no
    session, that intake is ``StoreUnavailable`` (an outage: nothing committed, a retry
    after ``retry_in_s``), never the opener's ``Unreachable``; once sessions are let in
    again, the same intake commits."""
    url = pg_db()
    name = conninfo_to_dict(url)["dbname"]
    admin = pg_server.url()
    async with AsyncQueue.open(url) as q:  # (the queue's own connection opens here)
        pgdb.query(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        try:
            for _ in range(2):  # the second try backs off, and is an outage too
                with pytest.raises(StoreUnavailable) as refused:
                    await q.enqueue({"id": "a", "qty": 1})
                assert refused.value.retry_in_s > 0
                assert "not currently accepting connections" in str(refused.value)
        finally:
            pgdb.query(admin, f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        assert await outlasting(lambda: q.enqueue({"id": "a", "qty": 1})) is True
    assert [row[0] for row in table(url)] == ["a"]

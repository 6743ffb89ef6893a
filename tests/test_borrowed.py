"""A queue on the application's own connection: its rows and the jobs commit together."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import subprocess
import sys
from typing import Any

import aiosqlite
import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.store.targets import is_url

from .conftest import T0, execute, job

ORDERS = "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, qty INTEGER NOT NULL)"
EVENT = {"id": "o1", "qty": 3}


class App:
    """An application's connection: its own table, its own transactions."""

    def __init__(self, con: Any, target: Any) -> None:
        self.con, self.target = con, target
        self.sqlite = isinstance(con, aiosqlite.Connection)

    async def begin(self) -> None:
        await self.con.execute("BEGIN IMMEDIATE" if self.sqlite else "BEGIN")

    async def order(self, order_id: str, qty: int) -> None:
        mark = "?" if self.sqlite else "%s"
        await self.con.execute(
            f"INSERT INTO orders (id, qty) VALUES ({mark}, {mark})", (order_id, qty)
        )

    async def commit(self) -> None:
        await self.con.execute("COMMIT")

    async def rollback(self) -> None:
        await self.con.execute("ROLLBACK")

    def orders(self) -> list[tuple[Any, ...]]:
        return execute(self.target, "SELECT id, qty FROM orders ORDER BY id")


async def open_app(target: Any) -> App:
    if is_url(target):
        import psycopg

        con: Any = await psycopg.AsyncConnection.connect(target, autocommit=True)
        await con.execute(ORDERS)
    else:
        con = await aiosqlite.connect(target, isolation_level=None)
        await con.execute_fetchall(ORDERS)
    return App(con, target)


@pytest.fixture(params=["sqlite", "pg"])
async def app(request, tmp_path):
    target = (
        tmp_path / "app.db" if request.param == "sqlite" else request.getfixturevalue("pg_db")()
    )
    opened = await open_app(target)
    try:
        yield opened
    finally:
        await opened.con.close()


@pytest.fixture
async def queue(app):
    return await AsyncQueue.within(app.con)


@pytest.mark.process
async def test_the_order_and_its_job_commit_together(app, queue):
    await app.begin()
    await app.order("o1", 3)
    assert await queue.enqueue(EVENT, T0, 60_000) is True
    assert await queue.enqueue_many([({"id": "o2", "qty": 1}, 60_000, 3)], T0) == [True]
    assert job(app.target, "o1") is None and app.orders() == []  # nothing before the COMMIT
    await app.commit()
    assert app.orders() == [("o1", 3)]
    assert job(app.target, "o1")["status"] == "pending" and job(app.target, "o2") is not None


@pytest.mark.process
async def test_a_rollback_leaves_neither(app, queue):
    await app.begin()
    await app.order("o1", 3)
    assert await queue.enqueue(EVENT, T0, 60_000) is True
    await app.rollback()
    assert app.orders() == [] and job(app.target, "o1") is None


@pytest.mark.process
async def test_an_exception_between_the_write_and_the_commit_leaves_neither(app, queue):
    async def place() -> None:
        await app.begin()
        try:
            await app.order("o1", 3)
            await queue.enqueue(EVENT, T0, 60_000)
            raise RuntimeError("the payment failed")
        except BaseException:
            await app.rollback()
            raise

    with pytest.raises(RuntimeError, match="payment"):
        await place()
    assert app.orders() == [] and job(app.target, "o1") is None


@pytest.mark.process
async def test_a_failed_intake_undoes_only_its_own_part(app, queue):
    await app.begin()
    await queue.enqueue(EVENT, T0, 60_000)
    await app.commit()
    await app.begin()
    await app.order("o2", 1)
    with pytest.raises(w.Conflict):  # the plan raised: its savepoint is rolled back
        await queue.enqueue({"id": "o1", "qty": 4}, T0, 60_000)
    await queue.enqueue({"id": "o2", "qty": 1}, T0, 60_000)
    await app.commit()
    assert app.orders() == [("o2", 1)] and job(app.target, "o1")["qty"] == 3
    assert job(app.target, "o2") is not None


CHILD = """
import asyncio, sys
from asnackq.aio import AsyncQueue
from tests.test_borrowed import open_app

async def main(target):
    app = await open_app(target)
    queue = await AsyncQueue.within(app.con)
    await app.begin()
    await app.order("o1", 3)
    await queue.enqueue({"id": "o1", "qty": 3}, 1, 60_000)
    print("ready", flush=True)
    await asyncio.Event().wait()  # killed here, before the application's COMMIT

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.process
async def test_a_sigkill_before_the_commit_leaves_neither(app, queue):
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(app.target), stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert await asyncio.wait_for(child.stdout.readline(), 30) == b"ready\n"
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), 30)
    assert app.orders() == [] and job(app.target, "o1") is None
    async with AsyncQueue.open(app.target) as own:  # the queue is whole: nothing to claim
        assert await own.claim("w1", T0) is None


@pytest.mark.process
async def test_what_cannot_be_honoured_is_refused(app, queue):
    with pytest.raises(ValueError, match="none is open"):  # autocommit: no transaction
        await queue.enqueue(EVENT, T0, 60_000)
    await app.begin()
    for refused in (
        queue.claim("w1", T0),
        queue.claim_many("w1", T0, 1000, 4),
        queue.cycle([], [], "w1", T0, 1000, 1),
        queue.redrive("o1", T0, 1000, "ops"),
    ):
        with pytest.raises(ValueError, match="only enqueues"):
            await refused
    with pytest.raises(ValueError, match="only enqueues"):
        Dispatcher(queue, lambda event, token: None, owner="d1")
    with pytest.raises(ValueError, match="build the queue before"):
        await AsyncQueue.within(app.con)
    await app.rollback()
    assert job(app.target, "o1") is None


@pytest.mark.parametrize(
    ("pragma", "found"),
    [("journal_mode=WAL", "journal_mode=wal"), ("synchronous=NORMAL", "synchronous=1")],
)
async def test_a_file_with_other_journal_settings_is_refused(tmp_path, pragma, found):
    async with aiosqlite.connect(tmp_path / "app.db", isolation_level=None) as db:
        await db.execute_fetchall(f"PRAGMA {pragma}")
        with pytest.raises(ValueError, match=found):
            await AsyncQueue.within(db)
    with contextlib.closing(sqlite3.connect(tmp_path / "app.db")) as con:
        assert con.execute("SELECT name FROM sqlite_master").fetchall() == []  # nothing made


async def test_other_connections_are_refused(tmp_path):
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as con, pytest.raises(ValueError, match="not"):
        await AsyncQueue.within(con)


@pytest.mark.process
async def test_two_queues_on_one_connection_never_undo_each_other_s_intakes(app):
    """Two queues on one connection, their intakes started together in one transaction of
    the application's, one of them failing (a ``Conflict``) at each round: the failing
    intake rolls back its own savepoint only - every other intake's jobs commit with the
    application's transaction."""
    first, second = await AsyncQueue.within(app.con), await AsyncQueue.within(app.con)
    await app.begin()
    await first.enqueue({"id": "taken", "qty": 1})
    for i in range(20):
        batch = [{"id": f"a{i}-{n}", "qty": 1} for n in range(5)]
        results = await asyncio.gather(
            first.enqueue_many(batch),
            second.enqueue({"id": "taken", "qty": 2}),
            return_exceptions=True,
        )
        assert results[0] == [True] * 5 and isinstance(results[1], w.Conflict)
    await app.commit()
    ids = {row[0] for row in execute(app.target, "SELECT id FROM jobs")}
    assert ids == {"taken"} | {f"a{i}-{n}" for i in range(20) for n in range(5)}

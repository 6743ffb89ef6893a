"""Statements sent together on the aiosqlite connection (``sqlite_aio.sent``), and failing.

A plan's ``Batch`` (on a store's connection any statements, on an application's a
statement, then reads) and a plan's first step (with BEGIN) go to the connection's thread
at once.  The failures are SQLite's own: a statement interrupted by the connection's
progress handler (an interrupted write ends the whole transaction, as a
full disk or an I/O error does), a lock another connection or process holds, a caller
cancelled.  Whatever fails, nothing of the transaction stays, no write runs outside it, and
COMMIT is never sent after a failure.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from subprocess import PIPE

import aiosqlite
import pytest

from asnackq.aio import AsyncQueue, QueueBusy
from asnackq.core import worker as w
from asnackq.store.sqlite_aio import SqliteStore, adrive

from .conftest import T0, rows


class Tripwire:
    """Every statement the connection starts (its trace callback), and the first one that
    ``trips`` matches, once armed, interrupted (its progress handler): both are called on
    the connection's thread."""

    def __init__(self, trips: Callable[[str], bool]) -> None:
        self.trips = trips
        self.seen: list[str] = []
        self.tripped: int | None = None

    def trace(self, sql: str) -> None:
        self.seen.append(" ".join(sql.split()))

    def progress(self) -> int:
        if self.tripped is None and self.seen and self.trips(self.seen[-1]):
            self.tripped = len(self.seen) - 1
            return 1  # SQLITE_INTERRUPT
        return 0

    async def arm(self, store: SqliteStore) -> None:
        await store.db.set_trace_callback(self.trace)
        await store.db.set_progress_handler(self.progress, 1)

    def after(self) -> list[str]:
        """The statements started after the interrupted one."""
        assert self.tripped is not None, "nothing was interrupted"
        return self.seen[self.tripped + 1 :]


async def opened(path: Path, busy_s: float = 1.0) -> tuple[AsyncQueue, SqliteStore]:
    store = await SqliteStore.open(path, w.SCHEMA, busy_s, attempts=2)
    return AsyncQueue(store, limits=w.PRODUCT), store


async def held_jobs(queue: AsyncQueue, count: int = 10, claim: int = 4) -> list[w.Ticket]:
    await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(count)], T0)
    return await queue.claim_many("w1", T0 + 1, 5_000, claim)


def leased(path: Path) -> int:
    return sum(1 for row in rows(path) if len(row) > 3 and row[3] == "leased")


def done(held: list[w.Ticket], now: int) -> list[tuple[w.Ticket, str, int, int]]:
    return [(ticket, "ok", now, 0) for ticket in held]


def settle(sql: str) -> bool:
    return "available_at = coalesce(" in sql  # (w.SQL_SETTLE: the cycle's fenced writes)


def claimable(sql: str) -> bool:
    return "token - attempts + 1" in sql  # (w.SQL_NEXT_RECLAIMABLE: the claims' read)


@pytest.mark.parametrize("trips", [settle, claimable], ids=["write", "read"])
async def test_a_statement_failing_mid_batch_leaves_nothing_and_no_commit_follows(db, trips):
    """The settle's write interrupted: SQLite ends the transaction itself, and what its batch
    sent after it runs outside it - reads only.  The claims' read interrupted, after the
    write in its batch: the write is rolled back.  Either way nothing of the cycle stays, no
    COMMIT is sent, and the next cycle lands."""
    queue, store = await opened(db)
    try:
        held = await held_jobs(queue)
        before = rows(db)
        wire = Tripwire(trips)
        await wire.arm(store)
        with pytest.raises(sqlite3.OperationalError, match="interrupt"):
            await queue.cycle(done(held, T0 + 2), [], "w1", T0 + 2, 5_000, 2, 3)
        assert not queue.in_transaction
        assert rows(db) == before  # neither the finishes nor the claims
        assert wire.after() and "COMMIT" not in wire.after()
        if trips is settle:  # (ended by SQLite: no ROLLBACK either)
            assert all(sql.startswith(("SELECT", "WITH")) for sql in wire.after())
        else:
            assert any(settle(sql) for sql in wire.seen[: wire.tripped])
            assert "ROLLBACK" in wire.after()
        await store.db.set_progress_handler(None, 1)
        statuses, _, tickets, _ = await queue.cycle(
            done(held, T0 + 3), [], "w1", T0 + 3, 5_000, 2, 3
        )
    finally:
        await queue.close()
    assert statuses == ["done"] * 4 and len(tickets) == 5


def two_writes(after_a_read: bool = False) -> w.Plan[None]:
    if after_a_read:  # (then the batch is no first step, sent with BEGIN, but one after it)
        yield w.Read("SELECT count(*) FROM jobs")
    yield w.Batch((w.Sql("UPDATE jobs SET qty = 2"), w.Sql("UPDATE jobs SET qty = 3")))
    return None, True


@pytest.mark.parametrize("after_a_read", [False, True], ids=["with-begin", "after-a-read"])
@pytest.mark.parametrize("trips", ["qty = 2", "qty = 3"], ids=["first", "second"])
async def test_a_store_sends_a_batch_of_writes_at_once_and_a_failure_leaves_nothing(
    db, trips, after_a_read
):
    """A store's connection begins a transaction before any write: a batch's writes go at
    once, with BEGIN or after it.  An interrupted write ends the transaction (SQLite's
    rule): the second, sent with an interrupted first, runs in a transaction of its own
    that is rolled back; the second interrupted takes the first with it.  Nothing stays, no
    COMMIT follows, and the batch lands whole after."""
    make = partial(two_writes, after_a_read)
    queue, store = await opened(db)
    try:
        await held_jobs(queue)
        before = rows(db)
        wire = Tripwire(lambda sql: trips in sql)
        await wire.arm(store)
        with pytest.raises(sqlite3.OperationalError, match="interrupt"):
            await store.run(make)
        assert not queue.in_transaction
        assert rows(db) == before
        assert "COMMIT" not in wire.after()
        if trips == "qty = 2":  # (sent with the first: it ran, in a transaction of its own)
            begun = wire.after().index("BEGIN IMMEDIATE")
            alone = ["BEGIN IMMEDIATE", "UPDATE jobs SET qty = 3", "ROLLBACK"]
            assert wire.after()[begun:] == alone
        await store.db.set_progress_handler(None, 1)
        await store.run(make)
    finally:
        await queue.close()
    assert {row[2] for row in rows(db) if len(row) > 3} == {3}


@pytest.mark.parametrize("isolation", [None, "DEFERRED"])
async def test_a_batch_of_writes_goes_one_by_one_on_an_application_s_connection(db, isolation):
    """On an application's connection a write sent after a failure could land outside any
    transaction (``isolation_level`` None), or in one its caller does not end (set): only
    a store's own transaction sends a batch's writes at once.  Here the batch goes one
    statement at a time, and the second never runs."""
    queue, _ = await opened(db)
    try:
        await held_jobs(queue)
    finally:
        await queue.close()
    before = rows(db)
    wire = Tripwire(lambda sql: "qty = 2" in sql)
    async with aiosqlite.connect(db, isolation_level=isolation) as con:
        await con.set_trace_callback(wire.trace)
        await con.set_progress_handler(wire.progress, 1)
        with pytest.raises(sqlite3.OperationalError, match="interrupt"):
            await adrive(con, two_writes())
        assert not con.in_transaction
        await con.set_progress_handler(None, 1)
        assert not any("qty = 3" in sql for sql in wire.seen)
        await adrive(con, two_writes())
    assert rows(db) != before
    assert {row[2] for row in rows(db) if len(row) > 3} == {3}


@pytest.mark.parametrize("first", ["write", "read"])
async def test_a_begin_refused_sends_no_write_and_its_reads_change_nothing(db, first):
    """Another connection holds the write lock throughout: BEGIN is refused until the store
    gives up.  A plan whose first step writes never sends it; one whose first step reads
    sends it with each BEGIN refused, outside any transaction, and drops what it read."""

    def plan() -> w.Plan[list[tuple[int]]]:
        if first == "read":
            counted = yield w.Read("SELECT count(*) FROM jobs")
        yield w.Sql("UPDATE jobs SET qty = 7")
        counted = yield w.Read("SELECT count(*) FROM jobs WHERE qty = 7")
        return counted, True

    queue, store = await opened(db, busy_s=0.05)
    other = sqlite3.connect(db, isolation_level=None)
    try:
        await held_jobs(queue)
        before = rows(db)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(QueueBusy):
            await store.run(plan)
        assert not queue.in_transaction
        other.execute("ROLLBACK")
        assert rows(db) == before
        assert await store.run(plan) == [(10,)]  # once the lock is free
    finally:
        other.close()
        await queue.close()


HOLDER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE jobs SET available_at = available_at + 3600000 WHERE id = 'j0'")
print("held", flush=True)
sys.stdin.readline()
con.execute("COMMIT")
"""


@pytest.mark.process
async def test_a_begin_refused_by_another_process_is_retried_and_its_reads_read_again(db):
    """Another process holds the write lock, having made j0 unclaimable: the claim's reads
    sent with the refused BEGIN still see j0 claimable.  Once the holder commits, BEGIN is
    tried again and the claim reads again, in its transaction: it takes j1."""
    queue, store = await opened(db, busy_s=30.0)
    await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(3)], T0)
    loop = asyncio.get_running_loop()
    read_outside = asyncio.Event()

    def trace(sql: str) -> None:  # (on the connection's thread)
        if claimable(sql):
            loop.call_soon_threadsafe(read_outside.set)

    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(db), stdin=PIPE, stdout=PIPE
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert await holder.stdout.readline() == b"held\n"
        await store.db.set_trace_callback(trace)
        claim = asyncio.ensure_future(queue.claim_many("w1", T0 + 1, 5_000, 1))
        await asyncio.wait_for(read_outside.wait(), 30)
        assert not claim.done() and not queue.in_transaction
        holder.stdin.write(b"go\n")
        await holder.stdin.drain()
        tickets = await asyncio.wait_for(claim, 30)
    finally:
        holder.stdin.close()
        await asyncio.wait_for(holder.wait(), 30)
        await queue.close()
    assert [t["id"] for t in tickets] == ["j1"]


class CancelAt:
    """A trace callback cancelling ``task`` as the ``k``-th statement starts (it is called
    on the connection's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Future[object], k: int):
        self.loop, self.task, self.k, self.started = loop, task, k, 0

    def __call__(self, sql: str) -> None:
        self.started += 1
        if self.started == self.k:
            self.loop.call_soon_threadsafe(self.task.cancel)


async def test_a_driver_cancelled_anywhere_leaves_the_cycle_whole_or_absent(db):
    """The driver alone (no ``AsyncQueue`` shield), cancelled as the k-th statement of a
    cycle starts on the connection's thread, for k = 1, 2, ... past its COMMIT: the cycle
    is committed whole or not at all, no transaction stays open, and a cycle that returned
    is committed."""
    queue, store = await opened(db)
    loop = asyncio.get_running_loop()
    outcomes: list[bool] = []
    try:
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(200)], T0)
        for k in range(1, 20):
            now = T0 + k
            held = await queue.claim_many("w1", now, 5_000, 2)
            before = leased(db)
            plan = w.plan_cycle(done(held, now), [], "w1", now, 5_000, 1, 2, limits=w.PRODUCT)
            task = asyncio.ensure_future(adrive(store.db, plan, None, 2, store.busy_ms))
            await store.db.set_trace_callback(CancelAt(loop, task, k))
            returned = (await asyncio.gather(task, return_exceptions=True))[0]
            await store.db.set_trace_callback(None)
            assert not store.db.in_transaction
            ids = {t["id"] for t in held}
            finished = {r[1]: r[3] for r in rows(db) if len(r) > 3 and r[1] in ids}
            whole = set(finished.values()) == {"done"} and leased(db) == before - 2 + 3
            absent = set(finished.values()) == {"leased"} and leased(db) == before
            assert whole or absent, (k, finished, before, leased(db))
            assert whole or isinstance(returned, asyncio.CancelledError)
            outcomes.append(whole)
            if not whole:
                await queue.finish_many(done(held, now))  # (settled for the next one)
    finally:
        await queue.close()
    assert not outcomes[0] and outcomes[-1]  # cancelled before its COMMIT, and never

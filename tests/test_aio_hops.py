"""Hops to the aiosqlite connection's thread per transaction: fixed, whatever the batch."""

from __future__ import annotations

from functools import partial
from typing import Any

import aiosqlite

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.core.inbox import SINK_SCHEMA, Arrival, event_digest, plan_receive, plan_stock
from asnackq.store.attempts import Record
from asnackq.store.sqlite_aio import HOPS, SqliteStore

from .conftest import T0

COUNTED = ("execute", "execute_fetchall", "executemany", "executescript", "commit", "rollback")


class Counting:
    """An aiosqlite connection counting hops: a call made while none is in flight starts
    one; calls sent together (before any reply came back) share it."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db
        self.awaits = 0  # hops
        self.calls = 0
        self.in_flight = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.db, name)
        if name not in COUNTED:
            return method

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.awaits += not self.in_flight
            self.in_flight += 1
            try:
                return await method(*args, **kwargs)
            finally:
                self.in_flight -= 1

        return counted


async def counting_queue(path) -> tuple[AsyncQueue, Counting]:
    store = await SqliteStore.open(path, w.SCHEMA, 1.0)
    counting = Counting(store.db)
    store.db = counting  # type: ignore[assignment]
    return AsyncQueue(store, limits=w.CONTRACT), counting


async def awaits(counting: Counting, call: Any) -> tuple[Any, int]:
    before = counting.awaits
    result = await call
    return result, counting.awaits - before


def results(tickets: list[w.Ticket], now: int) -> list[tuple[w.Ticket, str, int, int]]:
    return [(t, "ok" if i % 3 else "retry", now, 10) for i, t in enumerate(tickets)]


async def test_a_cycle_of_one_and_a_cycle_of_five_hundred_take_the_same_awaits(db):
    queue, counting = await counting_queue(db)
    try:
        items = [({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(2_600)]
        assert all(await queue.enqueue_many(items[:1], T0))
        (_, hops) = await awaits(counting, queue.enqueue_many(items[1:], T0))
        assert hops == HOPS["enqueue"]
        # some jobs the quarantine ends in both cycles: spent budgets, passed deadlines
        await queue.enqueue_many([({"id": f"d{i}", "qty": 1}, 5, 1) for i in range(300)], T0)
        held = await queue.claim_many("w1", T0 + 1, 5_000, 1024)
        held += await queue.claim_many("w1", T0 + 1, 5_000, 1024)
        small, hops_small = await awaits(
            counting, queue.cycle(results(held[:1], T0 + 20), held[1:2], "w1", T0 + 20, 5_000, 1)
        )
        big, hops_big = await awaits(
            counting,
            queue.cycle(results(held[2:502], T0 + 30), held[502:1002], "w1", T0 + 30, 5_000, 500),
        )
    finally:
        await queue.close()
    assert len(small[0]) == len(small[1]) == len(small[2]) == 1
    assert len(big[0]) == len(big[1]) == len(big[2]) == 500
    assert all(small[0]) and all(big[0]) and all(small[1]) and all(big[1])
    assert small[3] == {"deadline": 300}  # the quarantine in the small cycle: one hop more
    assert hops_small - HOPS["quarantine"] == hops_big == HOPS["cycle"]


async def test_a_dispatcher_s_cycle_takes_its_hops_with_claims_ahead_and_records(db):
    queue, counting = await counting_queue(db)
    try:
        await queue.keep_attempts()
        await queue.enqueue_many([({"id": f"j{i}", "qty": 1}, 60_000, 3) for i in range(40)], T0)
        held = await queue.claim_many("w1", T0 + 1, 5_000, 4)
        kept = [Record(t["id"], t["token"], t["attempt"], T0 + 2, 200, 1, "ok", "") for t in held]
        done = [(t, "ok" if i % 3 else "retry", T0 + 2, 0) for i, t in enumerate(held)]
        (statuses, _, tickets, _), hops = await awaits(
            counting, queue.cycle(done, [], "w1", T0 + 2, 5_000, 2, 8, attempts=kept)
        )
        recorded = await queue.read("SELECT count(*) FROM asnackq_attempts")
    finally:
        await queue.close()
    assert statuses == ["pending", "done", "done", "pending"]
    # the two retried with no delay are claimable again, the lowest seqs: taken first
    assert [t["id"] for t in tickets] == ["j0", "j3", *(f"j{i}" for i in range(4, 12))]
    assert [t["attempt"] for t in tickets] == [2, 2, *[1] * 8]
    assert recorded == [(4,)]
    assert hops == HOPS["cycle"] + HOPS["records"]


async def test_an_inbox_batch_of_one_and_of_three_hundred_take_the_same_awaits(tmp_path):
    """The sink's batch: BEGIN, the new rows, the read of the rows that were there, their
    count, the stock's two statements (sent at once), COMMIT (three hops without repeats),
    whatever its size."""
    store = await SqliteStore.open(tmp_path / "sink.db", SINK_SCHEMA, 1.0)
    counting = Counting(store.db)
    store.db = counting  # type: ignore[assignment]

    def make(batch: list[Arrival]) -> Any:
        def effect(applied: list[int]) -> Any:
            return plan_stock([(batch[i].event_id, 1) for i in applied])

        return partial(plan_receive, batch, T0, effect)

    try:
        hops = []
        for size in (1, 300):
            known = [
                Arrival(f"old{size}-{i}", event_digest(f"old{size}-{i}", 1), None)
                for i in range(size)
            ]  # (duplicates, too)
            statuses, first = await awaits(counting, store.run(make(known)))
            assert statuses == ["applied"] * size
            batch = [
                Arrival(f"new{size}-{i}", event_digest(f"new{size}-{i}", 1), 7) for i in range(size)
            ] + known
            statuses, n = await awaits(counting, store.run(make(batch)))
            assert statuses == ["applied"] * size + ["duplicate"] * size
            hops.append((first, n))
    finally:
        await store.close()
    assert hops == [(HOPS["inbox"], HOPS["inbox"] + 2)] * 2  # (+ the duplicates: read, count)

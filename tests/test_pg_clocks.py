"""Clocks across hosts: a worker whose clock runs ahead by more than a lease.

Liveness depends on the workers' clocks (when a lease is seen as expired); safety does not:
every finish and extension is fenced by the token, so the worker ahead causes duplicate
sends at most - never a stale finish accepted, never an effect twice.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms
from asnackq.wire.send import AsyncHttpSender

from .conftest import rows
from .sinks import sink, sink_state

LEASE_MS = 1000
AHEAD_MS = 3 * LEASE_MS


@pytest.fixture(params=["file", "pg"])
def places(request, tmp_path):
    if request.param == "pg":
        fresh = request.getfixturevalue("pg_db")
        return fresh(), fresh()
    return tmp_path / "queue.db", tmp_path / "sink.db"


@pytest.mark.process
async def test_a_worker_clock_ahead_by_more_than_a_lease_duplicates_at_most(places):
    db, sink_db = places
    qty = {f"job-{i}": i % 9 + 1 for i in range(40)}
    finishes = []
    held = asyncio.Event()  # the slow worker has claimed every job
    claimed = set()

    def tracer(name):
        def trace(kind, ticket, at, status):
            if kind == "claim" and name == "behind":
                claimed.add(ticket["id"])
                if len(claimed) == len(qty):
                    held.set()
            if kind == "finish" and status is not False:
                finishes.append((ticket["id"], ticket["token"], status, name))

        return trace

    async with (
        AsyncQueue.open(db) as behind,
        AsyncQueue.open(db) as ahead,
        sink(sink_db, delay_ms=300) as s,
        AsyncHttpSender(s.url, timeout_s=0.9) as send,
    ):
        await behind.enqueue_many(
            [({"id": i, "qty": n}, 600_000, 16) for i, n in qty.items()], epoch_ms()
        )
        slow = Dispatcher(
            behind,
            send,
            owner="behind",
            concurrency=4,
            lease_ms=LEASE_MS,
            prefetch=40,
            trace=tracer("behind"),
        )
        fast = Dispatcher(
            ahead,
            send,
            owner="ahead",
            concurrency=4,
            lease_ms=LEASE_MS,
            clock=lambda: epoch_ms() + AHEAD_MS,
            trace=tracer("ahead"),
        )
        first = asyncio.ensure_future(slow.run())
        await asyncio.wait_for(held.wait(), 10)
        summaries = await asyncio.gather(fast.run(), first)
        async with aiohttp.ClientSession() as session, session.get(s.base + "/stats") as answer:
            stats = await answer.json()
    jobs = {r[1]: r for r in rows(db) if len(r) > 3}
    assert {r[3] for r in jobs.values()} == {"done"}
    done = sorted((i, t) for i, t, status, _ in finishes if status == "done")
    assert done == sorted((i, r[6]) for i, r in jobs.items())  # once, at the last token
    assert sum(s.lost + s.stale for s in summaries) > 0  # the clock did bite
    assert {name for *_, name in finishes} >= {"ahead"}
    total, inbox = sink_state(sink_db)
    assert {i: q for i, q, _ in inbox} == qty and total == sum(qty.values())
    assert stats["applied"] == len(qty)  # each effect once
    assert stats["requests"] == sum(s.requests for s in summaries)  # duplicates at most

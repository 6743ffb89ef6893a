"""Sink replicas sharing one PostgreSQL inbox: real ``asnackq sink`` processes, real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import aiohttp
import pytest

from asnackq.lab.procs import kill, sink_process, sink_stats, start_sink

from .pgdb import query
from .sinks import sink_state


@pytest.fixture
def url(pg_db):
    return pg_db()


async def post_all(requests, concurrency=64):
    """POST each ``(sink_url, id, qty)``; the answers ``(status, body)`` in the same order."""
    gate = asyncio.Semaphore(concurrency)

    async def post(session, target, event_id, qty):
        async with gate, session.post(target, json={"id": event_id, "qty": qty}) as answer:
            return answer.status, await answer.json()

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(post(session, *r) for r in requests))


async def test_replicas_apply_each_id_once_under_concurrent_duplicates(url):
    rng = random.Random(5)
    ids = {f"e{i}": rng.randint(1, 9) for i in range(300)}
    with sink_process(url) as one, sink_process(url) as two:
        requests = []
        for event_id, qty in ids.items():  # the same id at both replicas at the same moment
            requests += [
                (one, event_id, qty),
                (two, event_id, qty),
                (two, event_id, qty),
                (one, event_id, qty),
            ]
            if rng.random() < 0.2:  # another qty, at either replica, in between
                requests.insert(len(requests) - 2, (rng.choice([one, two]), event_id, qty + 1))
        answers = await post_all(requests)
        counters = [sink_stats(one), sink_stats(two)]
    first: dict[str, int] = {}
    for (_, event_id, qty), (_, body) in zip(requests, answers, strict=True):
        assert body["id"] == event_id
        if body["status"] == "applied":
            assert event_id not in first, f"{event_id} applied twice"
            first[event_id] = qty
    for (_, event_id, qty), (status, body) in zip(requests, answers, strict=True):
        same = qty == first[event_id]  # judged against the qty that was applied
        assert (status, body["status"]) in (
            [(200, "applied"), (200, "duplicate")] if same else [(409, "conflict")]
        )
    total, inbox = sink_state(url)
    assert {i: q for i, q, _ in inbox} == first and len(first) == len(ids)
    assert total == sum(first.values())
    assert sum(c["applied"] for c in counters) == len(ids)
    assert sum(d for _, _, d in inbox) == sum(c["applied"] + c["duplicates"] for c in counters)
    assert all(c["applied"] > 0 for c in counters)  # both replicas did apply


@contextlib.contextmanager
def raw_sink(url):
    """A sink process and its URL, for a test that SIGKILLs it (killed at the end if not)."""
    proc, target = start_sink(url)
    try:
        yield proc, target
    finally:
        kill(proc)


def open_transactions(url):
    return query(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
    )[0][0]


async def test_a_sink_killed_during_a_group_commit_leaves_every_ack_applied_once(url):
    ids = {f"k{i}": i % 9 + 1 for i in range(3000)}
    acked: set[str] = set()
    with raw_sink(url) as (proc, target):

        async def load():
            gate = asyncio.Semaphore(64)

            async def post(session, event_id, qty):
                async with gate:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.post(target, json={"id": event_id, "qty": qty}) as a:
                            if a.status == 200:
                                acked.add(event_id)

            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(post(session, i, q) for i, q in ids.items()))

        sending = asyncio.ensure_future(load())
        caught = False
        deadline = time.monotonic() + 30
        while not caught and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            caught = len(acked) > 200 and await asyncio.to_thread(open_transactions, url) > 0
        kill(proc)  # the writer's transaction is open right now
        await sending
    assert caught, "no open group commit was seen under load"
    for _ in range(100):  # the server ends the dead session's transaction
        if open_transactions(url) == 0:
            break
        await asyncio.sleep(0.05)
    total, inbox = sink_state(url)
    applied = {i: q for i, q, _ in inbox}
    assert acked <= applied.keys() and len(applied) < len(ids)  # every ACK is on disk
    assert all(applied[i] == ids[i] for i in applied) and total == sum(applied.values())
    with sink_process(url) as again:  # a replica takes over; every id re-sent
        answers = await post_all([(again, i, q) for i, q in ids.items()])
        counters = sink_stats(again)
    assert all(status == 200 for status, _ in answers)
    assert counters["applied"] == len(ids) - len(applied)  # nothing applied twice
    total, inbox = sink_state(url)
    assert len(inbox) == len(ids) and total == sum(ids.values())

"""The product surfaces' defaults: the queue's clock and a new job's budget (a day, 5 tries)."""

from __future__ import annotations

import os

import aiosqlite
import pytest

from asnackq import ops
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.budget import DEFAULT_MAX_ATTEMPTS, DEFAULT_TTL_MS, Budget

from .conftest import T0, job


def budget(path, job_id):
    row = job(path, job_id)
    assert row is not None
    return row["deadline"] - row["available_at"], row["max_attempts"]


async def test_intakes_and_redrive_read_the_queue_clock_and_budget(db):
    assert (DEFAULT_TTL_MS, DEFAULT_MAX_ATTEMPTS) == (86_400_000, 5)
    readings = iter(range(T0, T0 + 100))
    async with AsyncQueue.open(db, clock=lambda: next(readings)) as q:
        assert await q.enqueue({"id": "a", "qty": 1}) is True
        assert await q.enqueue({"id": "b", "qty": 2}, T0 + 50, 60_000, 2) is True  # explicit
        plain, triple = {"id": "c", "qty": 3}, ({"id": "d", "qty": 4}, 5000, 1)
        assert await q.enqueue_many([plain, triple, {"id": "a", "qty": 1}]) == [True, True, False]
        assert job(db, "a")["available_at"] == T0 and job(db, "c")["available_at"] == T0 + 1
        assert budget(db, "a") == budget(db, "c") == (86_400_000, 5)
        assert budget(db, "b") == (60_000, 2) and budget(db, "d") == (5000, 1)
        ticket = await q.claim("w1", T0 + 60, 1000)
        assert ticket is not None and ticket["id"] == "a"
        assert await q.finish(ticket, "permanent", T0 + 61) == "dead"
        assert await q.redrive("a", note="partner-fixed") is True
    row = job(db, "a")
    assert row["status"] == "pending" and row["deadline"] == T0 + 2 + 86_400_000


async def test_the_defaults_are_checked_at_open_and_nothing_is_made(tmp_path):
    path = tmp_path / "q.db"
    for kwargs, message in [
        ({"ttl_ms": 0}, r"ttl_ms must be an int in 1\.\.2592000000: 0"),
        ({"ttl_ms": 31 * w.DAY_MS}, r"ttl_ms must be an int in 1\.\.2592000000"),
        ({"max_attempts": 17}, r"max_attempts must be an int in 1\.\.16: 17"),
        ({"max_attempts": True}, r"max_attempts must be an int in 1\.\.16: True"),
        ({"clock": 5}, r"clock must be callable: 5"),
    ]:
        with pytest.raises(ValueError, match=message):
            await AsyncQueue.connect(path, **kwargs)
        async with aiosqlite.connect(tmp_path / "app.db") as con:
            with pytest.raises(ValueError, match=message):
                await AsyncQueue.within(con, **kwargs)
    assert not path.exists()
    with pytest.raises(ValueError, match=r"ttl_ms must be an int in 1\.\.60000: 86400000"):
        await AsyncQueue.connect(path, limits=w.CONTRACT, ttl_ms=w.DAY_MS)
    async with AsyncQueue.open(path, limits=w.CONTRACT) as q:
        assert q.budget == (60_000, 5)  # a day is past the contract's longest ttl


async def test_a_bad_item_is_named_and_nothing_is_written(db):
    async with AsyncQueue.open(db, clock=lambda: T0) as q:
        with pytest.raises(ValueError, match=r"an event or \(event, ttl_ms, max_attempts\)"):
            await q.enqueue_many([{"id": "a", "qty": 1}, ({"id": "b", "qty": 1}, 5)])
        with pytest.raises(ValueError, match=r"ttl_ms must be an int in 1\.\.2592000000: 0"):
            await q.enqueue({"id": "a", "qty": 1}, None, 0)
        with pytest.raises(ValueError, match="note must be"):
            await q.redrive("a")
    assert job(db, "a") is None


async def test_the_dispatcher_reads_the_queue_clock_unless_given_one(db):
    def clock():
        return T0

    def other():
        return T0 + 1

    async def send(event, token):
        return None

    async with AsyncQueue.open(db, clock=clock) as q:
        assert Dispatcher(q, send, owner="w1").settings.clock is clock
        assert Dispatcher(q, send, owner="w1", clock=other).settings.clock is other


def test_the_bulk_helper_takes_plain_events_too(db):
    items = [{"id": "a", "qty": 1}, ({"id": "b", "qty": 1}, 60_000, 3)]
    assert ops.enqueue_all(db, items) == [True, True]
    assert budget(db, "a") == (86_400_000, 5) and budget(db, "b") == (60_000, 3)
    with pytest.raises(ValueError, match=r"max_attempts must be an int in 1\.\.16: 0"):
        ops.enqueue_all(db, [{"id": "c", "qty": 1}], budget=Budget(60_000, 0))
    assert job(db, "c") is None


@pytest.mark.process
def test_the_command_line_s_intakes_get_the_queue_s_budget(db, tmp_path):
    from .test_cli import asnackq

    assert asnackq("init", str(db)).returncode == 0
    assert asnackq("enqueue", str(db), "--id", "cli-1", "--qty", "2").returncode == 0
    lines = tmp_path / "jobs.jsonl"
    lines.write_text('{"id": "cli-2", "qty": 1}\n{"id": "cli-3", "qty": 1, "max_attempts": 2}\n')
    assert asnackq("enqueue", str(db), str(lines)).returncode == 0
    assert budget(db, "cli-1") == budget(db, "cli-2") == (DEFAULT_TTL_MS, DEFAULT_MAX_ATTEMPTS)
    assert budget(db, "cli-3") == (DEFAULT_TTL_MS, 2)


async def test_a_dispatcher_given_no_owner_names_itself(db):
    async def send(event, token):
        return True

    async with AsyncQueue.open(db, clock=lambda: T0) as q:
        assert await q.enqueue({"id": "a", "qty": 1}) is True
        claims = []

        def trace(kind, ticket, now_ms, status):
            claims.append((kind, ticket["owner"]))

        first, second = Dispatcher(q, send, trace=trace), Dispatcher(q, send)
        assert first.owner != second.owner  # two workers of one process never share leases
        host, pid, part = first.owner.rsplit("-", 2)
        assert host and pid == str(os.getpid()) and len(part) == 8
        w.check_identifier(first.owner, "owner")
        assert (await first.run(until_empty=True)).done == 1
    assert claims[0] == ("claim", first.owner) and job(db, "a")["status"] == "done"

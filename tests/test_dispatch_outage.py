"""Outlasting a sink outage: no job dies, or spends an attempt, because the sink was away."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.http_sink import SinkConfig, make_app
from asnackq.wire.send import AsyncHttpSender

from .conftest import job, rows
from .sequencer import until
from .sinks import dead_port, peer, serving, sink, sink_state

FAST = BreakerPolicy(after=4, base_ms=20, max_ms=200)


@pytest.fixture
async def queue(db):
    async with AsyncQueue.open(db) as opened:
        yield opened


async def fill(queue, count, ttl=60_000, now=None):
    await queue.enqueue_many(
        [({"id": f"job-{i}", "qty": i % 7 + 1}, ttl, 3) for i in range(count)],
        epoch_ms() if now is None else now,
    )


def assert_all_done_first_attempt(db, count):
    jobs = [r for r in rows(db) if len(r) > 3]
    assert len(jobs) == count
    assert {(r[3], r[4], r[6]) for r in jobs} == {("done", 1, 1)}  # done, 1 attempt, token 1


def assert_each_effect_once(sink_db, count):
    total, inbox = sink_state(sink_db)
    assert [i for i, _, _ in inbox] == sorted(f"job-{i}" for i in range(count))
    assert total == sum(i % 7 + 1 for i in range(count))


def held_through_an_outage(dispatcher, coroutines):
    """Whether the run has met the outage: the breaker opened, a probe failed, and every
    coroutine re-sent its ticket and had its lease extended meanwhile."""
    seen = dispatcher.snapshot()
    return (
        seen["outages"] >= 1
        and seen["probes"] >= 1
        and seen["resent"] >= coroutines
        and seen["extended"] >= coroutines
    )


async def test_nothing_listening_for_a_while_then_a_sink_every_job_done(
    queue, db, tmp_path, loop_clock
):
    """The sink is away until the run has held its tickets through the outage (in events,
    not seconds), and a second more of the loop's time: the pause counts it."""
    await fill(queue, 40)
    port = dead_port()
    async with AsyncHttpSender(f"http://127.0.0.1:{port}/events", timeout_s=0.5) as send:
        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=8, lease_ms=2000, breaker=FAST)
        run = asyncio.ensure_future(dispatcher.run())
        await until(lambda: held_through_an_outage(dispatcher, 8))
        loop_clock.advance(1.0)
        assert not run.done() and dispatcher.summary.done == 0
        runner = web.AppRunner(make_app(SinkConfig(tmp_path / "s.db")), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            summary = await asyncio.wait_for(run, 30)
        finally:
            await runner.cleanup()
    assert (summary.done, summary.dead, summary.retried, summary.stale) == (40, 0, 0, 0)
    assert summary.outages >= 1 and summary.probes >= 1 and summary.paused_ms >= 1000
    assert summary.resent >= 8 and summary.extended >= 8  # held through the outage
    assert_all_done_first_attempt(db, 40)
    assert_each_effect_once(tmp_path / "s.db", 40)


def gate(upstream, mode):
    """A peer in front of a real sink: while ``mode['down']``, answer 503 or hang."""

    async def handler(request):
        body = await request.read()
        while mode["down"]:
            if mode["how"] == "503":
                return web.Response(status=503, text="down")
            await asyncio.sleep(0.05)  # hang: the sender's timeout fires
        async with (
            aiohttp.ClientSession() as session,
            session.post(upstream, data=body, headers=request.headers) as answer,
        ):
            return web.Response(
                status=answer.status, body=await answer.read(), content_type="application/json"
            )

    return peer(handler)


@contextlib.asynccontextmanager
async def gated_sender(tmp_path, mode):
    """A sender to a real sink behind ``gate(..., mode)``."""
    async with (
        sink(tmp_path / "s.db") as real,
        serving(gate(real.url, mode)) as front,
        AsyncHttpSender(front.url, timeout_s=0.3) as send,
    ):
        yield send


@pytest.mark.parametrize("how", ["503", "hang"])
async def test_a_sink_answering_503_or_hanging_for_a_while(queue, db, tmp_path, how):
    await fill(queue, 30)
    mode = {"down": True, "how": how}
    async with gated_sender(tmp_path, mode) as send:
        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=6, lease_ms=2000, breaker=FAST)
        run = asyncio.ensure_future(dispatcher.run())
        await until(lambda: held_through_an_outage(dispatcher, 6))
        mode["down"] = False
        summary = await asyncio.wait_for(run, 30)
    assert (summary.done, summary.dead, summary.retried, summary.stale) == (30, 0, 0, 0)
    assert summary.outages >= 1 and summary.resent >= 6
    assert_all_done_first_attempt(db, 30)
    assert_each_effect_once(tmp_path / "s.db", 30)


async def test_probes_go_on_when_the_wait_between_them_outgrows_the_lease(queue, db, tmp_path):
    """Probes 20 ms apart, doubling up to 8 s, under 1.5 s leases: once the wait outgrows
    what a lease has left (the 8th probe comes 2.56 s after the 7th), probes still go (the
    sink answers 503 for a while, then all is done); the probe's time is not reset by each
    send that waits for it."""
    await fill(queue, 12)
    mode = {"down": True, "how": "503"}
    slow = BreakerPolicy(after=4, base_ms=20, max_ms=8000)
    async with gated_sender(tmp_path, mode) as send:
        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=4, lease_ms=1500, breaker=slow)
        run = asyncio.ensure_future(dispatcher.run())
        await until(lambda: dispatcher.snapshot()["probes"] >= 8)
        mode["down"] = False
        summary = await asyncio.wait_for(run, 60)
    assert (summary.done, summary.dead, summary.retried, summary.stale) == (12, 0, 0, 0)
    assert summary.outages >= 1 and summary.probes >= 9  # the last probe found the sink
    assert_all_done_first_attempt(db, 12)
    assert_each_effect_once(tmp_path / "s.db", 12)


async def test_a_job_s_own_failure_is_still_charged(queue, db, tmp_path):
    await fill(queue, 3)

    async def reject(request):
        return web.Response(status=409, text="no")

    async with serving(peer(reject)) as front, AsyncHttpSender(front.url) as send:
        summary = await Dispatcher(queue, send, owner="d1", concurrency=2).run()
    assert (summary.dead, summary.dead_permanent, summary.dead_unanswered) == (3, 3, 0)
    assert summary.outages == 0


async def test_a_job_whose_deadline_passes_during_the_outage_is_counted_dead(queue, db):
    await fill(queue, 4, ttl=600)
    async with AsyncHttpSender(f"http://127.0.0.1:{dead_port()}/events", timeout_s=0.2) as send:
        summary = await Dispatcher(
            queue, send, owner="d1", concurrency=2, lease_ms=300, breaker=FAST
        ).run()
    assert (summary.dead, summary.dead_deadline, summary.dead_unanswered) == (4, 4, 4)
    assert {(r[3], r[11]) for r in rows(db) if len(r) > 3} == {("dead", "deadline")}
    assert {r[4] for r in rows(db) if len(r) > 3} <= {0, 1}  # at most one attempt, not three


async def test_jobs_the_quarantine_ends_are_counted_in_the_summary(queue, db):
    await fill(queue, 5, ttl=1000, now=epoch_ms() - 5000)  # already past their deadline
    await queue.enqueue({"id": "fresh", "qty": 1}, epoch_ms(), 60_000)

    async def send(event, token):
        return True

    summary = await Dispatcher(queue, send, owner="d1", concurrency=2).run()
    assert (summary.done, summary.dead, summary.dead_deadline) == (1, 5, 5)


async def test_the_retry_policy_is_the_worker_s(queue, db):
    await fill(queue, 1, ttl=2 * w.HOUR_MS)

    async def failing(event, token):
        raise w.Retryable("500")

    before = epoch_ms()
    summary = await Dispatcher(
        queue,
        failing,
        owner="d1",
        concurrency=1,
        jitter=lambda: 1.0,
        retry=w.Retry(600_000, 3_600_000),
    ).run(max_jobs=1)
    row = job(db, "job-0")
    assert summary.retried == 1 and row["status"] == "pending"
    assert 600_000 <= row["available_at"] - before <= 600_000 + 5000  # ten minutes later
    with pytest.raises(ValueError, match="cap_ms"):
        Dispatcher(queue, failing, owner="d1", retry=w.Retry(100, w.HOUR_MS + 1))


async def test_product_surfaces_take_a_day_long_ttl_and_an_hour_long_lease(queue, db):
    now = epoch_ms()
    assert await queue.enqueue({"id": "day", "qty": 1}, now, w.DAY_MS, 16)
    ticket = await queue.claim("d1", now, w.HOUR_MS)
    assert ticket["lease_until"] == now + w.HOUR_MS
    for bad in (
        lambda: queue.enqueue({"id": "x", "qty": 1}, now, 31 * w.DAY_MS),
        lambda: queue.claim("d1", now, w.HOUR_MS + 1),
        lambda: queue.finish(ticket, "retry", now, w.HOUR_MS + 1),
    ):
        with pytest.raises(ValueError, match="must be an int in"):
            await bad()
    # The sync core, with the contract's ranges, reads and finishes the same row.
    con = w.open_queue(db)
    try:
        assert w.finish(con, ticket, "ok", now + 1) == "done"
        with pytest.raises(ValueError):
            w.enqueue(con, {"id": "y", "qty": 1}, now, w.DAY_MS)  # not on the graded core
    finally:
        con.close()
    assert job(db, "day")["status"] == "done" and job(db, "day")["deadline"] == now + w.DAY_MS

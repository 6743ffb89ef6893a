"""A worker that dies holding tickets it never sent spends each job's first attempt at most."""

from __future__ import annotations

import asyncio
import collections
import json
import signal

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms
from asnackq.dispatch.pacer import ANY_S
from asnackq.lab import procs

from .conftest import rows
from .sequencer import until
from .sinks import peer, serving


class Hanging:
    """A peer that records each request's id and answers nothing until ``released`` (then
    503)."""

    def __init__(self) -> None:
        self.received: collections.Counter[str] = collections.Counter()
        self.arrived = asyncio.Event()
        self.released = asyncio.Event()

    async def handle(self, request):
        self.received[(await request.json())["id"]] += 1
        self.arrived.set()
        await self.released.wait()
        return web.Response(status=503)

    async def wait_for(self, total: int) -> None:
        while sum(self.received.values()) < total:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 60)


@pytest.mark.process
async def test_sigkilled_workers_spend_no_attempt_of_a_job_more_than_once_unsent(tmp_path):
    """Four ``asnackq work`` processes in turn (2 coroutines, 6 tickets ahead), each
    SIGKILLed once both coroutines are sending: a job's attempts never exceed the requests
    the sink saw for it plus one, and no job is spent by claims it was never sent under."""
    queue = tmp_path / "queue.db"
    async with AsyncQueue.open(queue) as q:
        events = [({"id": f"j-{i:02d}", "qty": 1}, 600_000, 3) for i in range(24)]
        await q.enqueue_many(events, epoch_ms())
    hanging = Hanging()
    async with serving(peer(hanging.handle)) as server:
        options = ("--concurrency", "2", "--prefetch", "6", "--lease-ms", "600")
        for round_ in range(4):
            work = await asyncio.create_subprocess_exec(
                *procs.command("work", queue, "--sink", server.url, "--timeout-s", "0.5"),
                *options,
                "--owner",
                f"w{round_}",
                "--until-empty",
            )
            try:
                await hanging.wait_for(2 * (round_ + 1))  # both coroutines send
            finally:
                work.send_signal(signal.SIGKILL)
                await work.wait()
            await until(lambda: leases_ended(queue), 60)  # (the next worker's claims)
        hanging.released.set()
    jobs = {r[1]: r for r in rows(queue) if len(r) > 3}
    attempts = {job_id: row[4] for job_id, row in jobs.items()}
    spent = {job_id: n - hanging.received[job_id] for job_id, n in attempts.items() if n}
    assert spent and max(spent.values()) <= 1, json.dumps(attempts)
    assert {row[3] for row in jobs.values()} <= {"pending", "leased"}  # none dead
    assert sum(attempts.values()) > sum(hanging.received.values())  # some never sent


def leases_ended(queue) -> bool:
    """Whether every lease the killed worker held has ended (its jobs claimable again)."""
    now = epoch_ms()
    return all(r[3] != "leased" or r[10] <= now for r in rows(queue) if len(r) > 3)


async def test_tickets_kept_ahead_are_first_attempts_and_reclaims_go_to_waiting_sends(db):
    """Once the jobs never attempted run short, claims ahead of demand take only those;
    retried and expired jobs are claimed for a coroutine that sends them at once, also after
    the pacer's second for a claim of any job has passed."""
    async with AsyncQueue.open(db) as queue:
        events = [({"id": f"j-{i:02d}", "qty": 1}, 600_000, 5) for i in range(12)]
        now = epoch_ms()
        await queue.enqueue_many(events, now)
        first = await queue.claim_many("gone", now, 1, 4)  # their leases end at once
        retried = await queue.claim("gone", now, 60_000)
        assert retried is not None
        await queue.finish(retried, "retry", now, 0)
        claims: list[tuple[str, int]] = []
        sent: list[str] = []
        sending = asyncio.Event()

        async def send(event, token):
            sent.append(event["id"])
            if len(sent) == 2:
                sending.set()
            await asyncio.Event().wait()

        ahead = asyncio.Event()  # more claimed than two coroutines can send: kept ahead

        def trace(kind, ticket, at, status):
            claims.append((ticket["id"], ticket["attempt"]))
            if len(claims) > 2:
                ahead.set()

        dispatcher = Dispatcher(
            queue,
            send,
            owner="d1",
            concurrency=2,
            prefetch=8,
            trace=trace,
        )
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        await asyncio.wait_for(asyncio.gather(sending.wait(), ahead.wait()), 30)
        await asyncio.sleep(1.5 * ANY_S)  # (past the claim of any job a second: see pacer)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    again = {t["id"] for t in first} | {retried["id"]}
    unsent = [(job, attempt) for job, attempt in claims if job not in sent]
    assert len(sent) == 2 and unsent  # some kept ahead, never sent
    assert all(attempt == 1 and job not in again for job, attempt in unsent)
    assert all(job in sent for job, attempt in claims if attempt > 1)

"""The Dispatcher keeps every lease it holds: slow sends, prefetched tickets, every cycle."""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.lab.procs import kill, sink_process, start
from asnackq.wire.send import AsyncHttpSender

from .conftest import execute, rows
from .sinks import sink, sink_state


async def fill(queue, count, ttl=60_000):
    await queue.enqueue_many(
        [({"id": f"job-{i}", "qty": i % 7 + 1}, ttl, 3) for i in range(count)], epoch_ms()
    )


class SlowSend:
    """A send taking ``durations[n]`` seconds for the n-th job it sees; counts every send."""

    def __init__(self, durations):
        self.durations = durations
        self.sends = collections.Counter()

    async def __call__(self, event, token):
        self.sends[event["id"]] += 1
        await asyncio.sleep(self.durations[int(event["id"].split("-")[1])])
        return True


def assert_each_done_once(db, count, send, summary):
    jobs = {r[1]: r for r in rows(db) if len(r) > 3}
    assert {(r[3], r[6]) for r in jobs.values()} == {("done", 1)}  # done, token 1
    assert len(jobs) == count and summary.done == summary.claimed == count
    assert (summary.stale, summary.lost) == (0, 0)
    assert sorted(send.sends.values()) == [1] * count  # one send per job


@pytest.fixture
async def queue(db):
    async with AsyncQueue.open(db) as opened:
        yield opened


@pytest.mark.parametrize(
    ("concurrency", "prefetch", "jobs", "seconds", "lease_ms"),
    [
        (1, 0, 3, 1.5, 1000),  # sends slower than the lease, in every cycle (half a lease
        (1, None, 3, 1.5, 1000),  # of slack for each extension: a busy machine's pauses)
        (2, 8, 16, 0.3, 1000),  # tickets waiting in the ready queue outlive their lease
    ],
)
async def test_sends_slower_than_the_lease_end_done_at_token_1(
    queue, db, concurrency, prefetch, jobs, seconds, lease_ms
):
    await fill(queue, jobs)
    send = SlowSend([seconds] * jobs)
    summary = await Dispatcher(
        queue, send, owner="d1", concurrency=concurrency, lease_ms=lease_ms, prefetch=prefetch
    ).run()
    assert_each_done_once(db, jobs, send, summary)
    assert summary.extended >= jobs - 1 + (prefetch or 0) // 2


async def test_a_real_sink_slower_than_half_the_lease_gets_each_job_once(queue, db, tmp_path):
    await fill(queue, 12)
    async with (
        sink(tmp_path / "s.db", delay_ms=450) as s,
        AsyncHttpSender(s.url, timeout_s=0.7) as send,
    ):
        summary = await Dispatcher(
            queue, send, owner="d1", concurrency=4, lease_ms=800, prefetch=4
        ).run()
    assert (summary.done, summary.requests, summary.stale, summary.lost) == (12, 12, 0, 0)
    total, inbox = sink_state(tmp_path / "s.db")
    assert [deliveries for _, _, deliveries in inbox] == [1] * 12
    assert total == sum(i % 7 + 1 for i in range(12))


async def test_a_lease_capped_at_its_deadline_is_not_extended_again(queue, db):
    await fill(queue, 1, ttl=400)
    send = SlowSend([0.6])
    summary = await Dispatcher(queue, send, owner="d1", concurrency=1, lease_ms=300).run()
    # Extended once, up to the deadline; there it ends dead (the queue's quarantine), and
    # the late result is stale: never retried in a loop of useless extensions.
    assert summary.extended == 1 and summary.stale == 1 and summary.done == 0
    assert [r[3] for r in rows(db) if len(r) > 3] in (["leased"], ["dead"])


async def test_a_ticket_whose_extension_is_refused_is_lost_not_sent_or_finished(queue, db):
    await fill(queue, 3)
    all_claimed = asyncio.Event()
    claims = []

    def trace(kind, ticket, at, status):
        claims.append(ticket["id"])
        if len(claims) == 3:
            all_claimed.set()

    async def send(event, token):
        await asyncio.sleep(0.5)
        return True

    dispatcher = Dispatcher(
        queue, send, owner="d1", concurrency=1, lease_ms=400, prefetch=2, trace=trace
    )
    run = asyncio.ensure_future(dispatcher.run(until_empty=False))
    await asyncio.wait_for(all_claimed.wait(), 10)
    # Another worker takes every job (forced: the leases are made to end now), so every
    # extension the Dispatcher tries comes back stale.
    execute(db, "UPDATE jobs SET lease_until = 1 WHERE status = 'leased'")
    assert len(await queue.claim_many("thief", epoch_ms(), 60_000, 3)) == 3
    summary = await asyncio.wait_for(run, 10)
    assert summary.lost == 3 and summary.requests == 1  # the two waiting were never sent
    assert (summary.done, summary.stale, summary.extended) == (0, 0, 0)
    assert {(r[3], r[9], r[6]) for r in rows(db) if len(r) > 3} == {("leased", "thief", 2)}


@pytest.fixture
def places(tmp_path_factory):
    """Fresh queue locations, one per example (files; databases in ``test_pg_dispatch``)."""
    return lambda: tmp_path_factory.mktemp("leases") / "queue.db"


@pytest.fixture
def lease_ms():
    """The property test's lease: short, so that its sends span up to two and a quarter of
    them, yet long enough that half of it outlasts a busy machine's pauses."""
    return 400


@pytest.mark.process
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(concurrency=st.integers(1, 6), prefetch=st.sampled_from([None, 0, 1, 3, 12]), data=st.data())
def test_random_send_durations_up_to_three_leases_every_job_done_once(
    places, lease_ms, concurrency, prefetch, data
):
    jobs = data.draw(st.integers(1, 3 * concurrency))
    leases = (0, 0.05, 0.45, 0.75, 1.25, 2.25)  # a send's length, in leases
    seconds = [lease_ms / 1000 * n for n in leases]
    durations = data.draw(st.lists(st.sampled_from(seconds), min_size=jobs, max_size=jobs))
    db = places()
    send = SlowSend(durations)

    async def main():
        async with AsyncQueue.open(db) as queue:
            await fill(queue, jobs)
            return await Dispatcher(
                queue,
                send,
                owner="d1",
                concurrency=concurrency,
                lease_ms=lease_ms,
                prefetch=prefetch,
            ).run()

    assert_each_done_once(db, jobs, send, asyncio.run(main()))


async def test_the_summary_is_new_for_each_run(queue, db):
    send = SlowSend([0] * 4)
    dispatcher = Dispatcher(queue, send, owner="d1", concurrency=2)
    await fill(queue, 2)
    first = await dispatcher.run()
    await queue.enqueue_many(
        [({"id": f"job-{i}", "qty": 1}, 60_000, 3) for i in (2, 3)], epoch_ms()
    )
    second = await dispatcher.run()
    assert (first.done, second.done, dispatcher.summary.done) == (2, 2, 2)


WORKER = """
import asyncio, sys
from asnackq.aio import AsyncQueue
from asnackq.aio import Dispatcher
from asnackq.wire.send import AsyncHttpSender

async def main(db, url):
    async with AsyncQueue.open(db) as queue, AsyncHttpSender(url, timeout_s=1.5) as send:
        await Dispatcher(queue, send, owner=sys.argv[3], concurrency=8, lease_ms=1600).run()

asyncio.run(main(*sys.argv[1:3]))
"""


def leases(db):
    """{(id, token): lease_until} of the leased rows, read through a separate connection."""
    return {
        (i, t): until
        for i, t, until in execute(
            db, "SELECT id, token, lease_until FROM jobs WHERE status = 'leased'"
        )
    }


def wait_for_an_extension(db, seconds):
    """Poll until a lease is seen to grow under the same token; False after ``seconds``."""
    first: dict = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key, until in leases(db).items():
            if until > first.setdefault(key, until):
                return True
        time.sleep(0.02)
    return False


@pytest.mark.process
def test_a_killed_dispatcher_holding_extended_tickets_is_recovered(tmp_path):
    db, sink_db = tmp_path / "queue.db", tmp_path / "sink.db"
    con = w.open_queue(db)
    w.enqueue_many(
        con, [({"id": f"job-{i}", "qty": i + 1}, 60_000, 3) for i in range(16)], epoch_ms()
    )
    con.close()
    with sink_process(sink_db, "--delay-ms", "900") as url:
        first = start([sys.executable, "-c", WORKER, str(db), url, "first"])
        try:
            assert wait_for_an_extension(db, 20)
        finally:
            assert kill(first) == -signal.SIGKILL
        second = subprocess.run([sys.executable, "-c", WORKER, str(db), url, "second"], timeout=60)
        assert second.returncode == 0
    jobs = [r for r in rows(db) if len(r) > 3]
    assert {r[3] for r in jobs} == {"done"}
    tokens = {r[6] for r in jobs}
    assert 2 in tokens and tokens <= {1, 2}  # what the first held was reclaimed once
    total, inbox = sink_state(sink_db)
    assert [(i, q) for i, q, _ in inbox] == sorted((f"job-{i}", i + 1) for i in range(16))
    assert total == sum(range(1, 17))  # each effect once


@pytest.mark.parametrize(
    ("options", "run_options"),
    [
        ({"idle_ms": 0}, {}),
        ({"grace_s": -1}, {}),
        ({"grace_s": float("nan")}, {}),
        ({"concurrency": 0}, {}),
        ({"prefetch": -1}, {}),
        ({"lease_ms": w.HOUR_MS + 1}, {}),
        ({}, {"max_jobs": -1}),
        ({}, {"max_jobs": True}),
    ],
)
async def test_bad_settings_are_refused_before_anything_is_claimed(queue, db, options, run_options):
    await fill(queue, 2)
    before = rows(db)
    with pytest.raises(ValueError):
        await Dispatcher(queue, SlowSend([0, 0]), owner="d1", **options).run(**run_options)
    assert rows(db) == before


async def test_a_lapsed_lease_is_reclaimed_while_tickets_ahead_keep_every_coroutine_busy(queue, db):
    """While the tickets claimed ahead keep every coroutine busy, none waits, and only the
    claim for waiting coroutines takes a retry due or a lease that lapsed: such a job
    waited behind every job never attempted, past its deadline.  At least once a second,
    one ticket ahead is claimed as any job, the lowest seq first, and sent next."""
    now = epoch_ms()
    await queue.enqueue_many([({"id": "x", "qty": 1}, 2_500, 3)], now)  # (its deadline)
    await fill(queue, 1600)  # (at least 4 s of sends: past x's deadline)
    _, _, [lost], _ = await queue.cycle([], [], "gone", now, 300, 1, 0)
    assert lost["id"] == "x"  # its lease lapses 300 ms on, never finished

    events: list[str] = []  # sends started, and x's claim

    async def send(event, token):
        events.append(event["id"])
        await asyncio.sleep(0.01)
        return True

    def trace(kind, ticket, now, status):
        if kind == "claim" and ticket["id"] == "x":
            events.append("claimed x")

    dispatcher = Dispatcher(queue, send, owner="d", concurrency=4, trace=trace)
    summary = await dispatcher.run(until_empty=True)
    assert summary.done == 1601
    claimed = events.index("claimed x")
    assert events[claimed + 1] == "x", events[claimed - 2 : claimed + 6]  # (sent next)
    [x] = [r for r in rows(db) if len(r) > 3 and r[1] == "x"]
    assert x[3] == "done", x

"""While every coroutine is busy, results gather for ``gather_ms`` before they are committed;
nothing that needs the committer now is kept waiting by it."""

from __future__ import annotations

import asyncio
import time

import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms

from .conftest import rows


@pytest.fixture
async def queue(db):
    async with AsyncQueue.open(db) as opened:
        yield opened


async def fill(queue, count):
    await queue.enqueue_many(
        [({"id": f"job-{i}", "qty": 1}, 600_000, 3) for i in range(count)], epoch_ms()
    )


class Gate:
    """A send that waits until the test releases its job; the trace reports each finish."""

    def __init__(self, count):
        self.release = {f"job-{i}": asyncio.Event() for i in range(count)}
        self.sent = {job_id: asyncio.Event() for job_id in self.release}
        self.finished = {job_id: asyncio.Event() for job_id in self.release}

    async def __call__(self, event, token):
        self.sent[event["id"]].set()
        await self.release[event["id"]].wait()
        return True

    def trace(self, kind, ticket, now_ms, status):
        if kind == "finish":
            self.finished[ticket["id"]].set()

    def open_all(self):
        for event in self.release.values():
            event.set()

    async def finished_within(self, job_id, seconds):
        """Whether ``job_id``'s finish is committed within ``seconds``."""
        try:
            await asyncio.wait_for(self.finished[job_id].wait(), seconds)
        except TimeoutError:
            return False
        return True


async def gated_run(queue, gather_ms, gate=None, **options):
    """Six jobs, two coroutines, four tickets ahead, a long lease; returns the gate and the
    run once job-0 and job-1 are being sent."""
    await fill(queue, 6)
    gate = gate or Gate(6)
    options.setdefault("trace", gate.trace)
    run = asyncio.ensure_future(
        Dispatcher(
            queue,
            gate,
            owner="d1",
            concurrency=2,
            prefetch=4,
            lease_ms=60_000,
            gather_ms=gather_ms,
            **options,
        ).run()
    )
    await asyncio.wait_for(asyncio.gather(gate.sent["job-0"].wait(), gate.sent["job-1"].wait()), 10)
    return gate, run


async def first_result_waits(queue, gather_ms, within_s):
    """Two coroutines, four tickets ahead: job-0 comes back while job-1 is still being sent.

    Returns whether job-0 was committed within ``within_s`` (job-1 still being sent), and
    the run's summary.
    """
    gate, run = await gated_run(queue, gather_ms)
    gate.release["job-0"].set()
    await asyncio.wait_for(gate.sent["job-2"].wait(), 10)  # its coroutine took a ready ticket
    early = await gate.finished_within("job-0", within_s)
    gate.open_all()
    return early, await asyncio.wait_for(run, 10)


async def test_without_gathering_a_result_is_committed_at_once(queue):
    early, summary = await first_result_waits(queue, gather_ms=0, within_s=10)
    assert early and summary.done == 6


async def test_a_result_gathers_while_every_coroutine_is_busy(queue, db):
    early, summary = await first_result_waits(queue, gather_ms=1000, within_s=0.3)
    assert not early  # 0.3 s later, job-0 still waited for company
    assert summary.done == 6 and summary.stale == 0
    assert {r[3] for r in rows(db) if len(r) > 3} == {"done"}


async def test_an_idle_coroutine_is_never_kept_waiting_by_the_gathering(queue):
    """One coroutine, nothing ahead: each result is followed by a wait for a ticket, which
    starts the cycle at once: 8 jobs take far less than the 8 s they would if each waited
    out its gathering (1 s)."""
    await fill(queue, 8)

    async def send(event, token):
        return True

    began = time.monotonic()
    summary = await Dispatcher(
        queue, send, owner="d1", concurrency=1, prefetch=0, lease_ms=60_000, gather_ms=1000
    ).run()
    assert summary.done == 8
    assert time.monotonic() - began < 4.0


async def test_results_gathered_while_every_coroutine_is_busy_share_one_commit(queue):
    """Two coroutines, four tickets ahead: job-0, job-1 and job-2 come back one after the
    other, each coroutine taking a ready ticket at once; the three results are committed
    together, in one commit, when the gathering (1 s) ends; without gathering each would be
    committed as it came back."""
    await fill(queue, 6)
    gate = Gate(6)
    committed_in: dict[str, int] = {}

    def trace(kind, ticket, now_ms, status):
        if kind == "finish":
            committed_in[ticket["id"]] = dispatcher.summary.commits
        gate.trace(kind, ticket, now_ms, status)

    dispatcher = Dispatcher(
        queue,
        gate,
        owner="d1",
        concurrency=2,
        prefetch=4,
        lease_ms=60_000,
        gather_ms=1000,
        trace=trace,
    )
    run = asyncio.ensure_future(dispatcher.run())
    for job, taken in (("job-0", "job-2"), ("job-1", "job-3"), ("job-2", "job-4")):
        await asyncio.wait_for(gate.sent[job].wait(), 10)
        gate.release[job].set()
        await asyncio.wait_for(gate.sent[taken].wait(), 10)  # its coroutine stays busy
    await asyncio.wait_for(gate.finished["job-2"].wait(), 10)
    gathered = dict(committed_in)
    gate.open_all()
    summary = await asyncio.wait_for(run, 10)
    assert summary.done == 6 and summary.stale == 0
    assert sorted(gathered) == ["job-0", "job-1", "job-2"]
    assert len(set(gathered.values())) == 1, gathered  # one commit of the three


async def test_a_draining_run_commits_the_gathered_results_at_once(queue):
    """A run cancelled while job-0's result gathers (job-1 and job-2 still being sent)
    settles job-0 at once, not when its gathering (1 s) would have ended."""
    gate, run = await gated_run(queue, 1000)
    gate.release["job-0"].set()
    await asyncio.wait_for(gate.sent["job-2"].wait(), 10)  # job-0's result gathers
    assert not gate.finished["job-0"].is_set()
    run.cancel()
    early = await gate.finished_within("job-0", 0.3)
    gate.open_all()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)
    assert early


async def test_a_lease_coming_due_ends_the_gathering(queue):
    """job-4's result gathers (up to 1 s after the cycle that claimed it) while job-0, claimed
    5 s earlier, is still being sent: its lease reaches half its length 50 ms later, and the
    cycle that keeps it starts then, settling job-4 with it."""
    gate = Gate(6)
    claims: dict[str, int] = {}
    job_5 = asyncio.Event()
    skew = [0]

    def trace(kind, ticket, now_ms, status):
        gate.trace(kind, ticket, now_ms, status)
        if kind == "claim":
            claims[ticket["id"]] = now_ms
            if ticket["id"] == "job-5":
                job_5.set()

    _, run = await gated_run(queue, 1000, gate, trace=trace, clock=lambda: epoch_ms() + skew[0])
    skew[0] = 5000  # what is claimed from now on is 5 s younger than job-0
    for job_id in ("job-1", "job-2", "job-3"):
        gate.release[job_id].set()
    await asyncio.wait_for(asyncio.gather(job_5.wait(), gate.sent["job-4"].wait()), 10)
    assert claims["job-4"] >= claims["job-0"] + 5000
    skew[0] = claims["job-0"] + 30_000 - 50 - epoch_ms()  # job-0: half its lease in 50 ms
    loop = asyncio.get_running_loop()
    released = loop.time()
    gate.release["job-4"].set()
    await asyncio.wait_for(gate.finished["job-4"].wait(), 10)
    settled_s = loop.time() - released
    gate.open_all()
    summary = await asyncio.wait_for(run, 10)
    assert summary.done == 6 and summary.extended >= 1
    assert settled_s < 0.5, settled_s  # not when the gathering would have ended (1 s)

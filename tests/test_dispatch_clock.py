"""A wall clock that steps (an NTP step) costs a run at most a re-sent job, never the run."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import random
import subprocess
import sys

import pytest

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms
from asnackq.dispatch.runclock import RunClock
from asnackq.lab import procs
from asnackq.wire.send import AsyncHttpSender

from .conftest import rows
from .sinks import sink, sink_state


class SteppedClock:
    """The wall clock plus an offset that the test moves (a step back is a negative move)."""

    def __init__(self) -> None:
        self.offset, self.last, self.back = 0, 0, 0

    def step_back(self, ms: int) -> None:
        """The next reading is ``ms`` before the last one, however long the run stalls
        between the two (a fixed move could be hidden by a stall longer than itself)."""
        self.back = ms

    def __call__(self) -> int:
        now = epoch_ms() + self.offset
        if self.back:
            self.offset -= now - self.last + self.back
            now, self.back = self.last - self.back, 0
        self.last = now
        return now


class CountingSend:
    """Sends nothing anywhere: counts each send, and calls ``at_send(n)`` on the n-th."""

    def __init__(self, at_send=lambda n: None) -> None:
        self.sends: collections.Counter[str] = collections.Counter()
        self.at_send = at_send

    async def __call__(self, event, token):
        self.sends[event["id"]] += 1
        self.at_send(sum(self.sends.values()))
        await asyncio.sleep(0.001)
        return True


@pytest.fixture
async def unretrieved():
    """Every "Task exception was never retrieved" the event loop reports during the test."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    yield reported
    loop.set_exception_handler(None)


async def fill(db, count, ttl_ms=600_000):
    async with AsyncQueue.open(db) as queue:
        events = [({"id": f"job-{i}", "qty": i % 7 + 1}, ttl_ms, 3) for i in range(count)]
        await queue.enqueue_many(events, epoch_ms())


def statuses(db):
    return collections.Counter((r[3], r[4]) for r in rows(db) if len(r) > 3)


@pytest.mark.parametrize("step_ms", [100, 10_000])
async def test_a_step_back_mid_run_holds_the_runs_clock_and_every_job_ends_done(
    db, tmp_path, unretrieved, step_ms
):
    await fill(db, 300)
    clock = SteppedClock()
    async with (
        sink(tmp_path / "s.db") as s,
        AsyncHttpSender(s.url, timeout_s=1) as http,
        AsyncQueue.open(db) as queue,
    ):
        calls = 0

        async def send(event, token):  # steps back once, between claims and their finishes
            nonlocal calls
            calls += 1
            if calls == 100:
                clock.step_back(step_ms)
            return await http(event, token)

        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=16, lease_ms=5000, clock=clock)
        summary = await dispatcher.run()
    gc.collect()
    assert dispatcher.snapshot()["clock_steps"] == 1  # (also live: work --metrics-port)
    assert unretrieved == []
    assert statuses(db) == {("done", 1): 300}  # nothing re-leased, nothing retried
    assert (summary.done, summary.errors, summary.stale, summary.lost) == (300, 0, 0, 0)
    assert (summary.clock_steps, summary.clock_step_ms >= step_ms - 50) == (1, True)
    total, inbox = sink_state(tmp_path / "s.db")
    assert len(inbox) == 300 and total == sum(i % 7 + 1 for i in range(300))


async def test_a_clock_that_steps_back_and_forth_at_random_never_ends_the_run(db, unretrieved):
    """Steps back of up to 30 s and forward of up to 3 leases, hundreds of them: jobs whose
    lease a forward jump ended are lost and sent again (at most once more per jump)."""
    await fill(db, 400)
    clock, rng = SteppedClock(), random.Random(7)
    moves = []

    def at_send(n):
        if n % 3 == 0:
            move = rng.choice([-30_000, -10_000, -100, -1, 1, 100, 900, 1500])
            moves.append(move)
            clock.offset += move

    send = CountingSend(at_send)
    async with AsyncQueue.open(db) as queue:
        summary = await Dispatcher(
            queue, send, owner="d1", concurrency=8, lease_ms=500, clock=clock, prefetch=4
        ).run()
    gc.collect()
    assert unretrieved == []
    assert {status for status, _ in statuses(db)} == {"done"}
    assert summary.done == 400 and summary.errors == 0
    assert summary.clock_steps >= 1 and sorted(send.sends) == sorted(f"job-{i}" for i in range(400))
    assert sum(send.sends.values()) - 400 <= summary.lost + summary.stale


async def test_a_huge_step_back_holds_the_clock_for_the_rest_of_the_run(db, unretrieved):
    await fill(db, 50)
    clock = SteppedClock()
    send = CountingSend(lambda n: n == 10 and setattr(clock, "offset", -epoch_ms() + 1))
    async with AsyncQueue.open(db) as queue:
        summary = await Dispatcher(queue, send, owner="d1", concurrency=4, clock=clock).run()
    assert statuses(db) == {("done", 1): 50} and summary.clock_steps == 1
    assert unretrieved == []


async def test_a_failing_clock_ends_the_run_with_every_task_exception_retrieved(db, unretrieved):
    """A clock that returns garbage is a programming error: the run ends with it, and no
    coroutine's copy of it is left for the event loop to report."""
    await fill(db, 100)
    send = CountingSend()
    readings = iter(range(10**9))

    def clock():
        n = next(readings)
        return "garbage" if n > 20 else epoch_ms()

    async with AsyncQueue.open(db) as queue:
        dispatcher = Dispatcher(queue, send, owner="d1", concurrency=16, clock=clock)
        with pytest.raises(ValueError, match="clock reading must be an int"):
            await dispatcher.run()
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []


async def test_a_clock_failing_at_a_deliverys_second_reading_ends_the_run(db, unretrieved):
    """The reading after an ACK is the delivery's second: garbage there ends the run (no
    outcome is recorded for the job, which stays leased), even when the clock reads well
    again at once: the send's outcome is never taken for a failed send of the job."""
    await fill(db, 1)
    bad = [False]

    def clock():
        if bad[0]:
            bad[0] = False  # (this reading only)
            return "garbage"
        return epoch_ms()

    async def send(event, token):
        bad[0] = True  # (the next reading is the second one of this delivery)
        return True

    async with AsyncQueue.open(db) as queue:
        dispatcher = Dispatcher(
            queue, send, owner="d1", concurrency=1, clock=clock, lease_ms=60_000
        )
        with pytest.raises(ValueError, match="clock reading must be an int"):
            async with asyncio.timeout(30):  # (a run that took the failure for a failed
                await dispatcher.run(until_empty=True)  # send would wait out the lease)
    assert statuses(db) == {("leased", 1): 1}
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), True, "0.5", None])
async def test_a_jitter_out_of_its_range_ends_the_run_before_any_send(db, unretrieved, bad):
    """A jitter is a number in 0..1 (``w.check_jitter``): anything else ends the run at the
    first send, nothing sent and the job left leased, whatever its type."""
    await fill(db, 1)
    sent = []

    async def send(event, token):
        sent.append(token)
        return True

    async with AsyncQueue.open(db) as queue:
        dispatcher = Dispatcher(
            queue, send, owner="d1", concurrency=1, jitter=lambda: bad, lease_ms=60_000
        )
        with pytest.raises(ValueError, match=r"jitter must be a finite int or float in 0\.\.1"):
            async with asyncio.timeout(30):
                await dispatcher.run(until_empty=True)
    assert sent == [] and statuses(db) == {("leased", 1): 1}
    gc.collect()
    await asyncio.sleep(0)
    assert unretrieved == []


def test_the_run_clock_holds_a_step_back_and_follows_a_step_forward():
    readings = iter([1000, 1010, 900, 950, 1005, 1020, 5000, 4000, 6000])
    clock = RunClock(lambda: next(readings), w.PRODUCT)
    assert [clock() for _ in range(9)] == [1000, 1010, 1010, 1010, 1010, 1020, 5000, 5000, 6000]
    assert (clock.steps, clock.largest_ms) == (2, 1000)


STEPPING_WORKER = """
import sys, time
from asnackq.cli import main
real, calls, last, back = time.time_ns, 0, 0, 0
def stepped():  # the host's wall clock, stepped back after AFTER readings to STEP ms before
    global calls, last, back  # the last reading (a fixed step from the wall clock would be
    calls += 1  # hidden by a stall longer than the step between two readings: a busy host)
    now = real()
    if calls == int(sys.argv[2]) + 1:
        back = now - last + int(sys.argv[1]) * 1_000_000
    last = now
    return now - back
time.time_ns = stepped
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.process
@pytest.mark.parametrize("step_ms", [100, 10_000])
def test_asnackq_work_outlasts_an_ntp_step_back(tmp_path, step_ms):
    """A real ``asnackq work`` whose wall clock steps back mid-run (time.time_ns patched in
    the child, as an NTP step looks to a process) delivers every job and exits 0."""
    queue = tmp_path / "queue.db"
    lines = "".join(json.dumps({"id": f"j-{i}", "qty": i % 9 + 1}) + "\n" for i in range(600))
    for args, stdin in ((("init", queue), None), (("enqueue", queue, "-"), lines)):
        subprocess.run(procs.command(*args), input=stdin, text=True, check=True, timeout=60)
    sink, url = procs.start_sink(tmp_path / "sink.db")
    try:
        work = subprocess.run(
            [
                sys.executable,
                "-c",
                STEPPING_WORKER,
                str(step_ms),
                "300",
                "work",
                str(queue),
                "--sink",
                url,
                "--until-empty",
                "--json",
                "--concurrency",
                "16",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        procs.stop(sink)
    assert work.returncode == 0, work.stderr
    assert "Traceback" not in work.stderr and "never retrieved" not in work.stderr
    summary = json.loads(work.stdout)
    assert (summary["done"], summary["errors"], summary["clock_steps"]) == (600, 0, 1)
    assert statuses(queue) == {("done", 1): 600}

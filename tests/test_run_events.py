"""What a run tells: its events (log records of ``asnackq.worker``, ``on_event``,
``Dispatcher.events()``), a sink timing out told apart from one away, and a stopped run's
summary - against real aiohttp receivers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Dispatcher, Event
from asnackq.core import worker as w
from asnackq.dispatch.breaker import BreakerPolicy
from asnackq.wire.send import DEFAULT_TIMEOUT_S, AsyncHttpSender, HttpSender, TimedOut

from .sinks import peer, serving

FAST_BREAKER = BreakerPolicy(after=2, base_ms=20, max_ms=100)


@pytest.fixture
async def queue(db):
    async with AsyncQueue.open(db) as opened:
        yield opened


async def fill(queue: AsyncQueue, count: int, max_attempts: int = 5) -> None:
    for i in range(count):
        await queue.enqueue({"id": f"e{i}", "qty": 1}, ttl_ms=3_600_000, max_attempts=max_attempts)


def ack(event_id: str) -> web.Response:
    return web.json_response({"id": event_id, "status": "applied"})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_senders_wait_15_s_by_default():
    assert DEFAULT_TIMEOUT_S == 15.0
    assert AsyncHttpSender("http://127.0.0.1:9/e").timeout_s == 15.0
    with HttpSender("http://127.0.0.1:9/e") as send:
        assert send.timeout_s == 15.0


async def test_a_sender_slower_than_the_lease_is_accepted(queue):
    async with AsyncHttpSender("http://127.0.0.1:9/e", timeout_s=30) as send:
        Dispatcher(queue, send, owner="d1", lease_ms=1000)  # (the lease is kept while it waits)


async def test_no_answer_in_time_is_timing_out_not_away_and_resumes(queue, caplog):
    """A receiver that hangs past the timeout, then answers: paused as *timing out*, probed,
    resumed; every job done once; the timeouts counted apart from sends finding no sink."""
    hanging, released = asyncio.Event(), asyncio.Event()
    hanging.set()
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if hanging.is_set():
            await released.wait()  # (long past the sender's timeout)
            return web.Response(status=500)
        seen.append(body["id"])
        return ack(body["id"])

    await fill(queue, 5)
    events: list[Event] = []

    def listen(event: Event) -> None:
        events.append(event)
        if event.name == "probing":
            hanging.clear()  # the receiver answers from the first probe on

    caplog.set_level(logging.INFO, logger="asnackq")
    async with (
        serving(peer(handler)) as running,
        AsyncHttpSender(running.url, timeout_s=0.3) as send,
    ):
        dispatcher = Dispatcher(
            queue, send, owner="t1", concurrency=4, breaker=FAST_BREAKER, on_event=listen
        )
        summary = await asyncio.wait_for(dispatcher.run(), 60)
        released.set()
    names = [event.name for event in events]
    assert names[0] == "started" and names[-1] == "stopped"
    assert names.index("paused") < names.index("probing") < names.index("resumed")
    paused = next(event for event in events if event.name == "paused")
    assert paused.fields["cause"] == "timing_out" and "timing out" in paused.message
    assert summary.done == 5 and sorted(seen) == [f"e{i}" for i in range(5)]
    assert summary.timeouts >= 2 and summary.away == 0
    assert events[-1].fields["reason"] == "ended" and events[-1].fields["done"] == 5
    records = [r for r in caplog.records if r.name == "asnackq.worker"]
    assert [r.event for r in records] == names  # the same events as log records
    assert records[1 + names[1:].index("paused")].levelno == logging.WARNING
    assert all(r.owner == "t1" for r in records)  # fields as the record's attributes


async def test_no_sink_there_is_away_and_stop_returns_the_summary(queue):
    """Refused connections: paused as *away*; ``stop()`` ends a following run, which
    returns its summary, and the event stream ends with ``stopped``."""
    await fill(queue, 3)
    url = f"http://127.0.0.1:{free_port()}/events"
    async with AsyncHttpSender(url) as send:
        dispatcher = Dispatcher(queue, send, owner="a1", concurrency=2, breaker=FAST_BREAKER)
        stream = dispatcher.events()
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        names = []
        async for event in stream:
            names.append(event.name)
            if event.name == "paused":
                assert event.fields["cause"] == "away"
                dispatcher.stop()
        summary = await asyncio.wait_for(run, 30)
    assert names[0] == "started" and "stopping" in names and names[-1] == "stopped"
    assert summary.away >= 2 and summary.timeouts == 0 and summary.outages == 1
    assert summary.done == 0 and summary.claimed >= 2


async def test_a_cancelled_run_keeps_its_summary_and_tells_why(queue):
    await fill(queue, 4)

    async def handler(request: web.Request) -> web.Response:
        return ack((await request.json())["id"])

    events: list[Event] = []
    async with serving(peer(handler)) as running, AsyncHttpSender(running.url) as send:
        dispatcher = Dispatcher(queue, send, owner="c1", concurrency=2, on_event=events.append)
        run = asyncio.ensure_future(dispatcher.run(follow=True))
        for _ in range(6000):  # until the 4 are done (bounded: 60 s)
            if dispatcher.snapshot()["done"] == 4:
                break
            await asyncio.sleep(0.01)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert dispatcher.summary.done == 4 and dispatcher.summary.commits >= 1
    stopped = events[-1]
    assert stopped.name == "stopped" and stopped.fields["reason"] == "cancelled"
    assert stopped.fields["summary"]["done"] == 4
    assert [event.name for event in events].count("stopping") == 1


async def test_jobs_ended_dead_are_told_with_their_reasons(queue):
    await fill(queue, 2, max_attempts=1)

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "no"}, status=422)

    events: list[Event] = []
    async with serving(peer(refuse)) as running, AsyncHttpSender(running.url) as send:
        await Dispatcher(queue, send, owner="x1", on_event=events.append).run()
    dead = [event for event in events if event.name == "dead"]
    assert sum(event.fields["jobs"] for event in dead) == 2
    assert all(event.fields["reasons"] == {"permanent": event.fields["jobs"]} for event in dead)
    assert dead[0].level == logging.WARNING


async def test_a_listener_that_fails_is_dropped_and_the_run_goes_on(queue, caplog):
    await fill(queue, 3)

    async def handler(request: web.Request) -> web.Response:
        return ack((await request.json())["id"])

    calls = []

    def broken(event: Event) -> None:
        calls.append(event.name)
        raise RuntimeError("a bug in the app's listener")

    async def nothing(event: dict[str, object], token: int | None) -> bool:
        return True

    with pytest.raises(ValueError, match="on_event must be callable"):
        Dispatcher(queue, nothing, on_event=3)  # type: ignore[arg-type]
    async with serving(peer(handler)) as running, AsyncHttpSender(running.url) as send:
        summary = await Dispatcher(queue, send, owner="b1", on_event=broken).run()
    assert summary.done == 3 and calls == ["started"]
    assert "listener of the run failed" in caplog.text


def test_timed_out_is_an_unavailable():
    assert issubclass(TimedOut, w.Unavailable)

"""``AsyncQueue.close()``: the calls made before it are answered, every call made once it
began raises ``QueueClosed`` and does nothing, the same on a file and on PostgreSQL (where
no session is opened again) - with real files, a real server and real concurrent callers."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections import Counter
from typing import Any

import pytest

from asnackq.aio import AsyncQueue, Dispatcher, Fleet, QueueClosed
from asnackq.core import lanes
from asnackq.core.endpoints import Endpoint
from asnackq.wire import webhooks as wh

from .conftest import T0
from .pgdb import ended
from .test_endpoints import where  # noqa: F401 (the fixture, by its name)
from .test_event_deliveries import hooks
from .test_intake_batches import table, targets  # noqa: F401 (the fixture, by its name)

LATE_CALLS = {  # (the queue, a ticket it gave before closing)
    "enqueue": lambda q, _: q.enqueue({"id": "late", "qty": 1}),
    "enqueue_many": lambda q, _: q.enqueue_many([{"id": "late", "qty": 1}]),
    "publish": lambda q, _: q.publish({"id": "late", "type": "order.paid", "data": {}}),
    "claim": lambda q, _: q.claim("w", T0 + 1),
    "finish": lambda q, ticket: q.finish(ticket, "ACK", T0 + 1),
    "read": lambda q, _: q.read("SELECT count(*) FROM jobs"),
}


@pytest.mark.parametrize("call", LATE_CALLS)
async def test_a_call_after_close_raises_queue_closed_and_changes_nothing(targets, call):  # noqa: F811
    kind, fresh = targets
    target = fresh()
    queue = await AsyncQueue.connect(target)
    await queue.enqueue_many([{"id": "warm", "qty": 1}, {"id": "next", "qty": 1}], T0)
    ticket = await queue.claim("w", T0, 60_000)
    await queue.close()
    before = table(target)
    with pytest.raises(QueueClosed, match="the queue is closed"):
        await LATE_CALLS[call](queue, ticket)
    assert table(target) == before
    if kind == "pg":
        assert await ended(target)  # neither the queue's session nor the intakes' reopened
    await queue.close()  # closing again is harmless


async def test_handlers_enqueuing_while_the_queue_closes_each_get_a_result_or_queue_closed(
    targets,  # noqa: F811
):
    """Eight handlers enqueue in a loop; the queue closes meanwhile.  Every call made before
    ``close()`` returned True and its job is in the table; every call made after raised
    ``QueueClosed`` and wrote nothing; nothing else was raised."""
    kind, fresh = targets
    target = fresh()
    queue = await AsyncQueue.connect(target)
    await queue.enqueue({"id": "warm", "qty": 1}, T0)
    closing = False
    outcomes: Counter[tuple[bool, str]] = Counter()  # (made once close began, outcome)
    inserted: list[str] = []
    enough = asyncio.Event()

    async def handler(h: int) -> None:
        for k in range(100_000):
            late, job_id = closing, f"h{h}-{k}"
            try:
                assert await queue.enqueue({"id": job_id, "qty": 1}) is True
            except Exception as error:
                outcomes[late, type(error).__name__] += 1
                return
            outcomes[late, "True"] += 1
            inserted.append(job_id)
            if len(inserted) >= 200:
                enough.set()

    handlers = [asyncio.ensure_future(handler(h)) for h in range(8)]
    await asyncio.wait_for(enough.wait(), 60)
    closing = True
    await asyncio.wait_for(queue.close(), 60)
    await asyncio.wait_for(asyncio.gather(*handlers), 60)
    assert set(outcomes) <= {(False, "True"), (True, "QueueClosed")}, outcomes
    assert outcomes[True, "QueueClosed"] == 8  # each handler's loop ended on a refusal
    assert sorted(row[0] for row in table(target)) == sorted([*inserted, "warm"])
    if kind == "pg":
        assert await ended(target)


async def delivering(queue: AsyncQueue, jobs: int) -> asyncio.Future[Any]:
    """A Dispatcher's run on ``queue`` (following it) over ``jobs`` new jobs, once it has
    sent the first."""
    await queue.enqueue_many([{"id": f"e{i}", "qty": 1} for i in range(jobs)])  # (wall time)
    sent = asyncio.Event()

    async def send(event: dict[str, Any], token: int) -> str:
        sent.set()
        await asyncio.sleep(0)
        return "ACK"

    run = asyncio.ensure_future(Dispatcher(queue, send, concurrency=4).run(follow=True))
    await asyncio.wait_for(sent.wait(), 60)
    return run


async def test_a_dispatcher_whose_queue_closes_under_it_stops_with_queue_closed(tmp_path):
    queue = await AsyncQueue.connect(str(tmp_path / "q.db"))
    run = await delivering(queue, 500)
    await queue.close()
    with pytest.raises(QueueClosed):
        await asyncio.wait_for(run, 60)


async def test_a_transaction_of_calls_made_before_close_runs_even_once_it_began(tmp_path):
    """On a file: call A's transaction is under way (held inside its INSERT by a function of
    the test's), call B waits behind it in a transaction of its own, then ``close()``
    begins.  B was made before ``close()``: its transaction runs, B gets True and its row
    stays; only calls made after ``close()`` began are refused."""
    target = str(tmp_path / "q.db")
    queue = await AsyncQueue.connect(target)
    await queue.enqueue({"id": "warm", "qty": 1})
    loop = asyncio.get_running_loop()
    inside, release = asyncio.Event(), threading.Event()

    def hold() -> int:  # (in aiosqlite's thread, inside A's INSERT)
        loop.call_soon_threadsafe(inside.set)
        return int(release.wait(60))

    await queue._db.db.create_function("hold", 0, hold)
    with sqlite3.connect(target) as con:
        con.execute(
            "CREATE TRIGGER held BEFORE INSERT ON jobs WHEN NEW.id = 'a' BEGIN SELECT hold(); END"
        )
    a = asyncio.ensure_future(queue.enqueue({"id": "a", "qty": 1}))
    await asyncio.wait_for(inside.wait(), 60)
    b = asyncio.ensure_future(queue.enqueue({"id": "b", "qty": 1}))
    for _ in range(10):  # (b joins a transaction of its own, waiting for a's)
        await asyncio.sleep(0)
    closing = asyncio.ensure_future(queue.close())
    await asyncio.sleep(0)
    with pytest.raises(QueueClosed):
        await queue.enqueue({"id": "c", "qty": 1})
    release.set()
    assert await asyncio.wait_for(asyncio.gather(a, b), 60) == [True, True]
    await asyncio.wait_for(closing, 60)
    assert [row[0] for row in table(target)] == ["a", "b", "warm"]


MADE_BEFORE = {  # calls made just before close(), each waiting for its transaction's turn
    "claim": lambda q: q.claim("w", T0 + 1, 60_000),
    "enqueue_many": lambda q: q.enqueue_many([{"id": "made-before", "qty": 1}], T0),
    "publish": lambda q: q.publish({"id": "made-before", "type": "t", "data": {}}, T0),
    "clear_rate": lambda q: q.clear_rate(),
    "endpoints": lambda q: q.endpoints(),  # (two statements: the table looked for, then read)
}


@pytest.mark.parametrize("call", MADE_BEFORE)
async def test_a_call_made_just_before_close_is_answered_and_leaves_no_session(targets, call):  # noqa: F811
    """The call's transaction has not yet asked for the queue's lock when ``close()`` runs
    (made in the same ``gather``): it still runs whole, and ``close()`` returns after it."""
    kind, fresh = targets
    target = fresh()
    queue = await AsyncQueue.connect(target)
    await queue.enqueue({"id": "warm", "qty": 1}, T0)
    result, _ = await asyncio.wait_for(asyncio.gather(MADE_BEFORE[call](queue), queue.close()), 60)
    assert not isinstance(result, BaseException)
    if call == "claim":
        assert result is not None and result["id"] == "warm"
    if call == "enqueue_many":
        assert result == [True] and "made-before" in [row[0] for row in table(target)]
    if call == "publish":
        assert result.created is True  # (stored; no endpoint: no delivery)
    if kind == "pg":
        assert await ended(target)


async def test_a_view_and_its_queue_close_together(targets):  # noqa: F811
    """A view (``in_lane``) shares its queue's connection: closing either refuses calls on
    both, and neither opens a session again."""
    kind, fresh = targets
    for closed_first in ("queue", "view"):
        target = fresh()
        queue = await AsyncQueue.connect(target)
        await queue.enqueue({"id": "warm", "qty": 1}, T0)
        view = queue.in_lane(lanes.PLAIN)
        await (queue if closed_first == "queue" else view).close()
        assert queue.closing and view.closing
        for q in (queue, view):
            with pytest.raises(QueueClosed):
                await q.claim("w", T0 + 1, 60_000)
            with pytest.raises(QueueClosed):
                await q.enqueue({"id": "late", "qty": 1})
        assert [row[0] for row in table(target)] == ["warm"]
        if kind == "pg":
            assert await ended(target)


@pytest.mark.process
async def test_a_dispatcher_on_a_view_stops_when_its_queue_closes_on_postgresql(pg_db):
    url = pg_db()
    queue = await AsyncQueue.connect(url)
    run = await delivering(queue.in_lane(lanes.PLAIN), 2_000)
    await queue.close()
    with pytest.raises(QueueClosed):
        await asyncio.wait_for(run, 60)
    assert await ended(url)


async def test_a_fleet_cancelled_as_its_queue_closes_ends_cancelled(where: str) -> None:  # noqa: F811
    """The fleet's last note of its endpoints (on its way out) finds the queue closing and
    says nothing: the run ends with its cancellation, not ``QueueClosed``."""
    secret = wh.new_secret()
    async with hooks(secret) as (_, url):
        queue = await AsyncQueue.connect(where)
        await queue.add_endpoint(Endpoint("ok", url, secrets=(secret,)))
        fleet = Fleet(queue, owner="fleet", refresh_s=0.05)
        task = asyncio.ensure_future(fleet.run())
        for _ in range(3_000):  # (60 s at most)
            if "ok" in fleet.running:
                break
            await asyncio.sleep(0.02)
        assert "ok" in fleet.running
        task.cancel()
        await asyncio.wait_for(queue.close(), 60)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)


async def test_a_close_whose_caller_is_cancelled_still_closes(targets):  # noqa: F811
    """The caller of ``close()`` (an ``async with`` under a timeout) is cancelled while it
    waits for the calls made before it: it waits for the close to end, then re-raises; no
    session is left open, and each call made before it has its answer."""
    kind, fresh = targets
    target = fresh()
    queue = await AsyncQueue.connect(target)
    await queue.enqueue({"id": "warm", "qty": 1}, T0)
    calls = [asyncio.ensure_future(queue.enqueue({"id": f"j{i}", "qty": 1})) for i in range(20)]
    await asyncio.sleep(0)  # (every call has joined its transaction)
    closing = asyncio.ensure_future(queue.close())
    await asyncio.sleep(0)  # (close() waits for them)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 60)
    assert await asyncio.gather(*calls) == [True] * 20
    with pytest.raises(QueueClosed):
        await queue.enqueue({"id": "late", "qty": 1})
    if kind == "pg":
        assert await ended(target)
    else:
        assert queue._db.db._connection is None  # (aiosqlite's: the file's connection closed)


async def test_a_fleet_whose_queue_closes_as_it_starts_its_endpoints_refuses_none(where):  # noqa: F811
    """``QueueClosed`` is a ``ValueError``, but no endpoint row's fault: the fleet stops with
    it and refuses no endpoint (a bad row is refused until it changes)."""
    secret = wh.new_secret()
    async with hooks(secret) as (_, url):
        queue = await AsyncQueue.connect(where)
        for i in range(4):
            await queue.add_endpoint(Endpoint(f"ep{i}", url, secrets=(secret,)))
        closing: list[asyncio.Future[None]] = []

        def on_start(name: str, dispatcher: Dispatcher) -> None:
            if not closing:  # (the first endpoint started: the others are yet to start)
                closing.append(asyncio.ensure_future(queue.close()))

        fleet = Fleet(queue, owner="fleet", on_start=on_start)
        with pytest.raises(QueueClosed):
            await asyncio.wait_for(fleet.run(), 60)
        await asyncio.wait_for(closing[0], 60)
        assert fleet.refused == {} and len(fleet.running) < 4

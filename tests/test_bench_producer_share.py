"""``benchmarks/producer_share.py``'s ``one`` producer: its handlers keep the depth exactly,
each delivery wakes one of them (never a poll), and they all end when told to stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asnackq.aio import AsyncQueue, Dispatcher

from .benches import loaded

bench = loaded("producer_share")


async def test_room_wakes_the_longest_waiting_handler_alone_and_banks_what_none_waits_for() -> None:
    room = bench.Room()
    room.release()  # nobody waits: banked
    await asyncio.wait_for(room.acquire(), 10)  # taken at once
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await room.acquire()
        woken.append(n)

    tasks = [asyncio.ensure_future(waiter(n)) for n in range(3)]
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(room.waiting) == 3 and woken == []
    room.release()
    await asyncio.wait_for(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED), 10)
    for _ in range(5):
        await asyncio.sleep(0)
    assert woken == [0]
    room.release()
    room.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert woken == [0, 1, 2]
    assert room.free == 0


async def test_the_one_producer_keeps_the_depth_exactly_and_stops(tmp_path: Path) -> None:
    depth, handlers = 10, 50
    counts, stop = bench.Counts(), asyncio.Event()
    async with AsyncQueue.open(str(tmp_path / "q.db")) as queue:
        await queue.enqueue_many(counts.events(depth))
        counts.enqueued = depth
        producing = asyncio.ensure_future(bench.produce_one(queue, counts, depth, stop, handlers))
        for _ in range(50):  # every handler has had its turns: none may enqueue yet
            await asyncio.sleep(0)
        assert counts.enqueued == depth
        for _ in range(7):  # seven deliveries: seven more events, no more
            counts.trace("finish", {}, 0, "done")
        for _ in range(3000):  # (at most 30 s: the intakes' transactions, a busy machine)
            if (await queue.read("SELECT count(*) FROM jobs"))[0][0] >= depth + 7:
                break
            await asyncio.sleep(0.01)
        for _ in range(50):
            await asyncio.sleep(0)
        assert counts.enqueued == depth + 7
        assert (await queue.read("SELECT count(*) FROM jobs"))[0][0] == depth + 7
        stop.set()
        await asyncio.wait_for(producing, 30)
    assert counts.enqueued == depth + 7


async def test_a_cancelled_handler_takes_no_room_from_the_others() -> None:
    room = bench.Room()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await room.acquire()
        woken.append(n)

    first, second, third = (asyncio.ensure_future(waiter(n)) for n in range(3))
    for _ in range(10):
        await asyncio.sleep(0)
    first.cancel()  # cancelled while it waits: its place is skipped
    room.release()
    second.cancel()  # handed the unit, then cancelled before it ran: the unit goes on
    await asyncio.wait_for(third, 10)
    assert woken == [2] and first.cancelled() and second.cancelled()
    room.release()
    assert room.free == 1 and not room.waiting


@pytest.mark.timeout(180)  # (its wait below: up to 60 s on a busy machine, then the stops)
async def test_beside_a_real_dispatcher_the_producer_never_goes_over_the_depth(
    tmp_path: Path,
) -> None:
    depth, handlers = 20, 64
    counts, stop = bench.Counts(), asyncio.Event()

    async def send(event: dict[str, object], token: int) -> bool:
        return True

    async with AsyncQueue.open(str(tmp_path / "q.db")) as queue:
        await queue.enqueue_many(counts.events(depth))
        counts.enqueued = depth
        dispatcher = Dispatcher(queue, send, concurrency=4, trace=counts.trace)
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        producing = asyncio.ensure_future(bench.produce_one(queue, counts, depth, stop, handlers))
        most = 0
        for _ in range(6000):  # (at most 60 s: a busy machine)
            most = max(most, counts.enqueued - counts.done)
            if counts.done >= 300:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(producing, 30)
        dispatcher.stop()
        await asyncio.wait_for(running, 30)
        assert counts.done >= 300 and 0 < most <= depth
        (jobs,) = (await queue.read("SELECT count(*) FROM jobs"))[0]
        assert jobs == counts.enqueued <= counts.done + depth

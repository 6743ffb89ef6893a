"""Ordered lanes, on a file and on PostgreSQL: an ordered endpoint's claim takes at most one
delivery per key, the earliest, and none of a key while one of its deliveries is leased or
waits for a retry; other keys and keyless deliveries go on; done and dead release a key; a
redriven delivery goes next in its key.  And a hundred cycles at random against a model."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue, Fleet
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Delays, Endpoint
from asnackq.wire import webhooks as wh

from .conftest import T0
from .sinks import serving
from .test_endpoints import where as a_queue

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
URL = "http://127.0.0.1:9/hooks"
LANE = lanes.Lane("o", ordered=True)
LEASE = 60_000


async def ordered_queue(queue: AsyncQueue, *events: tuple[str, str | None]) -> AsyncQueue:
    """``queue`` with the ordered endpoint "o" and ``events`` (id, key) published to it, in
    order: the view claiming in its ordered lane."""
    await queue.add_endpoint(Endpoint("o", URL, ordered=True, concurrency=8), now_ms=T0)
    for event_id, key in events:
        event: dict[str, Any] = {"id": event_id, "data": event_id}
        await queue.publish(event if key is None else {**event, "key": key}, T0)
    view = queue.in_lane(LANE)
    await view.prepare_lane()
    return view


async def events_of(view: AsyncQueue, tickets: list[w.Ticket]) -> list[str]:
    found = [await view.delivery(t["id"]) for t in tickets]
    return [one[0] for one in found if one is not None]


async def claim(view: AsyncQueue, now: int, count: int = 16) -> list[w.Ticket]:
    return await view.claim_many("w", now, LEASE, count)


async def test_one_claim_takes_each_keys_earliest_and_every_keyless_one(where: str) -> None:
    published = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("free1", None), ("b2", "B")]
    async with AsyncQueue.open(where) as queue:
        view = await ordered_queue(queue, *published, ("a3", "A"), ("free2", None))
        first = await claim(view, T0 + 1)
        assert await events_of(view, first) == ["a1", "b1", "free1", "free2"]
        assert await claim(view, T0 + 2) == []  # A and B are held while a1 and b1 are out
        assert await view.read(w.SQL_ACTIVE) == [(7,)]  # held ones are still left
        await queue.finish_many([(first[0], "ok", T0 + 3, 0)])  # a1 done
        assert await events_of(view, await claim(view, T0 + 4)) == ["a2"]


async def test_a_claim_of_one_takes_the_key_in_order_one_at_a_time(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        view = await ordered_queue(queue, *[(f"e{i}", "K") for i in range(5)])
        seen = []
        for step in range(5):
            tickets = await claim(view, T0 + 10 * step)
            assert len(tickets) == 1
            seen += await events_of(view, tickets)
            await queue.finish_many([(tickets[0], "ok", T0 + 10 * step + 1, 0)])
        assert seen == [f"e{i}" for i in range(5)]


async def test_a_failing_head_holds_its_key_only(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        published = [("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B"), ("b3", "B")]
        view = await ordered_queue(queue, *published)
        a1, b1 = await claim(view, T0 + 1)
        await queue.finish_many([(a1, "retry", T0 + 2, 10_000), (b1, "ok", T0 + 2, 0)])
        for at in (T0 + 3, T0 + 5000):  # while a1 waits for its retry: B goes on, A does not
            tickets = await claim(view, at)
            assert await events_of(view, tickets) == [f"b{2 if at == T0 + 3 else 3}"]
            await queue.finish_many([(tickets[0], "ok", at, 0)])
        retried = await claim(view, T0 + 10_002)  # a1 again, at its next attempt
        assert [(t["id"], t["attempt"]) for t in retried] == [(a1["id"], 2)]
        await queue.finish_many([(retried[0], "permanent", T0 + 10_003, 0)])  # dead: released
        assert await events_of(view, await claim(view, T0 + 10_004)) == ["a2"]


async def test_a_lease_that_ended_is_retaken_before_the_keys_next(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        view = await ordered_queue(queue, ("a1", "A"), ("a2", "A"))
        [a1] = await claim(view, T0 + 1)
        assert await claim(view, T0 + LEASE) == []
        [again] = await claim(view, T0 + LEASE + 2)  # a1's lease ended: a1, never a2
        assert again["id"] == a1["id"] and again["token"] == a1["token"] + 1


async def test_a_redriven_delivery_goes_after_the_one_in_flight_and_before_later_ones(
    where: str,
) -> None:
    async with AsyncQueue.open(where) as queue:
        view = await ordered_queue(queue, *[(f"e{i}", "K") for i in range(1, 5)])
        [e1] = await claim(view, T0 + 1)
        await queue.finish_many([(e1, "permanent", T0 + 2, 0)])  # e1 dead
        [e2] = await claim(view, T0 + 3)
        await queue.finish_many([(e2, "ok", T0 + 4, 0)])
        [e3] = await claim(view, T0 + 5)  # in flight when e1 is redriven
        assert await queue.redrive(e1["id"], T0 + 6, note="fixed") is True
        assert await claim(view, T0 + 7) == []  # e3 is out: nothing else of K
        await queue.finish_many([(e3, "ok", T0 + 8, 0)])
        assert await events_of(view, await claim(view, T0 + 9)) == ["e1"]  # before e4


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_hundred_cycles_keep_each_key_in_order_one_at_a_time(where: str, seed: int) -> None:
    """Two claimers, random outcomes, leases left to end: every claim takes, of each key, only
    its earliest delivery not done or dead, and only while no other of the key is leased;
    every done delivery of a key is done in enqueue order; at the end every one is settled."""
    rng = random.Random(seed)
    keys = ("A", "B", "C", None)
    async with AsyncQueue.open(where) as queue:
        view = await ordered_queue(queue)
        order: dict[str, list[str]] = {}  # key -> its deliveries' job ids, enqueue order
        key_of: dict[str, str | None] = {}
        settled: set[str] = set()
        held: dict[str, tuple[w.Ticket, int]] = {}  # job -> (ticket, lease end)
        done: dict[str, list[str]] = {}
        now = T0
        for step in range(140):
            now += rng.choice((1, 5, 200, 30_000))
            if rng.random() < 0.35:
                key = rng.choice(keys)
                made = await queue.publish(
                    {"id": f"e{step}", "data": step, **({"key": key} if key else {})}, now
                )
                [(_, job)] = made.deliveries
                key_of[job] = key
                order.setdefault(key or "", []).append(job)
                continue
            held = {job: (t, end) for job, (t, end) in held.items() if end > now}
            tickets = await view.claim_many(rng.choice("xy"), now, LEASE, rng.randint(1, 4))
            for ticket in tickets:
                key = key_of[ticket["id"]]
                if key is not None:
                    earliest = next(j for j in order[key] if j not in settled)
                    assert ticket["id"] == earliest
                    assert not [j for j in held if key_of[j] == key and j != ticket["id"]]
                held[ticket["id"]] = (ticket, ticket["lease_until"])
            finishing = [job for job in held if rng.random() < 0.6]
            results = []
            for job in finishing:
                outcome = rng.choice(("ok", "ok", "ok", "retry", "permanent"))
                results.append((held.pop(job)[0], outcome, now, rng.choice((0, 500, 40_000))))
            statuses = await queue.finish_many(results) if results else []
            for (ticket, _, _, _), status in zip(results, statuses, strict=True):
                if status in ("done", "dead"):
                    settled.add(ticket["id"])
                if status == "done" and key_of[ticket["id"]] is not None:
                    done.setdefault(key_of[ticket["id"]] or "", []).append(ticket["id"])
        now += 10 * LEASE
        while tickets := await view.claim_many("z", now, LEASE, 16):
            assert len({key_of[t["id"]] for t in tickets if key_of[t["id"]]}) == sum(
                1 for t in tickets if key_of[t["id"]]
            )
            await queue.finish_many([(t, "ok", now, 0) for t in tickets])
            settled.update(t["id"] for t in tickets)
            for t in tickets:
                if key_of[t["id"]] is not None:
                    done.setdefault(key_of[t["id"]] or "", []).append(t["id"])
            now += 1
        assert await view.read(w.SQL_ACTIVE) == [(0,)]
        assert settled == set(key_of)
        for key, jobs in done.items():
            assert jobs == sorted(jobs), key  # each key's done ones in enqueue order
            assert len(jobs) == len(set(jobs))


def test_an_ordered_lane_is_an_endpoints() -> None:
    assert lanes.Lane("o").ordered is False
    with pytest.raises(ValueError, match="endpoint's"):
        AsyncQueue.in_lane(object.__new__(AsyncQueue), lanes.Lane(None, ordered=True))


def test_an_ordered_claim_reads_its_range_and_each_keys_deliveries_by_index(
    tmp_path: Path,
) -> None:
    from asnackq.core import events as ev

    con = w.open_queue(tmp_path / "q.db")
    try:
        w.drive(con, w.plan_schema(ev.SCHEMA))
        params = {"now": 1, "n": 4, "losses": 3, **LANE.params()}
        for sql in (w.SQL_NEXT_RECLAIMABLE, w.SQL_NEXT_FRESH_RECLAIMING):
            plan = con.execute("EXPLAIN QUERY PLAN " + lanes.ORDERED_TEXTS[sql], params)
            reads = [row[3] for row in plan.fetchall()]
            assert (
                "SEARCH jobs USING INDEX asnackq_jobs_by_lane (status=? AND id>? AND id<?)" in reads
            )
            by_key = (
                "SEARCH k USING COVERING INDEX asnackq_deliveries_by_key"
                " (endpoint=? AND key=? AND job>?)"
            )
            oldest = (
                "SEARCH a USING COVERING INDEX asnackq_jobs_by_lane (status=? AND id>? AND id<?)"
            )
            assert by_key in reads and oldest in reads
            # (the lane's oldest pending and leased: read once a statement, not once a row)
            assert "CORRELATED" not in reads[reads.index(oldest) - 1]
            assert not [r for r in reads if r.startswith(("SCAN jobs", "SCAN d", "SCAN k"))]
    finally:
        con.close()


async def test_a_fleet_sends_an_ordered_endpoints_keys_in_order_one_at_a_time(where: str) -> None:
    """A Fleet claims an ordered endpoint's deliveries in its ordered lane: each event first
    answered 500, then 204; each key's events are ACKed in enqueue order, never two of one
    key in flight at once, while the keys go on side by side."""
    tried: set[str] = set()
    acked: dict[str, list[int]] = {}
    in_flight: dict[str, int] = {}
    overlaps = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal overlaps
        data = json.loads(await request.read())["data"]
        key, first = data["key"], request.headers["webhook-id"] not in tried
        tried.add(request.headers["webhook-id"])
        overlaps += bool(in_flight.get(key))
        in_flight[key] = in_flight.get(key, 0) + 1
        await asyncio.sleep(0.002)
        in_flight[key] -= 1
        if first:
            return web.Response(status=500)
        acked.setdefault(key, []).append(data["n"])
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", handle)
    async with serving(app) as running, AsyncQueue.open(where) as queue:
        await queue.add_endpoint(
            Endpoint(
                "o",
                f"{running.base}/hook",
                secrets=(wh.new_secret(),),
                ordered=True,
                concurrency=8,
                retry=Delays((10,)),
            )
        )
        events = [{"id": f"{k}-{n}", "key": k, "data": {"key": k, "n": n}} for n in range(5)
                  for k in "ABCD"]  # fmt: skip
        await queue.enqueue_many(events)
        summaries = await Fleet(queue, owner="fleet").run(until_empty=True)
    assert summaries["o"].done == 20
    assert acked == {k: [0, 1, 2, 3, 4] for k in "ABCD"} and overlaps == 0

"""Lanes over many cycles, on a file and on PostgreSQL: events published at random, claims in
random lanes - each lane takes its own endpoint's deliveries alone, oldest first, the plain lane
every job but deliveries - and at the end every lane drained, nothing taken twice or lost.  And
the claim's plan: a lane reads a range of its index."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint

from .conftest import T0
from .test_endpoints import where as a_queue

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
URL = "http://127.0.0.1:9/hooks"
NAMES = ("alpha", "alpha-2", "b")  # ("alpha-2"'s lane is not a range inside alpha's)
TYPES = ("order.paid", "order.void", "user.new")


@pytest.mark.parametrize("seed", [1, 2])
async def test_each_lane_takes_its_own_oldest_first_over_a_hundred_cycles(
    where: str, seed: int
) -> None:
    rng = random.Random(seed)
    owed: dict[lanes.Lane, list[str]] = {lanes.Lane(n): [] for n in NAMES}
    owed[lanes.PLAIN] = []
    done: list[str] = []
    async with AsyncQueue.open(where) as queue:
        await queue.add_endpoint(Endpoint("alpha", URL, types=("order.*",)), now_ms=T0)
        await queue.add_endpoint(Endpoint("alpha-2", URL, types=("order.paid",)), now_ms=T0)
        await queue.add_endpoint(Endpoint("b", URL), now_ms=T0)
        views = {lane: queue.in_lane(lane) for lane in owed}
        for view in views.values():
            await view.prepare_lane()
        for step in range(120):
            now = T0 + step
            if rng.random() < 0.5:
                made = await queue.publish(
                    {"id": f"e{step}", "type": rng.choice(TYPES), "data": step}, now
                )
                for name, job in made.deliveries:
                    owed[lanes.Lane(name)].append(job)
            elif rng.random() < 0.4:  # a plain job whose id looks like a delivery's
                job = lanes.delivery_id(rng.choice(NAMES), 10**6 + step)
                assert await queue.enqueue({"id": job, "qty": 2}, now)
                owed[lanes.PLAIN].append(job)
            else:
                lane, count = rng.choice(list(owed)), rng.randint(1, 4)
                tickets = await views[lane].claim_many("w", now, 60_000, count)
                taken = [t["id"] for t in tickets]
                assert taken == owed[lane][:count]  # all it could take: its own, oldest first
                del owed[lane][:count]
                if tickets:
                    await queue.finish_many([(t, "ok", now, 0) for t in tickets])
                done += taken
        for lane, view in views.items():  # each drained in its own lane
            while tickets := await view.claim_many("w", T0 + 1000, 60_000, 16):
                assert [t["id"] for t in tickets] == owed[lane][: len(tickets)]
                del owed[lane][: len(tickets)]
                await queue.finish_many([(t, "ok", T0 + 1000, 0) for t in tickets])
                done += [t["id"] for t in tickets]
            assert owed[lane] == [] and await view.read(w.SQL_ACTIVE) == [(0,)]
        assert await queue.read(w.SQL_ACTIVE) == [(0,)]
    assert len(done) == len(set(done))


def test_a_lanes_claim_reads_a_range_of_its_index(tmp_path: Path) -> None:
    from asnackq.core import events as ev

    con = w.open_queue(tmp_path / "q.db")
    try:
        w.drive(con, w.plan_schema(ev.SCHEMA))
        params = {"now": 1, "n": 4, "losses": 3, **lanes.Lane("a").params()}
        for sql in (w.SQL_NEXT_RECLAIMABLE, w.SQL_NEXT_FRESH_RECLAIMING, w.SQL_ACTIVE):
            plan = con.execute("EXPLAIN QUERY PLAN " + lanes.LANE_TEXTS[sql], params).fetchall()
            reads = [row[3] for row in plan if " jobs " in f" {row[3]} "]
            assert reads and all(
                "asnackq_jobs_by_lane (status=? AND id>? AND id<?)" in r
                for r in reads
                if "PRIMARY KEY" not in r
            ), reads
    finally:
        con.close()

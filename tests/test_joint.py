"""The lanes' transactions share one while they wait (``asnackq.store.joint``): plans that
arrive while another transaction holds the queue's lock run in one transaction, each as
if alone; a plan that fails there fails for its caller only, the others commit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store.outage import StoreUnavailable

from .conftest import away_once, execute


@pytest.fixture
def where(tmp_path: Path) -> str:
    """A queue file (the joint is the queue's, above its store: the same on PostgreSQL)."""
    return str(tmp_path / "q.db")


TABLE = "CREATE TABLE IF NOT EXISTS joint_rows (name TEXT PRIMARY KEY)"


def insert(name: str, fails: bool = False) -> w.Plan[str]:
    """A plan writing one row (then raising, if ``fails``)."""
    yield w.Sql(TABLE)
    yield w.Sql("INSERT INTO joint_rows (name) VALUES (:name)", {"name": name})
    if fails:
        raise RuntimeError(f"{name} fails after its write")
    return name, True


class Counted:
    """The store's transactions, counted (the store itself runs them)."""

    def __init__(self, queue: AsyncQueue) -> None:
        self.runs = 0
        store = queue._db
        run = store.run

        async def counted(make: w.Make, fault: w.Fault = None) -> Any:
            self.runs += 1
            return await run(make, fault)

        store.run = counted  # type: ignore[method-assign]


async def test_plans_waiting_for_the_lock_share_one_transaction(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        views = [queue.in_lane(lanes.Lane(f"e{i}")) for i in range(10)]
        counted = Counted(queue)
        async with queue._lock:  # another transaction holds the lock meanwhile
            calls = [
                asyncio.ensure_future(view._run(lambda i=i: insert(f"r{i}")))
                for i, view in enumerate(views)
            ]
            await asyncio.sleep(0.05)
            assert not any(call.done() for call in calls)
        results = await asyncio.gather(*calls)
    assert results == [f"r{i}" for i in range(10)]
    assert counted.runs == 1
    assert sorted(execute(where, "SELECT name FROM joint_rows")) == [(f"r{i}",) for i in range(10)]


async def test_a_plan_that_fails_in_a_joint_transaction_fails_alone(where: str) -> None:
    async with AsyncQueue.open(where) as queue:
        views = [queue.in_lane(lanes.Lane(f"e{i}")) for i in range(3)]
        async with queue._lock:
            calls = [
                asyncio.ensure_future(views[0]._run(lambda: insert("a"))),
                asyncio.ensure_future(views[1]._run(lambda: insert("b", fails=True))),
                asyncio.ensure_future(views[2]._run(lambda: insert("c"))),
            ]
            await asyncio.sleep(0.05)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert outcomes[0] == "a" and outcomes[2] == "c"
    assert isinstance(outcomes[1], RuntimeError) and "b fails" in str(outcomes[1])
    assert sorted(execute(where, "SELECT name FROM joint_rows")) == [("a",), ("c",)]


async def test_a_plan_alone_runs_in_its_own_transaction_and_a_plain_queue_never_joins(
    where: str,
) -> None:
    async with AsyncQueue.open(where) as queue:
        counted = Counted(queue)
        with pytest.raises(RuntimeError, match="fails after"):
            await queue.in_lane(lanes.Lane("e"))._run(lambda: insert("x", fails=True))
        async with queue._lock:  # the queue itself (no lane): a transaction each
            calls = [
                asyncio.ensure_future(queue._run(lambda i=i: insert(f"p{i}"))) for i in range(3)
            ]
            await asyncio.sleep(0.05)
        await asyncio.gather(*calls)
    assert counted.runs == 4
    assert execute(where, "SELECT count(*) FROM joint_rows") == [(3,)]


async def test_a_transaction_the_store_refused_before_it_ran_leaves_the_next_ones_their_own(
    where: str,
) -> None:
    """The store away before the joint transaction's plan ran: every call of it gets the
    outage, and calls made after it get a transaction of their own (none joins the failed
    one and waits for ever)."""
    async with AsyncQueue.open(where) as queue:
        view = queue.in_lane(lanes.Lane("e"))
        away_once(queue._db)
        with pytest.raises(StoreUnavailable):
            await view._run(lambda: insert("lost"))
        found = await asyncio.wait_for(view._run(lambda: insert("next")), 30)
    assert found == "next"
    assert execute(where, "SELECT name FROM joint_rows") == [("next",)]

"""On a file, the intakes waiting for the queue's lock ride the transaction that holds it
(``asnackq.store.joint.Riders``): one COMMIT for both, each caller its own fate.

The order is made, not waited for: the test holds the queue's lock while the host and then
the riders line up behind it (no I/O happens before a transaction takes the lock, so a
few passes of the loop put each in line), then lets them go.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from asnackq.aio import AsyncQueue, QueueBusy
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.store.outage import StoreUnavailable

NOW = 1_700_000_000_000


async def passes(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def lined_up(
    queue: AsyncQueue, host: Callable[[], Awaitable[Any]], *riders: Callable[[], Awaitable[Any]]
) -> tuple[asyncio.Future[Any], list[asyncio.Future[Any]], list[int]]:
    """``host`` then ``riders`` started while the test holds the queue's lock, in that order;
    the lock is let go once every rider waits in the open batch.  Also returns how many
    riders each host took, as it takes them."""
    assert queue._riders is not None
    adopt, adopted = queue._riders.adopt, []

    def counted() -> Any:
        taken = adopt()
        adopted.append(len(taken))
        return taken

    queue._riders.adopt = counted  # type: ignore[method-assign]
    await queue._lock.acquire()
    try:
        hosting = asyncio.ensure_future(host())
        await passes()
        riding = [asyncio.ensure_future(ride()) for ride in riders]
        await passes()
        assert queue._riders._open is not None
    finally:
        queue._lock.release()
    return hosting, riding, adopted


def traced(seen: list[str], word: str) -> int:
    return sum(1 for s in seen if s.strip().upper().startswith(word))


def jobs(path: Path) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT id, qty, status, token FROM jobs ORDER BY seq").fetchall()
    finally:
        con.close()


async def test_intakes_waiting_for_the_lock_ride_the_transaction_that_holds_it(tmp_path):
    """A claim and two intakes (``enqueue_many`` and ``enqueue``) waiting behind it: one
    BEGIN and one COMMIT for all three; the claim does not see the riders' jobs, each
    caller gets what it would alone, and the riders' own turn at the lock opens no
    transaction."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "a", "qty": 1}, NOW)
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim_many("o", NOW + 1, 30_000, 5),
            lambda: q.enqueue_many([{"id": "b", "qty": 2}, {"id": "a", "qty": 1}], NOW + 2),
            lambda: q.enqueue({"id": "c", "qty": 3}, NOW + 3),
        )
        claimed = await hosting
        assert await riding[0] == [True, False]
        assert await riding[1] is True
        await passes()
        await q._db.db.set_trace_callback(None)
    assert [t["id"] for t in claimed] == ["a"] and adopted == [2]
    assert traced(seen, "BEGIN") == 1 and traced(seen, "COMMIT") == 1
    assert jobs(path) == [("a", 1, "leased", 1), ("b", 2, "pending", 0), ("c", 3, "pending", 0)]


async def test_a_riders_conflict_is_its_own_and_the_host_and_other_riders_land(tmp_path):
    """A lone ``enqueue`` whose intake is a Conflict rolls its plan back (as the core's
    does), so it fails the shared transaction: each rider then runs alone and the host after
    them; the Conflict reaches its caller only, the other rider's job lands and the claim
    lands once (its token 1)."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "k", "qty": 2}, NOW)
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim("o", NOW + 1, 30_000),
            lambda: q.enqueue({"id": "k", "qty": 3}, NOW + 2),
            lambda: q.enqueue_many([{"id": "n", "qty": 1}], NOW + 2),
        )
        ticket = await hosting
        with pytest.raises(w.Conflict, match="exists with qty 2"):
            await riding[0]
        assert await riding[1] == [True]
        await q._db.db.set_trace_callback(None)
    assert adopted == [2]
    assert traced(seen, "BEGIN") == 4 and traced(seen, "ROLLBACK") == 2  # shared, Conflict
    assert ticket is not None and ticket["id"] == "k" and ticket["token"] == 1
    assert jobs(path) == [("k", 2, "leased", 1), ("n", 1, "pending", 0)]


async def test_a_rider_failing_on_its_own_fails_alone_and_the_host_lands_once(tmp_path):
    """A rider's plan that raises rolls the shared transaction back: each rider then runs
    alone, the host after them, so the error reaches its caller only, the other rider's
    job lands and the claim lands once (its token 1)."""

    def failing() -> w.Plan[None]:
        yield w.Sql("INSERT INTO redrives (id, token, at_ms, note) VALUES ('x', 0, 0, 'x')", ())
        raise RuntimeError("this rider's own")

    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "k", "qty": 2}, NOW)
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim("o", NOW + 1, 30_000),
            lambda: q._run(failing, intake=True),
            lambda: q.enqueue_many([{"id": "n", "qty": 1}], NOW + 2),
        )
        ticket = await hosting
        with pytest.raises(RuntimeError, match="this rider's own"):
            await riding[0]
        assert await riding[1] == [True]
    assert adopted == [2]
    assert ticket is not None and ticket["id"] == "k" and ticket["token"] == 1
    assert jobs(path) == [("k", 2, "leased", 1), ("n", 1, "pending", 0)]
    con = sqlite3.connect(path)
    assert con.execute("SELECT count(*) FROM redrives").fetchone() == (0,)
    con.close()


async def test_a_host_that_cannot_commit_fails_its_riders_with_the_store_and_lands_nothing(
    tmp_path,
):
    """Another program's reader holds the file as the host commits: the host and every
    rider get the store's refusal (``QueueBusy``), and nothing of any of them lands."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path, busy_s=0.05) as q:
        assert await q.enqueue({"id": "a", "qty": 1}, NOW)
        reader = sqlite3.connect(path, isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM jobs").fetchall()  # holds a shared lock
            hosting, riding, adopted = await lined_up(
                q,
                lambda: q.claim("o", NOW + 1, 30_000),
                lambda: q.enqueue_many([{"id": "b", "qty": 1}], NOW + 2),
                lambda: q.enqueue({"id": "c", "qty": 1}, NOW + 2),
            )
            with pytest.raises(QueueBusy):
                await hosting
            for rider in riding:
                with pytest.raises(StoreUnavailable):
                    await rider
            assert adopted == [2]
            await passes()  # the riders' own turn at the lock: no transaction, no news
            assert q.health is not None and q.health.down
        finally:
            reader.execute("ROLLBACK")
            reader.close()
        assert jobs(path) == [("a", 1, "pending", 0)]
        assert await q.enqueue_many([{"id": "b", "qty": 1}], NOW + 3) == [True]  # free again


async def test_cancelled_callers_wait_for_the_shared_transaction_and_it_lands_whole(tmp_path):
    """The host's caller and a rider's caller cancelled as the lock is let go: each waits
    for the transaction to end, then is cancelled; the other rider gets its result and
    every write of the transaction lands."""
    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "a", "qty": 1}, NOW)
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim("o", NOW + 1, 30_000),
            lambda: q.enqueue_many([{"id": "b", "qty": 1}], NOW + 2),
            lambda: q.enqueue_many([{"id": "c", "qty": 1}], NOW + 2),
        )
        jobs_when_it_ended: list[int] = []
        riding[0].add_done_callback(lambda _: jobs_when_it_ended.append(len(jobs(path))))
        hosting.cancel()
        riding[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await hosting
        with pytest.raises(asyncio.CancelledError):
            await riding[0]
        assert await riding[1] == [True] and adopted == [2]
        assert jobs_when_it_ended == [3]  # the rider ended once the transaction had landed
    assert jobs(path) == [("a", 1, "leased", 1), ("b", 1, "pending", 0), ("c", 1, "pending", 0)]


async def test_a_transaction_with_a_fault_hook_hosts_no_rider(tmp_path):
    """A hook's test sees its transaction's own statements: an intake waiting behind a
    hooked claim runs in a transaction of its own."""
    path = tmp_path / "q.db"
    hooks: list[str] = []
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "a", "qty": 1}, NOW)
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim("o", NOW + 1, 30_000, fault=hooks.append),
            lambda: q.enqueue_many([{"id": "b", "qty": 1}], NOW + 2),
        )
        assert (await hosting) is not None and await riding[0] == [True]
        await q._db.db.set_trace_callback(None)
    assert "after-claim" in hooks and adopted == []
    assert traced(seen, "BEGIN") == 2 and traced(seen, "COMMIT") == 2


async def test_riders_whose_fate_is_cut_short_are_cancelled_never_left_waiting(tmp_path):
    """The shared transaction fails and a rider's run alone is cancelled under it (the
    driver's own cancellation): every caller still ends, cancelled, none waits for ever."""

    def failing() -> w.Plan[None]:
        yield w.Read("SELECT 1")
        raise RuntimeError("this rider's own")

    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        assert await q.enqueue({"id": "k", "qty": 2}, NOW)
        run, runs = q._db.run, []

        async def cut_short(make: Any, fault: Any = None) -> Any:
            runs.append(make)
            if len(runs) == 2:  # the first rider's run alone
                raise asyncio.CancelledError
            return await run(make, fault)

        q._db.run = cut_short  # type: ignore[method-assign]
        hosting, riding, adopted = await lined_up(
            q,
            lambda: q.claim("o", NOW + 1, 30_000),
            lambda: q._run(failing, intake=True),
            lambda: q.enqueue_many([{"id": "n", "qty": 1}], NOW + 2),
        )
        for caller in (hosting, *riding):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(caller), 10)
        q._db.run = run  # type: ignore[method-assign]
    assert adopted == [2]
    assert jobs(path) == [("k", 2, "pending", 0)]


def lane_row(name: str, fails: bool = False) -> w.Plan[str]:
    """A lane's plan writing one row (then raising, if ``fails``)."""
    yield w.Sql("CREATE TABLE IF NOT EXISTS lane_rows (name TEXT PRIMARY KEY)")
    yield w.Sql("INSERT INTO lane_rows (name) VALUES (?)", (name,))
    if fails:
        raise RuntimeError(f"{name}'s own")
    return name, True


@pytest.mark.parametrize("rider_fails", [False, True])
async def test_a_fleets_joint_transaction_hosts_the_riders(tmp_path, rider_fails):
    """Two endpoints' lanes joined in one transaction, and an intake waiting behind them:
    one BEGIN for all; a rider that fails gets its error alone, its run alone first, then
    the joint again whole, every lane's row and the other rider's job landing once."""

    def failing() -> w.Plan[None]:
        yield w.Read("SELECT 1")
        raise RuntimeError("this rider's own")

    path = tmp_path / "q.db"
    async with AsyncQueue.open(path) as q:
        views = [q.in_lane(lanes.Lane(f"e{i}")) for i in range(2)]
        seen: list[str] = []
        await q._db.db.set_trace_callback(seen.append)
        riders = [lambda: q.enqueue_many([{"id": "n", "qty": 1}], NOW)]
        if rider_fails:
            riders.insert(0, lambda: q._run(failing, intake=True))
        hosting, riding, adopted = await lined_up(
            q,
            lambda: asyncio.gather(
                *(v._run(partial(lane_row, f"r{i}")) for i, v in enumerate(views))
            ),
            *riders,
        )
        assert await hosting == ["r0", "r1"]
        if rider_fails:
            with pytest.raises(RuntimeError, match="this rider's own"):
                await riding[0]
        assert await riding[-1] == [True]
        await q._db.db.set_trace_callback(None)
    assert adopted == [len(riders)]
    assert traced(seen, "BEGIN") == (4 if rider_fails else 1)  # shared, then each alone
    con = sqlite3.connect(path)
    assert con.execute("SELECT name FROM lane_rows ORDER BY name").fetchall() == [("r0",), ("r1",)]
    con.close()
    assert jobs(path) == [("n", 1, "pending", 0)]

"""A queue's PostgreSQL session lost mid-transaction: before COMMIT, and during it.

A deferred constraint trigger makes the COMMIT of a claim slow (``pg_sleep``) while a flag
row exists; the test cuts the session while that COMMIT is in flight, seen in
``pg_stat_activity``: by ``pg_terminate_backend`` (the transaction aborts) or by shutting
the client's socket (the server goes on and commits; only the answer is lost).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator

import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.store import pg_session
from asnackq.store.outage import Backoff, StoreUnavailable

from .conftest import T0
from .pgdb import query
from .slow_commit import in_commit, job_row, slow_queue


@pytest.fixture
async def queue(pg_db) -> AsyncIterator[tuple[AsyncQueue, pg_session.AsyncStore, str]]:
    url = pg_db()
    async with slow_queue(url) as (q, store):
        yield q, store, url


async def test_a_commit_cut_by_a_killed_session_is_found_aborted_and_re_run(queue):
    q, store, url = queue
    pid = store.con.info.backend_pid
    claiming = asyncio.ensure_future(q.claim("w1", T0 + 1, 5000))
    await in_commit(url, pid)
    query(url, "DELETE FROM slow")  # the re-run commits at once
    query(url, "SELECT pg_terminate_backend(%s)", (pid,))
    ticket = await claiming
    assert ticket is not None and ticket["token"] == 1  # the cut claim never happened
    assert job_row(url) == ("leased", 1)
    assert store.health.counts() | {"db_down_ms": 0} == {
        "db_outages": 1,
        "db_down_ms": 0,
        "db_reruns": 1,
        "db_cut_commits": 1,
    }
    assert await q.finish(ticket, "ok", T0 + 2) == "done"
    assert not store.health.down


async def test_a_commit_whose_answer_was_lost_is_found_committed_and_stands(queue):
    q, store, url = queue
    con = store.con
    claiming = asyncio.ensure_future(q.claim("w1", T0 + 1, 5000))
    await in_commit(url, con.info.backend_pid)
    with socket.socket(fileno=os.dup(con.fileno())) as cut:
        cut.shutdown(socket.SHUT_RDWR)  # the server commits; its answer cannot arrive
    ticket = await claiming
    assert ticket is not None and ticket["token"] == 1
    assert job_row(url) == ("leased", 1)  # exactly one claim: the cut one, which stands
    counts = store.health.counts()
    assert (counts["db_outages"], counts["db_reruns"], counts["db_cut_commits"]) == (1, 0, 1)
    assert await q.finish(ticket, "ok", T0 + 2) == "done"


async def test_a_store_without_its_server_fails_at_once_and_comes_back(queue, pg_server):
    q, store, url = queue
    query(url, "DELETE FROM slow")
    query(url, "SELECT pg_terminate_backend(%s)", (store.con.info.backend_pid,))
    store.url = url.replace(f"port={pg_server.port}", "port=1")  # nothing listens there
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(StoreUnavailable):
            await q.read(w.SQL_ACTIVE)
    assert time.monotonic() - started < 5  # no wait: the backoff only spaces the attempts
    store.url = url
    await asyncio.sleep(store.health.wait_s())
    assert await q.read(w.SQL_ACTIVE) == [(1,)]
    counts = store.health.counts()
    assert counts["db_outages"] == 1 and counts["db_down_ms"] > 0


async def test_a_store_away_for_long_keeps_trying_within_the_backoff_s_cap(queue, pg_server):
    """No count of failures or time away ends a store: each try fails at once with
    ``StoreUnavailable`` and the next comes within the cap (2 s), whatever the count."""
    cap = Backoff().cap_s
    assert all(Backoff().delay_s(n, d) <= cap for n in range(10_000) for d in (0.0, 0.5, 1.0))
    q, store, url = queue
    query(url, "DELETE FROM slow")
    query(url, "SELECT pg_terminate_backend(%s)", (store.con.info.backend_pid,))
    store.url = url.replace(f"port={pg_server.port}", "port=1")  # nothing listens there
    waits = []
    while store.health.failures < 9:  # ~7 s of backoff: past its cap
        with pytest.raises(StoreUnavailable) as away:
            await q.read(w.SQL_ACTIVE)
        waits.append(away.value.retry_in_s)
        await asyncio.sleep(away.value.retry_in_s)
    assert max(waits) <= cap and store.health.down
    assert max(waits) > cap / 2  # (the cap was reached)
    store.url = url
    assert await q.read(w.SQL_ACTIVE) == [(1,)]
    assert store.health.counts()["db_outages"] == 1


async def test_a_session_ended_by_the_idle_in_transaction_timeout_is_opened_again(queue):
    """A partition longer than the server's idle-in-transaction timeout ends the session
    mid-transaction (its FATAL read after the heal): nothing committed, the plan re-run."""
    q, store, url = queue
    query(url, "DELETE FROM slow")
    await store.con.execute("SET idle_in_transaction_session_timeout = 100")
    stalls = []

    def stall(point: str) -> None:  # the first try stands still mid-transaction
        if not stalls:
            stalls.append(point)
            time.sleep(0.5)

    ticket = await q.claim("w1", T0 + 1, 5000, fault=stall)
    assert ticket is not None and ticket["token"] == 1 and stalls == ["after-claim"]
    assert job_row(url) == ("leased", 1)
    counts = store.health.counts()
    assert (counts["db_outages"], counts["db_reruns"]) == (1, 1)

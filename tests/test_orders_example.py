"""The example order service (examples/orders_app.py) and the outbox on an app's connection."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import aiosqlite
import pytest

from asnackq.aio import AsyncQueue
from asnackq.core import outbox
from asnackq.core.worker import epoch_ms
from asnackq.lab import procs
from asnackq.store.borrowed import Source

from .conftest import execute, job
from .sinks import sink_state

EXAMPLE = Path(__file__).parents[1] / "examples" / "orders_app.py"


@pytest.mark.process
async def test_the_example_commits_each_order_with_its_delivery_job(tmp_path):
    shop = tmp_path / "shop.db"
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), str(shop), stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        url = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().split()[-1]
        async with aiohttp.ClientSession() as session:
            answers = []
            for body in ({"id": "o1", "qty": 3}, {"id": "o1", "qty": 5}, {"id": "o2", "qty": 0}):
                async with session.post(url, json=body) as response:
                    answers.append(response.status)
    finally:
        child.terminate()
        await asyncio.wait_for(child.wait(), 30)
    assert answers == [201, 409, 400]
    assert execute(shop, "SELECT id, qty FROM orders") == [("o1", 3)]
    assert job(shop, "o1")["status"] == "pending" and job(shop, "o2") is None
    async with AsyncQueue.open(shop) as queue:  # a Dispatcher's queue delivers it
        ticket = await queue.claim("w1", epoch_ms())
        assert ticket is not None and (ticket["id"], ticket["qty"]) == ("o1", 3)


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
async def test_the_outbox_accepts_inside_the_application_transaction(tmp_path, end):
    path = tmp_path / "source.db"
    async with aiosqlite.connect(path, isolation_level=None) as db:
        source = await Source.within(db)
        await db.execute("CREATE TABLE audit (note TEXT)")
        await db.execute("BEGIN IMMEDIATE")
        await db.execute("INSERT INTO audit VALUES ('order o1 taken')")
        assert await source.accept({"id": "o1", "qty": 2}) is True
        assert await source.accept({"id": "o1", "qty": 2}) is False
        await db.execute(end)
        with pytest.raises(ValueError, match="none is open"):
            await source.accept({"id": "o2", "qty": 1})
    committed = end == "COMMIT"
    assert execute(path, "SELECT count(*) FROM audit") == [(int(committed),)]
    with sqlite3.connect(path) as con:
        assert outbox.pending(con) == ([{"id": "o1", "qty": 2}] if committed else [])
    con.close()


def shop_app(shop: Path, sink: str) -> tuple[procs.Proc, str]:
    """Start the example with a Dispatcher delivering to ``sink``; return it and its URL."""
    app = procs.start([sys.executable, str(EXAMPLE), str(shop), sink], stdout=procs.PIPE)
    assert app.stdout is not None
    line = app.stdout.readline()
    if not line.startswith("listening on "):
        procs.stop(app)
        raise RuntimeError(f"the example did not start: {line!r}")
    return app, line.split()[-1]


def post(url: str, order: dict[str, object]) -> int:
    request = urllib.request.Request(url, json.dumps(order).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(answer.status)


@pytest.mark.process
def test_the_app_delivers_every_order_once_across_a_graceful_restart(tmp_path):
    shop, stock = tmp_path / "shop.db", tmp_path / "stock.db"
    orders = [{"id": f"o{i}", "qty": i % 7 + 1} for i in range(40)]
    sink, sink_url = procs.start_sink(stock, "--delay-ms", 200)  # sends are in flight
    try:
        app, url = shop_app(shop, sink_url)
        try:
            assert [post(url, order) for order in orders[:20]] == [201] * 20
        finally:
            assert procs.stop(app) == [0]  # SIGTERM mid-stream: a graceful stop
        done = {i for (i,) in execute(shop, "SELECT id FROM jobs WHERE status = 'done'")}
        applied = {i for i, _, _ in sink_state(stock)[1]}
        assert applied <= done  # the sends in flight finished and their results committed
        assert execute(shop, "SELECT count(*) FROM jobs WHERE status = 'leased'") == [(0,)]
        app, url = shop_app(shop, sink_url)
        try:
            assert [post(url, order) for order in orders[20:]] == [201] * 20
            deadline = time.monotonic() + 30
            while execute(shop, "SELECT count(*) FROM jobs WHERE status = 'done'") != [(40,)]:
                assert time.monotonic() < deadline, execute(shop, "SELECT * FROM jobs")
                time.sleep(0.05)  # polled, bounded: the dispatcher's progress
        finally:
            assert procs.stop(app) == [0]
    finally:
        procs.stop(sink)
    total, inbox = sink_state(stock)
    assert sorted((i, q) for i, q, _ in inbox) == sorted((o["id"], o["qty"]) for o in orders)
    assert total == sum(int(o["qty"]) for o in orders)  # every effect applied exactly once
    assert execute(shop, "SELECT count(*) FROM orders") == [(40,)]

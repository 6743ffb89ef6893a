"""An ordered endpoint served by two real ``asnackq work --endpoint`` processes, one killed
with SIGKILL mid-run and restarted, against a real aiohttp receiver that fails a fifth of the
requests at random and records each event it ACKs the first time: every key's events are
applied in enqueue order, each once, never two of one key in flight at the receiver; a key
whose head keeps failing holds that key only, and once it is answered its key goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from asnackq.aio import AsyncQueue
from asnackq.core.endpoints import Delays, Endpoint
from asnackq.wire import webhooks as wh

from .conftest import execute
from .sequencer import until
from .sinks import serving
from .test_endpoints import where as a_queue

where = a_queue  # the fixture ``where``: a new queue, a file or a PostgreSQL database
WAIT_S = 120.0  # (a busy 2-core machine; the run takes seconds)
KEYS = [f"k{i}" for i in range(10)]
PER_KEY = 10
STUCK = "stuck"
# Retries from 0.2 s doubling to 4 s: the stuck key's head, at most 16 attempts, lives about
# a minute, far longer than the other keys take on a busy machine.
WORKER = ("--lease-ms", "3000", "--retry-base-ms", "200", "--retry-cap-ms", "4000")


class Receiver:
    """Answers 503 to a fifth of the requests at random and to every one of the stuck key
    until ``release``; else 204, recording each event's first ACK in its key's list."""

    def __init__(self, seed: int, total: int) -> None:
        self.rng = random.Random(seed)
        self.applied: dict[str, list[int]] = {}
        self.acked: set[str] = set()
        self.tried: dict[str, set[int]] = {}  # per key: the events requested at all
        self.in_flight: dict[str, int] = {}
        self.overlaps = 0
        self.release = asyncio.Event()
        self.half, self.all = asyncio.Event(), asyncio.Event()
        self.total = total  # the events of the other keys

    async def handle(self, request: web.Request) -> web.Response:
        data = json.loads(await request.read())["data"]
        key, n = data["key"], data["n"]
        self.tried.setdefault(key, set()).add(n)
        if key and self.in_flight.get(key):  # (keyless ones may overlap)
            self.overlaps += 1
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            await asyncio.sleep(self.rng.uniform(0, 0.01))  # (an answer takes a moment)
            if (key == STUCK and not self.release.is_set()) or self.rng.random() < 0.2:
                return web.Response(status=503)
            if request.headers["webhook-id"] not in self.acked:
                self.acked.add(request.headers["webhook-id"])
                self.applied.setdefault(key, []).append(n)
                self.count()
            return web.Response(status=204)
        finally:
            self.in_flight[key] -= 1

    def count(self) -> None:
        done = sum(len(ns) for key, ns in self.applied.items() if key != STUCK)
        if done >= self.total // 2:
            self.half.set()
        if done == self.total:
            self.all.set()


@contextlib.asynccontextmanager
async def worker(where: str, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """A real ``asnackq work QUEUE --endpoint o`` process, stopped (SIGTERM) at the end."""
    with log.open("ab") as err:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asnackq", "work", where, "--endpoint", "o", *WORKER,
            stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        yield child
    finally:
        if child.returncode is None:
            child.terminate()
        await asyncio.wait_for(child.wait(), WAIT_S)


def events(rng: random.Random) -> list[dict[str, Any]]:
    """Every key's events, the keys interleaved at random, keyless ones among them."""
    queued = {key: list(range(PER_KEY)) for key in [*KEYS, STUCK]}
    made: list[dict[str, Any]] = []
    while any(queued.values()):
        key = rng.choice([k for k, ns in queued.items() if ns])
        n = queued[key].pop(0)
        made.append({"id": f"{key}-{n}", "key": key, "data": {"key": key, "n": n}})
        if rng.random() < 0.1:
            made.append({"id": f"free-{len(made)}", "data": {"key": "", "n": len(made)}})
    return made


@pytest.mark.process
@pytest.mark.timeout(300)  # (two workers and a restart: on a busy machine, minutes)
async def test_two_workers_one_sigkilled_apply_each_keys_events_in_order_once(
    where: str, tmp_path: Path
) -> None:
    rng = random.Random(7)
    published = events(rng)
    receiver = Receiver(7, total=len(KEYS) * PER_KEY)
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    log = tmp_path / "workers.log"
    async with serving(app) as running, AsyncQueue.open(where) as queue:
        retries = Delays((0,) * 15)  # (16 attempts: the budget; the worker's delays apply)
        await queue.add_endpoint(
            Endpoint(
                "o",
                f"{running.base}/hook",
                secrets=(wh.new_secret(),),  # (a webhook-id on each request)
                ordered=True,
                concurrency=8,
                retry=retries,
            )
        )
        first, rest = published[: len(published) // 2], published[len(published) // 2 :]
        await queue.enqueue_many(first)
        async with worker(where, log) as one, worker(where, log):
            async with worker(where, log) as killed:
                await asyncio.wait_for(receiver.half.wait(), WAIT_S)
                killed.kill()  # SIGKILL, holding leases
                assert await killed.wait() == -9
            async with worker(where, log):  # its restart
                await queue.enqueue_many(rest)
                await asyncio.wait_for(receiver.all.wait(), WAIT_S)
                # every other key went on while the stuck key's head kept failing
                assert STUCK not in receiver.applied and receiver.tried[STUCK] == {0}
                receiver.release.set()
                await until(lambda: len(receiver.applied.get(STUCK, [])) == PER_KEY, WAIT_S)
                await until(lambda: left(where) == 0, WAIT_S)
            assert one.returncode is None, log.read_text()[-2000:]
    for key in [*KEYS, STUCK]:
        assert receiver.applied[key] == list(range(PER_KEY)), key  # in order, each once
    assert receiver.overlaps == 0  # one at a time per key, across the workers
    frees = [e["data"]["n"] for e in published if "key" not in e]
    assert sorted(receiver.applied.get("", [])) == frees  # keyless ones: each once


def left(where: str) -> int:
    """The queue's pending and leased jobs, read through a connection of its own."""
    [(count,)] = execute(where, "SELECT count(*) FROM jobs WHERE status IN ('pending', 'leased')")
    return int(count)

"""What a producer in the same process costs a Dispatcher: deliveries alone vs beside a producer.

    python benchmarks/producer_share.py [--store pg,sqlite] [--concurrency 16,64] [--rounds 4]
                                        [--seconds 8] [--depth 4000] [--send-ms 1]
                                        [--shapes one,many] [--handlers 1024] [--probe]

One Dispatcher (its send waits ``--send-ms`` and answers True) on one ``AsyncQueue``, at its
defaults but ``concurrency``.  "alone": the queue holds enough jobs for the whole window and
nothing else touches it.  Beside it, a producer on the SAME ``AsyncQueue`` (as
docs/embedding.md's first program does) keeps ``--depth`` jobs queued through the public API
at its defaults, in one of two shapes:

* ``one``: ``--handlers`` coroutines (1,024), each calling ``queue.enqueue(event)`` one event
  at a time (an application's request handlers), and waiting, when ``--depth`` are queued,
  for a delivery to make room (woken one per delivery: they never poll);
* ``many``: ``queue.enqueue_many`` of up to 128 events at a time (the harness's bulk
  producer).

"alone" keeps the same depth from ANOTHER process (``--feed``: its own queue, topping up to
``--depth`` waiting jobs every 20 ms with ``enqueue_many``), so the table the Dispatcher
claims from looks the same in every case and only the Dispatcher's process differs.

Each round measures every case back to back (the order rotates each round), so all see the
same machine; the ratio "with producer / alone" is taken within its round, and the median
and range over the rounds are printed.  Each producer's line says how many jobs it kept
queued (enqueued and not yet delivered, sampled every 20 ms of the window: mean and least):
a producer that cannot keep ``--depth`` queued starves the Dispatcher, and its ratio is then
the producer's own rate, not what it costs the Dispatcher (``one``'s handlers each wait for
a durable COMMIT before their next event).  Target (issue 37 item 3): every ratio >= 0.8.
PostgreSQL is a throwaway local server (``fsync=on``, ``synchronous_commit=on``); SQLite a
file (journal DELETE, ``synchronous=FULL``).

``--probe`` (a diagnostic, not part of the ratio) replaces the queue's lock with one that
times every acquisition, and prints per case: transactions per second by the Dispatcher and
by the producer, the mean wait for the lock, the share of the window the lock was held by
each, and jobs per Dispatcher transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import itertools
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from statistics import median
from typing import Any

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.store.outage import StoreUnavailable

BULK = 128
WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="dispatcher")


class ProbeLock(asyncio.Lock):
    """An ``asyncio.Lock`` that adds up, per caller (``WHO``), acquisitions, wait and hold."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, list[float]] = {}  # who -> [count, wait_s, hold_s]
        self._since = 0.0

    async def acquire(self) -> bool:
        asked = time.perf_counter()
        await super().acquire()
        self._since = time.perf_counter()
        row = self.stats.setdefault(WHO.get(), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += self._since - asked
        return True

    def release(self) -> None:
        self.stats[WHO.get()][2] += time.perf_counter() - self._since
        super().release()


class Room:
    """Room for events: each delivery frees one, taken by the handler that has waited
    longest (woken alone, in constant time: ``asyncio.Semaphore`` walks the futures it
    already woke, a cost of its own with a thousand waiters)."""

    def __init__(self) -> None:
        self.free = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def release(self) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():  # (a waiter cancelled meanwhile takes nothing)
                waiter.set_result(None)
                return
        self.free += 1

    async def acquire(self) -> None:
        if self.free:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a unit, then cancelled: the next waiter has it
            raise


class Counts:
    """Jobs enqueued and delivered; the Dispatcher's ``trace`` counts deliveries, and each
    one makes room for one more event (``room``: ``one``'s handlers wait on it)."""

    def __init__(self) -> None:
        self.enqueued = 0
        self.done = 0
        self.ids = itertools.count()
        self.room = Room()

    def trace(self, kind: str, ticket: dict[str, Any], at: int, status: object) -> None:
        if kind == "finish" and status == "done":
            self.done += 1
            self.room.release()

    def events(self, n: int) -> list[dict[str, Any]]:
        return [{"id": f"j{next(self.ids)}", "qty": 1} for _ in range(n)]


async def produce_one(
    queue: AsyncQueue, counts: Counts, depth: int, stop: asyncio.Event, handlers: int
) -> None:
    """``handlers`` coroutines, each enqueuing one event while fewer than ``depth`` wait.
    A handler whose event would go over ``depth`` waits for a delivery to make room (one
    delivery wakes one handler: none polls, so many handlers cost the process nothing
    while they wait; the queue starts ``depth`` deep, so room + queued stays ``depth``)."""
    WHO.set("producer")
    if counts.enqueued - counts.done + counts.room.free != depth:
        raise ValueError(f"the queue must hold {depth} jobs, or room for the rest, at the start")

    async def handler() -> None:
        while True:
            await counts.room.acquire()
            if stop.is_set():
                return
            counts.enqueued += 1
            await queue.enqueue(counts.events(1)[0])

    async def stopped() -> None:
        await stop.wait()
        for _ in range(handlers):
            counts.room.release()

    await asyncio.gather(stopped(), *(handler() for _ in range(handlers)))


async def produce_many(
    queue: AsyncQueue, counts: Counts, depth: int, stop: asyncio.Event, handlers: int
) -> None:
    """``enqueue_many`` of up to ``BULK`` events while fewer than ``depth`` wait."""
    WHO.set("producer")
    while not stop.is_set():
        missing = min(BULK, depth - (counts.enqueued - counts.done))
        if missing <= 0:
            await asyncio.sleep(0.005)
            continue
        await queue.enqueue_many(counts.events(missing))
        counts.enqueued += missing


PRODUCERS = {"one": produce_one, "many": produce_many}
PENDING = "SELECT count(*) FROM jobs WHERE status = 'pending'"


@contextlib.asynccontextmanager
async def counter(target: str) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Counts the pending jobs on a connection of its own (a reader beside the queue)."""
    if target.startswith("postgresql://"):
        import psycopg

        async with await psycopg.AsyncConnection.connect(target, autocommit=True) as con:

            async def count_pg() -> int:
                return int(((await (await con.execute(PENDING)).fetchone()) or (0,))[0])

            yield count_pg
    else:
        import aiosqlite

        async with aiosqlite.connect(f"file:{target}?mode=ro", uri=True) as db:

            async def count_file() -> int:
                return int(((await (await db.execute(PENDING)).fetchone()) or (0,))[0])

            yield count_file


async def feed(target: str, depth: int) -> None:
    """The "alone" case's producer, in a process of its own: tops up to ``depth`` pending
    jobs every 20 ms until its standard input closes."""
    ids = itertools.count()
    closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
    async with AsyncQueue.open(target) as queue, counter(target) as pending:
        while not closed.done():
            missing = depth - await pending()
            for start in range(0, missing, 500):
                n = min(500, missing - start)
                with contextlib.suppress(StoreUnavailable):  # a file held by the Dispatcher
                    await queue.enqueue_many([{"id": f"f{next(ids)}", "qty": 1} for _ in range(n)])
            await asyncio.wait([closed], timeout=0.02)


async def window(target: str, case: str, args: argparse.Namespace, concurrency: int) -> str:
    """One measured window; returns a line of deliveries/s (and the probe's figures)."""
    counts, stop = Counts(), asyncio.Event()

    async def send(event: dict[str, Any], token: int) -> bool:
        await asyncio.sleep(args.send_ms / 1000)
        return True

    async with AsyncQueue.open(target) as queue:
        for start in range(0, args.depth, 1000):
            await queue.enqueue_many(counts.events(min(1000, args.depth - start)))
        counts.enqueued = args.depth
        feeder = None
        if case == "alone":
            argv = [__file__, "--feed", target, "--depth", str(args.depth)]
            feeder = await asyncio.create_subprocess_exec(
                sys.executable, *argv, stdin=subprocess.PIPE
            )
        probe = ProbeLock() if args.probe else None
        if probe is not None:
            queue._lock = probe  # diagnostic only: times the queue's transactions
        dispatcher = Dispatcher(queue, send, concurrency=concurrency, trace=counts.trace)
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        producing = None
        if case != "alone":
            producing = asyncio.ensure_future(
                PRODUCERS[case](queue, counts, args.depth, stop, args.handlers)
            )
        try:
            await asyncio.sleep(1.0)  # warm: the first claims, the producer's first top-up
            done0, began = counts.done, time.perf_counter()
            stats0 = {k: list(v) for k, v in probe.stats.items()} if probe else {}
            queued = await sampled(lambda: counts.enqueued - counts.done, args.seconds)
            elapsed = time.perf_counter() - began
            rate = (counts.done - done0) / elapsed
            line = f"{rate:7.0f} jobs/s"
            if case != "alone":
                line += f", queued mean {sum(queued) / len(queued):5.0f} least {min(queued):5d}"
            if probe is not None:
                line += probe_line(probe.stats, stats0, elapsed, counts.done - done0)
        finally:
            stop.set()
            if feeder is not None:
                await asyncio.wait_for(feeder.communicate(b""), 60)  # EOF ends it
            dispatcher.stop()
            await asyncio.gather(running, *([producing] if producing else []))
    return f"{rate}|{line}"


async def sampled(read: Callable[[], int], seconds: float) -> list[int]:
    """``read()`` every 20 ms for ``seconds``."""
    samples, end = [], time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        samples.append(read())
        await asyncio.sleep(min(0.02, end - now))
    return samples or [read()]


def probe_line(
    stats: dict[str, list[float]], before: dict[str, list[float]], elapsed: float, jobs: int
) -> str:
    parts = []
    for who in ("dispatcher", "producer"):
        now, then = stats.get(who, [0, 0.0, 0.0]), before.get(who, [0, 0.0, 0.0])
        n, wait, hold = (a - b for a, b in zip(now, then, strict=True))
        if n:
            parts.append(
                f"{who}: {n / elapsed:5.0f} tx/s, wait {1000 * wait / n:5.1f} ms, "
                f"held {100 * hold / elapsed:3.0f} %"
            )
    tx = stats.get("dispatcher", [0])[0] - before.get("dispatcher", [0])[0]
    return " | " + "; ".join(parts) + f"; {jobs / max(tx, 1):4.1f} jobs/dispatcher tx"


@contextlib.contextmanager
def targets(store: str) -> Iterator[Callable[[str], str]]:
    """Yields a function giving a fresh queue target (a new database or file) per window."""
    if store == "pg":
        import psycopg

        from asnackq.lab.pg_server import local_server

        with local_server() as server:

            def fresh(name: str) -> str:
                with psycopg.connect(server.url(), autocommit=True) as con:
                    con.execute(f'CREATE DATABASE "{name}"')
                return server.url(name)

            yield fresh
    else:
        with tempfile.TemporaryDirectory(prefix="asnackq-share-", dir=".") as tmp:
            yield lambda name: str(Path(tmp) / f"{name}.db")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="pg,sqlite")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--shapes", default="one,many")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--depth", type=int, default=4000)
    parser.add_argument("--send-ms", type=float, default=1.0)
    parser.add_argument("--handlers", type=int, default=1024, help="the 'one' shape's coroutines")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--feed", help=argparse.SUPPRESS)  # the "alone" case's producer
    args = parser.parse_args()
    if args.feed:
        asyncio.run(feed(args.feed, args.depth))
        return
    shapes = args.shapes.split(",")
    for store in args.store.split(","):
        with targets(store) as fresh:
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                measure(store, fresh, concurrency, shapes, args)


def measure(
    store: str, fresh: Callable[[str], str], concurrency: int, shapes: list[str], args: Any
) -> None:
    cases = ["alone", *shapes]
    ratios: dict[str, list[float]] = {s: [] for s in shapes}
    serial = itertools.count()
    for rnd in range(args.rounds):
        order = cases[rnd % len(cases) :] + cases[: rnd % len(cases)]
        rates = {}
        for case in order:
            target = fresh(f"share_{store}_{concurrency}_{next(serial)}")
            rate, line = asyncio.run(window(target, case, args, concurrency)).split("|", 1)
            rates[case] = float(rate)
            print(f"{store} c={concurrency} round {rnd + 1} {case:>5}: {line}", flush=True)
        for s in shapes:
            ratios[s].append(rates[s] / rates["alone"])
    for s in shapes:
        r = ratios[s]
        print(
            f"{store} c={concurrency} producer '{s}' / alone: median {median(r):.2f} "
            f"(range {min(r):.2f}-{max(r):.2f}, {len(r)} rounds)",
            flush=True,
        )


if __name__ == "__main__":
    main()

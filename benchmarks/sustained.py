"""Sustained load: throughput, claim latency and dead rows minute by minute at a fixed depth.

    python benchmarks/sustained.py [--store pg|sqlite] [--minutes 10] [--depth 4000]
                                   [--concurrency 64] [--send-ms 1] [--hold-xmin]
                                   [--keep-done SECONDS] [--shared-buffers SIZE]
                                   [--statements N] [--control SECONDS]
                                   [--ids ordered|random] [--no-kept-answers]

One process runs a Dispatcher (its send waits ``--send-ms`` and answers True) and, on a
connection of its own, a producer that keeps ``--depth`` jobs waiting: every 50 ms it
enqueues what the Dispatcher finished since. PostgreSQL is a throwaway local server
(``fsync=on``, ``synchronous_commit=on``, autovacuum at its defaults); SQLite a file
(journal DELETE, ``synchronous=FULL``). ``--hold-xmin`` (PostgreSQL): another session holds
one REPEATABLE READ transaction open for the whole run, so no dead row can be removed
(the xmin horizon stays where it began).  ``--shared-buffers SIZE`` (PostgreSQL): the
server's ``shared_buffers`` (its default, 128MB, is a small machine's: the docs suggest a
quarter of a dedicated server's memory).  ``--keep-done S``: every ``S / 2`` seconds the
process purges the done jobs that finished more than ``S`` seconds ago (``asnackq purge``'s
``ops.purge``, on a connection of its own).  ``--statements N`` (PostgreSQL): the server
loads ``pg_stat_statements``, and each minute prints its ``N`` most expensive statements of
that minute (calls, rows and execution time per job) and the transactions committed per job.
``--control S`` (up to 60): a second queue (a database of its own on the same server, or a
second file), with a producer and a Dispatcher of its own, runs for ``S`` seconds after each
minute (and once before the first) while the measured queue waits (its producer enqueues
nothing and its sends wait), after 2 s to settle; after each window its done jobs are
purged (and on PostgreSQL vacuumed), so it stays small.  The held snapshot of ``--hold-xmin``
has no transaction ID, so it keeps no dead row of the control's database.  Both Dispatchers
take leases of 300 s then (else the Dispatcher's 5 s): a paused side renews none.  A job
claimed during a pause, or enqueued before one and claimed after it, counts in no claim
latency; ``--keep-done`` purges nothing during a pause.

Each minute prints: jobs done per second, the claim latency (from enqueue to claim) p50
and p99 in ms, the CPU per job of this process (every thread: the Dispatcher, the producer,
the store's threads) and of the PostgreSQL server (its processes alive at each minute's
end, from ``/proc``: ``cpu_per_job.server_cpu_s``; one that ended within the minute is not
counted), and the ``jobs`` table's dead and live rows (``pg_stat_user_tables``) and size
(PostgreSQL), or the file's size and free pages (SQLite). The last line: the last
minute's throughput and claim latency p50 as a ratio of the first minute's.  With
``--control``, each minute also prints the control's throughput and claim latency p50 and
this minute's ratios to them, and the last line their ratio in the last minute over the
first's: the machine's drift from minute to minute (a sixth either way on a 2-core machine)
moves both queues and cancels; what the measured queue's state costs (dead rows, a larger
file) remains.

``--ids random``: each job's id is a random UUID (32 hex digits), as an application keying
its events by UUIDv4 sends them, where ``ordered`` (the default) numbers them in enqueue
order (``j0``, ``j1``, ...).  ``--no-kept-answers``: the Dispatchers keep no request's answer
(``Dispatcher(keep_attempts=False)``; kept by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from statistics import quantiles
from typing import Any

from cpu_per_job import cpu_s, server_cpu_s, server_processes_s

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import Ticket, epoch_ms
from asnackq.ops.purge import purge
from asnackq.store.targets import is_url

BATCH = 500
CONTROL_SETTLE_S = 2.0  # a resumed control queue runs this long before its window


class Load:
    """The producer's and the Dispatcher's counts, and each job's enqueue time.  While
    ``active`` is clear (``--control``) the producer enqueues nothing and each send waits."""

    def __init__(self) -> None:
        self.enqueued = 0
        self.done = 0
        self.born: dict[str, int] = {}
        self.latencies: list[int] = []  # claim - enqueue, ms, this minute
        self.active = asyncio.Event()
        self.active.set()
        self.paused = (0, 0)  # the last pause's start and end (epoch ms)

    def trace(self, kind: str, ticket: Ticket, at: int, status: str | bool | None) -> None:
        if kind == "claim":
            born = self.born.pop(ticket["id"], None)
            paused, resumed = self.paused
            if born is not None and not (born < resumed and at >= paused):  # (none waited)
                self.latencies.append(at - born)
        elif kind == "finish" and status == "done":
            self.done += 1

    def pause(self) -> None:
        self.active.clear()
        self.paused = (epoch_ms(), 2**62)

    def resume(self) -> None:
        self.paused = (self.paused[0], epoch_ms())
        self.active.set()


async def produce(
    queue: AsyncQueue, load: Load, depth: int, stop: asyncio.Event, random_ids: bool
) -> None:
    while not stop.is_set():
        missing = depth - (load.enqueued - load.done) if load.active.is_set() else 0
        while missing > 0:
            n = min(missing, BATCH)
            now = epoch_ms()
            ids = (
                [uuid.uuid4().hex for _ in range(n)]
                if random_ids
                else [f"j{load.enqueued + i}" for i in range(n)]
            )
            for job_id in ids:
                load.born[job_id] = now
            await queue.enqueue_many([({"id": i, "qty": 1}, 3_600_000, 5) for i in ids], now)
            load.enqueued += n
            missing -= n
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def table_pg(url: str) -> str:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as con:
        cur = await con.execute(
            "SELECT n_dead_tup, n_live_tup, pg_total_relation_size('jobs') "
            "FROM pg_stat_user_tables WHERE relname = 'jobs'"
        )
        dead, live, size = (await cur.fetchone()) or (0, 0, 0)
    return f"dead {dead:>8} live {live:>8} size {size / 2**20:7.1f} MiB"


def table_sqlite(path: Path) -> str:
    con = sqlite3.connect(path)
    try:
        pages, free, page = (
            con.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    finally:
        con.close()
    return f"size {pages * page / 2**20:7.1f} MiB, free pages {free:>7}"


async def keep_done(target: str, keep_s: float, stop: asyncio.Event, load: Load) -> None:
    """Purge the done jobs older than ``keep_s`` every ``keep_s / 2`` seconds (none while
    the queue is paused)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), keep_s / 2)
        if not load.active.is_set():
            continue
        now = epoch_ms()
        await asyncio.to_thread(purge, target, now - int(keep_s * 1000), ("done",), now)


STATEMENTS = """
SELECT queryid, calls, rows, total_exec_time,
  left(regexp_replace(query, '\\s+', ' ', 'g'), 100)
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"""


class Statements:
    """Each minute's most expensive statements on the server, from ``pg_stat_statements``'
    running totals (and the database's committed transactions)."""

    def __init__(self, url: str, top: int) -> None:
        self.url, self.top = url, top
        self.last: dict[int, tuple[int, int, float]] = {}
        self.commits = 0

    async def read(self) -> tuple[dict[int, tuple[int, int, float, str]], int]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as con:
            rows = await (await con.execute(STATEMENTS)).fetchall()
            cur = await con.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            )
            commits = ((await cur.fetchone()) or (0,))[0]
        return {row[0]: (row[1], row[2], row[3], row[4]) for row in rows}, commits

    async def start(self) -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as con:
            await con.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await self.minute(1)

    async def minute(self, jobs: int) -> list[str]:
        """The lines of the minute since the last call (``jobs``: the jobs done in it)."""
        now, commits = await self.read()
        spent = []
        for key, (calls, rows, ms, query) in now.items():
            calls0, rows0, ms0 = self.last.get(key, (0, 0, 0.0))
            if calls > calls0:
                spent.append((ms - ms0, calls - calls0, rows - rows0, query))
        self.last = {key: value[:3] for key, value in now.items()}
        lines = [f"  transactions committed per job {(commits - self.commits) / jobs:.3f}"]
        self.commits = commits
        for ms, calls, rows, query in sorted(spent, reverse=True)[: self.top]:
            lines.append(
                f"  {ms * 1e3 / jobs:6.1f} us/job {calls / jobs:6.3f} calls/job "
                f"{rows / max(calls, 1):6.1f} rows/call  {query}"
            )
        return lines


@contextlib.asynccontextmanager
async def held_xmin(url: str) -> AsyncIterator[None]:
    """A session holding one snapshot open for as long as the block runs."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(url) as con:
        await con.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        # (its snapshot only, no transaction ID of its own: the control's snapshots in its
        # own database, --control, list no transaction of this one as running)
        await con.execute("SELECT count(*) FROM jobs")
        yield
        await con.rollback()


@contextlib.asynccontextmanager
async def streaming(target: str, args: argparse.Namespace) -> AsyncIterator[Load]:
    """A producer keeping ``--depth`` jobs queued and a Dispatcher delivering them, on
    ``target``, for as long as the block runs: their counts."""
    load, stop = Load(), asyncio.Event()
    # (with --control each queue is paused for a while, its tickets waiting in their sends:
    # under leases long enough that it renews none meanwhile)
    lease_ms = 300_000 if args.control else 5000

    async def send(event: dict[str, Any], token: int) -> bool:
        await load.active.wait()
        await asyncio.sleep(args.send_ms / 1000)
        return True

    async with AsyncQueue.open(target) as producer_queue, AsyncQueue.open(target) as queue:
        producing = asyncio.ensure_future(
            produce(producer_queue, load, args.depth, stop, args.ids == "random")
        )
        dispatcher = Dispatcher(
            queue,
            send,
            owner="bench",
            keep_attempts=args.kept_answers,
            concurrency=args.concurrency,
            lease_ms=lease_ms,
            trace=load.trace,
        )
        running = asyncio.ensure_future(dispatcher.run(follow=True))
        try:
            yield load
        finally:
            stop.set()
            load.active.set()
            running.cancel()
            await asyncio.gather(producing, running, return_exceptions=True)


async def window(load: Load, seconds: float) -> tuple[float, list[float]]:
    """The jobs done per second and the claim latency percentiles over ``seconds`` (NaN
    for a window without any claim latency)."""
    before, began = load.done, time.perf_counter()
    load.latencies = []
    await asyncio.sleep(seconds)
    rate = max(load.done - before, 1) / (time.perf_counter() - began)
    lat, load.latencies = load.latencies, []
    return rate, quantiles(lat, n=100) if len(lat) > 1 else [math.nan] * 99


async def controlled(load: Load, control: Load, seconds: float, target: str) -> tuple[float, float]:
    """The control queue's rate and claim latency p50 over ``seconds`` while the measured
    one is paused (its done jobs purged afterwards, so that it stays small)."""
    load.pause()
    control.resume()
    await asyncio.sleep(CONTROL_SETTLE_S)
    rate, cuts = await window(control, seconds)
    control.pause()
    now = epoch_ms()
    await asyncio.to_thread(purge, target, now, ("done",), now)
    if is_url(target):  # (its dead rows removed now, not in a minute)
        import psycopg

        async with await psycopg.AsyncConnection.connect(target, autocommit=True) as con:
            await con.execute("VACUUM jobs")
    load.resume()
    return rate, cuts[49]


async def run(
    target: str,
    args: argparse.Namespace,
    table: Callable[[str], Awaitable[str]],
    data: Path | None = None,
    control: str = "",
) -> list[tuple[float, float, float, float]]:
    """Each minute's (rate, claim latency p50) and, with a ``control`` queue, the control's
    in the window after it (else 1.0 and 1.0).  The control runs one window first, to warm
    up: so every minute follows a pause."""
    stop = asyncio.Event()
    statements = Statements(target, args.statements) if args.statements else None
    async with contextlib.AsyncExitStack() as stack:
        load = await stack.enter_async_context(streaming(target, args))
        checked = None
        if control:
            checked = await stack.enter_async_context(streaming(control, args))
            checked.pause()
        if args.hold_xmin:
            await stack.enter_async_context(held_xmin(target))
        purging = asyncio.ensure_future(
            keep_done(target, args.keep_done, stop, load) if args.keep_done else stop.wait()
        )
        minutes: list[tuple[float, float, float, float]] = []
        if checked is not None:  # (warmed up, and every minute after a pause, the first too)
            await controlled(load, checked, args.control, control)
        if statements:
            await statements.start()
        try:
            for minute in range(args.minutes):
                before, cpu = load.done, cpu_s()
                served = server_processes_s(data) if data else {}
                rate, cuts = await window(load, 60)
                jobs = max(load.done - before, 1)
                used = f"CPU {(cpu_s() - cpu) / jobs * 1e6:5.1f} us/job"
                if data:
                    used += f", server {server_cpu_s(data, served) / jobs * 1e6:5.1f} us/job"
                line = (
                    f"minute {minute + 1:>2}: {rate:7.0f} jobs/s, claim latency p50 "
                    f"{cuts[49]:7.0f} ms p99 {cuts[98]:7.0f} ms, {used}, {await table(target)}"
                )
                if statements:
                    line += "\n" + "\n".join(await statements.minute(jobs))
                base = (1.0, 1.0)
                if checked is not None:
                    base = await controlled(load, checked, args.control, control)
                    if statements:
                        await statements.minute(1)  # (the next minute's from here)
                    line += (
                        f"\n  control: {base[0]:7.0f} jobs/s, claim latency p50 {base[1]:7.0f} ms;"
                        f" this / control: throughput {rate / base[0]:.2f},"
                        f" p50 {cuts[49] / max(base[1], 1e-9):.2f}; {await table(control)}"
                    )
                minutes.append((rate, cuts[49], *base))
                print(line, flush=True)
        finally:
            stop.set()
            await asyncio.gather(purging, return_exceptions=True)
    return minutes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("pg", "sqlite"), default="pg")
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--depth", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--send-ms", type=float, default=1.0)
    parser.add_argument("--hold-xmin", action="store_true")
    parser.add_argument("--keep-done", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--shared-buffers", metavar="SIZE", help="PostgreSQL's, e.g. 4GB")
    parser.add_argument("--statements", type=int, default=0, metavar="N")
    parser.add_argument("--control", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--ids", choices=("ordered", "random"), default="ordered")
    parser.add_argument("--no-kept-answers", dest="kept_answers", action="store_false")
    args = parser.parse_args()
    if not 0 <= args.control <= 60:  # (NaN too)
        parser.error("--control takes 0 (none) to 60 seconds")
    if args.minutes < 1:
        parser.error("--minutes takes 1 or more")
    if (args.hold_xmin or args.shared_buffers or args.statements) and args.store != "pg":
        parser.error("--hold-xmin, --shared-buffers and --statements go with --store pg")
    print(
        f"{args.store}, depth {args.depth}, concurrency {args.concurrency}, sends of "
        f"{args.send_ms:g} ms"
        + (", xmin held" if args.hold_xmin else "")
        + (f", done jobs kept {args.keep_done:g} s" if args.keep_done else "")
        + (f", shared_buffers {args.shared_buffers}" if args.shared_buffers else "")
        + (f", a control queue {args.control:g} s a minute" if args.control else "")
        + (", random ids" if args.ids == "random" else "")
        + ("" if args.kept_answers else ", no answer kept"),
        flush=True,
    )
    if args.store == "pg":
        from asnackq.lab.pg_server import DURABLE, local_server

        settings = dict(DURABLE)
        if args.shared_buffers:
            settings["shared_buffers"] = args.shared_buffers
        if args.statements:
            settings["shared_preload_libraries"] = "pg_stat_statements"
        with local_server(settings) as server:
            url = server.url()
            with controls(server.url(), args.control) as control:
                minutes = asyncio.run(run(url, args, table_pg, server.data, control))
    else:
        with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
            path = Path(tmp) / "q.db"

            async def table(target: str) -> str:
                # (in a thread: read on the loop's thread, it could wait for a lock held by
                # a transaction of this process that waits for the loop)
                return await asyncio.to_thread(table_sqlite, Path(target))

            control = str(Path(tmp) / "control.db") if args.control else ""
            minutes = asyncio.run(run(str(path), args, table, control=control))
    first, last = minutes[0], minutes[-1]
    print(
        f"last minute / first: throughput {last[0] / first[0]:.2f}, claim latency p50 "
        f"{last[1] / max(first[1], 1e-9):.2f} (pid {os.getpid()})"
    )
    if args.control:
        # each minute against its control, the last minute's ratio over the first minute's
        print(
            "against the control queue, last minute / first: throughput "
            f"{last[0] / last[2] / (first[0] / first[2]):.2f}, claim latency p50 "
            f"{last[1] / max(last[3], 1e-9) / (first[1] / max(first[3], 1e-9)):.2f}"
        )


@contextlib.contextmanager
def controls(admin_url: str, seconds: float) -> Iterator[str]:
    """The control queue's database on the server (``--control``), or no control: ""."""
    if not seconds:
        yield ""
        return
    from pg_queue import database

    with database(admin_url, "control") as url:
        yield url


if __name__ == "__main__":
    main()

"""Sustained load: throughput, claim latency and dead rows minute by minute at a fixed depth.

    python benchmarks/sustained.py [--store pg|sqlite] [--minutes 10] [--depth 4000]
                                   [--concurrency 64] [--send-ms 1] [--hold-xmin]
                                   [--keep-done SECONDS] [--shared-buffers SIZE]
                                   [--statements N]

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

Each minute prints: jobs done per second, the claim latency (from enqueue to claim) p50
and p99 in ms, the CPU per job of this process (every thread: the Dispatcher, the producer,
the store's threads) and of the PostgreSQL server (its processes alive at each minute's
end, from ``/proc``: ``cpu_per_job.server_cpu_s``; one that ended within the minute is not
counted), and the ``jobs`` table's dead and live rows (``pg_stat_user_tables``) and size
(PostgreSQL), or the file's size and free pages (SQLite). The last line: the last
minute's throughput and claim latency p50 as a ratio of the first minute's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from statistics import quantiles
from typing import Any

from cpu_per_job import cpu_s, server_cpu_s, server_processes_s

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core.worker import epoch_ms
from asnackq.ops.purge import purge

BATCH = 500


class Load:
    """The producer's and the Dispatcher's counts, and each job's enqueue time."""

    def __init__(self) -> None:
        self.enqueued = 0
        self.done = 0
        self.born: dict[str, int] = {}
        self.latencies: list[int] = []  # claim - enqueue, ms, this minute

    def trace(self, kind: str, ticket: dict[str, Any], at: int, status: object) -> None:
        if kind == "claim":
            born = self.born.pop(ticket["id"], None)
            if born is not None:
                self.latencies.append(at - born)
        elif kind == "finish" and status == "done":
            self.done += 1


async def produce(queue: AsyncQueue, load: Load, depth: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        missing = depth - (load.enqueued - load.done)
        while missing > 0:
            n = min(missing, BATCH)
            now = epoch_ms()
            ids = [f"j{load.enqueued + i}" for i in range(n)]
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


async def keep_done(target: str, keep_s: float, stop: asyncio.Event) -> None:
    """Purge the done jobs older than ``keep_s`` every ``keep_s / 2`` seconds."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), keep_s / 2)
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
        await con.execute("SELECT txid_current(), count(*) FROM jobs")
        yield
        await con.rollback()


async def run(
    target: str, args: argparse.Namespace, table: Any, data: Path | None = None
) -> list[tuple[float, float]]:
    load, stop = Load(), asyncio.Event()
    statements = Statements(target, args.statements) if args.statements else None

    async def send(event: dict[str, Any], token: int) -> bool:
        await asyncio.sleep(args.send_ms / 1000)
        return True

    async with AsyncQueue.open(target) as producer_queue, AsyncQueue.open(target) as queue:
        hold = held_xmin(target) if args.hold_xmin else contextlib.nullcontext()
        async with hold:
            producing = asyncio.ensure_future(produce(producer_queue, load, args.depth, stop))
            purging = asyncio.ensure_future(
                keep_done(target, args.keep_done, stop) if args.keep_done else stop.wait()
            )
            dispatcher = Dispatcher(
                queue, send, owner="bench", concurrency=args.concurrency, trace=load.trace
            )
            running = asyncio.ensure_future(dispatcher.run(follow=True))
            minutes: list[tuple[float, float]] = []
            if statements:
                await statements.start()
            try:
                for minute in range(args.minutes):
                    before, began = load.done, time.perf_counter()
                    cpu, served = cpu_s(), server_processes_s(data) if data else {}
                    await asyncio.sleep(60)
                    jobs = max(load.done - before, 1)
                    rate = jobs / (time.perf_counter() - began)
                    used = f"CPU {(cpu_s() - cpu) / jobs * 1e6:5.1f} us/job"
                    if data:
                        used += f", server {server_cpu_s(data, served) / jobs * 1e6:5.1f} us/job"
                    lat, load.latencies = load.latencies, []
                    cuts = quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
                    minutes.append((rate, cuts[49]))
                    print(
                        f"minute {minute + 1:>2}: {rate:7.0f} jobs/s, claim latency p50 "
                        f"{cuts[49]:7.0f} ms p99 {cuts[98]:7.0f} ms, {used}, {await table()}",
                        flush=True,
                    )
                    if statements:
                        print(*await statements.minute(jobs), sep="\n", flush=True)
            finally:
                stop.set()
                running.cancel()
                await asyncio.gather(producing, running, purging, return_exceptions=True)
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
    args = parser.parse_args()
    if (args.hold_xmin or args.shared_buffers or args.statements) and args.store != "pg":
        parser.error("--hold-xmin, --shared-buffers and --statements go with --store pg")
    print(
        f"{args.store}, depth {args.depth}, concurrency {args.concurrency}, sends of "
        f"{args.send_ms:g} ms"
        + (", xmin held" if args.hold_xmin else "")
        + (f", done jobs kept {args.keep_done:g} s" if args.keep_done else "")
        + (f", shared_buffers {args.shared_buffers}" if args.shared_buffers else ""),
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
            minutes = asyncio.run(run(url, args, lambda: table_pg(url), server.data))
    else:
        with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
            path = Path(tmp) / "q.db"

            async def table() -> str:
                return table_sqlite(path)

            minutes = asyncio.run(run(str(path), args, table))
    (first_rate, first_p50), (last_rate, last_p50) = minutes[0], minutes[-1]
    print(
        f"last minute / first: throughput {last_rate / first_rate:.2f}, claim latency p50 "
        f"{last_p50 / max(first_p50, 1e-9):.2f} (pid {os.getpid()})"
    )


if __name__ == "__main__":
    main()

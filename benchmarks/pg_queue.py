"""PostgreSQL: the queue alone vs procrastinate, and end to end with two sink replicas vs SQLite.

    python benchmarks/pg_queue.py [--url postgresql://...] [--jobs 20000] [--e2e-jobs 6000]
                                  [--processes 1,2] [--concurrency 64] [--rounds 3]

Without ``--url`` a throwaway local server is started (``fsync=on``,
``synchronous_commit=on``: every COMMIT waits for its WAL flush); with it, each measurement
creates (and drops) its own database there.  The server's settings are printed first.

* queue only: P processes, each a Dispatcher of the given concurrency with a send that
  returns True at once, until the queue is empty; jobs/s = jobs / (last end - first start),
  every process starting together after it has connected.  The peer: procrastinate
  (``pip install procrastinate``; not a dependency of asnackq), its own worker
  (``run_worker_async(concurrency=C, wait=False)``) and a no-op task, the same number of
  jobs and processes on the same server.
* end to end: 2 worker processes x C coroutines through two ``asnackq sink --db URL``
  replicas sharing one inbox (each worker sends to one), vs the SQLite setup (a queue file,
  one sink with a DB file, 2 worker processes).
Each round measures every configuration back to back; medians over the rounds are printed,
with the range of each ratio.  Target: queue only >= 10 x procrastinate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from statistics import median
from typing import Any

import psycopg
from peer_workers import procrastinate_fill, procrastinate_work

from asnackq import ops
from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.lab.pg_server import DURABLE, local_server
from asnackq.lab.procs import sink_process
from asnackq.wire.send import AsyncHttpSender

SETTINGS = (
    "server_version",
    "fsync",
    "synchronous_commit",
    "wal_sync_method",
    "full_page_writes",
    "shared_buffers",
    "max_connections",
    "commit_delay",
)


# --- children: one measured worker process each ----------------------------------------


async def asnackq_child(target: str, owner: str, concurrency: int, sink: str) -> dict[str, Any]:
    async def null(event: dict[str, Any], token: int) -> bool:
        return True

    async with contextlib.AsyncExitStack() as stack:
        queue = await stack.enter_async_context(AsyncQueue.open(target))
        send = (
            null
            if sink == "-"
            else await stack.enter_async_context(
                AsyncHttpSender(sink, timeout_s=2.0, limit=concurrency)
            )
        )
        began = await ready()
        summary = await Dispatcher(
            queue, send, owner=owner, concurrency=concurrency, lease_ms=10_000
        ).run(until_empty=True)
        return {"began": began, "ended": time.time(), "done": summary.done}


async def ready() -> float:
    """Tell the parent this process is connected; start when it says go."""
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    return time.time()


# --- the parent -------------------------------------------------------------------------


def run_children(commands: list[list[str]]) -> list[dict[str, Any]]:
    """Start every child, let them all go at once, return their reports."""
    procs = [
        subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for c in commands
    ]
    try:
        for proc in procs:
            line = proc.stdout.readline() if proc.stdout is not None else ""
            if line != "ready\n":
                raise RuntimeError(f"a child did not start: {line!r}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [json.loads(proc.communicate(timeout=600)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return reports


def child(*args: object) -> list[str]:
    return [sys.executable, __file__, "--child", *map(str, args)]


def rate(reports: list[dict[str, Any]], jobs: int) -> float:
    return jobs / (max(r["ended"] for r in reports) - min(r["began"] for r in reports))


@contextlib.contextmanager
def database(admin_url: str, name: str) -> Iterator[str]:
    """A fresh database on the server (its URL), dropped afterwards."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield urllib.parse.urlsplit(admin_url)._replace(path=f"/{name}").geturl()
        finally:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def fill(target: str | Path, jobs: int, prefix: str) -> None:
    """``jobs`` jobs, and the table of the requests' answers the Dispatcher keeps: each
    system's tables are made before its clock starts (pgqueuer's ``install``, procrastinate's
    schema), so a worker's run does not time a one-off CREATE TABLE."""
    ops.enqueue_all(
        target, [({"id": f"{prefix}-{i}", "qty": i % 9 + 1}, 3_600_000, 3) for i in range(jobs)]
    )
    asyncio.run(kept_requests(target))


async def kept_requests(target: str | Path) -> None:
    async with AsyncQueue.open(target) as queue:
        await queue.keep_attempts()


def analyzed(url: str) -> None:
    """The database's statistics taken (``ANALYZE``), as autovacuum takes them on a server
    that has been running: the planner then plans for the tables as they are."""
    with psycopg.connect(url, autocommit=True) as con:
        con.execute("ANALYZE")


def queue_only(
    admin: str, jobs: int, processes: int, concurrency: int, analyze: bool = False
) -> float:
    with database(admin, "bench_asnackq") as url:
        fill(url, jobs, "q")
        if analyze:
            analyzed(url)
        reports = run_children(
            [child("asnackq", url, f"p{n}", concurrency, "-") for n in range(processes)]
        )
        assert sum(r["done"] for r in reports) == jobs, reports
    return rate(reports, jobs)


def procrastinate_only(admin: str, jobs: int, processes: int, concurrency: int) -> float:
    with database(admin, "bench_procrastinate") as url:
        asyncio.run(procrastinate_fill(url, jobs))
        reports = run_children([child("procrastinate", url, concurrency) for _ in range(processes)])
        with psycopg.connect(url) as con:
            (done,) = con.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            ).fetchone() or (0,)
        assert done == jobs, (done, jobs)
    return rate(reports, jobs)


def end_to_end(
    target: str | Path, sink_dbs: list[str | Path], jobs: int, concurrency: int
) -> float:
    """2 worker processes through the sinks (worker n sends to sink n mod K)."""
    fill(target, jobs, "e")
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(sink_process(db)) for db in sink_dbs]
        reports = run_children(
            [child("asnackq", target, f"w{n}", concurrency, urls[n % len(urls)]) for n in range(2)]
        )
    assert sum(r["done"] for r in reports) == jobs, reports
    return rate(reports, jobs)


def e2e_pg(admin: str, jobs: int, concurrency: int) -> float:
    with database(admin, "bench_e2e") as url:
        return end_to_end(url, [url, url], jobs, concurrency)


def e2e_sqlite(jobs: int, concurrency: int) -> float:
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        root = Path(tmp)
        return end_to_end(root / "queue.db", [root / "sink.db"], jobs, concurrency)


def show_settings(admin: str) -> None:
    with psycopg.connect(admin) as con:
        values = {
            name: con.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in SETTINGS
        }
    print("server: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    print(f"machine: {os.cpu_count()} cores; client, workers, sinks and server share them")


def spread(rates: list[float], peers: list[float]) -> str:
    ratios = sorted(r / p for r, p in zip(rates, peers, strict=True))
    return f"{median(ratios):6.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def measure(admin: str, args: argparse.Namespace) -> None:
    show_settings(admin)
    levels = [int(p) for p in args.processes.split(",")]
    mine: dict[int, list[float]] = {p: [] for p in levels}
    peer: dict[int, list[float]] = {p: [] for p in levels}
    e2e: dict[str, list[float]] = {"pg": [], "sqlite": []}
    for _ in range(args.rounds):
        for p in levels:
            mine[p].append(queue_only(admin, args.jobs, p, args.concurrency))
            if not args.no_peer:
                peer[p].append(procrastinate_only(admin, args.jobs, p, args.concurrency))
        if args.e2e_jobs:
            e2e["pg"].append(e2e_pg(admin, args.e2e_jobs, args.concurrency))
            e2e["sqlite"].append(e2e_sqlite(args.e2e_jobs, args.concurrency))
    print(
        f"queue only, null send, concurrency {args.concurrency}, {args.jobs} jobs, "
        f"medians of {args.rounds} rounds (ratio ranges in brackets)"
    )
    print(f"{'processes':>9} {'asnackq jobs/s':>15} {'procrastinate':>14} {'ratio':>20}")
    for p in levels:
        line = f"{p:>9} {median(mine[p]):>15.0f}"
        if peer[p]:
            line += f" {median(peer[p]):>14.0f} {spread(mine[p], peer[p]):>20}"
        print(line)
    if e2e["pg"]:
        print(
            f"end to end, 2 workers x {args.concurrency}, {args.e2e_jobs} jobs: PostgreSQL "
            f"queue + 2 sink replicas {median(e2e['pg']):.0f} jobs/s, SQLite queue + sink "
            f"{median(e2e['sqlite']):.0f} jobs/s, ratio {spread(e2e['pg'], e2e['sqlite'])}"
        )
    print("target: queue only >= 10 x procrastinate")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "asnackq":
            report = asyncio.run(asnackq_child(rest[0], rest[1], int(rest[2]), rest[3]))
        else:
            report = {**asyncio.run(procrastinate_work(rest[0], int(rest[1]))), "done": 0}
        print(json.dumps(report))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a server to use (a superuser URL: it creates databases)")
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--e2e-jobs", type=int, default=6000)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip procrastinate")
    args = parser.parse_args()
    if args.url:
        measure(args.url, args)
        return
    with local_server(DURABLE) as server:
        measure(server.url(), args)


if __name__ == "__main__":
    main()

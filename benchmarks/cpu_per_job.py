"""CPU per job: the Dispatcher with a no-op send at concurrency 64, on SQLite and PostgreSQL.

    python benchmarks/cpu_per_job.py [--jobs 20000] [--rounds 3] [--concurrency 64]
                                     [--baseline TREE]

Each round fills a queue (a file; a fresh database on a throwaway local PostgreSQL 15 with
``fsync=on``, ``synchronous_commit=on`` and ``pg_stat_statements``), then runs one worker
process - a Dispatcher whose send answers True at once - until the queue is empty, and
reports per job, over the run only (from the moment the connected worker is told to go):

* worker CPU us: the worker process's user + system time (``getrusage``);
* event loop CPU us: of which its event loop's thread (``time.thread_time``): the
  Dispatcher's Python and the drivers' calls, where the rest is the statements' threads
  (SQLite: aiosqlite's connection thread) and the interpreter's other threads;
* server CPU us (PostgreSQL): the server's processes' user + system time, summed from
  ``/proc/PID/stat`` over the postmaster and its children;
* statements: SQLite statements stepped (the connection's trace callback, in a run of
  its own on a copy of the queue, as the callback costs CPU per statement: BEGIN and
  COMMIT count, an ``executemany`` counts each row), or PostgreSQL's
  ``pg_stat_statements`` calls (BEGIN and COMMIT count);
* jobs per transaction: over SQLite's BEGINs, or PostgreSQL's ``xact_commit`` +
  ``xact_rollback``.  Round trips are not counted here: on SQLite a transaction is at
  most ``asnackq.store.sqlite_aio.HOPS`` hops to its connection's thread (4 for a
  Dispatcher's cycle, whether it keeps its requests' answers or not).

Printed: the median of each over the rounds, with its range.  ``--baseline TREE`` (a
checkout of other code: ``git worktree add /tmp/base <commit>``) runs that tree's worker
beside this one's in every round, in alternating order, on the same queue contents and
server, and prints the median of the paired ratios (this / baseline) of each figure with
their range.  Figures with their date and commit go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from statistics import median
from typing import Any

import psycopg
from sink_throughput import proc_stat, tree_env

from asnackq.aio import AsyncQueue, Dispatcher

READING = 2  # statements (and transactions) of one ``server_counts``
FIGURES = (
    "worker CPU us",
    "event loop CPU us",
    "server CPU us",
    "statements",
    "jobs per transaction",
)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def worker(target: str, concurrency: int, traced_run: bool) -> None:
    """The measured child: connect, say ready, run on "go", report its own counts, and
    keep its session (its server process's CPU) until told to end.  ``traced_run``: count
    a SQLite connection's statements (its trace callback, which costs that connection's
    thread CPU for each statement it steps)."""

    async def null(event: dict[str, Any], token: int) -> bool:
        return True

    stepped = [0, 0]  # statements, BEGINs (SQLite)

    def traced(sql: str) -> None:
        stepped[0] += 1
        stepped[1] += sql.lstrip().startswith("BEGIN")

    async with AsyncQueue.open(target) as queue:
        sqlite = getattr(queue._db, "db", None)  # (a file's aiosqlite connection)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        if sqlite is not None and traced_run:
            await sqlite.set_trace_callback(traced)
        cpu, loop = cpu_s(), time.thread_time()
        summary = await Dispatcher(
            queue, null, owner="bench", concurrency=concurrency, lease_ms=10_000
        ).run(until_empty=True)
        cpu, loop = cpu_s() - cpu, time.thread_time() - loop
        if sqlite is not None and traced_run:
            await sqlite.set_trace_callback(None)
        report = {
            "done": summary.done,
            "cpu_s": cpu,
            "loop_s": loop,
            "statements": stepped[0],
            "transactions": stepped[1],
        }
        print(json.dumps(report), flush=True)
        await asyncio.to_thread(sys.stdin.readline)


def server_processes_s(data: Path) -> dict[int, float]:
    """User + system seconds of each process of the server (the postmaster and its
    children), by pid, from /proc."""
    postmaster = int((data / "postmaster.pid").read_text().split()[0])
    used = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid, (ppid, cpu) = int(stat.parent.name), proc_stat(stat)
            if postmaster in (pid, ppid):
                used[pid] = cpu
    return used


def server_cpu_s(data: Path, since: dict[int, float]) -> float:
    """Seconds the server's processes used since ``since`` (``server_processes_s``): each
    process alive now, all of its time if it started since; one that ended since is not
    counted (a backend or an autovacuum worker that came and went: a little less, never a
    negative share)."""
    return sum(s - since.get(pid, 0.0) for pid, s in server_processes_s(data).items())


def server_counts(url: str) -> tuple[int, int]:
    """(statements by pg_stat_statements, transactions) of the database so far."""
    with psycopg.connect(url, autocommit=True) as con:
        ((calls,),) = con.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = current_database()"
        ).fetchall()
        ((xacts,),) = con.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname = current_database()"
        ).fetchall()
    return int(calls), int(xacts)


def run_worker(
    target: str, concurrency: int, data: Path | None, tree: str | None = None
) -> dict[str, float]:
    """One measured run: the child's report, with the server's share on PostgreSQL (the
    child imports asnackq from ``tree``, if given, through the design card's names).  On
    SQLite the statements are counted in a run of their own, on a copy of the queue: the
    CPU figures come from a run without the trace callback."""
    if data is not None:
        return one_run(target, concurrency, data, tree, traced_run=True)
    copy = copied(target, None)
    try:
        counted = one_run(copy, concurrency, None, tree, traced_run=True)
    finally:
        dropped(copy, None)
    timed = one_run(target, concurrency, None, tree, traced_run=False)
    return timed | {name: counted[name] for name in ("statements", "jobs per transaction")}


def one_run(
    target: str, concurrency: int, data: Path | None, tree: str | None, traced_run: bool
) -> dict[str, float]:
    """``run_worker``'s run of one child."""
    command = [sys.executable, __file__, "--worker", target, str(concurrency), str(traced_run)]
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=tree_env(tree)
    )
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        if proc.stdout.readline() != "ready\n":
            raise RuntimeError("the worker did not start")
        before = (server_processes_s(data), *server_counts(target)) if data is not None else None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        server_s = (  # (its session still open)
            server_cpu_s(data, before[0]) if data is not None and before is not None else None
        )
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    jobs, transactions = report["done"], report["transactions"]
    figures = {
        "worker CPU us": report["cpu_s"] * 1e6,
        "event loop CPU us": report["loop_s"] * 1e6,
        "statements": report["statements"],
    }
    if before is not None and server_s is not None:
        time.sleep(1)  # a server process reports its transactions as it ends
        _, calls, xacts = before
        after = server_counts(target)
        figures["server CPU us"] = server_s * 1e6
        # (less the readings' own statements and transactions, which land in between)
        figures["statements"] = after[0] - calls - READING
        transactions = after[1] - xacts - READING
    per_job = {name: value / jobs for name, value in figures.items()}
    per_job["jobs per transaction"] = jobs / max(1, transactions)
    return per_job


def show(name: str, rounds: list[dict[str, float]]) -> None:
    print(f"{name}: {len(rounds)} rounds")
    for figure in FIGURES:
        values = sorted(r[figure] for r in rounds if figure in r)
        if values:
            print(
                f"  {figure if 'per' in figure else figure + ' per job':>26}: {median(values):9.2f}"
                f"  ({values[0]:.2f}-{values[-1]:.2f})"
            )


def compare(name: str, pairs: list[tuple[dict[str, float], dict[str, float]]]) -> None:
    """The median of the paired ratios (this / baseline) of each figure, with their range."""
    print(f"{name}: this / baseline, {len(pairs)} rounds")
    for figure in FIGURES:
        ratios = sorted(
            this[figure] / base[figure] for this, base in pairs if base.get(figure)
        )  # (a tree whose connection cannot be traced counts no statements)
        if ratios:
            print(f"  {figure:>26}: {median(ratios):6.3f}  ({ratios[0]:.3f}-{ratios[-1]:.3f})")


def measured(
    target: str, concurrency: int, data: Path | None, baseline: str | None, first: bool
) -> tuple[dict[str, float], dict[str, float] | None]:
    """This tree's run and (with a baseline) the baseline's on the same queue: the one
    that runs first alternates from round to round (``first``: this one)."""
    if baseline is None:
        return run_worker(target, concurrency, data), None
    copy = copied(target, data)
    try:
        runs = [(None, target), (baseline, copy)]
        if not first:
            runs.reverse()
        reports = {tree: run_worker(where, concurrency, data, tree) for tree, where in runs}
    finally:
        dropped(copy, data)
    return reports[None], reports[baseline]


def copied(target: str, data: Path | None) -> str:
    """A second queue with the same contents: a copy of the file, or of the database."""
    if data is None:
        fd, copy = tempfile.mkstemp(".db", dir=os.path.dirname(target))
        os.close(fd)
        shutil.copyfile(target, copy)
        return copy
    name = urllib.parse.urlsplit(target).path.lstrip("/")
    with psycopg.connect(target, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}_copy TEMPLATE {name}")
    return urllib.parse.urlsplit(target)._replace(path=f"/{name}_copy").geturl()


def dropped(copy: str, data: Path | None) -> None:
    """Remove ``copied``'s copy."""
    if data is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(copy)
        return
    name = urllib.parse.urlsplit(copy).path.lstrip("/")
    admin = urllib.parse.urlsplit(copy)._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as con:
        con.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        asyncio.run(worker(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "True"))
        return
    # (here, not above: a child run with another tree imports the design card's names only)
    from pg_queue import database, fill

    from asnackq.lab.pg_server import DURABLE, local_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--baseline", help="a checkout of other code to compare with")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"SQLite": [], "PostgreSQL": []}
    pairs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {
        name: [] for name in results
    }
    settings = {**DURABLE, "shared_preload_libraries": "pg_stat_statements"}
    with (
        local_server(settings) as server,
        tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp,
    ):
        for r in range(args.rounds):
            path = str(Path(tmp) / f"r{r}.db")
            fill(path, args.jobs, "s")
            first = r % 2 == 0
            this, base = measured(path, args.concurrency, None, args.baseline, first)
            results["SQLite"].append(this)
            with database(server.url(), "bench_cpu") as url:
                with psycopg.connect(url, autocommit=True) as con:
                    con.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                fill(url, args.jobs, "p")
                pg_this, pg_base = measured(
                    url, args.concurrency, server.data, args.baseline, first
                )
                results["PostgreSQL"].append(pg_this)
            for name, pair in (("SQLite", (this, base)), ("PostgreSQL", (pg_this, pg_base))):
                if pair[1] is not None:
                    pairs[name].append((pair[0], pair[1]))
    print(f"{args.jobs} jobs a round, one worker process at concurrency {args.concurrency}")
    for name, rounds in results.items():
        show(name, rounds)
        if pairs[name]:
            compare(name, pairs[name])


if __name__ == "__main__":
    main()

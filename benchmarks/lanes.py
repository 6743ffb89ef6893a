"""What lanes cost and what they isolate, in one run (alternated rounds).

    python benchmarks/lanes.py [--jobs 3000] [--batch 64] [--backlog 50000]
                               [--lane-jobs 2000] [--rounds 7] [--dir DIR] [--pg]

1. *The plain lane on a queue without deliveries* (a sink's worker, ``work --sink``): claim
   ``--batch`` jobs and finish them, one transaction each, through the core's statements
   and through the plain lane's (``NOT EXISTS`` a delivery), on the same kind of queue;
   ``synchronous=OFF`` (timed by this process's CPU: the statements' cost, which a busy
   machine does not stretch) and ``FULL`` (wall time).  Printed: jobs/s and the median
   ratio plain lane / core with its range.
2. *A lane behind another endpoint's backlog*: endpoint B's ``--lane-jobs`` deliveries
   claimed and finished in B's lane while endpoint A holds ``--backlog`` pending deliveries,
   against the same with A empty (``synchronous=OFF``, CPU time).  Printed: the median ratio.
3. ``--pg``: 1. on a throwaway local PostgreSQL server (``fsync=on``), through
   ``AsyncQueue`` (psycopg), each round's queues in databases of their own.

Every claim uses the product's limits (``worker.PRODUCT``), as a Dispatcher does.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import psycopg

from asnackq.aio import AsyncQueue
from asnackq.core import events as ev
from asnackq.core import lanes
from asnackq.core import worker as w

T0 = 1_700_000_000_000
Wrap = Callable[[w.Plan[object]], w.Plan[object]]
Clock = Callable[[], float]


def core(plan: w.Plan[object]) -> w.Plan[object]:
    return plan


def plain(plan: w.Plan[object]) -> w.Plan[object]:
    return lanes.substituted(plan, lanes.PLAIN)


def queue(path: Path, synchronous: str, plain_jobs: int) -> sqlite3.Connection:
    con = w.open_queue(path)
    con.execute(f"PRAGMA synchronous={synchronous}")
    w.drive(con, w.plan_schema((lanes.DELIVERIES,)))
    w.enqueue_many(con, [({"id": f"p{i}", "qty": 1}, 60_000, 3) for i in range(plain_jobs)], T0)
    return con


def drain(
    con: sqlite3.Connection, wrap: Wrap, batch: int, expect: int, clock: Clock = time.perf_counter
) -> float:
    """Jobs/s of claim ``batch`` + finish them ok, one transaction each, until none is left
    (``clock``: wall time, or ``time.process_time``: this process's CPU, which other
    programs on a busy machine do not stretch)."""
    done, start = 0, clock()
    while True:
        plan = w.plan_claim_many("bench", T0 + 1, 30_000, batch, limits=w.PRODUCT)
        tickets: list[w.Ticket] = w.drive(con, wrap(plan))  # type: ignore[arg-type]
        if not tickets:
            break
        w.finish_many(con, [(t, "ok", T0 + 2, 0) for t in tickets])
        done += len(tickets)
    elapsed = clock() - start
    assert done == expect, (done, expect)
    return done / elapsed


def plain_cost(root: Path, args: argparse.Namespace) -> None:
    for synchronous in ("OFF", "FULL"):
        got: dict[str, list[float]] = {"core": [], "plain": []}
        for r in range(args.rounds):
            pair: list[tuple[str, Wrap]] = [("core", core), ("plain", plain)]
            for name, wrap in pair if r % 2 == 0 else pair[::-1]:
                con = queue(root / f"{synchronous}-{r}-{name}.db", synchronous, args.jobs)
                clock = time.process_time if synchronous == "OFF" else time.perf_counter
                got[name].append(drain(con, wrap, args.batch, args.jobs, clock))
                con.close()
        ratios = sorted(p / c for p, c in zip(got["plain"], got["core"], strict=True))
        print(
            f"plain lane, synchronous={synchronous:4}: core {median(got['core']):7.0f} jobs/s, "
            f"plain lane {median(got['plain']):7.0f}; plain/core {median(ratios):.3f} "
            f"({ratios[0]:.3f}-{ratios[-1]:.3f}), {args.rounds} rounds of {args.jobs} jobs"
        )


def endpoints_queue(path: Path, backlog: int, own: int) -> sqlite3.Connection:
    """A queue whose endpoint A holds ``backlog`` pending deliveries and B ``own``."""
    con = w.open_queue(path)
    con.execute("PRAGMA synchronous=OFF")
    w.drive(con, w.plan_schema(ev.SCHEMA))
    con.execute("BEGIN IMMEDIATE")
    for name, count, first in (("a", backlog, 1), ("b", own, backlog + 1)):
        ids = [lanes.delivery_id(name, n) for n in range(first, first + count)]
        con.executemany(w.SQL_INSERT_JOB, ((job, 1, 5, T0, T0 + 60_000) for job in ids))
        con.executemany(
            ev.SQL_INSERT_DELIVERY, ((job, f"e{n}", name, None) for n, job in enumerate(ids))
        )
    con.execute("COMMIT")
    return con


def isolation(root: Path, args: argparse.Namespace) -> None:
    in_b: Wrap = lambda plan: lanes.substituted(plan, lanes.Lane("b"))  # noqa: E731
    got: dict[int, list[float]] = {0: [], args.backlog: []}
    for r in range(args.rounds):
        for backlog in (0, args.backlog) if r % 2 == 0 else (args.backlog, 0):
            con = endpoints_queue(root / f"iso-{r}-{backlog}.db", backlog, args.lane_jobs)
            got[backlog].append(drain(con, in_b, args.batch, args.lane_jobs, time.process_time))
            con.close()
    ratios = sorted(f / e for f, e in zip(got[args.backlog], got[0], strict=True))
    print(
        f"lane b with a's {args.backlog:,} pending: {median(got[args.backlog]):7.0f} jobs/s, "
        f"with a empty {median(got[0]):7.0f}; ratio {median(ratios):.3f} "
        f"({ratios[0]:.3f}-{ratios[-1]:.3f}), {args.rounds} rounds"
    )


async def pg_drain(url: str, in_plain_lane: bool, args: argparse.Namespace) -> float:
    """``drain`` on a new PostgreSQL queue through ``AsyncQueue``: jobs/s."""
    async with AsyncQueue.open(url) as queue:
        await queue.enqueue_many(
            [({"id": f"p{i}", "qty": 1}, 60_000, 3) for i in range(args.jobs)], T0
        )
        view = queue.in_lane(lanes.PLAIN) if in_plain_lane else queue
        await view.prepare_lane()
        done, start = 0, time.perf_counter()
        while tickets := await view.claim_many("bench", T0 + 1, 30_000, args.batch):
            await queue.finish_many([(t, "ok", T0 + 2, 0) for t in tickets])
            done += len(tickets)
        elapsed = time.perf_counter() - start
    assert done == args.jobs
    return done / elapsed


def pg_plain_cost(args: argparse.Namespace) -> None:
    from asnackq.lab.pg_server import DURABLE, local_server

    got: dict[str, list[float]] = {"core": [], "plain": []}
    with local_server(DURABLE) as server:
        for r in range(args.rounds):
            for name in ("core", "plain") if r % 2 == 0 else ("plain", "core"):
                with psycopg.connect(server.url(), autocommit=True) as admin:
                    admin.execute(f"CREATE DATABASE lanes_{r}_{name}")
                url = server.url(f"lanes_{r}_{name}")
                got[name].append(asyncio.run(pg_drain(url, name == "plain", args)))
    ratios = sorted(p / c for p, c in zip(got["plain"], got["core"], strict=True))
    print(
        f"plain lane, PostgreSQL: core {median(got['core']):7.0f} jobs/s, plain lane "
        f"{median(got['plain']):7.0f}; plain/core {median(ratios):.3f} "
        f"({ratios[0]:.3f}-{ratios[-1]:.3f}), {args.rounds} rounds of {args.jobs} jobs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--lane-jobs", type=int, default=2000, help="endpoint B's deliveries")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--pg", action="store_true", help="the plain lane on PostgreSQL too")
    args = parser.parse_args()
    if args.pg:
        pg_plain_cost(args)
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=args.dir) as tmp:
        plain_cost(Path(tmp), args)
        isolation(Path(tmp), args)


if __name__ == "__main__":
    main()

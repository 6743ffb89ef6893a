"""A Dispatcher beside a busy event loop: deliveries alone vs beside coroutines running Python.

    python benchmarks/busy_loop.py [--store sqlite,pg] [--jobs 5000] [--concurrency 64]
                                   [--busy 4] [--work-us 5] [--rounds 3] [--baseline TREE]

Each case runs one child process: a queue of ``--jobs`` jobs (a file; a fresh database on a
throwaway local PostgreSQL 15 with ``fsync=on`` and ``synchronous_commit=on``), one
Dispatcher at ``--concurrency`` whose send answers True at once, until the queue is empty.
"alone": nothing else runs on its event loop.  "busy": beside it, ``--busy`` coroutines each
run about ``--work-us`` us of Python, then yield (``asyncio.sleep(0)``), round and round: an
application whose handlers keep the loop running Python, as a web app under load does.  The
loop then lets the GIL go only between its rounds (a poll that does not wait) or when the
interpreter's switch interval (5 ms) forces it: each time aiosqlite's connection thread needs
the GIL back (at every row sqlite3 steps, at every reply) it waits for one of those.

Printed per store: jobs/s alone and busy (medians over the rounds), and the ratio busy /
alone within each round (median and range).  ``--baseline TREE`` (a checkout of other
code: ``git worktree add /tmp/base <commit>``) runs that tree's child beside this one's for
every case, in alternating order, and prints the ratio this / baseline per case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from sink_throughput import tree_env

from asnackq.aio import AsyncQueue, Dispatcher


def spin(work_s: float) -> None:
    until = time.perf_counter() + work_s
    while time.perf_counter() < until:
        pass


async def child(target: str, concurrency: int, busy: int, work_us: float) -> None:
    """The measured run: the Dispatcher until the queue is empty, beside ``busy`` spinners;
    prints ``{"rate": jobs/s, "done": n}``."""
    stop = asyncio.Event()

    async def spinner() -> None:
        while not stop.is_set():
            spin(work_us / 1e6)
            await asyncio.sleep(0)

    async def null(event: dict[str, Any], token: int) -> bool:
        return True

    async with AsyncQueue.open(target) as queue:
        spinners = [asyncio.create_task(spinner()) for _ in range(busy)]
        started = time.perf_counter()
        summary = await Dispatcher(
            queue, null, owner="bench", concurrency=concurrency, lease_ms=60_000
        ).run(until_empty=True)
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*spinners)
    print(json.dumps({"rate": summary.done / elapsed, "done": summary.done}), flush=True)


def run_child(target: str, args: argparse.Namespace, busy: int, tree: str | None) -> float:
    command = [
        sys.executable,
        __file__,
        "--child",
        target,
        str(args.concurrency),
        str(busy),
        str(args.work_us),
    ]
    out = subprocess.run(
        command, capture_output=True, text=True, env=tree_env(tree), check=True, timeout=900
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    if report["done"] != args.jobs:
        raise RuntimeError(f"the child delivered {report['done']} of {args.jobs} jobs")
    return float(report["rate"])


def spread(ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return f"{median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        target, concurrency, busy, work_us = sys.argv[2:]
        asyncio.run(child(target, int(concurrency), int(busy), float(work_us)))
        return
    # (here, not above: a child run with another tree imports the design card's names only)
    from pg_queue import database, fill

    from asnackq.lab.pg_server import DURABLE, local_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="sqlite,pg")
    parser.add_argument("--jobs", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--busy", type=int, default=4)
    parser.add_argument("--work-us", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a checkout of other code to compare with")
    args = parser.parse_args()
    stores = args.store.split(",")
    if not stores or set(stores) - {"sqlite", "pg"}:
        parser.error(f"--store: sqlite, pg or both (comma-separated), not {args.store!r}")
    trees: list[str | None] = [None] if args.baseline is None else [None, args.baseline]
    rates: dict[tuple[str, str, str | None], list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp,
        contextlib.ExitStack() as stack,
    ):
        server = stack.enter_context(local_server(DURABLE)) if "pg" in stores else None
        for r in range(args.rounds):
            for store in stores:
                cases: tuple[tuple[str, int], ...] = (("alone", 0), ("busy", args.busy))
                for case, spinners in cases:
                    for tree in trees if r % 2 == 0 else trees[::-1]:
                        if store == "sqlite":
                            path = str(Path(tmp) / f"r{r}{case}{tree is None}.db")
                            fill(path, args.jobs, "s")
                            rate = run_child(path, args, spinners, tree)
                        else:
                            assert server is not None
                            with database(server.url(), "bench_busy") as url:
                                fill(url, args.jobs, "p")
                                rate = run_child(url, args, spinners, tree)
                        rates.setdefault((store, case, tree), []).append(rate)
                        name = "this" if tree is None else "base"
                        print(f"round {r + 1} {store} {case:>5} {name}: {rate:8.0f} jobs/s")
    print(
        f"{args.jobs} jobs, concurrency {args.concurrency}, busy: {args.busy} coroutines of"
        f" {args.work_us:.0f} us, medians of {args.rounds} rounds"
    )
    for store in stores:
        for tree in trees:
            alone, beside = rates[(store, "alone", tree)], rates[(store, "busy", tree)]
            name = "this" if tree is None else "base"
            print(
                f"{store:>6} {name}: alone {median(alone):8.0f} busy {median(beside):8.0f} jobs/s,"
                f" busy / alone {spread([b / a for a, b in zip(alone, beside, strict=True)])}"
            )
        if args.baseline is not None:
            for case in ("alone", "busy"):
                this, base = rates[(store, case, None)], rates[(store, case, args.baseline)]
                ratios = [t / b for t, b in zip(this, base, strict=True)]
                print(f"{store:>6} {case:>5}: this / base {spread(ratios)}")


if __name__ == "__main__":
    main()

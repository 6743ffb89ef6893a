"""End to end through a real sink: the sync run_once loop vs the Dispatcher vs HTTP-only.

    python benchmarks/dispatch_e2e.py [--jobs 2000] [--sync-jobs 300] [--concurrency 1,16,64,256]
                                      [--rounds 3] [--baseline TREE [--one-sink]]

The sink (`asnackq sink`) and the HTTP-only server (a handler that stores nothing) each run
in their own process on loopback; the queue and the delivery run in this one.  Two HTTP-only
ceilings at the same concurrency: "http-only" sends through the Dispatcher's own sender
(`AsyncHttpSender`: token header, verified ACK, bounded read) - the delivery minus the queue;
"raw" is a bare aiohttp client (`sink_throughput.load`), for reference.  Each round measures,
per concurrency, both ceilings and then the Dispatcher back to back (so all three see the same
machine), and each ratio is taken within its round; the medians over the rounds are printed,
with the range of the ratio.
Targets: Dispatcher at concurrency 64 >= 5 x the sync loop and >= 0.5 x the bare client ("raw").
``--gather-ms`` sets the Dispatcher's ``gather_ms`` (default 10; 0 commits without waiting).
``--baseline TREE``: each round also measures the code of another checkout (``git worktree add
/tmp/base <commit>``), its Dispatcher and its sink; then both Dispatchers run in child processes
(so both pay the same start-up), this checkout's first in even rounds, the other's in odd ones.
``--one-sink``: both Dispatchers deliver to this checkout's sink, so their ratio is theirs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from core_cycle import prefill
from sink_throughput import ASNACKQ, load, rate, start, tree_env

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w
from asnackq.core.worker import epoch_ms

try:
    from asnackq.wire.send import AsyncHttpSender, HttpSender
except ImportError:  # a baseline tree from before the package's layers
    from asnackq.http_send import AsyncHttpSender, HttpSender  # type: ignore[import-not-found,no-redef]


def fill(path: Path, jobs: int, prefix: str) -> None:
    con = w.open_queue(path)
    try:
        prefill(con, jobs, 0, epoch_ms(), prefix)
    finally:
        con.close()


def sync_loop(path: Path, url: str, jobs: int) -> float:
    fill(path, jobs, "sync")
    send = HttpSender(url)
    con = w.open_queue(path)
    start_at = time.perf_counter()
    while w.run_once(con, "sync", epoch_ms, send, 0.5, 5000) is not None:
        pass
    elapsed = time.perf_counter() - start_at
    con.close()
    return jobs / elapsed


async def sender_load(url: str, requests: int, concurrency: int, prefix: str) -> float:
    """Requests/s of the Dispatcher's sender alone: ``concurrency`` coroutines, new ids."""
    async with AsyncHttpSender(url, limit=concurrency) as send:

        async def post(i: int) -> None:
            assert await send({"id": f"{prefix}-{i}", "qty": 1}, i + 1) is True

        return await rate(post, requests, concurrency)


async def dispatcher(
    path: Path, url: str, jobs: int, concurrency: int, gather_ms: int = 10
) -> float:
    fill(path, jobs, f"c{concurrency}")
    async with AsyncQueue.open(path) as queue, AsyncHttpSender(url) as send:
        start_at = time.perf_counter()
        summary = await Dispatcher(
            queue, send, owner="bench", concurrency=concurrency, lease_ms=5000, gather_ms=gather_ms
        ).run()
        elapsed = time.perf_counter() - start_at
    assert summary.done == jobs, summary
    return jobs / elapsed


def dispatcher_in(tree: str | None, path: Path, url: str, jobs: int, c: int, gather: int) -> float:
    """``dispatcher(...)`` in a child process importing asnackq from ``tree``."""
    command = [
        sys.executable,
        __file__,
        "--measure",
        str(path),
        url,
        str(jobs),
        str(c),
        str(gather),
    ]
    out = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--sync-jobs", type=int, default=300)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gather-ms", type=int, default=10, help="the Dispatcher's gather_ms")
    parser.add_argument("--baseline", help="a checkout of the code to compare with")
    parser.add_argument("--one-sink", action="store_true", help="both deliver to this sink")
    parser.add_argument("--measure", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        path, url, *numbers = args.measure
        print(asyncio.run(dispatcher(Path(path), url, *map(int, numbers))))
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    here = str(Path(__file__).with_name("sink_throughput.py"))
    series = ["raw", "http-only", "dispatcher", *(["base"] if args.baseline else [])]
    got: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in series}
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        root = Path(tmp)
        sink = [*ASNACKQ, "sink", "--db"]
        null, null_url = start([sys.executable, here, "--serve-null"])
        ours, url = start([*sink, str(root / "s.db")])
        theirs, base_url = (
            start([*sink, str(root / "b.db")], args.baseline)
            if args.baseline and not args.one_sink
            else (None, url)
        )
        try:
            sync = sync_loop(root / "sync.db", url, args.sync_jobs)
            for r in range(args.rounds):
                for c in levels:
                    got["raw"][c].append(asyncio.run(load(null_url, args.jobs, c, f"r{r}c{c}")))
                    got["http-only"][c].append(
                        asyncio.run(sender_load(null_url, args.jobs, c, f"s{r}c{c}"))
                    )
                    if not args.baseline:
                        got["dispatcher"][c].append(
                            asyncio.run(
                                dispatcher(root / f"r{r}q{c}.db", url, args.jobs, c, args.gather_ms)
                            )
                        )
                        continue
                    pair = [("dispatcher", None, url), ("base", args.baseline, base_url)]
                    for name, tree, at in pair if r % 2 == 0 else pair[::-1]:
                        db = root / f"r{r}{name}{c}.db"
                        got[name][c].append(
                            dispatcher_in(tree, db, at, args.jobs, c, args.gather_ms)
                        )
        finally:
            for proc in (null, ours, theirs):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
    report(got, levels, sync, args.rounds, args.jobs)


def report(
    got: dict[str, dict[int, list[float]]], levels: list[int], sync: float, rounds: int, jobs: int
) -> None:
    print(f"sync run_once loop + HttpSender: {sync:8.0f} jobs/s")
    print(f"medians of {rounds} rounds of {jobs} jobs (ratio ranges in brackets)")
    base = "base" in got
    print(
        f"{'concurrency':>11} {'dispatcher':>11} {'http-only':>10} {'raw':>6} {'vs sync':>8} "
        f"{'vs http-only':>19} {'vs raw':>19}" + (f" {'base':>6} {'vs base':>19}" if base else "")
    )
    for c in levels:
        rates = got["dispatcher"][c]
        line = (
            f"{c:>11} {median(rates):>11.0f} {median(got['http-only'][c]):>10.0f} "
            f"{median(got['raw'][c]):>6.0f} {median(rates) / sync:>8.2f} "
            f"{spread(rates, got['http-only'][c]):>19} {spread(rates, got['raw'][c]):>19}"
        )
        if base:
            line += f" {median(got['base'][c]):>6.0f} {spread(rates, got['base'][c]):>19}"
        print(line)
    print("targets at concurrency 64: vs sync >= 5.0, vs raw >= 0.5")


def spread(rates: list[float], ceilings: list[float]) -> str:
    """The median ratio of paired measurements, and their range."""
    ratios = sorted(r / c for r, c in zip(rates, ceilings, strict=True))
    return f"{median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


if __name__ == "__main__":
    main()

"""End to end through a real sink: the sync run_once loop vs the Dispatcher vs HTTP-only.

    python benchmarks/dispatch_e2e.py [--jobs 2000] [--sync-jobs 300] [--concurrency 1,16,64,256]

The sink (`asnackq sink`) and the HTTP-only ceiling (a handler that stores nothing) each run
in their own process on loopback; the queue and the delivery run in this one.
Targets: Dispatcher at concurrency 64 >= 5 x the sync loop and >= 0.5 x the ceiling at 64.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from core_cycle import prefill
from sink_throughput import load, start

from asnackq.aio import AsyncQueue, Dispatcher, epoch_ms
from asnackq.core import worker as w
from asnackq.http_send import AsyncHttpSender, HttpSender


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


async def dispatcher(path: Path, url: str, jobs: int, concurrency: int) -> float:
    fill(path, jobs, f"c{concurrency}")
    async with AsyncQueue.open(path) as queue, AsyncHttpSender(url) as send:
        start_at = time.perf_counter()
        summary = await Dispatcher(queue, send, owner="bench", concurrency=concurrency,
                                   lease_ms=5000).run()
        elapsed = time.perf_counter() - start_at
    assert summary.done == jobs, summary
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--sync-jobs", type=int, default=300)
    parser.add_argument("--concurrency", default="1,16,64,256")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    here = str(Path(__file__).with_name("sink_throughput.py"))
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        root = Path(tmp)
        null, null_url = start([sys.executable, here, "--serve-null"])
        try:
            ceiling = {c: asyncio.run(load(null_url, args.jobs, c, f"n{c}")) for c in levels}
        finally:
            null.terminate()
            null.wait(timeout=30)
        sink, url = start([sys.executable, "-m", "asnackq", "sink", "--db", str(root / "s.db")])
        try:
            sync = sync_loop(root / "sync.db", url, args.sync_jobs)
            rates = {c: asyncio.run(dispatcher(root / f"q{c}.db", url, args.jobs, c))
                     for c in levels}
        finally:
            sink.terminate()
            sink.wait(timeout=30)
    print(f"sync run_once loop + HttpSender: {sync:8.0f} jobs/s")
    print(f"{'concurrency':>11} {'dispatcher':>11} {'http-only':>10} {'vs sync':>8} "
          f"{'vs http-only':>13}")
    for c in levels:
        print(f"{c:>11} {rates[c]:>11.0f} {ceiling[c]:>10.0f} {rates[c] / sync:>8.2f} "
              f"{rates[c] / ceiling[c]:>13.2f}")
    print("targets at concurrency 64: vs sync >= 5.0, vs http-only >= 0.5")


if __name__ == "__main__":
    main()

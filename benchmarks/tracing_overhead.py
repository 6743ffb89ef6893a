"""What tracing support costs when tracing is off: this checkout's Dispatcher vs another's.

    python benchmarks/tracing_overhead.py --baseline TREE [--jobs 4000] [--rounds 10]
                                          [--concurrency 64] [--http]

Each round runs the Dispatcher over a fresh queue file of ``--jobs`` jobs once per checkout,
each in a child process importing asnackq from its tree (``git worktree add /tmp/base
414ce2e``: the code before tracing support), in alternating order.  A child reports the
CPU seconds of its process per job
(``time.process_time``: what this code costs, less swayed by other processes on a shared
machine than wall time) and its jobs/s.  The send is an in-process coroutine answering True
at once (the Dispatcher's own path: queue, committer, delivery coroutines), or with
``--http`` the Dispatcher's ``AsyncHttpSender`` to a null HTTP server in a third process.
No tracer provider is configured in either child.  Printed: the medians and the median of
the paired ratios (this / baseline) with their range.  Target: within 2 %.
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
from sink_throughput import start, tree_env

from asnackq.aio import AsyncQueue, Dispatcher
from asnackq.core import worker as w

try:
    from asnackq.wire.send import AsyncHttpSender
except ImportError:  # a baseline tree from before the package's layers
    from asnackq.http_send import AsyncHttpSender  # type: ignore[import-not-found,no-redef]


async def null_send(event: dict[str, object], token: int | None) -> bool:
    return True


async def measure(path: Path, jobs: int, concurrency: int, url: str) -> tuple[float, float]:
    """(CPU seconds per job, jobs/s) of one Dispatcher run over ``jobs`` fresh jobs."""
    con = w.open_queue(path)
    try:
        prefill(con, jobs, 0, w.epoch_ms())
    finally:
        con.close()
    async with (
        AsyncQueue.open(path) as queue,
        AsyncHttpSender(url or "http://127.0.0.1:9/") as http,
    ):
        send = http if url else null_send
        cpu, wall = time.process_time(), time.perf_counter()
        summary = await Dispatcher(queue, send, owner="bench", concurrency=concurrency).run()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert summary.done == jobs, summary
    return cpu / jobs, jobs / wall


def child(tree: str | None, path: Path, jobs: int, concurrency: int, url: str) -> list[float]:
    command = [sys.executable, __file__, "--measure", str(path), str(jobs), str(concurrency), url]
    out = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a checkout without tracing support")
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--http", action="store_true", help="send over HTTP to a null server")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        path, jobs, concurrency, url = args.measure
        print(*asyncio.run(measure(Path(path), int(jobs), int(concurrency), url.strip("-"))))
        return
    got: dict[str, list[list[float]]] = {"this": [], "base": []}
    here = str(Path(__file__).with_name("sink_throughput.py"))
    null, url = start([sys.executable, here, "--serve-null"]) if args.http else (None, "-")
    try:
        with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
            for r in range(args.rounds):
                pair = [("this", None), ("base", args.baseline)]
                for name, tree in pair if r % 2 == 0 else pair[::-1]:
                    db = Path(tmp) / f"r{r}{name}.db"
                    got[name].append(child(tree, db, args.jobs, args.concurrency, url))
    finally:
        if null is not None:
            null.terminate()
            null.wait(timeout=30)
    report(got, args)


def report(got: dict[str, list[list[float]]], args: argparse.Namespace) -> None:
    print(
        f"{args.rounds} rounds of {args.jobs} jobs, concurrency {args.concurrency}, "
        f"send: {'HTTP to a null server' if args.http else 'in-process'}"
    )
    for i, what in ((0, "CPU us per job"), (1, "jobs/s")):
        scale = 1e6 if i == 0 else 1
        this = [run[i] * scale for run in got["this"]]
        base = [run[i] * scale for run in got["base"]]
        ratios = sorted(t / b for t, b in zip(this, base, strict=True))
        print(
            f"{what:>15}: this {median(this):9.1f}  baseline {median(base):9.1f}  "
            f"this/baseline {median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


if __name__ == "__main__":
    main()

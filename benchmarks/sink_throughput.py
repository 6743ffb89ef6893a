"""Requests/s of the sink (group commit) vs an HTTP-only ceiling and commit-per-request.

    python benchmarks/sink_throughput.py [--requests 2000] [--concurrency 1,16,64,256]
                                         [--rounds 1] [--baseline TREE]

Each server runs in its own process on 127.0.0.1 port 0 (the client in this one):
  ceiling   an aiohttp handler that validates the body and commits nothing
  sink      `asnackq sink` (group commit)
  per-req   `asnackq sink --batch-max 1` (one commit per request)
  base      with ``--baseline TREE``: `asnackq sink` importing asnackq from another checkout
            (``git worktree add /tmp/base <commit>``), the code a change is measured against
Every request carries a new id, so every request is an applied effect.  With ``--rounds``,
each round measures every server in turn (medians printed): all see the same machine.
Targets at concurrency 64: sink >= 0.6 x ceiling, sink >= 5 x per-request.

A second table gives each server's CPU per request: its process's user + system time
(every thread, from ``/proc/PID/stat``) over the requests of each measurement.  The client
runs in this process, so its share is not counted.  The CPU a request costs moves far less
with the machine than the rate does: at concurrency 1 a request's rate is its latency, which
moves with the disk's syncs and the scheduler's wakeups of the sink's threads.  The kernel
counts that time in clock ticks (10 ms): give each measurement enough requests (the default
2,000 at a few hundred us each) that a tick is a small part of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from statistics import median

import aiohttp
from aiohttp import web

from asnackq.core.worker import check_event

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
# ``python -m asnackq`` for a child that may import another tree (``tree_env``): ``-P`` keeps
# the working directory off the front of its ``sys.path``, where, run from a checkout's
# root, that checkout's asnackq would win over the tree's.  (A script's child, ``python
# FILE``, has the script's directory there, which holds no asnackq.)
ASNACKQ = [sys.executable, "-P", "-m", "asnackq"]


def serve_null() -> None:
    """The ceiling: parse and validate like the sink, answer like the sink, store nothing."""

    async def handler(request: web.Request) -> web.Response:
        event_id, _ = check_event(json.loads(await request.read()))
        return web.json_response({"id": event_id, "status": "applied"})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/events", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        print(f"null listening on http://127.0.0.1:{port}/events", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def start(command: list[str], tree: str | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start a server printing its URL; ``tree``: the checkout its asnackq is imported from."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=tree_env(tree))
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[-1]


def proc_stat(stat: Path) -> tuple[int, float]:
    """A process's parent pid and the user + system seconds it has used so far (every
    thread's), from its ``/proc/PID/stat``."""
    fields = stat.read_text().rsplit(")", 1)[1].split()  # (after the command's name)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S


def process_cpu_s(pid: int) -> float:
    """User + system seconds process ``pid`` has used so far, every thread's."""
    return proc_stat(Path(f"/proc/{pid}/stat"))[1]


def tree_env(tree: str | None) -> dict[str, str] | None:
    """The environment of a child importing asnackq from ``tree`` (None: this one's)."""
    return None if tree is None else {**os.environ, "PYTHONPATH": tree}


async def rate(post: Callable[[int], Awaitable[None]], requests: int, concurrency: int) -> float:
    """Requests/s of ``post(i)`` for each i < ``requests``, from ``concurrency`` coroutines."""
    ids = iter(range(requests))

    async def client() -> None:
        for i in ids:
            await post(i)

    start_at = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return requests / (time.perf_counter() - start_at)


async def load(url: str, requests: int, concurrency: int, prefix: str) -> float:
    """Requests/s for ``requests`` POSTs of new ids from ``concurrency`` coroutines."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(i: int) -> None:
            async with session.post(url, json={"id": f"{prefix}-{i}", "qty": 1}) as response:
                assert response.status == 200, await response.text()
                await response.read()

        return await rate(post, requests, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", help="a checkout of the code to compare with")
    parser.add_argument("--serve-null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_null:
        serve_null()
        return
    if args.requests < 1:
        raise SystemExit("--requests must be at least 1")
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        sink = [*ASNACKQ, "sink", "--db"]
        servers = {
            "ceiling": ([sys.executable, __file__, "--serve-null"], None),
            "sink": ([*sink, f"{tmp}/group.db"], None),
            "per-req": ([*sink, f"{tmp}/single.db", "--batch-max", "1"], None),
        }
        if args.baseline:
            servers["base"] = ([*sink, f"{tmp}/base.db"], args.baseline)
        results, cpu = measure(servers, levels, args.requests, args.rounds)
    report(results, levels)
    report_cpu(cpu, levels)


Servers = dict[str, tuple[list[str], str | None]]
Results = dict[str, dict[int, list[float]]]


def measure(
    servers: Servers, levels: list[int], requests: int, rounds: int
) -> tuple[Results, Results]:
    """Requests/s of each server at each level, ``rounds`` times, the servers in turn, and
    the CPU us per request of its process in each measurement."""
    results: Results = {name: {c: [] for c in levels} for name in servers}
    cpu: Results = {name: {c: [] for c in levels} for name in servers}
    procs = {name: start(command, tree) for name, (command, tree) in servers.items()}
    try:
        for _, url in procs.values():
            asyncio.run(load(url, 200, 16, "warm"))
        for r in range(rounds):
            for c in levels:
                for name, (proc, url) in procs.items():
                    before = process_cpu_s(proc.pid)
                    results[name][c].append(asyncio.run(load(url, requests, c, f"r{r}c{c}")))
                    used = process_cpu_s(proc.pid) - before
                    cpu[name][c].append(used / requests * 1e6)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(timeout=30)
    return results, cpu


def report(results: Results, levels: list[int]) -> None:
    names = list(results)
    ratios = ["sink/ceiling", "sink/per-req", *(["sink/base"] if "base" in results else [])]
    print(f"medians of {len(results['sink'][levels[0]])} rounds (ratio ranges in brackets)")
    print(f"{'concurrency':>11} " + " ".join(f"{n:>9}" for n in [*names, *ratios]))
    for c in levels:
        cells = [f"{median(results[n][c]):>9.0f}" for n in names]
        cells += [ratio(results, *name.split("/"), c) for name in ratios]
        print(f"{c:>11} " + " ".join(cells))
    print("targets at concurrency 64: sink/ceiling >= 0.60, sink/per-req >= 5.0")


def report_cpu(cpu: Results, levels: list[int]) -> None:
    names = [name for name in cpu if name != "ceiling"]
    ratios = ["sink/per-req", *(["sink/base"] if "base" in cpu else [])]
    print("CPU us per request of each server's process (medians; ratios: lower uses less)")
    print(f"{'concurrency':>11} " + " ".join(f"{n:>9}" for n in [*names, *ratios]))
    for c in levels:
        cells = [f"{median(cpu[n][c]):>9.0f}" for n in names]
        cells += [ratio(cpu, *name.split("/"), c) for name in ratios]
        print(f"{c:>11} " + " ".join(cells))


def ratio(results: Results, a: str, b: str, c: int) -> str:
    """The median of the per-round ratios a/b at concurrency c, and their range (a round
    whose b read 0, as a CPU time under one clock tick can, has none)."""
    pairs = zip(results[a][c], results[b][c], strict=True)
    ratios = sorted(x / y for x, y in pairs if y)
    if not ratios:
        return f"{'-':>9}"
    return f"{median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


if __name__ == "__main__":
    main()

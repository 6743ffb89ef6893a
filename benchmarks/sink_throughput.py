"""Requests/s of the sink (group commit) vs an HTTP-only ceiling and commit-per-request.

    python benchmarks/sink_throughput.py [--requests 2000] [--concurrency 1,16,64,256]

Each server runs in its own process on 127.0.0.1 port 0 (the client in this one):
  ceiling   an aiohttp handler that validates the body and commits nothing
  sink      `asnackq sink` (group commit)
  per-req   `asnackq sink --batch-max 1` (one commit per request)
Every request carries a new id, so every request is an applied effect.
Targets at concurrency 64: sink >= 0.6 x ceiling, sink >= 5 x per-request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from asnackq.core.worker import check_event


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


def start(command: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()[-1]


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
    parser.add_argument("--serve-null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_null:
        serve_null()
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=".") as tmp:
        servers = {
            "ceiling": [sys.executable, __file__, "--serve-null"],
            "sink": [sys.executable, "-m", "asnackq", "sink", "--db", f"{tmp}/group.db"],
            "per-req": [
                sys.executable,
                "-m",
                "asnackq",
                "sink",
                "--db",
                f"{tmp}/single.db",
                "--batch-max",
                "1",
            ],
        }
        results: dict[str, dict[int, float]] = {}
        for name, command in servers.items():
            proc, url = start(command)
            try:
                asyncio.run(load(url, 200, 16, "warm"))
                results[name] = {
                    c: asyncio.run(load(url, args.requests, c, f"c{c}")) for c in levels
                }
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    print(
        f"{'concurrency':>11} {'ceiling':>9} {'sink':>9} {'per-req':>9} "
        f"{'sink/ceiling':>13} {'sink/per-req':>13}"
    )
    for c in levels:
        ceiling, group, single = (results[n][c] for n in ("ceiling", "sink", "per-req"))
        print(
            f"{c:>11} {ceiling:>9.0f} {group:>9.0f} {single:>9.0f} "
            f"{group / ceiling:>13.2f} {group / single:>13.2f}"
        )
    print("targets at concurrency 64: sink/ceiling >= 0.60, sink/per-req >= 5.0")


if __name__ == "__main__":
    main()

"""The peers' side of ``pg_peers.py``: pgqueuer and procrastinate, each at its documented
defaults, run by the Python of a venv of their own (this file imports nothing of asnackq).

    PEER_PYTHON peer_workers.py fill  pgqueuer|procrastinate URL JOBS
    PEER_PYTHON peer_workers.py work  pgqueuer|procrastinate URL CONCURRENCY
    PEER_PYTHON peer_workers.py done  pgqueuer|procrastinate URL

``work`` prints ``ready``, waits for a line on stdin, processes no-op jobs until none is
left, and prints ``{"began", "ended"}`` (wall-clock seconds); ``done`` prints how many jobs
ended successfully.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

BATCH = 1000  # jobs per enqueue call when filling


async def ready() -> float:
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    return time.time()


# --- pgqueuer: asyncpg, PgQueuer, an entrypoint, qm.run(mode=drain) ----------------------


async def pgqueuer_fill(url: str, jobs: int) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    con = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(con))
        await queries.install()
        for start in range(0, jobs, BATCH):
            n = min(BATCH, jobs - start)
            await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
    finally:
        await con.close()


async def pgqueuer_work(url: str, concurrency: int) -> dict[str, float]:
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.models import Job

    con = await asyncpg.connect(url)
    try:
        pgq = PgQueuer(AsyncpgDriver(con))

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            return None

        began = await ready()
        await pgq.qm.run(mode=QueueExecutionMode.drain, max_concurrent_tasks=concurrency)
        return {"began": began, "ended": time.time()}
    finally:
        await con.close()


async def pgqueuer_done(url: str) -> int:
    import asyncpg

    con = await asyncpg.connect(url)
    try:
        left = await con.fetchval("SELECT count(*) FROM pgqueuer")
        logged = await con.fetchval("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'")
        stats = await con.fetchval(
            "SELECT coalesce(sum(count), 0) FROM pgqueuer_statistics WHERE status = 'successful'"
        )
        return -1 if left else int(logged) + int(stats)
    finally:
        await con.close()


# --- procrastinate: psycopg's connector, a task, run_worker_async(wait=False) -----------


def procrastinate_app(url: str, concurrency: int) -> Any:
    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=url, min_size=4, max_size=concurrency + 4)
    )

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


async def procrastinate_fill(url: str, jobs: int) -> None:
    app = procrastinate_app(url, 4)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        task = app.tasks["noop"]
        for start in range(0, jobs, BATCH):
            await task.batch_defer_async(*({} for _ in range(start, min(jobs, start + BATCH))))


async def procrastinate_work(url: str, concurrency: int) -> dict[str, float]:
    app = procrastinate_app(url, concurrency)
    async with app.open_async():
        began = await ready()
        await app.run_worker_async(concurrency=concurrency, wait=False, listen_notify=False)
        return {"began": began, "ended": time.time()}


async def procrastinate_done(url: str) -> int:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url) as con:
        cur = await con.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def main() -> None:
    verb, peer, url, *rest = sys.argv[1:]
    run = globals()[f"{peer}_{verb}"]
    result = asyncio.run(run(url, *map(int, rest)))
    if result is not None:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

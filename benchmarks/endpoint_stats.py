"""What each endpoint's figures cost ``asnackq stats`` and the dashboard on a large backlog.

    python benchmarks/endpoint_stats.py [--backlog 50000] [--done 50000] [--rounds 7]
                                        [--dir DIR] [--pg]

Three endpoints: A holds ``--backlog`` pending deliveries, B 200, C ``--done`` done ones
(every delivery made by the product's intake, ``AsyncQueue.enqueue_many``).  Printed: the
median and the fastest milliseconds over ``--rounds`` of every endpoint's figures
(``ops.per_endpoint.plan_endpoints``) and of the whole of ``ops.stats`` (which includes
them), each on a read-only connection as the commands open one.  ``--pg``: the same on a
throwaway local PostgreSQL server (after VACUUM ANALYZE, as autovacuum would leave it).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import psycopg

from asnackq.aio import AsyncQueue
from asnackq.core import worker as w
from asnackq.core.endpoints import Endpoint
from asnackq.ops import per_endpoint, queries
from asnackq.store import readers, reads
from asnackq.store.targets import is_url

CHUNK = 5000


async def fill(where: str, backlog: int, done: int) -> None:
    """The three endpoints and their deliveries; C's marked done."""
    async with AsyncQueue.open(where) as queue:
        for name in ("a", "b", "c"):
            url = f"http://127.0.0.1:9/{name}"
            await queue.add_endpoint(Endpoint(name, url, types=(f"{name}.x",)))
        for name, n in (("a", backlog), ("b", 200), ("c", done)):
            for start in range(0, n, CHUNK):
                events = [
                    {"id": f"{name}{i}", "type": f"{name}.x", "data": i}
                    for i in range(start, min(n, start + CHUNK))
                ]
                await queue.enqueue_many(events)
    mark_done = (
        "UPDATE jobs SET status = 'done' WHERE id IN"
        " (SELECT job FROM asnackq_deliveries WHERE endpoint = 'c')"
    )
    if is_url(where):
        with psycopg.connect(where, autocommit=True) as con:
            con.execute(mark_done)
            con.execute("VACUUM ANALYZE")
    else:
        con = w.open_queue(where)
        with con:
            con.execute(mark_done)
        con.close()


def timed(where: str, rounds: int) -> None:
    on_sqlite = not is_url(where)
    now = w.epoch_ms()
    reads_: dict[str, Callable[[], w.Plan[Any]]] = {
        "every endpoint's figures": lambda: per_endpoint.plan_endpoints(now, on_sqlite),
        "the whole of stats": lambda: queries.plan_stats(now, on_sqlite),
    }
    for what, make in reads_.items():
        took = []
        for _ in range(rounds):
            with readers.read_only(where, "jobs") as con:
                started = time.perf_counter()
                reads.run(con, make())
                took.append((time.perf_counter() - started) * 1000)
        print(
            f"{'PostgreSQL' if not on_sqlite else 'SQLite'}: {what}: median "
            f"{median(took):.1f} ms, fastest {min(took):.1f} ms ({rounds} rounds)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=50_000, help="A's pending deliveries")
    parser.add_argument("--done", type=int, default=50_000, help="C's done deliveries")
    parser.add_argument("--rounds", type=int, default=7, help="readings of each")
    parser.add_argument("--dir", type=Path, default=None, help="where the queue file goes")
    parser.add_argument("--pg", action="store_true", help="on a local PostgreSQL server too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        where = str(Path(folder) / "queue.db")
        asyncio.run(fill(where, args.backlog, args.done))
        timed(where, args.rounds)
    if args.pg:
        from asnackq.lab.pg_server import DURABLE, local_server

        with local_server(DURABLE) as server:
            with psycopg.connect(server.url(), autocommit=True) as admin:
                admin.execute("CREATE DATABASE endpoint_stats")
            where = server.url("endpoint_stats")
            asyncio.run(fill(where, args.backlog, args.done))
            timed(where, args.rounds)


if __name__ == "__main__":
    main()

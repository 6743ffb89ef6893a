"""``asnackq demo``: a worker dies right after a send; another process recovers its jobs.

Everything is embedded: a temporary directory, ``asnackq sink`` on a loopback port 0, and
two worker processes running a Dispatcher each.  Worker ``alpha`` exits hard (``os._exit``)
right after its 40th verified ACK, leaving its in-flight jobs leased - some of them already
applied at the sink.  Worker ``bravo`` reclaims them when their leases expire and re-sends;
the sink's inbox absorbs the duplicates.  The report shows how far the evidence reaches.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asnackq import ops
from asnackq.aio import AsyncQueue
from asnackq.dispatch import Dispatcher
from asnackq.http_send import AsyncHttpSender
from asnackq.procs import sink_process, sink_stats

JOBS = 300
LEASE_MS = 2000
DIE_AFTER = 40


async def work(db: str, url: str, owner: str, die_after: int) -> None:
    """A worker process: deliver until the queue is empty, or die after ``die_after`` ACKs."""
    acks = 0
    async with AsyncQueue.open(db) as queue, AsyncHttpSender(url, timeout_s=1.0) as http:
        async def send(event: dict[str, Any], token: int) -> object:
            nonlocal acks
            answer = await http(event, token)
            acks += 1
            if acks == die_after:
                os._exit(9)                 # the effect is applied; the finish never happens
            return answer

        summary = await Dispatcher(queue, send, owner=owner, concurrency=32,
                                   lease_ms=LEASE_MS).run(until_empty=True)
    print(json.dumps(summary.as_dict()), flush=True)


def enqueue_jobs(db: Path) -> dict[str, int]:
    qty = {f"snack-{i:03d}": i % 9 + 1 for i in range(JOBS)}
    ops.enqueue_all(db, [({"id": job_id, "qty": n}, 60_000, 5) for job_id, n in qty.items()])
    return qty


def wait_for_effects(url: str, count: int, timeout_s: float = 60) -> None:
    """Poll the sink (bounded) until ``count`` effects were applied."""
    give_up = time.monotonic() + timeout_s
    while sink_stats(url)["applied"] < count:
        if time.monotonic() > give_up:
            raise RuntimeError(f"the sink applied fewer than {count} effects in {timeout_s}s")
        time.sleep(0.02)


def worker_process(db: Path, url: str, owner: str, die_after: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "asnackq.demo", str(db), url, owner,
                             str(die_after)], stdout=subprocess.PIPE, text=True)


def report(db: Path, sink_db: Path, stats: dict[str, int], qty: dict[str, int],
           died: int, seconds: float) -> bool:
    con = sqlite3.connect(db)
    states = dict(con.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall())
    recovered = con.execute("SELECT count(*) FROM jobs WHERE status = 'done' AND token > 1"
                            ).fetchone()[0]
    con.close()
    sink = sqlite3.connect(sink_db)
    inbox = dict(sink.execute("SELECT id, qty FROM inbox").fetchall())
    twice = sink.execute("SELECT count(*) FROM inbox WHERE deliveries > 1").fetchone()[0]
    stock = sink.execute("SELECT total FROM stock").fetchone()[0]
    sink.close()
    once = inbox == qty and stock == sum(qty.values())
    table = Table(title=f"asnackq demo: {JOBS} jobs, 2 worker processes, 1 killed after a send")
    table.add_column("evidence")
    table.add_column("value", justify="right")
    for label, value in [
        ("HTTP requests at the sink", stats["requests"]),
        ("effects applied (inbox rows)", stats["applied"]),
        ("duplicates absorbed by the inbox", stats["duplicates"]),
        ("ids delivered more than once", twice),
        ("worker alpha exit code (killed after a send)", died),
        ("jobs recovered by bravo (token > 1, done)", recovered),
        ("final states", ", ".join(f"{k} {v}" for k, v in sorted(states.items()))),
        ("stock at the sink / sum of job qty", f"{stock} / {sum(qty.values())}"),
        ("every id's effect applied exactly once", "yes" if once else "NO"),
        ("seconds", f"{seconds:.1f}"),
    ]:
        table.add_row(label, str(value))
    Console().print(table)
    return once and states.get("done", 0) == JOBS


def main() -> int:
    """Run the demo; exit code 0 when every job is done and every effect applied once."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="asnackq-demo-") as tmp:
        root = Path(tmp)
        qty = enqueue_jobs(root / "queue.db")
        procs: list[subprocess.Popen[str]] = []
        with sink_process(root / "sink.db") as url:
            try:
                alpha = worker_process(root / "queue.db", url, "alpha", DIE_AFTER)
                procs.append(alpha)
                wait_for_effects(url, DIE_AFTER // 2)   # alpha is well under way: it will die
                bravo = worker_process(root / "queue.db", url, "bravo", 0)
                procs.append(bravo)
                died = alpha.wait(timeout=60)
                bravo.communicate(timeout=120)
                stats = sink_stats(url)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.terminate()
                    proc.wait(timeout=30)
                    if proc.stdout is not None:
                        proc.stdout.close()
        ok = report(root / "queue.db", root / "sink.db", stats, qty, died,
                    time.perf_counter() - started)
    return 0 if ok else 1


if __name__ == "__main__":
    asyncio.run(work(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))

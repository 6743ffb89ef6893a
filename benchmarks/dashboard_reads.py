"""What the dashboard's reads cost on a large queue file: one sample (stats, the latest
redrives, leases by owner), done per minute over the last hour, and one job's story.

    python benchmarks/dashboard_reads.py [--done 1000000] [--within-hour 0.1] [--leased 1000]
                                         [--owners 20] [--rounds 7] [--dir DIR]

The queue holds ``--done`` done jobs (a ``--within-hour`` share of them finished in the last
hour, the rest a day before), ``--leased`` jobs leased by ``--owners`` owners, and a trace
table.  Prints the median milliseconds of each read over ``--rounds`` (each on a fresh
read-only connection, as the dashboard opens them), and how often the watcher would read
the hour's chart (ten times its duration, at least every second, at most every minute).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asnackq import ops
from asnackq.core import worker as w
from asnackq.ops import inspect, watcher
from asnackq.store import readers

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def fill(path: Path, done: int, within_hour: float, leased: int, owners: int, now: int) -> None:
    """The queue, written in one transaction with plain INSERTs (the reads do not care how)."""
    con = w.open_queue(path)
    recent = int(done * within_hour)
    rows = (
        (f"d-{i}", "done", 1, 1, now - (i % HOUR_MS if i < recent else DAY_MS + i), now + DAY_MS)
        for i in range(done)
    )
    live = (
        (f"l-{i}", "leased", 1, 1, now, now + DAY_MS, f"owner-{i % owners}", now + 30_000)
        for i in range(leased)
    )
    con.execute("BEGIN IMMEDIATE")
    con.executemany(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) VALUES (?, 1, ?, ?, 5, ?, ?, ?)",
        rows,
    )
    con.executemany(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline, owner, lease_until) VALUES (?, 1, ?, ?, 5, ?, ?, ?, ?, ?)",
        live,
    )
    con.execute("CREATE TABLE asnackq_job_traces (job_id TEXT PRIMARY KEY, traceparent TEXT)")
    con.execute(
        "INSERT INTO asnackq_job_traces VALUES ('d-7', ?)",
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",),
    )
    con.execute("COMMIT")
    con.close()


def median_ms(path: Path, read: Callable[[Any], object], rounds: int) -> float:
    """The median time of ``read(con)`` on a fresh read-only connection, open included."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        with readers.read_only(path, "jobs") as con:
            read(con)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--done", type=int, default=1_000_000)
    parser.add_argument("--within-hour", type=float, default=0.1)
    parser.add_argument("--leased", type=int, default=1000)
    parser.add_argument("--owners", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args()
    now = w.epoch_ms()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "queue.db"
        fill(path, args.done, args.within_hour, args.leased, args.owners, now)
        reads: dict[str, Callable[[Any], object]] = {
            "stats (each sample)": lambda con: ops.stats(con, now),
            "leases by owner (each sample)": lambda con: inspect.leases(con, now),
            "sample in all (stats, redrives, leases)": lambda con: watcher.read_queue(con, now),
            "done per minute, last hour": lambda con: inspect.done_per_minute(con, now),
            "one job's story (row, redrives, trace)": lambda con: inspect.job_story(
                con, "d-7", now
            ),
        }
        print(
            f"{args.done:,} done ({args.within_hour:.0%} in the last hour), {args.leased:,} leased"
        )
        for name, read in reads.items():
            print(f"  {name:42} {median_ms(path, read, args.rounds):9.1f} ms")
        hour = median_ms(path, reads["done per minute, last hour"], args.rounds) / 1000
        every = min(max(watcher.SAMPLE_S, 10 * hour), watcher.MAX_AUDIT_GAP_S)
        print(f"  the hour's chart read every {every:.1f} s")


if __name__ == "__main__":
    main()

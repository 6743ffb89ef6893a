"""PostgreSQL: asnackq's queue beside the Python PostgreSQL queues, on one throwaway server.

    python benchmarks/pg_peers.py [--url postgresql://...] [--jobs 5000] [--concurrency 64]
                                  [--rounds 5] [--peers pgqueuer,procrastinate]
                                  [--peers-venv DIR] [--analyze]

The peers run from a venv of their own (``--peers-venv``, made and filled from PyPI when
absent: pgqueuer with asyncpg, procrastinate with psycopg), never from asnackq's; their side
is ``peer_workers.py``.  Each round measures every system back to back, in a rotated order,
each in a fresh database: ``--jobs`` no-op jobs enqueued first, then one worker process at
``--concurrency`` (asnackq: a Dispatcher whose send returns True at once; pgqueuer:
``QueueManager.run(mode=drain, max_concurrent_tasks=C)`` with an entrypoint that returns;
procrastinate: ``run_worker_async(concurrency=C, wait=False)`` with a task that returns),
otherwise each at its documented defaults.  jobs/s = jobs / (end - start), every worker
starting after it has connected; each run checks every job ended successfully.
``--analyze``: each system's database is analyzed after its fill, before its clock starts
(the statistics autovacuum takes on a server that has been running; without it the planner
plans for tables it has no statistics of).  Printed: the medians and, per peer, the median
of the per-round ratios with their range.
Target (issue #37): asnackq >= 3 x the fastest peer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path
from statistics import median

from pg_queue import analyzed, database, queue_only, rate, run_children, show_settings

from asnackq.lab.pg_server import DURABLE, local_server

PEERS = {
    "pgqueuer": ("pgqueuer", "asyncpg"),
    "procrastinate": ("procrastinate", "psycopg[binary]"),
}
WORKERS = Path(__file__).with_name("peer_workers.py")


def peer_python(root: Path, peers: list[str]) -> Path:
    """The venv's Python, with each peer's packages installed in it."""
    python = root / "bin" / "python"
    if not python.exists():
        venv.create(root, with_pip=True)
    for peer in peers:
        module = PEERS[peer][0]
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
        if found.returncode:
            subprocess.run([python, "-m", "pip", "install", "-q", *PEERS[peer]], check=True)
    return python


def peer_run(
    python: Path, peer: str, admin: str, jobs: int, concurrency: int, analyze: bool
) -> float:
    with database(admin, f"bench_{peer}") as url:
        subprocess.run([python, WORKERS, "fill", peer, url, str(jobs)], check=True)
        if analyze:
            analyzed(url)
        reports = run_children([[str(python), str(WORKERS), "work", peer, url, str(concurrency)]])
        done = subprocess.run(
            [python, WORKERS, "done", peer, url], check=True, capture_output=True, text=True
        )
        if int(done.stdout) != jobs:
            raise RuntimeError(f"{peer}: {done.stdout.strip()} of {jobs} jobs ended successfully")
    return rate(reports, jobs)


def measure(admin: str, args: argparse.Namespace, python: Path) -> None:
    show_settings(admin)
    systems = ["asnackq", *args.peers]
    rates: dict[str, list[float]] = {name: [] for name in systems}
    for n in range(args.rounds):
        for name in systems[n % len(systems) :] + systems[: n % len(systems)]:
            if name == "asnackq":
                rates[name].append(queue_only(admin, args.jobs, 1, args.concurrency, args.analyze))
            else:
                rates[name].append(
                    peer_run(python, name, admin, args.jobs, args.concurrency, args.analyze)
                )
        print(f"round {n + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()))
    print(
        f"{args.jobs} no-op jobs, one worker process at concurrency {args.concurrency}, "
        f"{'analyzed tables, ' if args.analyze else ''}"
        f"medians of {args.rounds} rounds (per-round ratio ranges in brackets)"
    )
    for name in args.peers:
        ratios = sorted(a / p for a, p in zip(rates["asnackq"], rates[name], strict=True))
        print(
            f"asnackq {median(rates['asnackq']):.0f} jobs/s, {name} {median(rates[name]):.0f}: "
            f"{median(ratios):.2f} x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        )
    print("target: asnackq >= 3 x the fastest peer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a server to use (a superuser URL: it creates databases)")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peers", default="pgqueuer,procrastinate")
    parser.add_argument(
        "--analyze", action="store_true", help="analyze each system's tables before its clock"
    )
    parser.add_argument(
        "--peers-venv", type=Path, default=Path.home() / ".cache" / "asnackq-bench" / "peers"
    )
    args = parser.parse_args()
    args.peers = [p for p in args.peers.split(",") if p]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        sys.exit(f"unknown peers: {', '.join(unknown)} (known: {', '.join(PEERS)})")
    python = peer_python(args.peers_venv, args.peers)
    if args.url:
        measure(args.url, args, python)
        return
    with local_server(DURABLE) as server:
        measure(server.url(), args, python)


if __name__ == "__main__":
    main()

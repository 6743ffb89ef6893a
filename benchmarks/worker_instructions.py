"""Instructions per job of a Dispatcher's worker: a count that does not move with the machine.

    python benchmarks/worker_instructions.py [--jobs 12000] [--base-jobs 2000]
                                             [--store pg,sqlite] [--baseline TREE]

The worker is ``cpu_per_job.py``'s: one process, a Dispatcher whose send answers True at
once, concurrency 64, a 10 s lease, over a queue filled beforehand (a fresh database on a
throwaway local PostgreSQL 15, or a file) until it is empty.  It runs under
``valgrind --tool=callgrind`` (``apt-get install valgrind``), which counts the instructions
the process runs: its start, imports and connect cost the same for any number of jobs, so
the count per job is the difference between a run of ``--jobs`` and one of
``--base-jobs``, over the difference in jobs.  Two runs of the same code agree within a
fraction of a percent, so a change of a few percent shows in one run, where the CPU time
of ``cpu_per_job.py`` moves by a tenth from round to round.

Instructions are not time: a system call, a cache miss or a page fault counts once here,
and a database's own process (PostgreSQL's server) is not counted at all.  The CPU figures
of the issue are ``cpu_per_job.py``'s; this is the instrument that shows where a change
moved them.  ``--baseline TREE`` (``git worktree add /tmp/base <commit>``) counts that
tree's worker on the same kind of queue, filled by this tree, and prints the ratio.
A run under callgrind is some 50 times slower: the default counts take about a minute per
tree and store.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pg_queue import database, fill
from sink_throughput import tree_env

from asnackq.lab.pg_server import DURABLE, local_server

WORKER = """
import asyncio, sys
from asnackq.aio import AsyncQueue, Dispatcher

async def null(event, token):
    return True

async def main(target):
    async with AsyncQueue.open(target) as queue:
        summary = await Dispatcher(
            queue, null, owner="bench", concurrency=64, lease_ms=10_000
        ).run(until_empty=True)
    print("done", summary.done)

asyncio.run(main(sys.argv[1]))
"""
COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(target: str, jobs: int, tree: str | None, out: Path) -> int:
    """The instructions one worker process runs to deliver the ``jobs`` of ``target``."""
    run = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-P",  # (the working directory off sys.path: the tree's asnackq, not its own)
            "-c",
            WORKER,
            target,
        ],
        capture_output=True,
        text=True,
        env=tree_env(tree),
        check=True,
    )
    if f"done {jobs}" not in run.stdout:
        raise SystemExit(f"the worker did not deliver {jobs} jobs: {run.stdout!r}")
    found = COLLECTED.search(run.stderr)
    if found is None:
        raise SystemExit(f"no instruction count from valgrind: {run.stderr[-400:]!r}")
    return int(found.group(1))


def per_job(
    store: str, counts: tuple[int, int], tree: str | None, scratch: Path, admin: str
) -> float:
    """Instructions per job of the worker of ``tree`` on ``store`` (``admin``: the server's
    URL): the difference of its two runs over the difference in jobs."""
    ran = []
    for jobs in counts:
        if store == "pg":
            with database(admin, "asnackq_instructions") as target:
                fill(target, jobs, "p")
                ran.append(instructions(target, jobs, tree, scratch / "callgrind.out"))
        else:
            path = scratch / f"queue-{jobs}.db"
            path.unlink(missing_ok=True)
            fill(path, jobs, "s")
            ran.append(instructions(str(path), jobs, tree, scratch / "callgrind.out"))
    return (ran[1] - ran[0]) / (counts[1] - counts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=12_000)
    parser.add_argument("--base-jobs", type=int, default=2_000)
    parser.add_argument("--store", default="pg,sqlite")
    parser.add_argument("--baseline", help="a checkout of other code to compare with")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is needed: apt-get install valgrind")
    if not 0 < args.base_jobs < args.jobs:
        raise SystemExit("--base-jobs must be above 0 and below --jobs")
    counts = (args.base_jobs, args.jobs)
    stores = [store for store in args.store.split(",") if store]
    if not stores or not set(stores) <= {"pg", "sqlite"}:
        raise SystemExit("--store takes pg, sqlite or both")
    with local_server(DURABLE) as server, tempfile.TemporaryDirectory() as scratch:
        for store in stores:
            this = per_job(store, counts, None, Path(scratch), server.url())
            line = f"{store}: {this:,.0f} instructions a job"
            if args.baseline:
                base = per_job(store, counts, args.baseline, Path(scratch), server.url())
                line += f"; baseline {base:,.0f}; this / baseline {this / base:.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()

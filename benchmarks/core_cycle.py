"""Claim+finish cycle of the sync core against the raw SQLite commit rate, in one run.

    python benchmarks/core_cycle.py [--jobs 2000] [--history 1000000] [--dir DIR]
                                    [--baseline TREE] [--rounds 6]

All files live in one temporary directory (on the file system of --dir, default: the
current directory), with journal_mode=DELETE and synchronous=FULL throughout.
Prints jobs/s and the ratios the core issue targets:
  cycle / raw commit rate        >= 0.40  (two commits per job make 0.5 the ceiling)
  cycle with history / without   >= 0.90  (claims must not slow down with finished rows)

``--baseline TREE`` (``git worktree add /tmp/base 874950c``) compares this checkout's cycle
with another's instead: each round measures both, each in a child process importing
``asnackq.core.worker`` from its tree, in alternating order, with ``synchronous=FULL`` and
with ``synchronous=OFF`` (no fsync: what the statements cost in CPU).  Printed: the medians,
the median of the paired ratios (this / baseline) with their range, and each cycle against
the raw commit rate measured in the same run.
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from sink_throughput import tree_env

from asnackq.core import worker as w

T0 = 1_700_000_000_000


def raw_commit_rate(path: Path, commits: int) -> float:
    """Commits/s of `BEGIN IMMEDIATE; UPDATE one row; COMMIT` with the core's settings."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE t (x INTEGER)")
    con.execute("INSERT INTO t VALUES (0)")
    start = time.perf_counter()
    for _ in range(commits):
        con.execute("BEGIN IMMEDIATE")
        con.execute("UPDATE t SET x = x + 1")
        con.execute("COMMIT")
    elapsed = time.perf_counter() - start
    con.close()
    return commits / elapsed


def prefill(
    con: sqlite3.Connection, jobs: int, history: int, now: int = T0, prefix: str = "job"
) -> None:
    """``history`` done rows, then ``jobs`` pending rows from ``now``, in one transaction."""
    con.execute("BEGIN IMMEDIATE")
    con.executemany(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) VALUES (?, 1, 'done', 1, 3, 1, ?, ?)",
        ((f"old-{i}", now, now + 60_000) for i in range(history)),
    )
    con.executemany(
        "INSERT INTO jobs (id, qty, status, attempts, max_attempts, token, available_at,"
        " deadline) VALUES (?, 1, 'pending', 0, 3, 0, ?, ?)",
        ((f"{prefix}-{i}", now, now + 60_000) for i in range(jobs)),
    )
    con.execute("COMMIT")


def cycle_rate(path: Path, jobs: int, history: int, synchronous: str = "FULL") -> float:
    """Jobs/s of claim + finish('ok'), one transaction each, over ``jobs`` pending jobs."""
    con = w.open_queue(path)
    con.execute(f"PRAGMA synchronous={synchronous}")
    prefill(con, jobs, history)
    start = time.perf_counter()
    for _ in range(jobs):
        ticket = w.claim(con, "bench", T0 + 1)
        assert ticket is not None
        assert w.finish(con, ticket, "ok", T0 + 2) == "done"
    elapsed = time.perf_counter() - start
    assert w.claim(con, "bench", T0 + 1) is None
    con.close()
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--baseline", help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=6, help="rounds with --baseline")
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        path, jobs, synchronous = args.measure
        print(cycle_rate(Path(path), int(jobs), 0, synchronous))
        return
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        raw = raw_commit_rate(root / "raw.db", args.jobs * 2)
        if args.baseline:
            compare(root, raw, args)
            return
        empty = cycle_rate(root / "empty.db", args.jobs, 0)
        full = cycle_rate(root / "history.db", args.jobs, args.history)
    print(f"file system of:              {Path(args.dir).resolve()}")
    print(f"raw commit rate:             {raw:10.0f} commits/s")
    print(f"claim+finish, empty history: {empty:10.0f} jobs/s")
    print(f"claim+finish, {args.history:,} done:  {full:10.0f} jobs/s")
    print(f"cycle / raw commit rate:     {empty / raw:10.3f}   (target >= 0.40, ceiling 0.5)")
    print(f"history / empty:             {full / empty:10.3f}   (target >= 0.90)")


def child(tree: str | None, path: Path, jobs: int, synchronous: str) -> float:
    """The cycle rate of the code in ``tree`` (None: this checkout), in a child process."""
    command = [sys.executable, __file__, "--measure", str(path), str(jobs), synchronous]
    out = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True, check=True)
    return float(out.stdout)


def compare(root: Path, raw: float, args: argparse.Namespace) -> None:
    """Rounds of this checkout's cycle and the baseline's, alternated; the report."""
    print(f"raw commit rate: {raw:.0f} commits/s; {args.rounds} rounds of {args.jobs} jobs")
    for synchronous in ("FULL", "OFF"):
        got: dict[str, list[float]] = {"this": [], "base": []}
        for r in range(args.rounds):
            pair = [("this", None), ("base", args.baseline)]
            for name, tree in pair if r % 2 == 0 else pair[::-1]:
                path = root / f"{synchronous}-{r}-{name}.db"
                got[name].append(child(tree, path, args.jobs, synchronous))
        ratios = sorted(t / b for t, b in zip(got["this"], got["base"], strict=True))
        this, base = median(got["this"]), median(got["base"])
        print(
            f"synchronous={synchronous:4}: this {this:7.0f} jobs/s ({this / raw:.2f} x raw), "
            f"baseline {base:7.0f} ({base / raw:.2f} x raw); this/baseline "
            f"{median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


if __name__ == "__main__":
    main()

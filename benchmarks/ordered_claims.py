"""What an ordered lane's claim costs against an unordered lane's, in one run (SQLite).

    python benchmarks/ordered_claims.py [--keys 500] [--per-key 20] [--batch 64]
                                        [--held 10000] [--history 10000] [--rounds 5] [--dir DIR]

Each figure is jobs/s of claim ``--batch`` + finish them ok, one transaction each, until the
lane is drained, timed by this process's CPU (``synchronous=OFF``: the statements' cost, which
a busy machine does not stretch); rounds alternate; printed: medians and the median ratio.

1. *Spread*: ``--keys`` keys x ``--per-key`` events, interleaved, drained in the ordered lane
   against the same queue drained in the endpoint's unordered lane.
2. *Held*: 2,000 deliveries of other keys enqueued after ``--held`` pending deliveries of one
   key whose head is leased elsewhere: each claim reads past the held ones (the test per row
   is a look-up), against the same 2,000 with nothing held.
3. *History*: one key's 200 deliveries, one at a time, after ``--history`` done deliveries of
   the same key (the test reads a key's stored deliveries: purged ones are not read), against
   none done.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import median

from asnackq.core import events as ev
from asnackq.core import lanes
from asnackq.core import worker as w

T0 = 1_700_000_000_000
ORDERED, UNORDERED = lanes.Lane("o", ordered=True), lanes.Lane("o")
Run = Callable[[int], float]  # round number -> jobs/s


def queue(path: Path, keys: Iterable[str | None], done: int = 0) -> sqlite3.Connection:
    """A queue whose endpoint "o" has a delivery per item of ``keys`` (in order), the first
    ``done`` of them done."""
    con = w.open_queue(path)
    con.execute("PRAGMA synchronous=OFF")
    w.drive(con, w.plan_schema(ev.SCHEMA))
    con.execute("BEGIN IMMEDIATE")
    rows = [(lanes.delivery_id("o", n), key) for n, key in enumerate(keys, 1)]
    con.executemany(w.SQL_INSERT_JOB, ((job, 1, 5, T0, T0 + 3_600_000) for job, _ in rows))
    con.executemany(ev.SQL_INSERT_DELIVERY, ((job, job, "o", key) for job, key in rows))
    con.executemany("UPDATE jobs SET status = 'done' WHERE id = ?", ((j,) for j, _ in rows[:done]))
    con.execute("COMMIT")
    return con


def drain(con: sqlite3.Connection, lane: lanes.Lane, batch: int) -> float:
    """Jobs/s (CPU) of claims of ``batch`` in ``lane``, each finished ok, until none is left."""
    count, start = 0, time.process_time()
    while True:
        plan = w.plan_claim_many("bench", T0 + 1, 60_000, batch, limits=w.PRODUCT)
        tickets: list[w.Ticket] = w.drive(con, lanes.substituted(plan, lane))
        if not tickets:
            break
        w.finish_many(con, [(t, "ok", T0 + 2, 0) for t in tickets])
        count += len(tickets)
    return count / (time.process_time() - start)


def hold_head(con: sqlite3.Connection) -> None:
    """Lease the first delivery (the held key's head) to another worker."""
    w.claim_many(con, "elsewhere", T0 + 1, 60_000, 1)


def compare(name: str, rounds: int, runs: dict[str, Run]) -> None:
    got: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(rounds):
        for label in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            got[label].append(runs[label](r))
    (a, first), (b, second) = got.items()
    ratios = sorted(x / y for x, y in zip(first, second, strict=True))
    print(
        f"{name}: {a} {median(first):7.0f} jobs/s, {b} {median(second):7.0f}; "
        f"ratio {median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}), {rounds} rounds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--per-key", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--held", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args()
    spread = [f"k{i}" for i in range(args.keys) for _ in range(args.per_key)]
    random.Random(1).shuffle(spread)
    others = [f"k{i % 500}" for i in range(2000)]
    with tempfile.TemporaryDirectory(prefix="asnackq-bench-", dir=args.dir) as tmp:
        root = Path(tmp)

        def spread_in(lane: lanes.Lane) -> Run:
            return lambda r: drain(
                queue(root / f"s-{r}-{lane.ordered}.db", spread), lane, args.batch
            )

        def held(count: int) -> Run:
            def run(r: int) -> float:
                con = queue(root / f"h-{r}-{count}.db", ["hot"] * count + others)
                if count:
                    hold_head(con)
                return drain(con, ORDERED, args.batch)

            return run

        def history(done: int) -> Run:
            keys = ["one"] * (done + 200)
            return lambda r: drain(queue(root / f"y-{r}-{done}.db", keys, done), ORDERED, 1)

        compare(
            "spread",
            args.rounds,
            {"ordered": spread_in(ORDERED), "unordered": spread_in(UNORDERED)},
        )
        compare(f"held {args.held:,}", args.rounds, {"held": held(args.held), "none held": held(0)})
        compare(
            f"history {args.history:,}",
            args.rounds,
            {"history": history(args.history), "none": history(0)},
        )


if __name__ == "__main__":
    main()

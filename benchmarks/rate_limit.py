"""A send rate shared by three worker processes, as the sink sees it, in one run.

    python benchmarks/rate_limit.py [--rate 200] [--seconds 20] [--workers 3] [--burst 1]
                                    [--queue postgresql://... | --pg-local] [--dir DIR]

Fills a queue (a file in a temporary directory under --dir, --queue's database, which
must be empty, or with --pg-local a throwaway local PostgreSQL server's, durable settings)
with rate x seconds jobs, runs ``asnackq work --rate R --until-empty`` in
--workers processes against the project's sink (noting each request's arrival), and prints
the most requests in any one-second window after the first second and the mean rate, each
divided by R, with the issue's verdicts:
  max window / R   <= 1.1
  mean / R         >= 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from asnackq.lab.pace import CAP_SHARE, KEEP_SHARE, fill, paced_run
from asnackq.lab.pg_server import local_server


async def main(args: argparse.Namespace) -> int:
    jobs = round(args.rate * args.seconds)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        queue = args.queue or Path(scratch) / "queue.db"
        await fill(queue, jobs)
        run = await paced_run(
            queue,
            Path(scratch) / "sink.db",
            args.rate,
            [("--lease-ms", "5000")] * args.workers,
            burst=args.burst,
            timeout_s=args.seconds * 3 + 60,
        )
    judged = run.pace.as_dict()
    done = sum(summary.get("done", 0) for summary in run.summaries)
    print(json.dumps({**judged, "jobs": jobs, "done": done, "codes": run.codes}))
    print(
        f"rate {args.rate:g}/s over {args.workers} workers, {judged['seconds']:.1f} s judged: "
        f"max window / R {judged['max_window_per_rate']:.3f} (<= {CAP_SHARE}: "
        f"{'ok' if run.pace.capped else 'FAIL'}), mean / R {judged['mean_per_rate']:.3f} "
        f"(>= {KEEP_SHARE}: {'ok' if run.pace.kept else 'FAIL'}), done {done}/{jobs}"
    )
    return 0 if run.pace.capped and run.pace.kept and done == jobs else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--burst", type=int, default=1)
    parser.add_argument("--queue", default=None, help="an empty postgresql:// database")
    parser.add_argument("--pg-local", action="store_true", help="a throwaway local server")
    parser.add_argument("--dir", default=".", help="where the temporary directory goes")
    options = parser.parse_args()
    if options.pg_local:
        with local_server() as server:
            options.queue = server.url()
            raise SystemExit(asyncio.run(main(options)))
    raise SystemExit(asyncio.run(main(options)))

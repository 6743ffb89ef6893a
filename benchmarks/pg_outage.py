"""PostgreSQL away for a long while: ``asnackq work`` and a sink ride it out.

    python benchmarks/pg_outage.py [--outage-s 60] [--jobs 4000] [--mode fast]

A throwaway local server, a queue of ``--jobs`` jobs, one ``asnackq sink`` and one
``asnackq work --until-empty`` on it.  Once a tenth of the jobs is done the server is
stopped (``pg_ctl stop -m MODE``) for ``--outage-s`` seconds, then started again.  Printed
as JSON: the worker's exit code and its database counters, the sink's, the seconds from the
server's return to the next job done (recovery) and to the end, and the evidence's verdict
(every job done, each effect once, no stale finish).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from asnackq import ops
from asnackq.dispatch.traces import read_traces
from asnackq.lab import evidence
from asnackq.lab.pg_server import DURABLE, local_server
from asnackq.lab.procs import PIPE, kill, sink_process, sink_stats, worker
from asnackq.store import sessions


def done(url: str) -> int:
    """Jobs done so far, or -1 while the server does not answer."""
    try:
        with psycopg.connect(url, connect_timeout=2) as con:
            row = con.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()
            return int(row[0]) if row else -1
    except psycopg.OperationalError:
        return -1


def fill(url: str, jobs: int) -> dict[str, int]:
    """A new queue at ``url`` with ``jobs`` jobs of an hour's ttl: their ids and qtys."""
    qty = {f"j{i}": i % 7 + 1 for i in range(jobs)}
    sessions.init(url)
    ops.enqueue_all(url, [({"id": i, "qty": q}, 3_600_000, 3) for i, q in qty.items()])
    return qty


def wait_for(what: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)


def measure(outage_s: float, jobs: int, mode: str, traces: Path) -> dict[str, Any]:
    with local_server({**DURABLE, "fsync": "off"}) as server:
        url = server.url()
        qty = fill(url, jobs)
        with sink_process(url, "--delay-ms", "20") as sink:
            options = ("--until-empty", "--json", "--concurrency", "16", "--trace")
            work = worker(url, sink, *options, traces / "w.trace", stdout=PIPE, stderr=PIPE)
            try:
                wait_for(lambda: done(url) >= jobs // 10, 120)
                server.halt(mode)
                time.sleep(outage_s)
                server.resume()
                back = time.monotonic()
                before = done(url)
                wait_for(lambda: done(url) > before or work.poll() is not None, 120)
                recovered = time.monotonic() - back
                out, err = work.communicate(timeout=600)
                ended = time.monotonic() - back
            finally:
                kill(work)
            stats = sink_stats(sink)
        result = evidence.verify(url, url, qty, read_traces(traces), stats)
    summary = json.loads(out) if out else {}
    return {
        "outage_s": outage_s,
        "mode": mode,
        "jobs": jobs,
        "work_exit": work.returncode,
        "work_error": err.strip()[-300:],
        "work_db": {k: v for k, v in summary.items() if k.startswith("db_")},
        "sink_db": {k: v for k, v in stats.items() if k.startswith("db_")},
        "recovered_s": round(recovered, 2),
        "ended_s_after_return": round(ended, 2),
        "violations": result.violations,
        "statuses": result.statuses,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--mode", choices=("fast", "immediate"), default="fast")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = measure(args.outage_s, args.jobs, args.mode, Path(scratch))
    print(json.dumps(report, indent=2))
    ok = report["work_exit"] == 0 and not report["violations"]
    return 0 if ok and report["statuses"] == {"done": args.jobs} else 1


if __name__ == "__main__":
    sys.exit(main())

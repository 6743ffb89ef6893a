"""``asnackq demo``: the lab's preset for a first run - a worker dies right after a send.

The lab's machinery (``asnackq.lab``: its fill, sink, workers and evidence), with fewer jobs
and one fixed kill instead of random ones: in a temporary directory, 300 jobs, a sink on a
loopback port and worker ``lab-w1`` alone, SIGKILLed right after its 40th verified ACK.  That
effect is applied and its finish never made; the jobs it held stay leased.  Two workers
start then, reclaim those jobs when their leases expire (token 2) and re-send them; the
inbox absorbs the duplicates.  The tables say what happened, and how far the evidence
reaches: every invariant, judged from the files alone (``asnackq.lab.evidence``).
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from asnackq.lab import LabConfig, LabResult, run_lab

__all__ = ["main", "preset"]

JOBS = 300
KILL_AFTER_ACKS = 40


def preset() -> LabConfig:
    """The demo's lab: 300 jobs, 2 workers x 32 coroutines, the first killed after 40 ACKs."""
    return LabConfig(
        jobs=JOBS, processes=2, concurrency=32, lease_ms=2000, kill_after_acks=KILL_AFTER_ACKS
    )


def story(result: LabResult) -> Table:
    """What happened: the kill, the requests, the duplicates, the recovered jobs."""
    table = Table(title=f"asnackq demo: {JOBS} jobs, a worker SIGKILLed right after a send")
    table.add_column("what happened")
    table.add_column("value", justify="right")
    for label, value in [
        (
            f"lab-w1 SIGKILLed right after a send (its {KILL_AFTER_ACKS}th verified ACK)",
            "yes" if result.kills == 1 else "NO",
        ),
        ("workers started (lab-w1 alone, then lab-w2 and lab-w3)", result.workers_started),
        ("HTTP requests at the sink", result.requests),
        ("effects applied (inbox rows)", result.evidence.inbox_rows),
        ("duplicates absorbed by the inbox", result.duplicates),
        ("ids delivered more than once", result.evidence.redelivered),
        ("jobs lab-w1 held, done by another worker (token > 1)", result.evidence.done_reclaimed),
        (
            "final states",
            ", ".join(f"{k} {v}" for k, v in sorted(result.evidence.statuses.items())),
        ),
        (
            "stock at the sink / sum of job qty",
            f"{result.evidence.stock} / {result.evidence.qty_total}",
        ),
        ("every id's effect applied exactly once", "yes" if once(result) else "NO"),
        ("seconds", f"{result.seconds:.1f}"),
    ]:
        table.add_row(label, str(value))
    return table


def verdicts(result: LabResult) -> Table:
    """How far the evidence reaches: each invariant with its verdict."""
    table = Table(title="how far the evidence reaches: queue, inbox, sink counters, traces")
    table.add_column("checked")
    table.add_column("found", justify="right")
    table.add_column("verdict", justify="right")
    for row in result.invariants:
        table.add_row(row["description"], str(row["violations"]), row["verdict"])
    return table


def once(result: LabResult) -> bool:
    """Every job done, every id's effect applied once, nothing broken."""
    return (
        not result.failed
        and result.evidence.statuses == {"done": JOBS}
        and result.evidence.inbox_rows == JOBS
    )


def main() -> int:
    """Run the demo; exit code 0 when the kill happened, every job is done and every
    effect was applied once."""
    result = run_lab(preset(), Console(stderr=True))
    out = Console()
    out.print(story(result))
    out.print(verdicts(result))
    return 0 if once(result) and result.kills == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

"""``asnackq purge``: finished jobs past a horizon go, with what was kept of them."""

from __future__ import annotations

import argparse

from rich.console import Console

from asnackq.cli.common import QUEUE_HELP, Commands, Usage, exact_int, existing_queue, target
from asnackq.cli.render import emit, iso, plural
from asnackq.core import worker as w
from asnackq.core.endpoints import duration, parse_duration
from asnackq.ops.purge import BATCH, purge
from asnackq.store import retention
from asnackq.store.targets import shown

__all__ = ["add_purge"]

MIN_HORIZON_MS = 60_000  # an id's enqueue stays a no-op at least this long after its deadline


def add_purge(commands: Commands) -> None:
    cmd = commands.add_parser(
        "purge",
        help="delete done (and with --dead, dead) jobs that ended more than a horizon ago",
        description="Delete the done jobs that finished more than --older-than ago (and with "
        "--dead the dead ones whose deadline and last schedule are that old), with the "
        "requests, traces and redrive records "
        "kept of them, in short audited transactions (asnackq_purges). A purged id is "
        "forgotten: enqueued again, it is a new job. Pending and leased jobs are never purged.",
    )
    cmd.add_argument("queue", type=target, help=QUEUE_HELP)
    cmd.add_argument(
        "--older-than", required=True, metavar="DURATION", help="a horizon: 1m at least, e.g. 7d"
    )
    cmd.add_argument("--dead", action="store_true", help="purge dead jobs too")
    cmd.add_argument(
        "--batch",
        type=exact_int,
        default=BATCH,
        help=f"jobs a transaction, 1..{retention.MAX_LIMIT} (default {BATCH})",
    )
    cmd.add_argument("--json", action="store_true", help="print the counts as JSON")
    cmd.set_defaults(run=run_purge)


def horizon_ms(text: str) -> int:
    """``--older-than``, checked: a duration of at least ``MIN_HORIZON_MS``."""
    try:
        ms = parse_duration(text)
    except ValueError as error:
        raise Usage(f"--older-than: {error}") from None
    if ms < MIN_HORIZON_MS:
        raise Usage(f"--older-than must be {duration(MIN_HORIZON_MS)} at least: {text!r}")
    return ms


def run_purge(args: argparse.Namespace) -> int:
    now = w.epoch_ms()
    cutoff = max(0, now - horizon_ms(args.older_than))
    statuses = ("done", "dead") if args.dead else ("done",)
    try:
        retention.check_purge(cutoff, "done", args.batch)
    except ValueError as error:
        raise Usage(f"--batch: {error}") from None
    existing_queue(args.queue)
    purged = purge(args.queue, cutoff, statuses, now, args.batch)

    def human(out: Console) -> None:
        counts = ", ".join(f"{plural(n, status + ' job')}" for status, n in purged.items())
        out.print(f"purged {counts} of {shown(args.queue)} (ended before {iso(cutoff)})")

    emit(args, {"purged": purged, "cutoff_ms": cutoff}, human)
    return 0

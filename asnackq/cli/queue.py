"""The queue commands: init, stats, dead, redrive, history, audit (``enqueue``: its own module)."""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

from rich.console import Console
from rich.table import Table

from asnackq import ops
from asnackq.cli.common import (
    QUEUE_HELP,
    Commands,
    Failure,
    Usage,
    exact_int,
    existing_queue,
    target,
)
from asnackq.cli.otel import add_otel
from asnackq.cli.render import emit, iso, key_values, plural, rows_table, shown_text
from asnackq.core import worker as w
from asnackq.ops.inspect import check_job_id, stories
from asnackq.store import readers, reads, sessions
from asnackq.store.targets import is_url, shown

__all__ = ["add_audit", "add_init", "add_inspect"]


def add_init(commands: Commands) -> None:
    init = commands.add_parser("init", help="create a queue file (idempotent)")
    init.add_argument("queue", type=target, help=QUEUE_HELP)
    init.add_argument("--json", action="store_true", help="print the result as JSON")
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    created, jobs = sessions.init(args.queue)
    result = {"queue": shown(args.queue), "created": created, "jobs": jobs}
    emit(
        args,
        result,
        lambda out: out.print(
            f"{'created' if created else 'opened existing'} queue {shown(args.queue)} "
            f"({plural(jobs, 'job')})"
        ),
    )
    return 0


def add_inspect(commands: Commands) -> None:
    stats = commands.add_parser("stats", help="jobs by status and reason, lag, attempts, leases")
    stats.add_argument("queue", type=target, help=QUEUE_HELP)
    stats.add_argument("--json", action="store_true", help="print the counts as JSON")
    stats.set_defaults(run=run_stats)

    dead = commands.add_parser("dead", help="the dead jobs with reason, attempts and token")
    dead.add_argument("queue", type=target, help=QUEUE_HELP)
    dead.add_argument("--reason", choices=ops.REASONS, help="only the jobs dead for this reason")
    dead.add_argument("--json", action="store_true", help="print the jobs as JSON")
    dead.set_defaults(run=run_dead)

    redrive = commands.add_parser(
        "redrive",
        help="return dead jobs to pending, each audited",
        description="Redrive one dead job by ID, or every dead job with --reason; each "
        "redrive is its own audited transaction (see 'history').",
    )
    redrive.add_argument("queue", type=target, help=QUEUE_HELP)
    redrive.add_argument("id", nargs="?")
    redrive.add_argument(
        "--reason", choices=ops.REASONS, help="every job dead for this reason (instead of --id)"
    )
    redrive.add_argument(
        "--ttl-ms", type=exact_int, required=True, help="new budget, 1..2592000000 (30 days)"
    )
    redrive.add_argument("--note", required=True, help="why ([A-Za-z0-9_-]{1,64})")
    redrive.add_argument("--json", action="store_true", help="print the result as JSON")
    add_otel(redrive, spans=False)
    redrive.set_defaults(run=run_redrive)

    history = commands.add_parser("history", help="a job's state and its redrive records")
    history.add_argument("queue", type=target, help=QUEUE_HELP)
    history.add_argument("id")
    history.add_argument("--json", action="store_true", help="print the history as JSON")
    history.set_defaults(run=run_history)

    inspect = commands.add_parser(
        "inspect",
        help="a job's or an event's story: an event's deliveries by endpoint, with attempts",
        description="Show the job ID (its row, redrives, the requests kept of it, and for a "
        "delivery its event and endpoint) and the event ID (its deliveries by endpoint, each "
        "with its status, attempts and the requests kept of it). Exit 1 if the queue holds "
        "neither.",
    )
    inspect.add_argument("queue", type=target, help=QUEUE_HELP)
    inspect.add_argument("id", help="a job id or an event id")
    inspect.add_argument("--json", action="store_true", help="print the story as JSON")
    inspect.set_defaults(run=run_inspect)


# (``oldest``: the oldest pending delivery's wait since its intake; ``leased``: in flight)
ENDPOINT_COLUMNS = (
    "endpoint",
    "state",
    "backlog",
    "oldest",
    "leased",
    "done",
    "dead",
    "breaker",
    "limit",
)


def endpoint_rows(endpoints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ops.stats``' endpoints as ``stats`` shows them (a disabled one with its reason)."""
    return [
        {
            "endpoint": one["name"],
            "state": one["state"]
            if one["disabled_reason"] is None
            else f"{one['state']}: {shown_text(one['disabled_reason'])}",
            "backlog": one["backlog"],
            "oldest": None if oldest is None else f"{oldest / 1000:.1f}s",
            "leased": one["in_flight"],
            "done": one["done"],
            "dead": one["dead"],
            "breaker": one["breaker"],
            "limit": one["limit"],
        }
        for one, oldest in ((one, one["oldest_pending_ms"]) for one in endpoints)
    ]


def run_stats(args: argparse.Namespace) -> int:
    with readers.read_only(args.queue, "jobs") as con:
        result = ops.stats(con, w.epoch_ms())

    def human(out: Console) -> None:
        pairs: list[tuple[str, object]] = [("jobs", result["jobs"])]
        pairs += list(result["by_status"].items())
        pairs += [(f"dead: {reason}", n) for reason, n in result["dead_by_reason"].items()]
        pairs += [
            ("oldest pending wait (ms)", result["oldest_pending_ms"]),
            ("expired leases awaiting reclaim", result["expired_leases"]),
        ]
        pairs += [(f"attempts = {n}", count) for n, count in result["attempts"].items()]
        out.print(key_values(f"asnackq stats {shown(args.queue)}", pairs))
        if result["endpoints"]:
            rows = endpoint_rows(result["endpoints"])
            out.print(rows_table(plural(len(rows), "endpoint"), rows, ENDPOINT_COLUMNS))

    emit(args, result, human)
    return 0


def run_dead(args: argparse.Namespace) -> int:
    with readers.read_only(args.queue, "jobs") as con:
        jobs = ops.dead(con, args.reason)
    emit(
        args,
        jobs,
        lambda out: out.print(
            rows_table(
                f"{len(jobs)} dead jobs",
                jobs,
                ("id", "qty", "reason", "attempts", "max_attempts", "token"),
            )
        ),
    )
    return 0


def run_redrive(args: argparse.Namespace) -> int:
    if (args.id is None) == (args.reason is None):
        raise Usage("give either one job ID or --reason (exhausted, deadline, permanent)")
    now = w.epoch_ms()
    try:
        w.check_redrive(args.id or "x", now, args.ttl_ms, args.note, w.PRODUCT)
    except ValueError as error:
        raise Usage(str(error)) from None
    existing_queue(args.queue)
    if args.id is not None:
        with sessions.open_session(args.queue) as store:
            ops.redrive(store, args.id, now, args.ttl_ms, args.note)
        results = [{"id": args.id, "redriven": True}]
    else:
        results = ops.redrive_by_reason(args.queue, args.reason, now, args.ttl_ms, args.note)
    count = sum(r["redriven"] for r in results)
    emit(
        args,
        {"redriven": count, "jobs": results},
        lambda out: out.print(
            f"redriven {plural(count, 'job')}"
            + "".join(f"\n  skipped {r['id']}: {r['why']}" for r in results if not r["redriven"])
        ),
    )
    return 0


def run_history(args: argparse.Namespace) -> int:
    with readers.read_only(args.queue, "jobs") as con:
        result = ops.history(con, args.id, on_sqlite=not is_url(args.queue))

    def human(out: Console) -> None:
        out.print(
            f"{args.id}: {result['status']}"
            + (f" ({result['reason']})" if result["reason"] else "")
            + f", attempts {result['attempts']}, token {result['token']}"
        )
        redrives = [{**row, "at": iso(row["at_ms"])} for row in result["redrives"]]
        out.print(rows_table(plural(len(redrives), "redrive"), redrives, ("token", "at", "note")))
        requests = [
            {**row, "at": iso(row["at_ms"]), "answer": shown_text(row["answer"][:60])}
            for row in result["requests"]
        ]
        columns = ("token", "attempt", "at", "status", "latency_ms", "verdict", "answer")
        out.print(rows_table(plural(len(requests), "request"), requests, columns))

    emit(args, result, human)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        check_job_id(args.id)
    except ValueError as error:
        raise Usage(str(error)) from None
    now = w.epoch_ms()
    with readers.read_only(args.queue, "jobs") as con:
        job, event = reads.run(con, stories(args.id, now, on_sqlite=not is_url(args.queue)))
    if job is None and event is None:
        raise Failure(f"no job or event {args.id!r} in the queue")
    result = {"id": args.id, "at_ms": now, **(job or {"job": None}), "event": event}
    emit(args, result, partial(show_story, args.id, job, event))
    return 0


def show_story(
    name: str, job: dict[str, Any] | None, event: dict[str, Any] | None, out: Console
) -> None:
    """``inspect``'s human rendering: the job, then the event's deliveries."""
    if job is not None:
        row, delivery = job["job"], job["delivery"] or {}
        pairs = [(key, row[key]) for key in ("status", "reason", "attempts", "max_attempts")]
        pairs += [("token", row["token"]), ("owner", row["owner"])]
        pairs += [(key, delivery[key]) for key in ("event", "endpoint") if key in delivery]
        pairs += [("requests kept", len(job["attempts"])), ("redrives", len(job["redrives"]))]
        out.print(key_values(f"job {name}", pairs))
    if event is not None:
        head = event["event"]
        title = f"event {name}" + (f" ({head['type']})" if head["type"] else "")
        rows = [
            {
                **one,
                "status": "purged" if one["status"] is None else one["status"],
                "attempts": f"{one['attempts']} of {one['max_attempts']}"
                if one["attempts"] is not None
                else None,
                "kept": len(one["requests"]),
                "last answer": one["requests"][-1]["status"] if one["requests"] else None,
            }
            for one in event["deliveries"]
        ]
        columns = ("endpoint", "job", "status", "reason", "attempts", "kept", "last answer")
        out.print(
            rows_table(f"{title}: {plural(len(rows), 'delivery', 'deliveries')}", rows, columns)
        )


def add_audit(commands: Commands) -> None:
    audit = commands.add_parser(
        "audit",
        help="how far the evidence reaches for each job (queue + sink DB)",
        description="Join the queue with the sink's inbox. Attention: effects applied to jobs "
        "not yet done (a re-send is pending, harmless), dead jobs whose effect was applied, "
        "expired leases. Violations (exit code 1): a done job without an inbox row, an "
        "inbox qty that differs from the job's, an inbox row without a job, a token the "
        "queue never issued, a stock that differs from the inbox total.",
    )
    audit.add_argument("queue", type=target, help=QUEUE_HELP)
    audit.add_argument(
        "--sink-db", required=True, type=target, help="the sink's DB file or postgresql:// URL"
    )
    audit.add_argument("--id", help="show one job's whole evidence chain")
    audit.add_argument("--limit", type=exact_int, default=20, help="jobs listed per kind, 0..")
    audit.add_argument("--json", action="store_true", help="print the verdict as JSON")
    audit.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    result = ops.audit(args.queue, args.sink_db, w.epoch_ms(), job_id=args.id, limit=args.limit)
    if args.id is not None:
        return audit_one(args, result.job)

    def human(out: Console) -> None:
        out.print(key_values("evidence reached", sorted(result.stages.items())))
        flags = [
            (f"{name}: {ops.VIOLATIONS.get(name) or ops.ATTENTION[name]}", n)
            for name, n in result.flags.items()
            if n
        ]
        if flags:
            out.print(key_values("flags", flags))
        listed = [(kind, entry) for kind, entries in result.listed.items() for entry in entries]
        if listed:
            table = Table(title="jobs that need a look")
            for column in ("id", "kind", "flags", "job", "inbox (qty, tokens, deliveries)"):
                table.add_column(column)
            for kind, entry in listed:
                job, inbox = entry.get("job"), entry["inbox"]
                table.add_row(
                    entry["id"],
                    "VIOLATION" if kind == "violations" else kind,
                    ", ".join(entry["flags"]),
                    "-"
                    if job is None
                    else f"{job['status']} qty {job['qty']} token {job['token']}",
                    "-"
                    if inbox is None
                    else f"{inbox['qty']}, {inbox['first_token']}..{inbox['last_token']}, "
                    f"{inbox['deliveries']}",
                )
            out.print(table)
        if result.job is not None:
            out.print(f"{args.id}: {json.dumps(result.job)}")
        verdict = (
            "no violations"
            if not result.violations
            else f"[bold red]{result.violations} VIOLATIONS[/]"
        )
        out.print(f"stock {result.stock} / inbox total {result.inbox_qty_sum}: {verdict}")

    emit(args, result.as_dict(), human)
    return 1 if result.violations else 0


def audit_one(args: argparse.Namespace, job: dict[str, Any] | None) -> int:
    """``audit --id``: that job's evidence chain and verdict alone (exit 1: a violation)."""
    if job is None:
        raise Failure(f"no job or inbox row {args.id!r}")
    violations = [flag for flag in job["flags"] if flag in ops.VIOLATIONS]

    def human(out: Console) -> None:
        row = job.get("job")
        inbox = job["inbox"]
        pairs = [
            ("stage", job["stage"]),
            (
                "job",
                "-" if row is None else f"{row['status']} qty {row['qty']} token {row['token']}",
            ),
            (
                "inbox",
                "-"
                if inbox is None
                else f"qty {inbox['qty']}, tokens {inbox['first_token']}..{inbox['last_token']}, "
                f"{plural(inbox['deliveries'], 'delivery', 'deliveries')}",
            ),
            *[
                (f"flag {flag}", ops.VIOLATIONS.get(flag) or ops.ATTENTION[flag])
                for flag in job["flags"]
            ],
        ]
        out.print(key_values(f"audit {args.id}", pairs))
        out.print(
            "no violations"
            if not violations
            else f"[bold red]VIOLATION: {', '.join(violations)}[/]"
        )

    emit(args, {"job": job, "violations": len(violations)}, human)
    return 1 if violations else 0

"""The ``asnackq`` command: one entry point, one subcommand per job.

Exit codes: 0 ok, 1 failure or violation, 2 usage.  A bad input is one clear line on
stderr (never a traceback) and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeAlias

from rich.console import Console
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

from asnackq import ops, stores
from asnackq.aio import epoch_ms
from asnackq.core import worker as w
from asnackq.http_send import is_loopback
from asnackq.targets import Target, one_line, shown, target

Command = Callable[[argparse.Namespace], int]


class Failure(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 1."""


Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

TTL_MS = 60_000          # the default ttl for intakes (up to 30 days: worker.PRODUCT)
QUEUE_HELP = "a queue file, or a postgresql:// URL"


def emit(args: argparse.Namespace, data: object, human: Callable[[Console], None]) -> None:
    """Print ``data`` as JSON with ``--json``, else the human rendering."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=None, sort_keys=True))
    else:
        human(Console(highlight=False))


def key_values(title: str, pairs: list[tuple[str, object]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in pairs:
        table.add_row(key, "-" if value is None else str(value))
    return table


def existing_queue(path: Target) -> Target:
    """A queue that must already exist (``init`` creates one; typos create nothing)."""
    try:
        stores.require(path)
    except ValueError as error:
        raise Failure(str(error)) from None
    return path


def rate(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1: {text}")
    return value


def add_sink(commands: Commands) -> None:
    sink = commands.add_parser("sink", help="run the HTTP sink (inbox + stock) until SIGINT/TERM")
    sink.add_argument("--db", required=True, type=target,
                      help="sink DB file or postgresql:// URL (created if needed; replicas "
                      "may share one database)")
    sink.add_argument("--host", default="127.0.0.1")
    sink.add_argument("--port", type=int, default=0, help="0 picks a free port")
    sink.add_argument("--allow-remote", action="store_true",
                      help="allow binding a non-loopback --host")
    sink.add_argument("--auth-token", help="require 'Authorization: Bearer TOKEN'")
    sink.add_argument("--fail-rate", type=rate, default=0.0, help="answer 503 before any change")
    sink.add_argument("--drop-rate", type=rate, default=0.0,
                      help="commit, then close the connection without an answer")
    sink.add_argument("--delay-ms", type=int, default=0)
    sink.add_argument("--seed", type=int, default=None)
    sink.add_argument("--batch-max", type=int, default=512,
                      help="most requests in one group commit (1: commit per request)")
    sink.set_defaults(run=run_sink)


def run_sink(args: argparse.Namespace) -> int:
    from asnackq.http_sink import SinkConfig, serve

    if not args.allow_remote and not is_loopback(args.host):
        raise Failure(f"refusing to bind non-loopback host {args.host!r} without --allow-remote")
    try:
        config = SinkConfig(args.db, auth_token=args.auth_token, fail_rate=args.fail_rate,
                            drop_rate=args.drop_rate, delay_ms=args.delay_ms, seed=args.seed,
                            batch_max=args.batch_max)
    except ValueError as error:
        raise Failure(str(error)) from None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(config, args.host, args.port, stop)

    asyncio.run(main())
    return 0


def add_outbox(commands: Commands) -> None:
    outbox = commands.add_parser("outbox", help="ordered delivery through a transactional outbox")
    actions = outbox.add_subparsers(dest="action", required=True, metavar="ACTION")
    accept = actions.add_parser("accept", help="accept an order and its outbox row atomically")
    accept.add_argument("source", type=Path)
    accept.add_argument("--id", required=True)
    accept.add_argument("--qty", required=True, type=int)
    pending = actions.add_parser("pending", help="unsent items in seq order (read-only)")
    pending.add_argument("source", type=Path)
    pending.add_argument("--limit", type=int, default=16)
    dispatch = actions.add_parser("dispatch", help="send one ordered batch; stop at a failure")
    dispatch.add_argument("source", type=Path)
    dispatch.add_argument("--sink", required=True, help="the sink's /events URL")
    dispatch.add_argument("--limit", type=int, default=16)
    dispatch.add_argument("--timeout-s", type=float, default=2.0)
    outbox.set_defaults(run=run_outbox)


def run_outbox(args: argparse.Namespace) -> int:
    from asnackq.core import outbox
    from asnackq.core.worker import BadAck, Conflict, Permanent, Retryable
    from asnackq.http_send import HttpSender

    if args.action != "accept" and not args.source.is_file():
        raise Failure(f"no source DB at {args.source}")
    con = outbox.open_source(args.source)
    try:
        if args.action == "accept":
            try:
                new = outbox.accept(con, {"id": args.id, "qty": args.qty})
            except Conflict as error:
                raise Failure(str(error)) from None
            print(json.dumps({"id": args.id, "accepted": new}))
        elif args.action == "pending":
            print(json.dumps(outbox.pending(con, args.limit)))
        else:
            sender = HttpSender(args.sink, timeout_s=args.timeout_s)
            try:
                print(json.dumps({"sent": outbox.dispatch(con, sender, args.limit)}))
            except (Retryable, Permanent, BadAck) as error:
                raise Failure(f"stopped at the first failure: {error}") from None
    finally:
        con.close()
    return 0


# --- init and enqueue -----------------------------------------------------------------

def add_init(commands: Commands) -> None:
    init = commands.add_parser("init", help="create a queue file (idempotent)")
    init.add_argument("queue", type=target, help=QUEUE_HELP)
    init.add_argument("--json", action="store_true", help="print the result as JSON")
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    created, jobs = stores.init(args.queue)
    result = {"queue": shown(args.queue), "created": created, "jobs": jobs}
    emit(args, result, lambda out: out.print(
        f"{'created' if created else 'opened existing'} queue {shown(args.queue)} "
        f"({jobs} jobs)"))
    return 0


def add_enqueue(commands: Commands) -> None:
    enqueue = commands.add_parser(
        "enqueue", help="add jobs: one with --id/--qty, or JSON Lines from a file or stdin",
        description="Add jobs to an existing queue. A JSON Lines input holds one object per "
        'line: {"id": "a-1", "qty": 3} with optional "ttl_ms" and "max_attempts". Every line '
        "is validated before anything is written; conflicting ids (known with another qty) "
        "change nothing, are reported, and make the exit code 1.")
    enqueue.add_argument("queue", type=target, help=QUEUE_HELP)
    enqueue.add_argument("input", nargs="?", help="JSON Lines file, or - for stdin")
    enqueue.add_argument("--id", help="the job id ([A-Za-z0-9_-]{1,64})")
    enqueue.add_argument("--qty", type=int)
    enqueue.add_argument("--ttl-ms", type=int, default=TTL_MS,
                         help="1..2592000000, 30 days (default 60000)")
    enqueue.add_argument("--max-attempts", type=int, default=3, help="1..16 (default 3)")
    enqueue.add_argument("--json", action="store_true", help="print the counts as JSON")
    enqueue.set_defaults(run=run_enqueue)


Intake = ops.Intake
INTAKE_KEYS = frozenset({"id", "qty", "ttl_ms", "max_attempts"})


def read_intakes(stream: IO[str], name: str, ttl_ms: int, max_attempts: int) -> list[Intake]:
    """Parse and validate every JSON line (``NAME:LINE: why`` on the first bad one)."""
    items = []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if type(record) is not dict:
                raise ValueError("each line must be a JSON object")
            unknown = record.keys() - INTAKE_KEYS
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            item = ({"id": record.get("id"), "qty": record.get("qty")},
                    record.get("ttl_ms", ttl_ms), record.get("max_attempts", max_attempts))
            w.plan_enqueue(item[0], 0, item[1], item[2], limits=w.PRODUCT).close()
        except ValueError as error:
            raise Failure(f"{name}:{number}: {error}") from None
        items.append(item)
    return items


def run_enqueue(args: argparse.Namespace) -> int:
    existing_queue(args.queue)
    if (args.input is None) == (args.id is None):
        raise Failure("give either --id and --qty, or a JSON Lines input (a file or -)")
    if args.input is None:
        if args.qty is None:
            raise Failure("--id needs --qty")
        items = [({"id": args.id, "qty": args.qty}, args.ttl_ms, args.max_attempts)]
    elif args.input == "-":
        items = read_intakes(sys.stdin, "stdin", args.ttl_ms, args.max_attempts)
    else:
        try:
            with open(args.input, encoding="utf-8") as stream:
                items = read_intakes(stream, args.input, args.ttl_ms, args.max_attempts)
        except UnicodeDecodeError as error:
            raise Failure(f"{args.input}: not UTF-8 text: {error}") from None
    results = intake(args.queue, items, show_progress=args.input is not None)
    conflicts = [str(r) for r in results if isinstance(r, w.Conflict)]
    counts = {"inserted": sum(r is True for r in results),
              "present": sum(r is False for r in results), "conflicts": len(conflicts)}
    if args.input is None and conflicts:
        raise Failure(conflicts[0])
    emit(args, {**counts, "conflicting": conflicts[:20]}, lambda out: out.print(
        f"inserted {counts['inserted']}, already present {counts['present']}, "
        f"conflicts {counts['conflicts']}"))
    for line in conflicts[:20]:
        print(f"asnackq enqueue: conflict: {line}", file=sys.stderr)
    return 1 if conflicts else 0


def intake(queue: Target, items: list[Intake], show_progress: bool) -> list[bool | w.Conflict]:
    """``ops.enqueue_all`` with a progress bar on a terminal."""
    console = Console(stderr=True)
    with Progress(console=console, transient=True,
                  disable=not (show_progress and console.is_terminal)) as progress:
        task = progress.add_task("enqueue", total=len(items))
        return ops.enqueue_all(queue, items, lambda n: progress.advance(task, n))


# --- work -------------------------------------------------------------------------------

def default_owner() -> str:
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "worker"
    return f"{name}-{os.getpid()}"


def add_work(commands: Commands) -> None:
    work = commands.add_parser(
        "work", help="deliver jobs to a sink with many coroutines (the async Dispatcher)",
        description="Claim, send and finish jobs until stopped (Ctrl-C or SIGTERM: stop "
        "claiming, let in-flight sends end, finish them, print the summary). With "
        "--until-empty, stop once no job is pending or leased.")
    work.add_argument("queue", type=target, help=QUEUE_HELP)
    work.add_argument("--sink", required=True, help="the sink's /events URL")
    work.add_argument("--concurrency", type=int, default=64)
    work.add_argument("--owner", default=None, help="lease owner name (default HOST-PID)")
    work.add_argument("--lease-ms", type=int, default=5000, help="1..3600000 (default 5000)")
    work.add_argument("--prefetch", type=int, default=None,
                      help="tickets kept claimed ahead of demand (default: adapts to how "
                      "many the coroutines take during one commit)")
    work.add_argument("--timeout-s", type=float, default=2.0,
                      help="HTTP timeout per send; must be below the lease")
    work.add_argument("--until-empty", action="store_true")
    work.add_argument("--retry-base-ms", type=int, default=100,
                      help="retry delay of a job's first retry, doubled per attempt (default 100)")
    work.add_argument("--retry-cap-ms", type=int, default=1000,
                      help="longest retry delay, up to an hour (default 1000)")
    work.add_argument("--breaker-after", type=int, default=8,
                      help="sends in a row that find no sink before the run pauses (default 8)")
    work.add_argument("--breaker-max-ms", type=int, default=2000,
                      help="longest wait between probes while paused (default 2000)")
    work.add_argument("--accept-dead", action="store_true",
                      help="exit 0 even when jobs ended dead that the sink never rejected")
    work.add_argument("--max-jobs", type=int, default=None, help="stop after N claims")
    work.add_argument("--allow-remote", action="store_true", help="allow a non-loopback sink")
    work.add_argument("--trace", type=Path, default=None,
                      help="append one JSON line per claim and per finish (for experiments)")
    work.add_argument("--json", action="store_true", help="print the summary as JSON")
    work.set_defaults(run=run_work)


class Tracer:
    """Appends claim/finish lines to a file; each line reaches the OS before the next step."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def __call__(self, kind: str, ticket: dict[str, Any], at_ms: int,
                 status: str | bool | None) -> None:
        record = {"e": kind, "id": ticket["id"], "token": ticket["token"],
                  "owner": ticket["owner"], "at": at_ms}
        if kind == "finish":
            record["status"] = status
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def progress_line(summary: dict[str, int], seconds: float, paused: bool) -> str:
    return (f"done {summary['done']}  retried {summary['retried']}  dead {summary['dead']}  "
            f"stale {summary['stale']}  bad ACKs {summary['bad_acks']}  "
            f"errors {summary['errors']}  {summary['done'] / max(seconds, 1e-9):,.0f} done/s"
            + ("  PAUSED: the sink is not there, probing" if paused else ""))


def run_work(args: argparse.Namespace) -> int:
    from asnackq.aio import AsyncQueue
    from asnackq.breaker import BreakerPolicy
    from asnackq.dispatch import Dispatcher
    from asnackq.http_send import AsyncHttpSender

    existing_queue(args.queue)
    owner = args.owner or default_owner()
    retry = w.Retry(args.retry_base_ms, args.retry_cap_ms).check(w.PRODUCT)
    breaker = BreakerPolicy(args.breaker_after, 100, args.breaker_max_ms).check()
    sender = AsyncHttpSender(args.sink, timeout_s=args.timeout_s,
                             allow_remote=args.allow_remote)
    tracer = Tracer(args.trace) if args.trace else None
    console = Console(stderr=True)
    started = time.perf_counter()

    async def main() -> tuple[dict[str, int], bool]:
        async with AsyncQueue.open(args.queue) as queue, sender as send:
            dispatcher = Dispatcher(queue, send, owner=owner, concurrency=args.concurrency,
                                    lease_ms=args.lease_ms, trace=tracer,
                                    prefetch=args.prefetch, retry=retry, breaker=breaker)
            running = asyncio.ensure_future(dispatcher.run(
                until_empty=True, max_jobs=args.max_jobs, follow=not args.until_empty))
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, running.cancel)
            with Live(console=console, transient=True, auto_refresh=False,
                      redirect_stdout=False, redirect_stderr=False) as live:
                while not running.done():
                    await asyncio.wait([running], timeout=0.25)
                    if console.is_terminal:
                        live.update(progress_line(
                            dispatcher.summary.as_dict(), time.perf_counter() - started,
                            dispatcher.paused), refresh=True)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            stopped = running.cancelled()
            if not stopped:
                running.result()
            return dispatcher.summary.as_dict(), stopped

    try:
        summary, stopped = asyncio.run(main())
    finally:
        if tracer is not None:
            tracer.close()
    seconds = time.perf_counter() - started
    result = {**summary, "owner": owner, "seconds": round(seconds, 3),
              "stopped_by_signal": stopped, "retry": retry._asdict(),
              "breaker": dataclasses.asdict(breaker)}
    emit(args, result, lambda out: out.print(key_values(
        f"asnackq work {owner}" + (" (stopped by signal)" if stopped else ""),
        [*summary.items(), ("seconds", f"{seconds:.1f}"),
         ("done/s", f"{summary['done'] / max(seconds, 1e-9):,.0f}"),
         ("retry policy", f"base {retry.base_ms} ms, cap {retry.cap_ms} ms"),
         ("breaker", f"after {breaker.after} failures in a row, probes "
                     f"{breaker.base_ms}..{breaker.max_ms} ms apart")])))
    unanswered = summary["dead_exhausted"] + summary["dead_deadline"]
    if unanswered and not args.accept_dead:
        print(f"asnackq work: {unanswered} jobs ended dead that the sink never rejected "
              f"(exhausted {summary['dead_exhausted']}, deadline {summary['dead_deadline']}); "
              "pass --accept-dead to exit 0", file=sys.stderr)
        return 1
    return 0


# --- stats, dead, redrive, history -----------------------------------------------------------

def add_inspect(commands: Commands) -> None:
    stats = commands.add_parser("stats", help="jobs by status and reason, lag, attempts, leases")
    stats.add_argument("queue", type=target, help=QUEUE_HELP)
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(run=run_stats)

    dead = commands.add_parser("dead", help="the dead jobs with reason, attempts and token")
    dead.add_argument("queue", type=target, help=QUEUE_HELP)
    dead.add_argument("--reason", choices=ops.REASONS)
    dead.add_argument("--json", action="store_true")
    dead.set_defaults(run=run_dead)

    redrive = commands.add_parser(
        "redrive", help="return dead jobs to pending, each audited",
        description="Redrive one dead job by ID, or every dead job with --reason; each "
        "redrive is its own audited transaction (see 'history').")
    redrive.add_argument("queue", type=target, help=QUEUE_HELP)
    redrive.add_argument("id", nargs="?")
    redrive.add_argument("--reason", choices=ops.REASONS)
    redrive.add_argument("--ttl-ms", type=int, required=True,
                         help="new budget, 1..2592000000 (30 days)")
    redrive.add_argument("--note", required=True, help="why ([A-Za-z0-9_-]{1,64})")
    redrive.add_argument("--json", action="store_true")
    redrive.set_defaults(run=run_redrive)

    history = commands.add_parser("history", help="a job's state and its redrive records")
    history.add_argument("queue", type=target, help=QUEUE_HELP)
    history.add_argument("id")
    history.add_argument("--json", action="store_true")
    history.set_defaults(run=run_history)


def run_stats(args: argparse.Namespace) -> int:
    with ops.read_only(args.queue, "jobs") as con:
        result = ops.stats(con, epoch_ms())

    def human(out: Console) -> None:
        pairs: list[tuple[str, object]] = [("jobs", result["jobs"])]
        pairs += list(result["by_status"].items())
        pairs += [(f"dead: {reason}", n) for reason, n in result["dead_by_reason"].items()]
        pairs += [("oldest pending wait (ms)", result["oldest_pending_ms"]),
                  ("expired leases awaiting reclaim", result["expired_leases"])]
        pairs += [(f"attempts = {n}", count) for n, count in result["attempts"].items()]
        out.print(key_values(f"asnackq stats {shown(args.queue)}", pairs))
    emit(args, result, human)
    return 0


def rows_table(title: str, rows: list[dict[str, Any]], keys: Sequence[str]) -> Table:
    table = Table(title=title)
    for key in keys:
        table.add_column(key)
    for row in rows:
        table.add_row(*("-" if row[key] is None else str(row[key]) for key in keys))
    return table


def run_dead(args: argparse.Namespace) -> int:
    with ops.read_only(args.queue, "jobs") as con:
        jobs = ops.dead(con, args.reason)
    emit(args, jobs, lambda out: out.print(rows_table(
        f"{len(jobs)} dead jobs", jobs, ("id", "qty", "reason", "attempts", "max_attempts",
                                         "token"))))
    return 0


def run_redrive(args: argparse.Namespace) -> int:
    existing_queue(args.queue)
    if (args.id is None) == (args.reason is None):
        raise Failure("give either one job ID or --reason (exhausted, deadline, permanent)")
    now = epoch_ms()
    if args.id is not None:
        with stores.open_queue(args.queue) as store:
            ops.redrive(store, args.id, now, args.ttl_ms, args.note)
        results = [{"id": args.id, "redriven": True}]
    else:
        results = ops.redrive_by_reason(args.queue, args.reason, now, args.ttl_ms, args.note)
    count = sum(r["redriven"] for r in results)
    emit(args, {"redriven": count, "jobs": results}, lambda out: out.print(
        f"redriven {count} job{'s' if count != 1 else ''}"
        + "".join(f"\n  skipped {r['id']}: {r['why']}" for r in results if not r["redriven"])))
    return 0


def run_history(args: argparse.Namespace) -> int:
    with ops.read_only(args.queue, "jobs") as con:
        result = ops.history(con, args.id)

    def human(out: Console) -> None:
        out.print(f"{args.id}: {result['status']}"
                  + (f" ({result['reason']})" if result["reason"] else "")
                  + f", attempts {result['attempts']}, token {result['token']}")
        out.print(rows_table(f"{len(result['redrives'])} redrives", result["redrives"],
                             ("token", "at_ms", "note")))
    emit(args, result, human)
    return 0


# --- audit ---------------------------------------------------------------------------------

def add_audit(commands: Commands) -> None:
    audit = commands.add_parser(
        "audit", help="how far the evidence reaches for each job (queue + sink DB)",
        description="Join the queue with the sink's inbox. Attention: effects applied to jobs "
        "not yet done (a re-send is pending, harmless), dead jobs whose effect was applied, "
        "expired leases. Violations (exit code 1): a done job without an inbox row, an "
        "inbox qty that differs from the job's, an inbox row without a job, a token the "
        "queue never issued, a stock that differs from the inbox total.")
    audit.add_argument("queue", type=target, help=QUEUE_HELP)
    audit.add_argument("--sink-db", required=True, type=target,
                       help="the sink's DB file or postgresql:// URL")
    audit.add_argument("--id", help="show one job's whole evidence chain")
    audit.add_argument("--limit", type=int, default=20, help="jobs listed per kind")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(run=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    result = ops.audit(args.queue, args.sink_db, epoch_ms(), job_id=args.id, limit=args.limit)

    def human(out: Console) -> None:
        out.print(key_values("evidence reached", sorted(result["stages"].items())))
        flags = [(f"{name}: {ops.VIOLATIONS.get(name) or ops.ATTENTION[name]}", n)
                 for name, n in result["flags"].items() if n]
        if flags:
            out.print(key_values("flags", flags))
        listed = [(kind, entry) for kind, entries in result["listed"].items()
                  for entry in entries]
        if listed:
            table = Table(title="jobs that need a look")
            for column in ("id", "kind", "flags", "job", "inbox (qty, tokens, deliveries)"):
                table.add_column(column)
            for kind, entry in listed:
                job, inbox = entry.get("job"), entry["inbox"]
                table.add_row(entry["id"], "VIOLATION" if kind == "violations" else kind,
                              ", ".join(entry["flags"]),
                              "-" if job is None else
                              f"{job['status']} qty {job['qty']} token {job['token']}",
                              "-" if inbox is None else
                              f"{inbox['qty']}, {inbox['first_token']}..{inbox['last_token']}, "
                              f"{inbox['deliveries']}")
            out.print(table)
        if result["job"] is not None:
            out.print(f"{args.id}: {json.dumps(result['job'])}")
        verdict = "no violations" if not result["violations"] else \
            f"[bold red]{result['violations']} VIOLATIONS[/]"
        out.print(f"stock {result['stock']} / inbox total {result['inbox_qty_sum']}: {verdict}")
    emit(args, result, human)
    return 1 if result["violations"] else 0


# --- lab -----------------------------------------------------------------------------------

def add_lab(commands: Commands) -> None:
    lab = commands.add_parser(
        "lab", help="a fault and load experiment with real processes; verifies the invariants",
        description="Start a sink with faults and P worker processes of C coroutines each, "
        "SIGKILL a random worker every --kill-every seconds (replacing it), then check every "
        "invariant from the evidence. Exit code 1 on any violation, and on any job that ended "
        "dead although the sink never rejected it (unless --fail-rate or --drop-rate 1 make "
        "that expected). Jobs get a ttl of --timeout-s plus a minute.")
    lab.add_argument("--jobs", type=int, default=2000)
    lab.add_argument("--processes", type=int, default=2)
    lab.add_argument("--concurrency", type=int, default=64)
    lab.add_argument("--fail-rate", type=rate, default=0.0)
    lab.add_argument("--drop-rate", type=rate, default=0.0)
    lab.add_argument("--delay-ms", type=int, default=0)
    lab.add_argument("--kill-every", type=float, default=0.0, metavar="SECONDS",
                     help="SIGKILL a random worker this often (0: never)")
    lab.add_argument("--seed", type=int, default=1)
    lab.add_argument("--lease-ms", type=int, default=2000)
    lab.add_argument("--send-timeout-s", type=float, default=1.0)
    lab.add_argument("--max-attempts", type=int, default=5)
    lab.add_argument("--timeout-s", type=float, default=300.0, help="bound on the whole run")
    lab.add_argument("--db", type=target, default=None, metavar="URL",
                     help="a postgresql:// URL holding no jobs yet: the queue and the inbox "
                     "there (default: files in --dir)")
    lab.add_argument("--pg-local", action="store_true",
                     help="--db on a throwaway local PostgreSQL server (initdb, stopped after)")
    lab.add_argument("--sinks", type=int, default=1,
                     help="sink replicas sharing the inbox (PostgreSQL only; default 1)")
    lab.add_argument("--kill-sinks", action="store_true",
                     help="every other SIGKILL hits a sink, restarted on its port")
    lab.add_argument("--dir", type=Path, default=None,
                     help="keep the files here (default: a temporary directory)")
    lab.add_argument("--json", type=Path, default=None, metavar="FILE",
                     help="write the results to FILE")
    lab.set_defaults(run=run_lab)


def run_lab(args: argparse.Namespace) -> int:
    from asnackq.lab import LabConfig, report_rows
    from asnackq.lab import run_lab as experiment

    config = LabConfig(
        jobs=args.jobs, processes=args.processes, concurrency=args.concurrency,
        fail_rate=args.fail_rate, drop_rate=args.drop_rate, delay_ms=args.delay_ms,
        kill_every=args.kill_every, seed=args.seed, lease_ms=args.lease_ms,
        send_timeout_s=args.send_timeout_s, max_attempts=args.max_attempts,
        timeout_s=args.timeout_s, directory=args.dir, db=args.db, sinks=args.sinks,
        kill_sinks=args.kill_sinks, pg_local=args.pg_local)
    result = experiment(config, Console(stderr=True))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out = Console(highlight=False)
    out.print(key_values("asnackq lab", report_rows(result)))
    for violation in result["violations"]:
        out.print(f"[bold red]VIOLATION[/] {violation}")
    for failure in result["liveness_failures"]:
        out.print(f"[bold red]LIVENESS[/] {failure}")
    return 1 if result["violations"] or result["liveness_failures"] else 0


def add_demo(commands: Commands) -> None:
    demo = commands.add_parser("demo", help="two workers, one killed after a send: recovery")
    demo.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from asnackq.demo import main as demo

    return demo()


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="asnackq", description="At-least-once delivery with once-only effects.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo(commands)
    add_init(commands)
    add_enqueue(commands)
    add_work(commands)
    add_inspect(commands)
    add_audit(commands)
    add_lab(commands)
    add_sink(commands)
    add_outbox(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asnackq`` command; return its exit code."""
    args = parser().parse_args(argv)
    run: Command = args.run
    try:
        return run(args)
    except Failure as error:
        print(f"asnackq {args.command}: {error}", file=sys.stderr)
        return 1
    except (OSError, ValueError, sqlite3.Error, w.Conflict) as error:
        print(f"asnackq {args.command}: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if not stores.database_error(error):
            raise
        print(f"asnackq {args.command}: database error: {one_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

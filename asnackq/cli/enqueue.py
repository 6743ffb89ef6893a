"""The ``enqueue`` command: a job or an event given by options, or JSON Lines of both."""

from __future__ import annotations

import argparse
import sys
from typing import IO, Any

from rich.console import Console
from rich.progress import Progress

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
from asnackq.cli.render import emit
from asnackq.core import events as ev
from asnackq.core import worker as w
from asnackq.core.budget import DEFAULT_MAX_ATTEMPTS, DEFAULT_TTL_MS
from asnackq.store.outage import database_error
from asnackq.store.targets import Target, one_line
from asnackq.wire import strict_json

__all__ = ["add_enqueue", "add_event_options", "event_of"]


def add_enqueue(commands: Commands) -> None:
    enqueue = commands.add_parser(
        "enqueue",
        help="add jobs or events: one with --id and --qty or --data, or JSON Lines from a "
        "file or stdin",
        description="Add jobs to an existing queue. A JSON Lines input holds one object per "
        'line: {"id": "a-1", "qty": 3} (a job for a sink), or an event {"id": "e-1", "type": '
        '"order.created", "key": "c-7", "data": ANY JSON} (type and key optional) stored with '
        "one delivery per enabled endpoint taking its type; either with optional "
        '"ttl_ms" and "max_attempts". Every line is validated before anything is written; '
        "conflicting ids (known with another qty, or another type, key or data) change "
        "nothing, are reported, and make the exit code 1.",
    )
    enqueue.add_argument("queue", type=target, help=QUEUE_HELP)
    enqueue.add_argument("input", nargs="?", help="JSON Lines file, or - for stdin")
    enqueue.add_argument("--id", help="the job id ([A-Za-z0-9_-]{1,64})")
    enqueue.add_argument("--qty", type=exact_int, help="the job's quantity, 1..1000 (with --id)")
    add_event_options(enqueue)
    enqueue.add_argument(
        "--to",
        action="append",
        metavar="ENDPOINT",
        help="send the events to this endpoint (again for more) instead of those whose "
        "types take them",
    )
    enqueue.add_argument(
        "--ttl-ms",
        type=exact_int,
        default=DEFAULT_TTL_MS,
        help=f"1..2592000000, 30 days (default {DEFAULT_TTL_MS}: a day, as AsyncQueue's)",
    )
    enqueue.add_argument(
        "--max-attempts",
        type=exact_int,
        default=DEFAULT_MAX_ATTEMPTS,
        help=f"1..16 (default {DEFAULT_MAX_ATTEMPTS}, as AsyncQueue's)",
    )
    enqueue.add_argument("--json", action="store_true", help="print the counts as JSON")
    add_otel(enqueue, spans=False)
    enqueue.set_defaults(run=run_enqueue)


def add_event_options(parser: argparse.ArgumentParser) -> None:
    """``--data``, ``--type``, ``--key`` and ``--max-event-bytes``: an event given by options."""
    parser.add_argument("--data", metavar="JSON", help="an event's data, any JSON (with --id)")
    parser.add_argument("--type", help="the event's type, a dotted name (with --data)")
    parser.add_argument("--key", help="the event's key (with --data)")
    parser.add_argument(
        "--max-event-bytes",
        type=exact_int,
        default=ev.DEFAULT_MAX_BYTES,
        help=f"the largest body an event stores, 1..{ev.MAX_BYTES} "
        f"(default {ev.DEFAULT_MAX_BYTES})",
    )


def event_of(args: argparse.Namespace) -> dict[str, Any]:
    """The event ``--id``, ``--data``, ``--type`` and ``--key`` give (``Usage`` when the data
    is not JSON)."""
    try:
        data = strict_json.loads(args.data)
    except ValueError as error:
        raise Usage(f"--data: {error}") from None
    event = {"id": args.id, "data": data, "type": args.type, "key": args.key}
    return {k: v for k, v in event.items() if v is not None or k == "data"}


Intake = ops.Intake


INTAKE_KEYS = frozenset({"id", "qty", "ttl_ms", "max_attempts"})
EVENT_KEYS = frozenset({"id", "data", "type", "key", "ttl_ms", "max_attempts"})


Numbered = list[tuple[int, Intake]]  # each intake with its input's line number


def read_intakes(stream: IO[str], name: str, args: argparse.Namespace) -> Numbered:
    """Parse and validate every JSON line (``NAME:LINE: why`` on the first bad one).  A line
    is read up to its bound only (``line_limit``): a stream without newlines (``/dev/zero``)
    is refused, not held in memory as it grows."""
    items = []
    limit = line_limit(args.max_event_bytes)
    number = 0
    while line := stream.readline(limit + 1):
        number += 1
        if len(line) > limit and not line.endswith("\n"):
            raise Failure(
                f"{name}:{number}: a line over {limit:,} characters (an event is at most "
                f"--max-event-bytes {args.max_event_bytes:,} bytes)"
            )
        if not line.strip():
            continue
        try:
            record = strict_json.loads(line)
            if type(record) is not dict:
                raise ValueError("each line must be a JSON object")
            item = checked_intake(record, args)
        except ValueError as error:
            raise Failure(f"{name}:{number}: {error}") from None
        items.append((number, item))
    return items


def line_limit(max_event_bytes: int) -> int:
    """The longest JSON line an intake may be: its event's bytes, each written as a JSON
    escape at most (6 characters: ``\\u00e9``), and room for its other keys."""
    return 6 * max_event_bytes + 4096


def checked_intake(record: dict[str, Any], args: argparse.Namespace) -> Intake:
    """A line's job or event with its budget (the options' where it names none), checked."""
    keys = EVENT_KEYS if "data" in record else INTAKE_KEYS
    unknown = record.keys() - keys
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    budget = (record.get("ttl_ms", args.ttl_ms), record.get("max_attempts", args.max_attempts))
    if "data" not in record:
        job = {"id": record.get("id"), "qty": record.get("qty")}
        w.check_enqueue(job, 0, *budget, w.PRODUCT)
        return job, *budget
    event = {k: v for k, v in record.items() if k in ev.KEYS}
    ev.check_event(event, w.epoch_ms(), args.max_event_bytes)
    w.check_enqueue({"id": "x", "qty": 1}, 0, *budget, w.PRODUCT)  # (the budget's ranges)
    return event, *budget


def read_input(args: argparse.Namespace) -> Numbered:
    """The intakes ``enqueue`` was given: ``--id``/``--qty``, a file, or stdin (``-``)."""
    if args.input is None:
        return [(0, one_intake(args))]
    if args.input == "-":
        if sys.stdin is None:
            raise Failure("stdin is closed: give a file, or pipe the JSON Lines in")
        return read_intakes(sys.stdin, "stdin", args)
    try:
        with open(args.input, encoding="utf-8") as stream:
            return read_intakes(stream, args.input, args)
    except UnicodeDecodeError as error:
        raise Failure(f"{args.input}: not UTF-8 text: {error}") from None


def one_intake(args: argparse.Namespace) -> Intake:
    """The one job (``--id``, ``--qty``) or event (``--id``, ``--data``, ...) given."""
    if args.data is None:
        return {"id": args.id, "qty": args.qty}, args.ttl_ms, args.max_attempts
    return event_of(args), args.ttl_ms, args.max_attempts


def check_enqueue_options(args: argparse.Namespace) -> None:
    """The options' combinations and ranges (a line's own values are checked as read)."""
    if (args.input is None) == (args.id is None):
        raise Usage("give either --id and --qty or --data, or a JSON Lines input (a file or -)")
    if args.input is None and (args.qty is None) == (args.data is None):
        raise Usage("--id goes with --qty (a job) or --data (an event)")
    if args.input is not None and (args.qty, args.data) != (None, None):
        raise Usage("--qty and --data go with --id, not with a JSON Lines input")
    if args.data is None and (args.type, args.key) != (None, None):
        raise Usage("--type and --key go with --data")
    event = (
        {"id": "x", "qty": 1} if args.id is None or args.data else {"id": args.id, "qty": args.qty}
    )
    try:
        ev.check_max_bytes(args.max_event_bytes)
        ev.check_to(args.to)
        w.check_enqueue(event, 0, args.ttl_ms, args.max_attempts, w.PRODUCT)
        if args.input is None and args.data is not None:
            ev.check_event(one_intake(args)[0], w.epoch_ms(), args.max_event_bytes)
    except ValueError as error:
        raise Usage(str(error)) from None


def run_enqueue(args: argparse.Namespace) -> int:
    check_enqueue_options(args)
    existing_queue(args.queue)
    numbered = read_input(args)
    results = intake(args.queue, numbered, args.input, args)
    conflicts = [str(r) for r in results if isinstance(r, w.Conflict)]
    counts = {
        "inserted": sum(r is True for r in results),
        "present": sum(r is False for r in results),
        "conflicts": len(conflicts),
    }
    if args.input is None and conflicts:
        raise Failure(conflicts[0])
    emit(
        args,
        {**counts, "conflicting": conflicts[:20]},
        lambda out: out.print(
            f"inserted {counts['inserted']}, already present {counts['present']}, "
            f"conflicts {counts['conflicts']}"
        ),
    )
    for line in conflicts[:20]:
        print(f"asnackq enqueue: conflict: {line}", file=sys.stderr)
    return 1 if conflicts else 0


def intake(
    queue: Target, numbered: Numbered, source: str | None, args: argparse.Namespace
) -> list[bool | w.Conflict]:
    """``ops.enqueue_all`` with a progress bar on a terminal; stopped by a database or
    OS error (a full disk), a ``Failure`` that says what was committed and where to resume."""
    console = Console(stderr=True)
    committed: list[bool | w.Conflict] = []
    with Progress(
        console=console, transient=True, disable=not (source and console.is_terminal)
    ) as progress:
        task = progress.add_task("enqueue", total=len(numbered))

        def advance(done: list[bool | w.Conflict]) -> None:
            committed.extend(done)
            progress.advance(task, len(done))

        try:
            items = [item for _, item in numbered]
            return ops.enqueue_all(
                queue, items, advance, to=args.to, max_event_bytes=args.max_event_bytes
            )
        except Exception as error:
            if not (isinstance(error, OSError) or database_error(error)):
                raise
            raise Failure(stopped(error, committed, numbered, source)) from None


def stopped(
    error: BaseException, committed: list[bool | w.Conflict], numbered: Numbered, source: str | None
) -> str:
    """What an intake stopped by ``error`` committed, and where the rest begins."""
    done, inserted = len(committed), sum(r is True for r in committed)
    text = (
        f"{one_line(error)}: stopped after {done} of {len(numbered)} jobs were committed "
        f"({inserted} inserted)"
    )
    if source is None or done == 0:
        return text + "; nothing after that was written"
    name = "stdin" if source == "-" else source
    return (
        f"{text}; the rest begins at {name} line {numbered[done][0]} (run the same input "
        "again: the committed jobs count as already present)"
    )

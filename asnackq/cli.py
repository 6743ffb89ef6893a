"""The ``asnackq`` command: one entry point, one subcommand per job.

Exit codes: 0 ok, 1 failure or violation, 2 usage.  A bad input is one clear line on
stderr (never a traceback) and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from asnackq.http_send import is_loopback

Command = Callable[[argparse.Namespace], int]


class Failure(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 1."""


def rate(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1: {text}")
    return value


def add_sink(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sink = commands.add_parser("sink", help="run the HTTP sink (inbox + stock) until SIGINT/TERM")
    sink.add_argument("--db", required=True, type=Path, help="sink DB file (created if needed)")
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


def add_outbox(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    except (OSError, ValueError) as error:
        print(f"asnackq {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

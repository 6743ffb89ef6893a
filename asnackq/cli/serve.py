"""The serving commands: sink, outbox dispatch and dashboard (their bodies import the asyncio
layer and aiohttp only when they run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sqlite3
import ssl
from typing import Any, cast

from asnackq.cli.common import (
    DELAY_MS,
    MAX_INFLIGHT,
    SINK_RATE,
    TIMEOUT,
    Commands,
    Failure,
    Usage,
    add_allow_network,
    add_db_wait,
    add_faults,
    add_files,
    add_log_format,
    add_receiver_rules,
    add_sink_tls,
    add_tls_files,
    check_sink,
    exact_int,
    file_only,
    log_to_stderr,
    port,
    receiver_rules,
    renamed,
    sink_tls,
    sink_url,
    target,
    wait_for_database,
    within,
)
from asnackq.cli.enqueue import add_event_options, event_of
from asnackq.cli.otel import add_otel
from asnackq.core.receivers import is_loopback
from asnackq.sink.checks import read_secrets
from asnackq.store import files, readers, sessions
from asnackq.wire.send import DEFAULT_TIMEOUT_S

__all__ = ["add_dashboard", "add_outbox", "add_sink"]

HOST_HELP = "the address to listen on (loopback unless --allow-remote)"


def add_sink(commands: Commands) -> None:
    sink = commands.add_parser("sink", help="run the HTTP sink (inbox + stock) until SIGINT/TERM")
    sink.add_argument(
        "--db",
        required=True,
        type=target,
        help="sink DB file or postgresql:// URL (created if needed; replicas "
        "may share one database)",
    )
    sink.add_argument(
        "--host",
        default="127.0.0.1",
        help=HOST_HELP,
    )
    sink.add_argument("--port", type=within(int, 0, 65535), default=0, help="0 picks a free port")
    sink.add_argument(
        "--allow-remote", action="store_true", help="allow binding a non-loopback --host"
    )
    sink.add_argument(
        "--auth-token",
        help="require 'Authorization: Bearer TOKEN' on every route "
        "(1-256 visible ASCII characters)",
    )
    add_faults(sink)
    sink.add_argument(
        "--delay-ms",
        type=DELAY_MS,
        default=0,
        help="wait this long before answering each event (a slow receiver's work)",
    )
    sink.add_argument(
        "--max-inflight",
        metavar="N",
        type=MAX_INFLIGHT,
        default=None,
        help="handle at most N events at once; answer 429 with Retry-After past it",
    )
    sink.add_argument(
        "--max-rate",
        metavar="R",
        type=SINK_RATE,
        default=None,
        help="handle at most R events a second (a token bucket, bursts of R/10); "
        "answer 429 with Retry-After past it",
    )
    sink.add_argument(
        "--seed",
        type=exact_int,
        default=None,
        help="any int: seeds --fail-rate and --drop-rate's draws (default: random)",
    )
    sink.add_argument(
        "--batch-max",
        type=within(int, 1, 10_000),
        default=512,
        help="most requests in one group commit (1: commit per request)",
    )
    sink.add_argument(
        "--idle-timeout-s",
        type=within(float, 0.01, 3600),
        default=10.0,
        help="close a connection with no request in progress (idle, or its "
        "headers incomplete) after this long (default 10)",
    )
    sink.add_argument(
        "--body-timeout-s",
        type=within(float, 0.01, 600),
        default=5.0,
        help="a request body must arrive within this (default 5; else 408)",
    )
    sink.add_argument(
        "--max-connections",
        type=within(int, 1, 65_536),
        default=1024,
        help="past this, a new connection closes the oldest idle ones "
        "(default 1024, lowered to fit the descriptor limit)",
    )
    sink.add_argument(
        "--secret-file",
        metavar="PATH",
        type=secrets_file,
        default=None,
        help="verify each event's Standard Webhooks signature with these whsec_ secrets "
        "(one a line; several: a rotation): 401 and no effect without a valid one",
    )
    add_tls_files(sink, "serve https")
    add_files(sink, {"--tls-client-ca": "require of every client a certificate from these CAs"})
    add_otel(sink)
    add_db_wait(sink, "--db")
    add_log_format(sink)
    sink.set_defaults(run=run_sink)


def run_sink(args: argparse.Namespace) -> int:
    from asnackq.http_sink import SinkConfig, serve

    if not args.allow_remote and not is_loopback(args.host):
        raise Failure(f"refusing to bind non-loopback host {args.host!r} without --allow-remote")
    try:
        config = SinkConfig(
            args.db,
            auth_token=args.auth_token,
            fail_rate=args.fail_rate,
            drop_rate=args.drop_rate,
            delay_ms=args.delay_ms,
            seed=args.seed,
            batch_max=args.batch_max,
            idle_timeout_s=args.idle_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_connections=args.max_connections,
            max_inflight=args.max_inflight,
            max_rate=args.max_rate,
            secrets=args.secret_file or (),
        )
    except ValueError as error:
        raise Usage(str(error)) from None
    tls = sink_server_tls(args)
    log_to_stderr(args, "sink")
    wait_for_database(args.db, args.db_wait_s, "sink")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(config, args.host, args.port, stop, tls)

    asyncio.run(main())
    return 0


def secrets_file(text: str) -> tuple[str, ...]:
    """An argparse type: a file of whsec_ secrets, one a line (never shown in an error)."""
    try:
        return read_secrets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def sink_server_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The sink's TLS context from ``--tls-cert``, ``--tls-key``, ``--tls-client-ca``."""
    if args.tls_cert is None and args.tls_key is None and args.tls_client_ca is None:
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise Usage("--tls-cert and --tls-key go together (--tls-client-ca needs both)")
    from asnackq.wire.tls import server_context

    try:
        return server_context(args.tls_cert, args.tls_key, args.tls_client_ca)
    except ValueError as error:
        flags = {
            "tls_cert": "--tls-cert",
            "tls_key": "--tls-key",
            "tls_client_ca": "--tls-client-ca",
        }
        raise Usage(renamed(error, flags)) from None


def add_outbox(commands: Commands) -> None:
    outbox = commands.add_parser("outbox", help="ordered delivery through a transactional outbox")
    actions = outbox.add_subparsers(dest="action", required=True, metavar="ACTION")
    accept = actions.add_parser(
        "accept",
        help="accept an order and its outbox row, or an event and its deliveries, atomically",
        description="Accept an order (--id, --qty: an outbox row that dispatch sends in seq "
        "order) or an event (--id, --data: stored with one delivery per enabled endpoint "
        "taking its type, which the queue's worker sends: asnackq work SOURCE), in one "
        "transaction.",
    )
    accept.add_argument("source", type=file_only)
    accept.add_argument("--id", required=True, help="its id ([A-Za-z0-9_-]{1,64})")
    accept.add_argument("--qty", type=exact_int, help="the order's quantity, 1..1000")
    add_event_options(accept)
    pending = actions.add_parser("pending", help="unsent items in seq order (read-only)")
    pending.add_argument("source", type=file_only)
    pending.add_argument("--limit", type=within(int, 1, 16), default=16, help="items listed")
    dispatch = actions.add_parser("dispatch", help="send one ordered batch; stop at a failure")
    dispatch.add_argument("source", type=file_only)
    dispatch.add_argument("--sink", required=True, type=sink_url, help="the sink's /events URL")
    add_sink_tls(dispatch)
    add_receiver_rules(dispatch)
    dispatch.add_argument(
        "--limit", type=within(int, 1, 16), default=16, help="items sent in the batch"
    )
    dispatch.add_argument(
        "--timeout-s",
        type=TIMEOUT,
        default=DEFAULT_TIMEOUT_S,
        help="how long each send waits for the sink's answer",
    )
    dispatch.add_argument("--allow-remote", action="store_true", help="allow a non-loopback sink")
    add_allow_network(dispatch)
    outbox.set_defaults(run=run_outbox)


def run_outbox(args: argparse.Namespace) -> int:
    from asnackq.core import outbox
    from asnackq.core.worker import BadAck, Conflict, Permanent, Retryable
    from asnackq.wire.send import HttpSender

    if args.action == "pending":  # read-only: a file is never created or migrated
        with readers.read_only(args.source, "outbox", "source DB") as con:
            print(json.dumps(outbox.pending(cast(sqlite3.Connection, con), args.limit)))
        return 0
    if args.action == "accept":
        event = accepted(args)  # checked before the file is created
        # A new or empty file, or a source DB already: never another application's file.
        sessions.take_turn(lambda: files.holds(args.source, outbox.SOURCE_SCHEMA), args.source)
    else:
        check_sink(args.sink, args.allow_remote, args.allow_network)
        sender = HttpSender(
            args.sink,
            timeout_s=args.timeout_s,
            allow_remote=args.allow_remote,
            allow_networks=args.allow_network,
            **sink_tls(args),
            **receiver_rules(args),
        )
        with readers.read_only(args.source, "outbox", "source DB"):
            pass  # an existing source DB only
    con = outbox.open_source(args.source)
    try:
        if args.action == "accept":
            try:
                new = outbox.accept(con, event, max_event_bytes=args.max_event_bytes)
            except Conflict as error:
                raise Failure(str(error)) from None
            print(json.dumps({"id": args.id, "accepted": new}))
        else:
            try:
                print(json.dumps({"sent": outbox.dispatch(con, sender, args.limit)}))
            except (Retryable, Permanent, BadAck) as error:
                raise Failure(f"stopped at the first failure: {error}") from None
    finally:
        con.close()
        if args.action == "dispatch":
            sender.close()
    return 0


def accepted(args: argparse.Namespace) -> dict[str, Any]:
    """The order (``--qty``) or event (``--data``) that ``outbox accept`` was given, checked."""
    from asnackq.core import outbox

    if (args.qty is None) == (args.data is None):
        raise Usage("--id goes with --qty (an order) or --data (an event)")
    if args.data is None and (args.type, args.key) != (None, None):
        raise Usage("--type and --key go with --data")
    event = {"id": args.id, "qty": args.qty} if args.data is None else event_of(args)
    outbox.plan_accept(event, max_event_bytes=args.max_event_bytes)  # ValueError: one line
    return event


def add_dashboard(commands: Commands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="a live web page of a queue (read-only), with /api/state and /metrics",
        description="Serve a page that shows the queue, refreshed every second: jobs by "
        "status, dead by reason, throughput over the last minute and done/s over the last "
        "hour, the oldest pending wait, leases by owner, expired leases, the latest redrives; "
        "with --sink-db the inbox counters and the audit's attention items. /api/state is "
        "the same data as JSON, /metrics in the Prometheus format. /jobs/ID (JSON: "
        "/api/jobs/ID) inspects one job: its row, redrives, trace id, and with --sink-db its "
        "inbox record and the audit's verdict. The DBs are opened read-only.",
    )
    dashboard.add_argument("queue", type=target, help="a queue file, or a postgresql:// URL")
    dashboard.add_argument(
        "--sink-db",
        type=target,
        default=None,
        help="the sink's DB file or postgresql:// URL: inbox counters and the audit",
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help=HOST_HELP,
    )
    dashboard.add_argument("--port", type=port, default=0, help="0..65535; 0 picks a free port")
    dashboard.add_argument(
        "--allow-remote", action="store_true", help="allow binding a non-loopback --host"
    )
    dashboard.add_argument(
        "--auth-token",
        default=None,
        help="require 'Authorization: Bearer TOKEN' (or Basic, any user, TOKEN as password)",
    )
    dashboard.set_defaults(run=run_dashboard)


def run_dashboard(args: argparse.Namespace) -> int:
    from asnackq.ops.dashboard import serve

    return serve(
        args.queue,
        args.sink_db,
        host=args.host,
        port=args.port,
        allow_remote=args.allow_remote,
        auth_token=args.auth_token,
    )

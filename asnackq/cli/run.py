"""The other run commands: lab, demo, sink, outbox, dashboard (their bodies import the
asyncio layer, aiohttp and the lab only when they run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sqlite3
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.console import Console

from asnackq.cli.common import (
    DELAY_MS,
    RATE,
    TIMEOUT,
    Commands,
    Failure,
    Usage,
    add_files,
    add_sink_tls,
    check_sink,
    exact_int,
    port,
    renamed,
    sink_tls,
    sink_url,
    target,
    within,
)
from asnackq.cli.render import key_values
from asnackq.store import readers
from asnackq.wire.send import is_loopback

__all__ = ["add_dashboard", "add_demo", "add_lab", "add_outbox", "add_sink"]

if TYPE_CHECKING:
    from asnackq.lab import LabConfig


def add_lab(commands: Commands) -> None:
    lab = commands.add_parser(
        "lab",
        help="a fault and load experiment with real processes; verifies the invariants",
        description="Start a sink with faults and P worker processes of C coroutines each, "
        "SIGKILL a random worker every --kill-every seconds (replacing it), then check every "
        "invariant from the evidence. Exit code 1 on any violation, and on any job that ended "
        "dead although the sink never rejected it (unless --fail-rate or --drop-rate 1 make "
        "that expected). Jobs get a ttl of --timeout-s plus a minute.",
    )
    lab.add_argument("--jobs", type=exact_int, default=2000)
    lab.add_argument("--processes", type=exact_int, default=2)
    lab.add_argument("--concurrency", type=exact_int, default=64)
    lab.add_argument("--fail-rate", type=RATE, default=0.0)
    lab.add_argument("--drop-rate", type=RATE, default=0.0)
    lab.add_argument("--delay-ms", type=DELAY_MS, default=0)
    lab.add_argument(
        "--kill-every",
        type=within(float, 0, 3600),
        default=0.0,
        metavar="SECONDS",
        help="SIGKILL a random worker this often (0: never)",
    )
    lab.add_argument("--seed", type=exact_int, default=1)
    lab.add_argument("--lease-ms", type=exact_int, default=2000)
    lab.add_argument("--send-timeout-s", type=TIMEOUT, default=1.0)
    lab.add_argument("--max-attempts", type=exact_int, default=5)
    lab.add_argument(
        "--timeout-s",
        type=within(float, 0.01, 86_400),
        default=300.0,
        help="bound on the whole run",
    )
    lab.add_argument(
        "--db",
        type=target,
        default=None,
        metavar="URL",
        help="a postgresql:// URL holding no jobs yet: the queue and the inbox "
        "there (default: files in --dir)",
    )
    lab.add_argument(
        "--pg-local",
        action="store_true",
        help="--db on a throwaway local PostgreSQL server (initdb, stopped after)",
    )
    lab.add_argument(
        "--sinks",
        type=within(int, 1, 16),
        default=1,
        help="sink replicas sharing the inbox (PostgreSQL only; default 1)",
    )
    lab.add_argument(
        "--kill-sinks",
        action="store_true",
        help="every other SIGKILL hits a sink, restarted on its port",
    )
    lab.add_argument(
        "--kill-after-acks",
        type=within(int, 1, 10_000_000),
        default=None,
        metavar="N",
        help="instead of --kill-every: the first worker runs alone "
        "and is SIGKILLed right after its Nth verified ACK, then the P workers "
        "start (the demo's fixed kill)",
    )
    add_lab_faults(lab)
    lab.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="keep the files here (default: a temporary directory)",
    )
    lab.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the results to FILE"
    )
    lab.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="write DIR/report.html: plots, invariants, summary (needs asnackq[report])",
    )
    add_tls_files(lab, "the sinks serve https")
    add_files(lab, {"--sink-ca": "the workers trust this CA"})
    lab.set_defaults(run=run_lab)


def add_lab_faults(lab: argparse.ArgumentParser) -> None:
    """The lab's hosts and its faults on a schedule (``lab.hosts``, ``lab.schedule``)."""
    every = within(float, 0, 3600)
    lab.add_argument(
        "--hosts",
        type=within(int, 0, 16),
        default=0,
        metavar="N",
        help="run the workers on N network namespaces, each reaching the database and "
        "the sinks over its own link (Linux, root, --pg-local; default 0: none)",
    )
    lab.add_argument(
        "--pg-restart-every",
        type=every,
        default=0.0,
        metavar="SECONDS",
        help="restart the server (pg_ctl restart, -m fast and immediate in turn; --pg-local)",
    )
    lab.add_argument(
        "--pg-kill-backends-every",
        type=every,
        default=0.0,
        metavar="SECONDS",
        help="pg_terminate_backend every worker's and sink's connection",
    )
    lab.add_argument(
        "--partition-every",
        type=every,
        default=0.0,
        metavar="SECONDS",
        help="cut a random host off from the database, the sinks or both (--hosts)",
    )
    lab.add_argument(
        "--partition-for",
        type=every,
        default=0.0,
        metavar="SECONDS",
        help="how long a partition lasts before it heals",
    )
    lab.add_argument(
        "--clock-skew-ms",
        type=within(int, 0, 86_400_000),
        default=0,
        metavar="K",
        help="each host's (else each worker's) clock reads a different offset in [-K, K]",
    )


def lab_config(args: argparse.Namespace) -> LabConfig:
    """The lab's configuration from its options, checked (``ValueError`` for one out of range)."""
    from asnackq.lab import LabConfig

    config = LabConfig(
        jobs=args.jobs,
        processes=args.processes,
        concurrency=args.concurrency,
        fail_rate=args.fail_rate,
        drop_rate=args.drop_rate,
        delay_ms=args.delay_ms,
        kill_every=args.kill_every,
        seed=args.seed,
        lease_ms=args.lease_ms,
        send_timeout_s=args.send_timeout_s,
        max_attempts=args.max_attempts,
        timeout_s=args.timeout_s,
        directory=args.dir,
        db=args.db,
        sinks=args.sinks,
        kill_sinks=args.kill_sinks,
        pg_local=args.pg_local,
        kill_after_acks=args.kill_after_acks or 0,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        sink_ca=args.sink_ca,
        hosts=args.hosts,
        pg_restart_every=args.pg_restart_every,
        pg_kill_backends_every=args.pg_kill_backends_every,
        partition_every=args.partition_every,
        partition_for=args.partition_for,
        clock_skew_ms=args.clock_skew_ms,
    )
    config.check()
    return config


def run_lab(args: argparse.Namespace) -> int:
    from asnackq.lab import report, report_rows
    from asnackq.lab import run_lab as experiment

    try:  # the lab's own ranges: an option out of range is a usage error
        config = lab_config(args)
    except ValueError as error:
        raise Usage(str(error)) from None
    if args.report is not None:
        report.check_target(args.report)
    result = experiment(config, Console(stderr=True))
    if args.json is not None:
        args.json.write_text(json.dumps(result.as_dict(), indent=2) + "\n", encoding="utf-8")
    written = None if args.report is None else report.write(result, args.report)
    out = Console(highlight=False)
    out.print(key_values("asnackq lab", report_rows(result)))
    for violation in result.violations:
        out.print(f"[bold red]VIOLATION[/] {violation}")
    for failure in result.liveness_failures:
        out.print(f"[bold red]LIVENESS[/] {failure}")
    if written is not None:
        out.print(f"report: {written}")
    return 1 if result.failed else 0


def add_demo(commands: Commands) -> None:
    demo = commands.add_parser("demo", help="two workers, one killed after a send: recovery")
    demo.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from asnackq.lab.demo import main as demo

    return demo()


def add_sink(commands: Commands) -> None:
    sink = commands.add_parser("sink", help="run the HTTP sink (inbox + stock) until SIGINT/TERM")
    sink.add_argument(
        "--db",
        required=True,
        type=target,
        help="sink DB file or postgresql:// URL (created if needed; replicas "
        "may share one database)",
    )
    sink.add_argument("--host", default="127.0.0.1")
    sink.add_argument("--port", type=within(int, 0, 65535), default=0, help="0 picks a free port")
    sink.add_argument(
        "--allow-remote", action="store_true", help="allow binding a non-loopback --host"
    )
    sink.add_argument(
        "--auth-token",
        help="require 'Authorization: Bearer TOKEN' on every route "
        "(1-256 visible ASCII characters)",
    )
    sink.add_argument("--fail-rate", type=RATE, default=0.0, help="answer 503 before any change")
    sink.add_argument(
        "--drop-rate",
        type=RATE,
        default=0.0,
        help="commit, then close the connection without an answer",
    )
    sink.add_argument("--delay-ms", type=DELAY_MS, default=0)
    sink.add_argument("--seed", type=exact_int, default=None)
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
    add_tls_files(sink, "serve https")
    add_files(sink, {"--tls-client-ca": "require of every client a certificate from these CAs"})
    sink.set_defaults(run=run_sink)


def run_sink(args: argparse.Namespace) -> int:
    from asnackq.sink.app import SinkConfig
    from asnackq.sink.server import serve

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
        )
    except ValueError as error:
        raise Usage(str(error)) from None
    tls = sink_server_tls(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(config, args.host, args.port, stop, tls)

    asyncio.run(main())
    return 0


def add_tls_files(parser: argparse.ArgumentParser, what: str) -> None:
    """``--tls-cert`` and ``--tls-key``: a sink's certificate and key."""
    add_files(
        parser,
        {
            "--tls-cert": f"{what}: this certificate (PEM, its chain after it)",
            "--tls-key": "its key (PEM)",
        },
    )


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
    accept = actions.add_parser("accept", help="accept an order and its outbox row atomically")
    accept.add_argument("source", type=Path)
    accept.add_argument("--id", required=True)
    accept.add_argument("--qty", required=True, type=exact_int)
    pending = actions.add_parser("pending", help="unsent items in seq order (read-only)")
    pending.add_argument("source", type=Path)
    pending.add_argument("--limit", type=within(int, 1, 16), default=16)
    dispatch = actions.add_parser("dispatch", help="send one ordered batch; stop at a failure")
    dispatch.add_argument("source", type=Path)
    dispatch.add_argument("--sink", required=True, type=sink_url, help="the sink's /events URL")
    add_sink_tls(dispatch)
    dispatch.add_argument("--limit", type=within(int, 1, 16), default=16)
    dispatch.add_argument("--timeout-s", type=TIMEOUT, default=2.0)
    dispatch.add_argument("--allow-remote", action="store_true", help="allow a non-loopback sink")
    outbox.set_defaults(run=run_outbox)


def run_outbox(args: argparse.Namespace) -> int:
    from asnackq.core import outbox
    from asnackq.core.worker import BadAck, Conflict, Permanent, Retryable, check_event
    from asnackq.wire.send import HttpSender

    if args.action == "pending":  # read-only: a file is never created or migrated
        with readers.read_only(args.source, "outbox", "source DB") as con:
            print(json.dumps(outbox.pending(cast(sqlite3.Connection, con), args.limit)))
        return 0
    if args.action == "accept":
        check_event({"id": args.id, "qty": args.qty})  # before the file is created
    else:
        check_sink(args.sink, args.allow_remote)
        sender = HttpSender(
            args.sink, timeout_s=args.timeout_s, allow_remote=args.allow_remote, **sink_tls(args)
        )
        with readers.read_only(args.source, "outbox", "source DB"):
            pass  # an existing source DB only
    con = outbox.open_source(args.source)
    try:
        if args.action == "accept":
            try:
                new = outbox.accept(con, {"id": args.id, "qty": args.qty})
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


def add_dashboard(commands: Commands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="a live web page of a queue (read-only), with /api/state and /metrics",
        description="Serve a page that shows the queue, refreshed every second: jobs by "
        "status, dead by reason, throughput over the last minute, the oldest pending wait, "
        "expired leases, the latest redrives; with --sink-db the inbox counters and the "
        "audit's attention items. /api/state is the same data as JSON, /metrics in the "
        "Prometheus format. The DBs are opened read-only.",
    )
    dashboard.add_argument("queue", type=target, help="a queue file, or a postgresql:// URL")
    dashboard.add_argument(
        "--sink-db",
        type=target,
        default=None,
        help="the sink's DB file or postgresql:// URL: inbox counters and the audit",
    )
    dashboard.add_argument("--host", default="127.0.0.1")
    dashboard.add_argument("--port", type=port, default=0, help="0 picks a free port")
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

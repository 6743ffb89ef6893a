"""The experiment commands: lab and demo (their bodies import the lab, the asyncio layer and
aiohttp only when they run)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from asnackq.cli.common import (
    DELAY_MS,
    MAX_INFLIGHT,
    SINK_RATE,
    TIMEOUT,
    Commands,
    Usage,
    add_faults,
    add_files,
    add_tls_files,
    concurrency_arg,
    exact_int,
    target,
    within,
)
from asnackq.cli.otel import add_otel
from asnackq.cli.render import key_values
from asnackq.cli.work import send_rate
from asnackq.core.rate import MAX_BURST

__all__ = ["add_demo", "add_lab"]

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
    lab.add_argument("--jobs", type=exact_int, default=2000, help="jobs to enqueue, 1..10000000")
    lab.add_argument(
        "--processes", type=exact_int, default=2, help="worker processes at once, 1..64"
    )
    lab.add_argument(
        "--concurrency",
        type=concurrency_arg,
        default=64,
        help="each worker's sends in flight, 1..1024 (default 64), or 'auto' "
        "(see work --concurrency)",
    )
    add_faults(lab, "the sink: ")
    lab.add_argument("--delay-ms", type=DELAY_MS, default=0, help="the sink's delay per event")
    lab.add_argument(
        "--sink-max-inflight",
        metavar="N",
        type=MAX_INFLIGHT,
        default=None,
        help="the sink handles at most N events at once (429 past it; see sink --max-inflight)",
    )
    lab.add_argument(
        "--sink-max-rate",
        metavar="R",
        type=SINK_RATE,
        default=None,
        help="the sink handles at most R events a second (429 past it; see sink --max-rate)",
    )
    lab.add_argument(
        "--kill-every",
        type=within(float, 0, 3600),
        default=0.0,
        metavar="SECONDS",
        help="SIGKILL a random worker this often (0: never)",
    )
    lab.add_argument(
        "--seed",
        type=exact_int,
        default=1,
        help="any int: seeds every random choice (faults, kill victims, job quantities): the "
        "same seed, the same choices",
    )
    lab.add_argument(
        "--lease-ms", type=exact_int, default=2000, help="the workers' lease, 1..3600000"
    )
    lab.add_argument(
        "--send-timeout-s",
        type=TIMEOUT,
        default=1.0,
        help="the workers' wait for each answer, below the lease",
    )
    lab.add_argument("--max-attempts", type=exact_int, default=5, help="each job's attempts, 1..16")
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
    add_lab_endpoints(lab)
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
    add_otel(lab)
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
        "--rate",
        type=send_rate,
        default=None,
        metavar="R",
        help="every worker: work --rate R (at most R sends a second, all workers together)",
    )
    lab.add_argument(
        "--burst", type=within(int, 1, MAX_BURST), default=1, metavar="B", help="with --rate"
    )
    lab.add_argument(
        "--clock-skew-ms",
        type=within(int, 0, 86_400_000),
        default=0,
        metavar="K",
        help="each host's (else each worker's) clock reads a different offset in [-K, K]",
    )


def add_lab_endpoints(lab: argparse.ArgumentParser) -> None:
    """``--endpoints N`` and its faults (``asnackq.lab.fanout``)."""
    lab.add_argument(
        "--endpoints",
        type=within(int, 1, 64),
        default=None,
        metavar="N",
        help="instead of one sink: --jobs events fanned out to N endpoints ep0..epN-1, each "
        "a receiver process of its own, served by --processes `asnackq work QUEUE` (with "
        "--kill-every, SIGKILLed and replaced; the queue in --dir, --db or --pg-local); "
        "verdicts per endpoint",
    )
    lab.add_argument(
        "--endpoint-fault",
        action="append",
        default=[],
        metavar="NAME:KIND[:ARG]",
        help="with --endpoints (repeat for more): down:AT:FOR (SIGKILLed AT s after the "
        "first events, back FOR s later), slow:MS, 429:RATE, 503:RATE (RATE below 1), "
        "410:AFTER (one 410 after AFTER applied; the lab enables it again), twice (a receiver that "
        "applies twice: a verdict must fail)",
    )
    lab.add_argument(
        "--endpoint-ordered",
        action="append",
        default=[],
        metavar="NAME",
        help="with --endpoints: this endpoint is ordered (each key's events in enqueue order)",
    )
    lab.add_argument(
        "--healthy-bound-s",
        type=within(float, 0.01, 3600),
        default=None,
        metavar="S",
        help="with --endpoints: a healthy endpoint's every delivery applied within S s of "
        "its enqueue (default 10; with --kill-every, give one that covers a lease per kill "
        "and the restarts)",
    )


# The options of the one-sink lab that an endpoints run has no use for: (flag, key, default).
SINK_ONLY = (
    ("--sinks", "sinks", 1),
    ("--kill-sinks", "kill_sinks", False),
    ("--kill-after-acks", "kill_after_acks", None),
    ("--hosts", "hosts", 0),
    ("--pg-restart-every", "pg_restart_every", 0.0),
    ("--pg-kill-backends-every", "pg_kill_backends_every", 0.0),
    ("--partition-every", "partition_every", 0.0),
    ("--clock-skew-ms", "clock_skew_ms", 0),
    ("--report", "report", None),
)


def run_fanout(args: argparse.Namespace) -> int:
    """``lab --endpoints``: the fan-out run and its verdicts (exit 1 on any violation)."""
    import tempfile

    from asnackq.lab import fanout

    try:
        given = [flag for flag, key, default in SINK_ONLY if getattr(args, key) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: one sink's, not with --endpoints")
        config = fanout.FanoutConfig(
            endpoints=args.endpoints,
            events=args.jobs,
            processes=args.processes,
            faults=dict(fanout.parse_fault(text) for text in args.endpoint_fault),
            ordered=tuple(args.endpoint_ordered),
            bound_s=args.healthy_bound_s or fanout.HEALTHY_BOUND_S,
            lease_ms=args.lease_ms,
            timeout_s=args.timeout_s,
            seed=args.seed,
            db=None if args.db is None else str(args.db),
            pg_local=args.pg_local,
            kill_every=args.kill_every,
        )
        config.check()
        if args.dir is not None and args.dir.exists() and any(args.dir.iterdir()):
            raise ValueError(f"--dir {args.dir} must be empty or absent")
        if config.db is not None:
            fanout.require_fresh(config.db)
    except ValueError as error:
        raise Usage(str(error)) from None
    check_json_file(args.json)
    with tempfile.TemporaryDirectory(prefix="asnackq-lab-") as tmp:
        result = fanout.run_fanout(config, args.dir or Path(tmp))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out = Console(highlight=False)
    for name, found in result["endpoints"].items():
        shown = {k: v for k, v in found.items() if k in fanout.VERDICTS or k == "latency_ms"}
        out.print(f"{name} ({found['fault'] or 'healthy'}): {json.dumps(shown)}")
    for violation in result["violations"]:
        out.print(f"[bold red]VIOLATION[/] {violation}")
    return 1 if result["violations"] else 0


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
        sink_max_inflight=args.sink_max_inflight,
        sink_max_rate=args.sink_max_rate,
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
        rate=args.rate,
        burst=args.burst,
        otel_exporter=args.otel_exporter,
        spans=None if args.spans is None else args.spans.resolve(),
    )
    config.check()
    return config


def check_json_file(path: Path | None) -> None:
    """Refuse a ``--json FILE`` that cannot be written, before the run starts (the run's
    results were lost to a directory's name after minutes of it)."""
    if path is None:
        return
    if path.is_dir():
        raise Usage(f"--json {path}: a directory, not a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise Usage(f"--json {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise Usage(f"--json {path}: not writable")


def run_lab(args: argparse.Namespace) -> int:
    from asnackq.lab import report, report_rows
    from asnackq.lab import run_lab as experiment

    if args.endpoints is not None:
        return run_fanout(args)
    if args.endpoint_fault or args.endpoint_ordered or args.healthy_bound_s is not None:
        raise Usage("--endpoint-fault, --endpoint-ordered and --healthy-bound-s need --endpoints")

    try:  # the lab's own ranges: an option out of range is a usage error
        config = lab_config(args)
    except ValueError as error:
        raise Usage(str(error)) from None
    check_json_file(args.json)
    if args.report is not None:
        report.check_target(args.report)
    result = experiment(config, Console(stderr=True))
    if args.json is not None:
        args.json.write_text(json.dumps(result.as_dict(), indent=2) + "\n", encoding="utf-8")
    written = None if args.report is None else report.write(result, args.report)
    out = Console(highlight=False)
    out.print(key_values("asnackq lab", report_rows(result)))
    for violation in result.evidence.violations:
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

"""``asnackq work QUEUE`` with neither ``--sink`` nor ``--endpoint``: one worker for every
endpoint of the queue (``asnackq.dispatch.fleet``), until stopped or, with
``--until-empty``, until no enabled endpoint has a pending or leased delivery."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from asnackq.cli.common import Usage, ended, setting_up, stop_signals
from asnackq.cli.render import emit, key_values, plural
from asnackq.core import worker as w

if TYPE_CHECKING:
    from asnackq.aio import AsyncQueue, Summary
    from asnackq.dispatch.breaker import BreakerPolicy


# Options that say how to send, which an endpoint's row says for itself.
ROW_SAYS = (
    ("--success", "success"),
    ("--secret-file", "secret_file"),
    ("--timeout-s", "timeout_s"),
    ("--concurrency", "concurrency"),
    ("--rate", "rate"),
    ("--kill-after-acks", "kill_after_acks"),
)


def refuse_given(
    args: argparse.Namespace, options: tuple[tuple[str, str], ...], why: str, *also: str
) -> None:
    """A usage error naming those of ``options`` (flag, attribute) that were given, and
    the flags ``also``."""
    given = [flag for flag, key in options if getattr(args, key) is not None] + list(also)
    if given:
        raise Usage(f"{', '.join(given)}: {why} (asnackq endpoint update)")
    if args.allow_network and not args.allow_remote:
        raise Usage("--allow-network goes with --allow-remote")


def check_fleet_options(args: argparse.Namespace) -> None:
    """Without ``--sink`` or ``--endpoint`` each endpoint's row says how to send to it: the
    options that say it for one receiver are refused, not ignored."""
    burst = ("--burst",) if args.burst != 1 else ()
    refuse_given(args, ROW_SAYS, "every endpoint's row says how to send to it", *burst)


def run_fleet(
    args: argparse.Namespace,
    owner: str,
    opened: AbstractAsyncContextManager[AsyncQueue],
    options: dict[str, Any],
    tls: dict[str, Any],
) -> int:
    """The fleet's run on the queue ``opened`` gives, its Dispatchers made with ``options``
    (``run_work`` checked the command line and made both)."""
    from asnackq.aio import Fleet
    from asnackq.dispatch.metrics import WorkerMetrics

    started = time.perf_counter()
    exporter = WorkerMetrics(args.metrics_host, args.metrics_port, args.allow_remote)

    async def main() -> tuple[dict[str, Summary], bool]:
        with setting_up() as go_on:
            async with opened as queue, exporter:
                try:
                    fleet = Fleet(
                        queue,
                        owner=owner,
                        on_start=exporter.watch_endpoint,
                        on_stop=exporter.unwatch_endpoint,
                        max_concurrency=64
                        if args.max_concurrency is None
                        else args.max_concurrency,
                        sender_options={
                            "allow_remote": args.allow_remote,
                            "allow_networks": args.allow_network,
                            **tls,
                        },
                        **options,
                    )
                except ValueError as error:
                    raise Usage(str(error)) from None
                go_on()
                running = asyncio.ensure_future(fleet.run(until_empty=args.until_empty))
                try:
                    with stop_signals(running):
                        await asyncio.wait([running])
                finally:  # (left early: the run ends before its queue closes)
                    await ended(running)
                if not running.cancelled() and running.exception() is not None:
                    raise running.exception()  # type: ignore[misc]
                return fleet.summaries, running.cancelled()

    tracer = options.get("trace")
    try:
        summaries, stopped = asyncio.run(main())
    finally:
        if tracer is not None:
            tracer.close()
    seconds = time.perf_counter() - started
    return report(args, owner, summaries, stopped, seconds, options["retry"], options["breaker"])


def report(
    args: argparse.Namespace,
    owner: str,
    summaries: dict[str, Summary],
    stopped: bool,
    seconds: float,
    retry: w.Retry,
    breaker: BreakerPolicy,
) -> int:
    """Print each endpoint's summary and the totals; exit 1 if a delivery ended dead that
    its endpoint never rejected (unless ``--accept-dead``)."""
    per: dict[str, dict[str, int]] = {name: s.as_dict() for name, s in sorted(summaries.items())}
    totals: dict[str, int] = {}
    for counts in per.values():
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    unanswered = sum(s.dead_unanswered for s in summaries.values())
    result: dict[str, Any] = {
        "owner": owner,
        "seconds": round(seconds, 3),
        "stopped_by_signal": stopped,
        "endpoints": per,
        "totals": totals,
        "retry": retry._asdict(),
        "breaker": dataclasses.asdict(breaker),
    }
    rows = [
        (
            name,
            f"done {c['done']}, retried {c['retried']}, dead {c['dead']}, "
            f"requests {c['requests']}, outages {c['outages']}",
        )
        for name, c in per.items()
    ]
    emit(
        args,
        result,
        lambda out: out.print(
            key_values(
                f"asnackq work {owner}: every endpoint"
                + (" (stopped by signal)" if stopped else ""),
                [
                    *rows,
                    ("endpoints", str(len(per))),
                    ("done", str(totals.get("done", 0))),
                    ("dead", str(totals.get("dead", 0))),
                    ("seconds", f"{seconds:.1f}"),
                ],
            )
        ),
    )
    if unanswered and not args.accept_dead:
        print(
            f"asnackq work: {plural(unanswered, 'delivery', 'deliveries')} ended dead that "
            "their endpoint never rejected; pass --accept-dead to exit 0",
            file=sys.stderr,
        )
        return 1
    return 0

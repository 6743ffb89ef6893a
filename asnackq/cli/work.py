"""``asnackq work``: a Dispatcher on a queue until stopped (its body imports the asyncio
layer and aiohttp only when it runs)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.live import Live

from asnackq.cli.common import (
    FLOAT_TEXT,
    QUEUE_HELP,
    TIMEOUT,
    Commands,
    SinkTls,
    Usage,
    add_allow_network,
    add_db_wait,
    add_log_format,
    add_metrics_options,
    add_receiver_rules,
    add_sink_tls,
    check_sink,
    concurrency_arg,
    ended,
    exact_int,
    existing_queue,
    log_to_stderr,
    receiver_rules,
    setting_up,
    sink_tls,
    sink_url,
    stop_signals,
    target,
    wait_for_database,
    within,
)
from asnackq.cli.otel import add_otel
from asnackq.cli.render import emit, key_values, plural, progress_line
from asnackq.core import lanes
from asnackq.core import worker as w
from asnackq.core.endpoints import NoSuchEndpoint
from asnackq.core.rate import MAX_BURST, MAX_SEND_RATE, MIN_SEND_RATE, Rate
from asnackq.dispatch.traces import Tracer
from asnackq.store.targets import Target, one_line
from asnackq.wire.send import DEFAULT_TIMEOUT_S

__all__ = ["add_work"]

if TYPE_CHECKING:
    from asnackq.aio import AsyncQueue
    from asnackq.dispatch.breaker import BreakerPolicy
    from asnackq.dispatch.endpoint import EndpointSend
    from asnackq.wire.send import AsyncHttpSender, AsyncSend

T = TypeVar("T")

CLOCK_OFFSET_MS = 86_400_000  # --clock-offset-ms: at most a day either way


def when_up(call: Callable[[], T], where: Target, gives_up: float) -> T:
    """``call()`` once the queue's server answers (``wait_for_database``), again if the
    server went away in between (a restart, a shutdown), until ``gives_up`` (monotonic)."""
    while True:
        wait_for_database(where, max(0.0, gives_up - time.monotonic()), "work")
        try:
            return call()
        except ConnectionError:  # (``pg.Unreachable``: refused, or shutting down)
            if time.monotonic() >= gives_up:
                raise
        time.sleep(0.2)


def live_line(console: Console) -> Live:
    """A terminal's progress line (log lines go above it)."""
    return Live(
        console=console,
        transient=True,
        auto_refresh=False,
        redirect_stdout=False,
        redirect_stderr=console.is_terminal,
    )


@contextlib.asynccontextmanager
async def queue_when_up(where: Target, gives_up: float) -> AsyncIterator[AsyncQueue]:
    """``AsyncQueue.open(where)``, tried again while its server refuses (``when_up``)."""
    from asnackq.aio import AsyncQueue

    while True:
        try:
            queue = await AsyncQueue.connect(where)
            break
        except ConnectionError:
            if time.monotonic() >= gives_up:
                raise
        await asyncio.sleep(0.2)
    try:
        yield queue
    finally:
        await queue.close()


def send_rate(text: str) -> float | str:
    """An argparse type: sends per second, a number written plainly in ASCII in
    ``MIN_SEND_RATE..MAX_SEND_RATE``; or ``off``."""
    if text == "off":
        return text
    value = float(text) if FLOAT_TEXT.fullmatch(text) else math.nan
    if not MIN_SEND_RATE <= value <= MAX_SEND_RATE:  # (NaN too)
        raise argparse.ArgumentTypeError(
            f"must be a number of sends a second in {MIN_SEND_RATE:g}..{MAX_SEND_RATE:g}, "
            f"or 'off', not {text!r}"
        )
    return value


def add_work(commands: Commands) -> None:
    work = commands.add_parser(
        "work",
        help="deliver jobs to a sink with many coroutines (the async Dispatcher)",
        description="Claim, send and finish jobs until stopped (Ctrl-C or SIGTERM: stop "
        "claiming, let in-flight sends end, finish them, print the summary). With "
        "--until-empty, stop once no job is pending or leased.",
    )
    work.add_argument("queue", type=target, help=QUEUE_HELP)
    to = work.add_mutually_exclusive_group()
    to.add_argument(
        "--sink",
        type=sink_url,
        help="the sink's /events URL: every job but the endpoints' deliveries is sent there "
        "(without --sink or --endpoint: every endpoint's deliveries, each as its row says, "
        "with a breaker, pacing and in-flight limit of its own)",
    )
    to.add_argument(
        "--endpoint",
        metavar="NAME",
        help="send the deliveries of the queue's endpoint NAME (asnackq endpoint add), and "
        "only those, each its event's stored body: to its URL, with its success "
        "rule, timeout, secrets and headers, read again every second (a rotated secret "
        "signs from the next send); while it is disabled nothing is sent and no attempt "
        "spent, and a 410 from it disables it",
    )
    add_sink_tls(work)
    add_receiver_rules(work)
    work.add_argument(
        "--concurrency",
        type=concurrency_arg,
        default=None,
        help="sends in flight (default 64), or 'auto': as many as the sink takes without "
        "slowing down or answering 429/503 (up to --max-concurrency)",
    )
    work.add_argument(
        "--max-concurrency",
        type=exact_int,
        default=None,
        help="with --concurrency auto: the most sends in flight, 1..1024 (default 256)",
    )
    work.add_argument("--owner", default=None, help="lease owner name (default HOST-PID-RANDOM)")
    work.add_argument("--lease-ms", type=exact_int, default=5000, help="1..3600000 (default 5000)")
    work.add_argument(
        "--prefetch",
        type=exact_int,
        default=None,
        help="tickets kept claimed ahead of demand, 0..1024 (default: adapts to how "
        "many the coroutines take during one commit)",
    )
    work.add_argument(
        "--gather-ms",
        type=within(int, 0, 1000),
        default=10,
        help="while every coroutine is busy, results wait up to this long (at "
        "most a tenth of the lease) to share a commit (default 10; 0: none)",
    )
    work.add_argument(
        "--timeout-s",
        type=TIMEOUT,
        default=None,
        help=f"how long a send waits for the sink's whole answer, 0.001..600 (default "
        f"{DEFAULT_TIMEOUT_S:g}); a send longer than the lease keeps its lease. No answer in "
        "time is reported as the sink timing out (no attempt spent; sent again)",
    )
    work.add_argument(
        "--until-empty",
        action="store_true",
        help="stop once no job is pending or leased (default: run until Ctrl-C or SIGTERM)",
    )
    work.add_argument(
        "--retry-base-ms",
        type=exact_int,
        default=100,
        help="retry delay of a job's first retry, doubled per attempt, 1..3600000 (default 100)",
    )
    work.add_argument(
        "--retry-cap-ms",
        type=exact_int,
        default=1000,
        help="longest retry delay, up to an hour (default 1000)",
    )
    work.add_argument(
        "--breaker-after",
        type=exact_int,
        default=8,
        help="sends in a row that find no sink (or no answer in time) before the run pauses, "
        "1..10000 (default 8)",
    )
    work.add_argument(
        "--breaker-max-ms",
        type=exact_int,
        default=2000,
        help="longest wait between probes while paused, up to an hour (default 2000)",
    )
    work.add_argument(
        "--accept-dead",
        action="store_true",
        help="exit 0 even when jobs ended dead that the sink never rejected",
    )
    work.add_argument(
        "--max-jobs", type=within(int, 1, 10**9), default=None, help="stop after N claims (N >= 1)"
    )
    work.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback sink (and --metrics-host)"
    )
    add_allow_network(work)
    work.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="append one JSON line per claim and per finish (for experiments)",
    )
    work.add_argument("--json", action="store_true", help="print the summary as JSON")
    work.add_argument(
        "--keep-attempts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each request's status, latency and the first KiB of its answer, shown by "
        "'asnackq history' and the dashboard (default: on; about 6 us of CPU a job)",
    )
    add_otel(work)
    work.add_argument(
        "--kill-after-acks",
        type=within(int, 1, 10**9),
        default=None,
        metavar="N",
        help="a crash for experiments: SIGKILL this process right "
        "after its Nth verified ACK (that effect applied, its finish never made)",
    )
    work.add_argument(
        "--clock-offset-ms",
        type=within(int, -CLOCK_OFFSET_MS, CLOCK_OFFSET_MS),
        default=0,
        metavar="N",
        help="for experiments: add N ms to every reading of the run's wall clock "
        "(a host whose clock is off; default 0)",
    )
    work.add_argument(
        "--rate",
        type=send_rate,
        default=None,
        metavar="R",
        help="at most R sends a second, shared by every worker of this queue (its "
        "permits live in the queue's database; the last --rate given sets it for all, and "
        "a worker given none keeps to it as well); 'off' removes it",
    )
    work.add_argument(
        "--burst",
        type=within(int, 1, MAX_BURST),
        default=1,
        metavar="B",
        help="with --rate: at most B sends at once after an idle spell (default 1)",
    )
    add_metrics_options(work)
    add_db_wait(work, "queue")
    add_log_format(work)
    work.set_defaults(run=run_work)


def check_endpoint_options(args: argparse.Namespace) -> None:
    """With ``--endpoint`` the endpoint's row says how to send: the options that say it
    for a sink are refused, not ignored."""
    try:
        w.check_identifier(args.endpoint, "--endpoint")
    except ValueError:
        raise Usage("--endpoint: a name is 1-64 ASCII letters, digits, '_' or '-'") from None
    from asnackq.cli.fleet import ROW_SAYS, refuse_given

    refuse_given(args, ROW_SAYS[:3], "with --endpoint, the endpoint's row says how to send")


def endpoint_send(queue: Any, args: argparse.Namespace, tls: SinkTls) -> EndpointSend:
    """The run's send to the endpoint ``args.endpoint`` of ``queue``."""
    from asnackq.dispatch.endpoint import EndpointSend

    name = args.endpoint
    return EndpointSend(
        name,
        read=partial(queue.endpoint, name),
        disable=partial(queue.disable_endpoint, name),
        payload=queue.delivery,
        allow_remote=args.allow_remote,
        allow_networks=args.allow_network,
        **tls,
    )


async def endpoint_lane(queue: Any, name: str) -> lanes.Lane:
    """The lane of the endpoint ``name`` as its row says at the run's start: an ordered
    endpoint's holds each key while one of its deliveries is out (a row not there yet:
    ordered too, the stricter, since it may be added so)."""
    try:
        row = await queue.endpoint(name)
    except NoSuchEndpoint:
        return lanes.Lane(name, ordered=True)
    return lanes.Lane(name, ordered=row.ordered)


def run_options(
    args: argparse.Namespace, tracer: Tracer | None, retry: w.Retry, breaker: BreakerPolicy
) -> dict[str, Any]:
    """The Dispatcher's options every ``work`` run takes from the command line."""
    return {
        "lease_ms": args.lease_ms,
        "trace": tracer,
        "prefetch": args.prefetch,
        "retry": retry,
        "breaker": breaker,
        "gather_ms": args.gather_ms,
        "clock": offset_clock(args.clock_offset_ms),
        "keep_attempts": args.keep_attempts,
    }


def offset_clock(offset_ms: int) -> Callable[[], int]:
    """The run's wall clock (epoch ms) read ``offset_ms`` off."""
    if not offset_ms:
        return w.epoch_ms
    return lambda: w.epoch_ms() + offset_ms


def run_work(args: argparse.Namespace) -> int:
    from asnackq.aio import Dispatcher, Summary, default_owner
    from asnackq.dispatch.breaker import BreakerPolicy
    from asnackq.dispatch.metrics import WorkerMetrics
    from asnackq.wire.send import AsyncHttpSender

    if args.sink is None and args.endpoint is None:  # every endpoint: as their rows say
        from asnackq.cli.fleet import check_fleet_options

        check_fleet_options(args)
    if args.endpoint is not None:  # (before a --secret-file it refuses is read)
        check_endpoint_options(args)
    tls = sink_tls(args)
    rules = receiver_rules(args)
    if args.sink is not None:
        check_sink(args.sink, args.allow_remote, args.allow_network)
    try:
        retry = w.Retry(args.retry_base_ms, args.retry_cap_ms).check(w.PRODUCT)
        breaker = BreakerPolicy(
            after=args.breaker_after, base_ms=100, max_ms=args.breaker_max_ms
        ).check()
    except ValueError as error:
        raise Usage(str(error)) from None
    if args.burst != 1 and args.rate in (None, "off"):
        raise Usage("--burst goes with --rate R")
    fleet = args.sink is None and args.endpoint is None
    if args.max_concurrency is not None and args.concurrency != "auto" and not fleet:
        raise Usage("--max-concurrency goes with --concurrency auto")
    if args.concurrency is None:
        args.concurrency = 64
    clear = args.rate == "off"
    rate = None if clear else args.rate
    log_to_stderr(args, "work")
    gives_up = time.monotonic() + args.db_wait_s
    when_up(lambda: existing_queue(args.queue), args.queue, gives_up)
    owner = args.owner or default_owner()
    if fleet:
        from asnackq.cli.fleet import run_fleet

        tracer = Tracer(args.trace) if args.trace else None
        opened = queue_when_up(args.queue, gives_up)
        options = run_options(args, tracer, retry, breaker)
        return run_fleet(args, owner, opened, options, dict(tls))
    sender: AsyncHttpSender | EndpointSend | None = None
    if args.sink is not None:
        sender = AsyncHttpSender(
            args.sink,
            timeout_s=DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s,
            allow_remote=args.allow_remote,
            allow_networks=args.allow_network,
            **tls,
            **rules,
        )
    exporter = WorkerMetrics(args.metrics_host, args.metrics_port, args.allow_remote)
    tracer = Tracer(args.trace) if args.trace else None
    console = Console(stderr=True)
    started = time.perf_counter()

    async def main() -> tuple[Summary, Rate | None, bool, BaseException | None]:
        with setting_up() as go_on:
            async with (
                queue_when_up(args.queue, gives_up) as queue,
                sender or endpoint_send(queue, args, tls) as http,
                exporter,
            ):
                dispatcher = await dispatcher_for(queue, http)
                go_on()
                running = asyncio.ensure_future(
                    dispatcher.run(
                        until_empty=True, max_jobs=args.max_jobs, follow=not args.until_empty
                    )
                )
                try:
                    with stop_signals(running), live_line(console) as live:
                        while not running.done():
                            await asyncio.wait([running], timeout=0.25)
                            if tracer is not None and dispatcher.adaptive:
                                clock = dispatcher.settings.clock()
                                tracer.limit(owner, clock, dispatcher.snapshot()["concurrency"])
                            if console.is_terminal:
                                line = progress_line(
                                    dispatcher.snapshot(),
                                    time.perf_counter() - started,
                                    dispatcher.paused,
                                    dispatcher.db_down,
                                )
                                live.update(line, refresh=True)
                finally:  # (left early: the run ends before its queue closes, its end read)
                    await ended(running)
                stopped = running.cancelled()
                failure = None if stopped else running.exception()
                return dispatcher.summary, dispatcher.settings.rate, stopped, failure

    async def dispatcher_for(queue: AsyncQueue, http: AsyncSend) -> Dispatcher:
        # A sink's run takes every job but the endpoints' deliveries; an endpoint's run,
        # that endpoint's deliveries alone (``asnackq.core.lanes``).
        lane = lanes.PLAIN if args.endpoint is None else await endpoint_lane(queue, args.endpoint)
        queue = queue.in_lane(lane)
        if clear:
            await queue.clear_rate()
        send: AsyncSend = http
        if args.kill_after_acks:
            send = killed_after(args.kill_after_acks, http)
        try:  # the Dispatcher's own ranges: an option out of range is a usage error
            dispatcher = Dispatcher(
                queue,
                exporter.timed(send),
                owner=owner,
                concurrency=args.concurrency,
                max_concurrency=256 if args.max_concurrency is None else args.max_concurrency,
                rate=rate,
                burst=args.burst,
                **run_options(args, tracer, retry, breaker),
            )
        except ValueError as error:
            raise Usage(str(error)) from None
        exporter.watch(dispatcher)
        return dispatcher

    try:  # (shared: the run's rate at its end, its own or the queue's)
        run, shared, stopped, failure = asyncio.run(main())
    finally:
        if tracer is not None:
            tracer.close()
    seconds = time.perf_counter() - started
    summary = run.as_dict()
    whose = " (the queue's)" if rate is None else ""
    result = {
        **summary,
        "owner": owner,
        "seconds": round(seconds, 3),
        "stopped_by_signal": stopped,
        "retry": retry._asdict(),
        "breaker": dataclasses.asdict(breaker),
        "rate": None if shared is None else {"per_s": shared.per_s, "burst": shared.burst},
        "error": None if failure is None else one_line(failure),
    }
    emit(
        args,
        result,
        lambda out: out.print(
            key_values(
                f"asnackq work {owner}" + (" (stopped by signal)" if stopped else ""),
                [
                    *summary.items(),
                    ("seconds", f"{seconds:.1f}"),
                    ("done/s", f"{summary['done'] / max(seconds, 1e-9):,.0f}"),
                    ("retry policy", f"base {retry.base_ms} ms, cap {retry.cap_ms} ms"),
                    (
                        "breaker",
                        f"after {plural(breaker.after, 'failure')} in a row, probes "
                        f"{breaker.base_ms}..{breaker.max_ms} ms apart",
                    ),
                    *(
                        [("shared rate", f"{shared.per_s:g}/s, bursts of {shared.burst}{whose}")]
                        if shared is not None
                        else []
                    ),
                ],
            )
        ),
    )
    if failure is not None:  # the summary first: what was done before the run died
        raise failure
    if run.dead_unanswered and not args.accept_dead:
        print(
            f"asnackq work: {plural(run.dead_unanswered, 'job')} ended dead that the sink never "
            "rejected "
            f"(exhausted {summary['dead_exhausted']}, deadline {summary['dead_deadline']}, "
            f"poison {summary['dead_poison']}); "
            "pass --accept-dead to exit 0",
            file=sys.stderr,
        )
        return 1
    return 0


def killed_after(acks: int, send: AsyncSend) -> AsyncSend:
    """``send``, and this process SIGKILLed right after its ``acks``-th verified ACK."""
    count = 0

    async def send_then_die(event: dict[str, Any], token: int | None) -> object:
        nonlocal count
        answer = await send(event, token)
        count += 1
        if count == acks:
            os.kill(os.getpid(), signal.SIGKILL)  # the effect is applied; no finish
        return answer

    return send_then_die

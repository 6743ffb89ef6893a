"""Prometheus metrics: the queue's state (the dashboard) and a running Dispatcher (``work``).

Rules of this module:

* Text exposition format 0.0.4.  Every family has ``HELP`` and ``TYPE`` lines; names start
  with ``asnackq_``; counters end in ``_total``; times are in seconds.
* Rendering is a pure function of a snapshot (``ops.stats`` or a Dispatcher's counts): the
  DB reads and the server live elsewhere, so one rendering serves every endpoint.
* A metrics endpoint only answers ``GET /metrics`` (and ``HEAD``): other methods get 405,
  other paths 404.  It binds loopback unless remote access is allowed explicitly.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from asnackq import logs
from asnackq.http_send import is_loopback

if TYPE_CHECKING:
    from aiohttp import web

    from asnackq.aio import AsyncSend
    from asnackq.dispatch import Dispatcher

__all__ = [
    "CONTENT_TYPE",
    "Family",
    "Histogram",
    "WorkerMetrics",
    "dispatcher_families",
    "port",
    "queue_families",
    "render",
    "serving",
]

CONTENT_TYPE = "text/plain"
CHARSET = "utf-8"
FORMAT = "0.0.4"
REASONS = ("exhausted", "deadline", "permanent")
STATUSES = ("pending", "leased", "done", "dead")
# Prometheus' default buckets, in seconds: sends take milliseconds to a lease's length.
SEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
Labels = dict[str, str]


@dataclass(frozen=True)
class Family:
    """One metric family: its name, type, help text, and ``(suffix, labels, value)`` samples.

    The name is the samples' own (a counter's ends in ``_total``, as the 0.0.4 format has it);
    only a histogram's samples add a suffix (``_bucket``, ``_sum``, ``_count``).
    """

    name: str
    kind: str  # counter, gauge or histogram
    help: str
    samples: list[tuple[str, Labels, float]]


def gauge(name: str, text: str, value: float, labels: Labels | None = None) -> Family:
    return Family(name, "gauge", text, [("", labels or {}, value)])


def counter(name: str, text: str, value: float) -> Family:
    return Family(name, "counter", text, [("", {}, value)])


def labelled(name: str, kind: str, text: str, label: str, values: dict[str, int]) -> Family:
    """One sample per label value."""
    return Family(name, kind, text, [("", {label: key}, value) for key, value in values.items()])


def number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    return repr(value)


def escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def render(families: Iterable[Family]) -> str:
    """The families in the text exposition format (one trailing newline)."""
    lines = []
    for family in families:
        lines += [
            f"# HELP {family.name} {escape(family.help, False)}",
            f"# TYPE {family.name} {family.kind}",
        ]
        for suffix, labels, value in family.samples:
            shown = ",".join(f'{key}="{escape(v, True)}"' for key, v in labels.items())
            lines.append(
                f"{family.name}{suffix}{{{shown}}} {number(value)}"
                if shown
                else f"{family.name}{suffix} {number(value)}"
            )
    return "\n".join(lines) + "\n"


# --- the queue (read by the dashboard) ---------------------------------------------------


def queue_families(stats: dict[str, Any]) -> list[Family]:
    """The queue's gauges from an ``ops.stats`` result."""
    by_status = {status: stats["by_status"].get(status, 0) for status in STATUSES}
    reasons = {reason: stats["dead_by_reason"].get(reason, 0) for reason in REASONS}
    oldest = stats["oldest_pending_ms"]
    return [
        labelled(
            "asnackq_queue_jobs", "gauge", "Jobs in the queue by status.", "status", by_status
        ),
        labelled("asnackq_queue_dead_jobs", "gauge", "Dead jobs by reason.", "reason", reasons),
        gauge(
            "asnackq_queue_oldest_pending_age_seconds",
            "How long the oldest claimable pending job has waited (0: none waits).",
            0 if oldest is None else oldest / 1000,
        ),
        gauge(
            "asnackq_queue_expired_leases",
            "Leased jobs whose lease has expired: awaiting reclaim.",
            stats["expired_leases"],
        ),
    ]


# --- a running Dispatcher (``work --metrics-port``) ------------------------------------


@dataclass
class Histogram:
    """Cumulative-bucket histogram of durations in seconds."""

    bounds: tuple[float, ...] = SEND_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, +Inf last
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def family(self, name: str, text: str) -> Family:
        samples: list[tuple[str, Labels, float]] = []
        seen = 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            seen += count
            samples.append(("_bucket", {"le": "+Inf" if math.isinf(bound) else repr(bound)}, seen))
        samples += [("_sum", {}, self.sum), ("_count", {}, seen)]
        return Family(name, "histogram", text, samples)


# Summary field -> (metric name without prefix and ``_total``, help).
WORKER_COUNTERS = {
    "claimed": ("claimed", "Tickets claimed (each a lease with its own token)."),
    "commits": ("commits", "Transactions (cycles) committed: finishes, extensions, claims."),
    "done": ("done", "Jobs finished done."),
    "retried": ("retried", "Jobs finished retry: back to pending with a delay."),
    "stale": ("stale", "Finishes refused because the lease was no longer this worker's."),
    "lost": ("lost", "Held tickets whose lease extension came back stale: never finished."),
    "extended": ("extended", "Lease extensions committed."),
    "requests": ("requests", "HTTP requests sent to the sink."),
    "resent": ("resent", "Sends repeated under the same lease because the sink was away."),
    "bad_acks": ("bad_acks", "Answers that proved nothing (redirects, wrong ids, bad bodies)."),
    "errors": ("errors", "Sends that ended in another error."),
    "outages": ("breaker_outages", "Times the circuit breaker opened (the sink was away)."),
    "probes": ("breaker_probes", "Probe sends while the circuit breaker was open."),
    "db_outages": ("db_outages", "Sessions with the queue's database lost (each reconnected)."),
    "db_reruns": ("db_reruns", "Transactions re-run after their database session was lost."),
    "db_cut_commits": ("db_cut_commits", "COMMITs whose answer was lost (outcome looked up)."),
    "unconfirmed": (
        "unconfirmed",
        "Tickets let go after a cycle whose COMMIT's outcome stayed unknown.",
    ),
    "clock_steps": ("clock_steps", "Times the wall clock stepped back (the run's clock held)."),
}


def dispatcher_families(
    counts: dict[str, int], owner: str, paused: bool, latency: Histogram
) -> list[Family]:
    """A Dispatcher's counters (``Dispatcher.snapshot``), its breaker and its send latency."""
    families = [gauge("asnackq_worker_info", "The worker's lease owner name.", 1, {"owner": owner})]
    families += [
        counter(f"asnackq_worker_{name}_total", text, counts[key])
        for key, (name, text) in WORKER_COUNTERS.items()
    ]
    families += [
        labelled(
            "asnackq_worker_dead_total",
            "counter",
            "Jobs ended dead, by reason.",
            "reason",
            {reason: counts[f"dead_{reason}"] for reason in REASONS},
        ),
        counter(
            "asnackq_worker_db_down_seconds_total",
            "Time without a session with the queue's database.",
            counts["db_down_ms"] / 1000,
        ),
        counter(
            "asnackq_worker_breaker_paused_seconds_total",
            "Time the circuit breaker kept the run paused.",
            counts["paused_ms"] / 1000,
        ),
        gauge("asnackq_worker_breaker_open", "1 while the circuit breaker is open.", int(paused)),
        latency.family(
            "asnackq_worker_send_duration_seconds",
            "Duration of each send to the sink, answered or failed.",
        ),
    ]
    return families


class TimedSend:
    """A sender that observes the duration of every send that returns or raises."""

    def __init__(self, send: AsyncSend, histogram: Histogram) -> None:
        self.send, self.histogram = send, histogram
        self.timeout_s = getattr(send, "timeout_s", None)  # the Dispatcher checks it

    async def __call__(self, event: dict[str, Any], token: int) -> object:
        started = time.perf_counter()
        try:
            ack = await self.send(event, token)
        except Exception:  # (a cancelled send is no duration)
            self.histogram.observe(time.perf_counter() - started)
            raise
        self.histogram.observe(time.perf_counter() - started)
        return ack


# --- serving ------------------------------------------------------------------------------


def port(text: str) -> int:
    """An ``argparse`` type: a TCP port, 0..65535 (0 picks a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free port): {text}")
    return value


def check_host(host: str, allow_remote: bool) -> None:
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to bind non-loopback host {host!r} without --allow-remote")


def exposition(text: str) -> web.Response:
    from aiohttp import web  # imported when served: the command line stays light

    return web.Response(
        body=text.encode(CHARSET),
        headers={
            "Content-Type": f"{CONTENT_TYPE}; version={FORMAT}; charset={CHARSET}",
            "Cache-Control": "no-store",
        },
    )


RequestHandler = Callable[["web.BaseRequest"], Awaitable["web.StreamResponse"]]
Refusal = Callable[["web.BaseRequest", "web.HTTPException"], "web.HTTPException"]


def screen_expect(handler: RequestHandler, shape: Refusal | None = None) -> RequestHandler:
    """Refuse (417) any ``Expect`` but ``100-continue`` before the application sees it
    (``shape`` may give the refusal its body and log it).

    aiohttp's own expect handler echoes the header into its 417: a byte that is not UTF-8
    made that a 500, on every path and method (found by the fuzz tests).
    """
    from aiohttp import web

    async def screened(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect and expect.lower() != "100-continue":
            refusal = web.HTTPExpectationFailed(text="only 'Expect: 100-continue' is understood")
            raise refusal if shape is None else shape(request, refusal)
        return await handler(request)

    return screened


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, host: str, port: int, log: logging.Logger | None = None
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` and yield its base URL (``http://HOST:PORT``);
    aiohttp's server errors (a malformed request) go to ``log``."""
    from aiohttp import web

    options: dict[str, Any] = {} if log is None else {"logger": log}
    runner = web.AppRunner(app, handle_signals=False, access_log=None, **options)
    await runner.setup()
    assert runner.server is not None
    runner.server.request_handler = screen_expect(runner.server.request_handler)
    try:
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        yield f"http://{shown}:{bound[1]}"
    finally:
        await runner.cleanup()


class WorkerMetrics:
    """``work --metrics-port``: a Dispatcher's metrics on ``GET /metrics`` while it runs.

    With no port it does nothing: ``timed`` returns the sender unchanged.
    """

    def __init__(self, host: str, port: int | None, allow_remote: bool) -> None:
        if port is not None:
            check_host(host, allow_remote)
        self.host, self.port = host, port
        self.latency = Histogram()
        self.dispatcher: Dispatcher | None = None
        self._stack = contextlib.AsyncExitStack()

    def timed(self, send: AsyncSend) -> AsyncSend:
        return send if self.port is None else TimedSend(send, self.latency)

    def watch(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def render(self) -> str:
        dispatcher = self.dispatcher
        if dispatcher is None:
            return render([])
        return render(
            dispatcher_families(
                dispatcher.snapshot(), dispatcher.settings.owner, dispatcher.paused, self.latency
            )
        )

    async def get_metrics(self, request: web.Request) -> web.Response:
        return exposition(self.render())

    async def __aenter__(self) -> WorkerMetrics:
        if self.port is not None:
            from aiohttp import web

            app = web.Application()
            app.router.add_get("/metrics", self.get_metrics)
            log = logs.to_stderr(logging.getLogger("asnackq.work.metrics"), "asnackq work")
            url = await self._stack.enter_async_context(serving(app, self.host, self.port, log))
            print(f"asnackq work: metrics on {url}/metrics", file=sys.stderr, flush=True)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self._stack.aclose()


def add_metrics_options(work: argparse.ArgumentParser) -> None:
    """``work``'s metrics flags."""
    work.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics while the "
        "run goes on (0: any free port; the URL is printed on stderr)",
    )
    work.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (default 127.0.0.1; another needs --allow-remote)",
    )

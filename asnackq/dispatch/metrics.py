"""``work --metrics-port``: a Dispatcher's counters, breaker and send latency as Prometheus text."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from asnackq.core.receivers import is_loopback
from asnackq.wire.metrics import (
    REASONS,
    Family,
    Histogram,
    check_host,
    counter,
    exposition,
    gauge,
    labelled,
    render,
    serving,
)

if TYPE_CHECKING:
    from aiohttp import web

    from asnackq.wire.send import AsyncSend

__all__ = ["WORKER_COUNTERS", "TimedSend", "Watched", "WorkerMetrics", "dispatcher_families"]


class Watched(Protocol):
    """What the metrics read of a run (``asnackq.aio.Dispatcher``)."""

    @property
    def owner(self) -> str: ...

    @property
    def paused(self) -> bool: ...

    def snapshot(self) -> dict[str, int]: ...


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
    "resent": ("resent", "Sends repeated under the same lease: the sink was away or overloaded."),
    "overloaded": (
        "overloaded",
        "Answers 429, or 503 with Retry-After: the job waited under its lease, no attempt spent.",
    ),
    "away": ("sends_away", "Sends that found no sink: no connection, refused, reset, 502-504."),
    "timeouts": (
        "sends_timed_out",
        "Sends with no answer within the sender's timeout: the sink timing out.",
    ),
    "untrusted": (
        "sends_untrusted",
        "Sends refused by TLS: the sink's certificate, or this worker's (no attempt spent).",
    ),
    "concurrency_cuts": ("concurrency_cuts", "Times the adaptive concurrency limit was cut."),
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
        gauge(
            "asnackq_worker_concurrency",
            "Sends let in flight at once (concurrency auto: the adaptive limit now).",
            counts["concurrency"],
        ),
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


class WorkerMetrics:
    """``work --metrics-port``: a Dispatcher's metrics on ``GET /metrics`` while it runs.

    With no port it does nothing: ``timed`` returns the sender unchanged.
    """

    def __init__(self, host: str, port: int | None, allow_remote: bool) -> None:
        if port is not None:
            check_host(host, allow_remote)
        self.host, self.port = host, port
        self.latency = Histogram()
        self.dispatcher: Watched | None = None
        self._stack = contextlib.AsyncExitStack()

    def timed(self, send: AsyncSend) -> AsyncSend:
        return send if self.port is None else TimedSend(send, self.latency)

    def watch(self, dispatcher: Watched) -> None:
        self.dispatcher = dispatcher

    def render(self) -> str:
        dispatcher = self.dispatcher
        if dispatcher is None:
            return render([])
        return render(
            dispatcher_families(
                dispatcher.snapshot(), dispatcher.owner, dispatcher.paused, self.latency
            )
        )

    async def get_metrics(self, request: web.Request) -> web.Response:
        return exposition(self.render())

    async def __aenter__(self) -> WorkerMetrics:
        if self.port is not None:
            from aiohttp import web

            app = web.Application()
            app.router.add_get("/metrics", self.get_metrics)
            log = logging.getLogger("asnackq.work.metrics")
            own = serving(app, self.host, self.port, log, loopback_names=is_loopback(self.host))
            url = await self._stack.enter_async_context(own)
            print(f"asnackq work: metrics on {url}/metrics", file=sys.stderr, flush=True)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

"""``work --metrics-port``: a Dispatcher's counters, breaker and send latency as Prometheus text;
in a fleet (``work QUEUE`` without ``--sink``), each endpoint's Dispatcher's, labelled
``endpoint="NAME"``."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from asnackq.core import worker as w
from asnackq.core.receivers import is_loopback
from asnackq.wire.metrics import (
    REASONS,
    Family,
    Histogram,
    Labels,
    check_host,
    exposition,
    gauge,
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


class Run(NamedTuple):
    """One Dispatcher's figures as its samples carry them: ``labels`` (``{}`` for a run of
    its own, ``{"endpoint": NAME}`` for one of a fleet's), its counts, its breaker."""

    labels: Labels
    counts: dict[str, int]
    paused: bool


def of(labels: Labels, dispatcher: Watched) -> Run:
    return Run(labels, dispatcher.snapshot(), dispatcher.paused)


def per_run(name: str, kind: str, text: str, runs: list[Run], value: Any) -> Family:
    """One sample per run: ``value(run)`` under the run's labels."""
    return Family(name, kind, text, [("", run.labels, value(run)) for run in runs])


def dispatcher_families(runs: list[Run], owner: str, latency: Histogram) -> list[Family]:
    """Dispatchers' counters (``Dispatcher.snapshot``) and breakers, a sample each, and the
    send latency of them all."""
    families = [gauge("asnackq_worker_info", "The worker's lease owner name.", 1, {"owner": owner})]
    families += [
        per_run(f"asnackq_worker_{name}_total", "counter", text, runs, lambda r, k=key: r.counts[k])
        for key, (name, text) in WORKER_COUNTERS.items()
    ]
    families += [
        Family(
            "asnackq_worker_dead_total",
            "counter",
            "Jobs ended dead, by reason.",
            [
                ("", {**run.labels, "reason": reason}, run.counts[f"dead_{reason}"])
                for run in runs
                for reason in REASONS
            ],
        ),
        per_run(
            "asnackq_worker_db_down_seconds_total",
            "counter",
            "Time without a session with the queue's database.",
            runs,
            lambda r: r.counts["db_down_ms"] / 1000,
        ),
        per_run(
            "asnackq_worker_breaker_paused_seconds_total",
            "counter",
            "Time the circuit breaker kept the run paused.",
            runs,
            lambda r: r.counts["paused_ms"] / 1000,
        ),
        per_run(
            "asnackq_worker_breaker_open",
            "gauge",
            "1 while the circuit breaker is open.",
            runs,
            lambda r: int(r.paused),
        ),
        per_run(
            "asnackq_worker_concurrency",
            "gauge",
            "Sends let in flight at once (concurrency auto: the adaptive limit now).",
            runs,
            lambda r: r.counts["concurrency"],
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
        self.endpoints: dict[str, Watched] = {}  # a fleet's Dispatchers, by endpoint
        self.url: str | None = None  # where it answers, once serving
        self._stack = contextlib.AsyncExitStack()

    def timed(self, send: AsyncSend) -> AsyncSend:
        return send if self.port is None else TimedSend(send, self.latency)

    def watch(self, dispatcher: Watched) -> None:
        """Export ``dispatcher``'s figures (a run of its own: samples without labels)."""
        self.dispatcher = dispatcher

    def watch_endpoint(self, name: str, dispatcher: Watched) -> None:
        """Export the figures of ``dispatcher``, a fleet's Dispatcher for the endpoint
        ``name``, as samples labelled ``endpoint="NAME"`` (it replaces one watched before)."""
        self.endpoints[w.check_identifier(name, "endpoint name")] = dispatcher

    def unwatch_endpoint(self, name: str, dispatcher: Watched | None = None) -> None:
        """Export ``name``'s figures no more (``dispatcher``: only if it is still the one
        watched, so a stop that comes after a restart leaves the new one)."""
        if dispatcher is None or self.endpoints.get(name) is dispatcher:
            self.endpoints.pop(name, None)

    def render(self) -> str:
        runs = [] if self.dispatcher is None else [of({}, self.dispatcher)]
        runs += [of({"endpoint": name}, one) for name, one in sorted(self.endpoints.items())]
        if not runs:
            return render([])
        owners = {one.owner for one in [*self.endpoints.values(), self.dispatcher] if one}
        return render(dispatcher_families(runs, ", ".join(sorted(owners)), self.latency))

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
            self.url = f"{url}/metrics"
            print(f"asnackq work: metrics on {url}/metrics", file=sys.stderr, flush=True)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self._stack.aclose()
